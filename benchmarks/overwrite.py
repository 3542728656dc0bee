"""What ``overwrite=True`` adds to a big local save, paired: one process, alternating.

Each pair is a save of ``big`` (400 MiB) to a new path and a save of the same state over an
existing checkpoint of it (``overwrite=True``), in alternating order, each after ``os.sync()``.
The replaced checkpoint is deleted after the commit, in the background: the overwrite's time
is to its return, and the deletion is waited for (``settle``) before the next save, outside
the timing. Reports the medians and the median of the per-pair ratios with their spread.

Run alone: ``python benchmarks/overwrite.py [--pairs 10] [--dir D]`` (8 simulated CPU devices;
writes ~800 MiB at a time under ``--dir``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import _state  # noqa: E402

import jaxckpt  # noqa: E402
from jaxckpt._runtime import pools  # noqa: E402


def run(root: str, pairs: int) -> tuple[list[float], list[float]]:
    """Seconds of ``pairs`` + 1 fresh saves and overwrites, alternated (the first pair is a
    warm-up and is dropped)."""
    state = _state.build("big")
    jaxckpt.save(f"{root}/over", state)
    fresh, over = [], []
    for r in range(pairs + 1):
        for kind in ("fresh", "over") if r % 2 else ("over", "fresh"):
            os.sync()
            t = time.perf_counter()
            jaxckpt.save(f"{root}/{kind}", state, overwrite=kind == "over")
            (over if kind == "over" else fresh).append(time.perf_counter() - t)
            pools.settle()  # the replaced checkpoint's deletion, outside the timing
            if kind == "fresh":
                shutil.rmtree(f"{root}/fresh")
    return fresh[1:], over[1:]


def report(fresh: list[float], over: list[float]) -> str:
    ratios = sorted(o / f for o, f in zip(over, fresh))
    med = statistics.median
    return "\n".join(
        [
            f"big save (400 MiB): overwrite vs a new path, {len(ratios)} pairs, alternated",
            "",
            "| | median (s) | min-max (s) |",
            "|---|---|---|",
            f"| save to a new path | {med(fresh):.3f} | {min(fresh):.3f}-{max(fresh):.3f} |",
            f"| save, `overwrite=True` | {med(over):.3f} | {min(over):.3f}-{max(over):.3f} |",
            "",
            f"overwrite ÷ new path: median of the pairs' ratios {med(ratios):.2f} "
            f"(min-max {ratios[0]:.2f}-{ratios[-1]:.2f}); difference of medians "
            f"{1000 * (med(over) - med(fresh)):+.0f} ms",
        ]
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=10)
    p.add_argument("--dir", default=None, help="where the files go (default: a new temp dir)")
    args = p.parse_args(argv)
    root = args.dir or tempfile.mkdtemp(prefix="jaxckpt-overwrite-")
    try:
        print(report(*run(root, args.pairs)))
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
