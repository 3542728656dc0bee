"""save and restore pause Python's garbage collector and always give it back as they found it."""

from __future__ import annotations

import gc

import jax.numpy as jnp
import pytest

import jaxckpt


@pytest.fixture
def gc_state():
    was = gc.isenabled()
    yield
    gc.enable() if was else gc.disable()


@pytest.mark.parametrize("enabled", [True, False])
def test_save_and_restore_leave_the_collector_as_they_found_it(tmp_path, gc_state, enabled):
    gc.enable() if enabled else gc.disable()
    jaxckpt.save(tmp_path / "a", {"w": jnp.ones(4)})
    assert gc.isenabled() == enabled
    jaxckpt.save_async(tmp_path / "b", {"w": jnp.ones(4)}).wait()
    assert gc.isenabled() == enabled
    jaxckpt.restore(tmp_path / "a")
    assert gc.isenabled() == enabled


def test_a_failing_restore_turns_the_collector_back_on(tmp_path, gc_state):
    gc.enable()
    with pytest.raises(jaxckpt.CheckpointNotFoundError):
        jaxckpt.restore(tmp_path / "missing")
    assert gc.isenabled()
    jaxckpt.save(tmp_path / "a", {"w": jnp.ones(4)})
    with pytest.raises(jaxckpt.CheckpointExistsError):
        jaxckpt.save(tmp_path / "a", {"w": jnp.ones(4)})
    assert gc.isenabled()
