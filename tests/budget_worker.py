"""One save_async of a ~256 MiB state in a fresh process, for tests/test_host_budget.py.

    python tests/budget_worker.py DIR MIB BUDGET_BYTES|none

8 CPU devices. Prints one line ``RESULT {json}``: the seconds save_async blocked and the
seconds to the commit, the growth of peak RSS (VmHWM, reset just before the save where the
kernel allows it) over the RSS before the save, RSS after the commit (the staging arena, kept
for reuse) and after the pool's idle release, and whether the checkpoint holds exactly the
state at the call although a jitted step donated every array right after save_async returned.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import sys
import time

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxckpt  # noqa: E402
from jaxckpt._runtime import staging  # noqa: E402

RELEASE_AFTER_S = 0.5  # the pool's idle release, shortened from its default for the test


def vm(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def make_state(mib: int) -> dict:
    """8 float32 arrays of (rows, 1024) sharded over 8 devices (4 MiB chunks at 256 MiB), made
    on the devices, plus small leaves (packed) and a numpy leaf."""
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    rows = mib * 2**20 // (8 * 1024 * 4)
    make = jax.jit(
        lambda k: jax.random.uniform(k, (rows, 1024), dtype=np.float32),
        out_shardings=NamedSharding(mesh, P("data", "model")),
    )
    keys = jax.random.split(jax.random.key(0), 8)
    state = {f"w{i}": make(keys[i]) for i in range(8)}
    state["bias"] = jax.device_put(np.arange(4096, dtype=np.float32), NamedSharding(mesh, P()))
    state["host"] = np.arange(1024, dtype=np.int64)
    return jax.block_until_ready(state)


def host(x) -> np.ndarray:
    """``x`` on the host, assembled from its shards: ``np.asarray`` of a sharded array would
    keep a host copy on the array (its RSS would then fall when the array goes)."""
    if not isinstance(x, jax.Array):
        return np.asarray(x)
    out = np.empty(x.shape, x.dtype)
    for shard in x.addressable_shards:
        out[shard.index] = np.asarray(shard.data)
    return out


def digests(tree: dict) -> dict:
    return {k: hashlib.blake2b(host(v).tobytes()).hexdigest() for k, v in tree.items()}


def main() -> None:
    root, mib, budget_arg = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    budget = None if budget_arg == "none" else int(budget_arg)
    staging.POOL.release_after = RELEASE_AFTER_S
    state = make_state(mib)
    expected = digests(state)
    arrays = [k for k in state if k != "host"]
    clobber = jax.jit(lambda s: jax.tree.map(lambda x: x * 0 - 7, s), donate_argnums=0)
    clobber({k: state[k] + 0 for k in arrays})  # compiled now, run right after save_async
    small = {"x": state["bias"] + 1}  # warm up: imports, threads, plans, compilation
    jaxckpt.save_async(f"{root}/warm", small, max_host_bytes=budget).wait()
    staging.POOL.clear()
    gc.collect()
    time.sleep(0.2)
    reset = reset_peak()
    rss0, hwm0 = vm("VmRSS"), vm("VmHWM")
    t0 = time.perf_counter()
    handle = jaxckpt.save_async(f"{root}/c", state, max_host_bytes=budget)
    blocked = time.perf_counter() - t0
    done = clobber({k: state.pop(k) for k in arrays})  # donated: the same buffers, rewritten
    state["host"][:] = -1  # and the numpy leaf changed in place
    handle.wait()
    total = time.perf_counter() - t0
    peak = vm("VmHWM") - (rss0 if reset else max(rss0, hwm0))
    kept = vm("VmRSS") - rss0
    time.sleep(RELEASE_AFTER_S + 1.0)
    gc.collect()
    released = vm("VmRSS") - rss0
    jax.block_until_ready(done)
    exact = digests(jaxckpt.restore(f"{root}/c")) == expected
    out = {
        "blocked_s": blocked,
        "total_s": total,
        "state_bytes": int(sum(v.nbytes for v in done.values()) + 1024 * 8),
        "peak_growth": peak,
        "peak_reset": reset,
        "rss_kept": kept,
        "rss_released": released,
        "exact": exact,
        "stage_s": handle.timings["stage"],
    }
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
