"""The big save against the disk's durable-write limit, paired: one process, alternating.

``compare.py`` measures the limit (``O_DIRECT`` writes, fsynced; ``_limits.py``) in passes at
the start and end of a run and each library in between, in its own process. On a disk whose
speed drifts by a third from minute to minute (this VM's) that comparison swings more than the
gap it is meant to show. Here one process alternates the two, ``A B B A A B ...``, each after
``os.sync()``, and reports the median of the per-pair ratios with their spread: the drift
moves both sides of a pair alike.

Run alone: ``python benchmarks/_paired.py [--pairs 10] [--dir D] [--threads 8]``
(8 simulated CPU devices; writes ~800 MiB at a time under ``--dir``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import _limits  # noqa: E402
import _state  # noqa: E402

import jaxckpt  # noqa: E402


def run(root: str, pairs: int, threads: int) -> tuple[list[float], list[float]]:
    """Seconds of ``pairs`` + 1 anchor writes and jaxckpt saves of ``big``, alternated (the
    first pair is a warm-up and is dropped)."""
    state = _state.build("big")
    shards = _limits._unique_shards(state)
    buffers = _limits._fill(shards, _limits._files(shards))
    anchor, ours = [], []
    with ThreadPoolExecutor(threads) as pool:
        for r in range(pairs + 1):
            for kind in ("anchor", "jaxckpt") if r % 2 else ("jaxckpt", "anchor"):
                path = f"{root}/{kind}"
                os.sync()
                if kind == "anchor":
                    anchor.append(_limits.write_direct(path, buffers, pool))
                else:
                    t = time.perf_counter()
                    jaxckpt.save(path, state)
                    ours.append(time.perf_counter() - t)
                shutil.rmtree(path)
    return anchor[1:], ours[1:]


def report(anchor: list[float], ours: list[float]) -> str:
    ratios = sorted(j / a for j, a in zip(ours, anchor))
    med = statistics.median
    return "\n".join(
        [
            f"big save (400 MiB) against the durable-write limit, {len(ratios)} pairs, alternated",
            "",
            "| | median (s) | min-max (s) |",
            "|---|---|---|",
            f"| limit: `O_DIRECT` + fsync | {med(anchor):.3f} | {min(anchor):.3f}-{max(anchor):.3f} |",
            f"| jaxckpt save | {med(ours):.3f} | {min(ours):.3f}-{max(ours):.3f} |",
            "",
            f"jaxckpt ÷ limit: median of the pairs' ratios {med(ratios):.2f} "
            f"(min-max {ratios[0]:.2f}-{ratios[-1]:.2f}); ratio of medians "
            f"{med(ours) / med(anchor):.2f}",
        ]
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=10)
    p.add_argument("--threads", type=int, default=8, help="threads writing the limit's files")
    p.add_argument("--dir", default=None, help="where the files go (default: a new temp dir)")
    args = p.parse_args(argv)
    root = args.dir or tempfile.mkdtemp(prefix="jaxckpt-paired-")
    try:
        print(report(*run(root, args.pairs, args.threads)))
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
