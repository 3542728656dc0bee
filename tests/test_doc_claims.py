"""Claims the docs make in words, tried as a user would (issue 56); the pages' code blocks run
in tests/test_docs.py.

- docs/manager.md: a save (``save``, ``save_async``, ``CheckpointManager.save``) called from an
  ``atexit`` hook, or from a signal handler while the interpreter shuts down, commits before
  it returns, for device arrays (one device, sharded over eight); as the program's first save
  (``atexit_first``: no library thread has run) or after others (Python has then marked the
  pools whose threads it joined as shut down).
- docs/faq.md: every error jaxckpt raises is a ``CheckpointError``, bad arguments included
  (which are also ``ValueError`` / ``TypeError``).
- docs/object_storage.md: what deleting does where there is nothing to delete.
"""

import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import jaxckpt

ROOT = Path(__file__).resolve().parent.parent
N = 1 << 20  # float32: 4 MiB

# The state a program saves as it ends: a 4 MiB array on one device and one sharded over 8.
PROGRAM = """
import atexit, os, signal, sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import jaxckpt

form, how, out = sys.argv[1:]
N = 1 << 20
mesh = Mesh(np.array(jax.devices()[:8]), ("x",))
state = {
    "one": jnp.arange(N, dtype=jnp.float32),
    "sharded": jax.device_put(jnp.arange(N, dtype=jnp.float32) * 2, NamedSharding(mesh, P("x"))),
    "step": 7,
}

class Staged(jaxckpt.DefaultSavePlanner):
    def resolve_data(self, item):  # no device copies: staged in host memory, as on accelerators
        return super().resolve_data(item)

def save(*_):
    if form == "save":
        jaxckpt.save(out + "/ckpt", state)
    elif form == "save_async":
        jaxckpt.save_async(out + "/ckpt", state)  # no wait(): it saves before it returns
    elif form == "save_async_host_staged":  # with 24 MiB more: copied on several threads
        big = {**state, "big": jnp.ones(6 << 20, jnp.float32)}
        jaxckpt.save_async(out + "/ckpt", big, planner=Staged())
    elif form == "save_async_budget":  # streamed through a ring smaller than the state
        jaxckpt.save_async(out + "/ckpt", state, max_host_bytes=5 << 20)
    else:
        jaxckpt.CheckpointManager(out + "/run").save(7, state)  # async_save=True, no close()

if how != "atexit_first":  # the library's threads have run before, as in a training loop
    with jaxckpt.CheckpointManager(out + "/warm") as mgr:
        mgr.save(0, state)
    big = {**state, "big": jnp.ones(6 << 20, jnp.float32)}
    jaxckpt.save_async(out + "/warm/big", big, planner=Staged()).wait()
if how.startswith("atexit"):
    atexit.register(save)
else:  # a signal arriving while the interpreter shuts down, as at a preemption
    signal.signal(signal.SIGUSR1, save)
    atexit.register(lambda: os.kill(os.getpid(), signal.SIGUSR1))
"""


@pytest.mark.parametrize(
    "form,how",
    [
        *(
            (form, how)
            for form in ("save", "save_async", "manager")
            for how in ("atexit_first", "atexit", "signal")
        ),
        ("save_async_host_staged", "atexit_first"),
        ("save_async_host_staged", "atexit"),
        ("save_async_budget", "atexit"),
    ],
)
def test_a_save_while_the_interpreter_exits_commits(tmp_path, form, how):
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "PYTHONPATH": str(ROOT),
    }
    args = [sys.executable, "-c", PROGRAM, form, how, str(tmp_path)]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr, done.stderr  # errors of atexit hooks go to stderr
    if form == "manager":
        restored = jaxckpt.CheckpointManager(tmp_path / "run").restore(7)
    else:
        restored = jaxckpt.restore(tmp_path / "ckpt")
    assert restored["step"] == 7
    if form == "save_async_host_staged":
        assert restored["big"].shape == (6 << 20,) and restored["big"].min() == 1
    np.testing.assert_array_equal(restored["one"], np.arange(N, dtype=np.float32))
    np.testing.assert_array_equal(restored["sharded"], np.arange(N, dtype=np.float32) * 2)
    assert jax.device_count() == 8  # the suite's devices, unchanged by the subprocess


# The tasks of the stream pools must run together at exit too (an elastic restore's receivers,
# the local tier's send and receive): one waits for the other here.
ALONGSIDE = """
import atexit, threading
from jaxckpt._runtime import pools

def at_exit():
    for pool in (pools.stream_pool(), pools.save_pool()):
        ready = threading.Event()
        waiting = pool.submit(ready.wait, 60)
        pool.submit(ready.set).result()
        print(pool.name, waiting.result())

pools.save_pool().submit(print).result()  # one pool has run threads, one has not
atexit.register(at_exit)
"""


@pytest.mark.skipif(sys.version_info[:2] == (3, 12), reason="Python 3.12 starts no thread at exit")
def test_tasks_that_wait_on_each_other_run_alongside_at_exit():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    args = [sys.executable, "-c", ALONGSIDE]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert done.stdout.split("\n")[-3:] == ["jaxckpt-stream True", "jaxckpt-save True", ""]


def _bad_arguments(d):
    """(the call, the argument its message names): the documented bad-argument cases."""
    tree = {"w": np.ones(4, np.float32)}
    mgr = jaxckpt.CheckpointManager(d / "run", async_save=False)
    return [
        (lambda: jaxckpt.CheckpointManager(d / "a", max_to_keep=-1), "max_to_keep"),
        (lambda: jaxckpt.CheckpointManager(d / "a", keep_every_n_steps=0), "keep_every_n_steps"),
        (lambda: jaxckpt.CheckpointManager(d / "a", best_mode="median"), "best_mode"),
        (lambda: jaxckpt.CheckpointManager(d / "a", save_interval_secs=-1), "save_interval_secs"),
        (lambda: jaxckpt.CheckpointManager(d / "a", keep_every_n_secs=0), "keep_every_n_secs"),
        (lambda: jaxckpt.CheckpointManager(d / "a", local_replicas=-1), "local_replicas"),
        (lambda: jaxckpt.CheckpointManager(d / "a", max_host_bytes=0), "max_host_bytes"),
        (lambda: mgr.save(-1, tree), "step"),
        (lambda: mgr.save(1.5, tree), "the step comes first"),
        (lambda: mgr.restore(tree), "the step comes first"),
        (lambda: mgr.all_steps(tier="disk"), "tier"),
        (lambda: jaxckpt.save_async(d / "c", tree, max_host_bytes=0), "max_host_bytes"),
        (lambda: jaxckpt.save_async(d / "c", tree, max_host_bytes="1G"), "max_host_bytes"),
        (lambda: jaxckpt.save(d / "c", tree, iterators=[iter([])]), "iterators="),
        (lambda: jaxckpt.save(d / "c", tree, iterators={"t": [1, 2]}), "get_state"),
        (lambda: jaxckpt.DefaultSavePlanner(dedup="random"), "dedup"),
        (lambda: jaxckpt.DefaultLoadPlanner(max_host_bytes=0), "max_host_bytes"),
        (lambda: jaxckpt.convert(d / "c", d / "e", max_chunk_bytes=0), "max_chunk_bytes"),
    ]


def test_every_bad_argument_is_a_checkpoint_error_and_a_builtin_one(tmp_path):
    jaxckpt.save(tmp_path / "c", {"w": np.ones(4, np.float32)})  # what convert reads
    for call, names in _bad_arguments(tmp_path):
        with pytest.raises(jaxckpt.CheckpointError, match=names) as info:
            call()
        if isinstance(info.value, jaxckpt.ArgumentTypeError):
            assert isinstance(info.value, TypeError)
        else:  # `except ValueError` catches it, as before these were CheckpointErrors
            assert type(info.value) is jaxckpt.InvalidArgumentError, (names, info.value)
            assert isinstance(info.value, ValueError)
    assert not (tmp_path / "a").exists() and not (tmp_path / "e").exists()  # nothing written
    assert jaxckpt.CheckpointManager(tmp_path / "run").all_steps() == []


@pytest.mark.parametrize("store", ["file", "memory"])
def test_deleting_where_nothing_is(tmp_path, store):
    from jaxckpt._storage import catalog
    from jaxckpt._storage.location import Location

    root = str(tmp_path) if store == "file" else f"memory://{tmp_path.name}"
    mgr = jaxckpt.CheckpointManager(f"{root}/run", async_save=False)
    for step in (1, 2):
        mgr.save(step, {"w": np.full(4, step, np.float32)})
    with pytest.raises(
        jaxckpt.CheckpointNotFoundError,
        match=r"Step 99 is not in .*run; committed steps: \[1, 2\]. Nothing was deleted.",
    ):
        mgr.delete(99)
    assert mgr.all_steps() == [1, 2]
    assert catalog.delete(Location(f"{root}/run/00000099")) is False  # nothing, no error
    assert catalog.delete(Location(f"{root}/nothing/at/all")) is False
    mgr.delete(1)
    assert mgr.all_steps() == [2]
