"""Checkpoints written by an old orbax-checkpoint (0.11.25, see data/orbax_old/make_fixture.py)
restore bit-exactly; orbax itself need not be installed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from helpers import assert_fixture_leaves

import jaxckpt

DATA = Path(__file__).resolve().parent / "data" / "orbax_old"
EXPECTED = json.loads((DATA / "expected.json").read_text())


@pytest.mark.parametrize("where", ["standard", "manager/1/state", "manager/2/state"])
def test_old_ocdbt_items_without_the_flag_open(where):
    doc = json.loads((DATA / where / "_METADATA").read_text())
    assert "use_ocdbt" not in doc  # the premise: Orbax < 0.11.31 did not record it
    want = EXPECTED["standard"] if where == "standard" else EXPECTED["manager"][where[8]]["state"]
    assert_fixture_leaves(jaxckpt.restore(DATA / where), want)
    assert jaxckpt.metadata(DATA / where).created["use_ocdbt"] is True


def _target(scale: int):
    """make_fixture.make_state's tree, as a training script builds it to restore into."""
    optax = pytest.importorskip("optax")
    return {
        "w": jnp.zeros((4, 4), jnp.float32),
        "b": jnp.zeros(4, jnp.int32),
        "opt": optax.adam(0.1).init({"w": jnp.zeros((4, 4), jnp.float32)}),
        "step": 0,
        "rng": jax.random.key(99),
    }


@pytest.mark.parametrize("where", ["standard", "manager/1/state", "manager/2/state"])
def test_old_items_restore_strictly_into_the_training_state(where):
    """The optax adam state keeps its EmptyState() and ScaleByAdamState, the key is a key."""
    target = _target(1)
    got = jaxckpt.restore(DATA / where, target)
    assert jax.tree.structure(got) == jax.tree.structure(target)
    assert type(got["opt"][0]).__name__ == "ScaleByAdamState"
    assert type(got["opt"][1]).__name__ == "EmptyState"
    want = EXPECTED["standard"] if where == "standard" else EXPECTED["manager"][where[8]]["state"]
    assert_fixture_leaves(got, want)
    assert jaxckpt.restore(DATA / where)["opt"][1] is None  # as Orbax restores it


def test_ocdbt_item_without_its_database_root_is_a_typed_error(tmp_path):
    item = tmp_path / "standard"
    shutil.copytree(DATA / "standard", item)
    (item / "manifest.ocdbt").unlink()
    with pytest.raises(jaxckpt.CorruptChunkError, match=r"standard: an OCDBT item .*manifest"):
        jaxckpt.restore(item)


def test_use_ocdbt_of_another_type_is_a_typed_error(tmp_path):
    item = tmp_path / "standard"
    shutil.copytree(DATA / "standard", item)
    doc = json.loads((item / "_METADATA").read_text())
    (item / "_METADATA").write_text(json.dumps(doc | {"use_ocdbt": "yes"}))
    with pytest.raises(jaxckpt.ManifestError, match=r"_METADATA: \"use_ocdbt\" is 'yes'"):
        jaxckpt.restore(item)


def test_metadata_nested_too_deeply_is_a_typed_error(tmp_path):
    item = tmp_path / "standard"
    shutil.copytree(DATA / "standard", item)
    (item / "_METADATA").write_text("[" * 100_000)
    with pytest.raises(jaxckpt.ManifestError, match=r"_METADATA is nested too deeply"):
        jaxckpt.restore(item)


def test_old_manager_run_steps_items_and_listing(capsys):
    from jaxckpt._cli.main import main

    for step in ("1", "2"):
        with pytest.raises(
            jaxckpt.ManifestError, match=rf"the arrays are in 'state'.*{step}/state"
        ):
            jaxckpt.restore(DATA / "manager" / step)
        assert (
            jaxckpt.restore(DATA / "manager" / step / "metadata")
            == (EXPECTED["manager"][step]["metadata"])
        )
        assert_fixture_leaves(
            jaxckpt.restore(DATA / "manager" / step / "state", _target(1)),
            EXPECTED["manager"][step]["state"],
        )
    assert main(["ls", str(DATA / "manager")]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[:-1]]
    assert [(r[0], r[1], r[-1]) for r in rows[1:]] == [
        ("1", "committed", "orbax"),
        ("2", "committed", "orbax"),
    ]


@pytest.mark.parametrize(
    "value, match",
    [
        ({"a/b": 1}, r"has the key 'a/b', which no key path"),
        ({"a": {"": 1}}, r"has the key '' under 'a'"),
        (json.loads("[" * 500 + "]" * 500), r"nested deeper than 400"),
    ],
)
def test_damaged_json_items_are_typed_errors(tmp_path, value, match):
    run = tmp_path / "manager"
    shutil.copytree(DATA / "manager", run)
    (run / "1" / "metadata" / "metadata").write_text(json.dumps(value))
    with pytest.raises(jaxckpt.ManifestError, match=r"1/metadata/metadata: .*" + match):
        jaxckpt.restore(run / "1" / "metadata")
