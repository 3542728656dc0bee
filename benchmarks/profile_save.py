"""Where a jaxckpt save spends its time: per-phase timings and a cProfile of one save.

    .venv/bin/python benchmarks/profile_save.py --workload big --runs 3
    .venv/bin/python benchmarks/profile_save.py --workload small --top 25

Prints ``SaveHandle.timings`` (plan, stage, write, commit) of a cold and of ``--runs`` warm
``jaxckpt.save_async`` calls, then the top functions of a cProfile'd warm ``jaxckpt.save`` (and
``jaxckpt.restore`` with ``--restore``). For native frames (tensorstore's threads) run it under
py-spy instead: ``py-spy record --native --format raw -o save.txt -- <this command> --loop 10``.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import time

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _state  # noqa: E402
import jax  # noqa: E402

import jaxckpt  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--workload", default="big", choices=sorted(_state.LAYOUTS))
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--top", type=int, default=20, help="functions to print per table")
    p.add_argument("--restore", action="store_true", help="also profile a restore")
    p.add_argument("--loop", type=int, default=0, help="only run N warm saves (for py-spy)")
    p.add_argument("--dir", help="where checkpoints go (default: a new temporary folder)")
    args = p.parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="jaxckpt-profile-")
    try:
        run(args, root)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


def _save(path: str, state) -> jaxckpt.SaveHandle:
    t = time.perf_counter()
    h = jaxckpt.save_async(path, state)
    h.timings["returned"] = time.perf_counter() - t
    h.wait()
    h.timings["total"] = time.perf_counter() - t
    return h


def run(args: argparse.Namespace, root: str) -> None:
    state = _state.build(args.workload)
    leaves = jax.tree_util.tree_leaves(state)
    print(f"{args.workload}: {_state.nbytes(state) / 2**20:.0f} MiB, {len(leaves)} leaves")
    n = 0

    def path() -> str:
        nonlocal n
        n += 1
        return f"{root}/c{n}"

    if args.loop:
        _save(path(), state)
        for _ in range(args.loop):
            shutil.rmtree(f"{root}/c{n}", ignore_errors=True)
            _save(path(), state)
        return
    cold = _save(path(), state).timings
    warm = []
    for _ in range(args.runs):
        shutil.rmtree(f"{root}/c{n}")
        warm.append(_save(path(), state).timings)
    phases = list(cold)
    print("\nSaveHandle.timings of jaxckpt.save_async, seconds ('returned': until save_async")
    print("returned; 'total': until wait() returned):\n")
    print(f"| phase | cold | warm median of {args.runs} |\n|---|---|---|")
    for k in phases:
        print(f"| {k} | {cold[k]:.3f} | {statistics.median(w.get(k, 0.0) for w in warm):.3f} |")
    shutil.rmtree(f"{root}/c{n}")
    prof = cProfile.Profile()
    target = path()
    t = time.perf_counter()
    prof.runcall(jaxckpt.save, target, state)
    print(
        f"\ncProfile of one warm jaxckpt.save ({time.perf_counter() - t:.3f} s under the profiler):"
    )
    _print(prof, args.top)
    if args.restore:
        abstract = _state.abstract(args.workload)
        jaxckpt.restore(target, abstract)  # warm up
        prof = cProfile.Profile()
        prof.runcall(jaxckpt.restore, target, abstract)
        print("\ncProfile of one warm jaxckpt.restore:")
        _print(prof, args.top)


def _print(prof: cProfile.Profile, top: int) -> None:
    for key in ("tottime", "cumulative"):
        print(f"\n-- by {key} --")
        pstats.Stats(prof, stream=sys.stdout).strip_dirs().sort_stats(key).print_stats(top)


if __name__ == "__main__":
    main()
