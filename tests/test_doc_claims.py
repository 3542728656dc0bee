"""Claims the docs make in words, tried as a user would (issue 56); the pages' code blocks run
in tests/test_docs.py.

- docs/manager.md: a save (``save``, ``save_async``, ``CheckpointManager.save``) called from an
  ``atexit`` hook, or from a signal handler while the interpreter shuts down, commits before
  it returns, for device arrays (one device, sharded over eight).
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

def save(*_):
    if form == "save":
        jaxckpt.save(out + "/ckpt", state)
    elif form == "save_async":
        jaxckpt.save_async(out + "/ckpt", state)  # no wait(): it saves before it returns
    else:
        jaxckpt.CheckpointManager(out + "/run").save(7, state)  # async_save=True, no close()

if how == "atexit":
    atexit.register(save)
else:  # a signal arriving while the interpreter shuts down, as at a preemption
    signal.signal(signal.SIGUSR1, save)
    atexit.register(lambda: os.kill(os.getpid(), signal.SIGUSR1))
"""


@pytest.mark.parametrize("how", ["atexit", "signal"])
@pytest.mark.parametrize("form", ["save", "save_async", "manager"])
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
    np.testing.assert_array_equal(restored["one"], np.arange(N, dtype=np.float32))
    np.testing.assert_array_equal(restored["sharded"], np.arange(N, dtype=np.float32) * 2)
    assert jax.device_count() == 8  # the suite's devices, unchanged by the subprocess
