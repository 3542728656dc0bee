"""Peak host-memory growth of a restore: the 1 GiB state of issue 10, in fresh processes.

    .venv/bin/python benchmarks/restore_memory.py [--budget BYTES] [--dir DIR]

Saves 8 float32 arrays of 128 MiB on a (4,2) mesh once, then in a fresh process per case
restores (a) the whole state and (b) one array with ``keys=``, once per fresh process,
printing the peak RSS growth (VmHWM after ``clear_refs`` minus VmRSS before) as a multiple of
what was restored. Only the first restore of a process is measured: later ones reuse memory
the allocator kept from the earlier ones and would read too low.
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import tempfile

SHAPE, N = (4096, 8192), 8


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _child(path: str, case: str, budget: int | None) -> None:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    import jaxckpt

    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("x", "y"))
    sh = NamedSharding(mesh, PartitionSpec("x", "y"))
    if case == "save":
        state = {
            f"a{i}": jax.make_array_from_callback(
                SHAPE, sh, lambda idx, i=i: np.full(SHAPE, i, np.float32)[idx]
            )
            for i in range(N)
        }
        jaxckpt.save(path, state, overwrite=True)
        return
    planner = jaxckpt.DefaultLoadPlanner(**({"max_host_bytes": budget} if budget else {}))
    for run in range(1):
        gc.collect()
        base = _status("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        if case == "full":
            out = jaxckpt.restore(path, {f"a{i}": sh for i in range(N)}, planner=planner)
            n = N * 4 * SHAPE[0] * SHAPE[1]
        else:
            key = f"a{run}"
            out = jaxckpt.restore(path, {key: sh}, keys=[key], planner=planner)
            n = 4 * SHAPE[0] * SHAPE[1]
        jax.block_until_ready(out)
        print(f"{case} run {run}: peak growth {(_status('VmHWM') - base) / n:.3f}x", flush=True)
        del out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=int, default=None, help="max_host_bytes (default: planner's)")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args.child[0], args.child[1], args.budget)
        return
    path = os.path.join(args.dir or tempfile.mkdtemp(), "state")
    for case in ("save", "full", "one"):
        cmd = [sys.executable, __file__, "--child", path, case]
        subprocess.run(cmd + (["--budget", str(args.budget)] if args.budget else []), check=True)


if __name__ == "__main__":
    main()
