"""What-if timings: jaxckpt.save / restore of ``big`` with one storage behaviour switched off.

    .venv/bin/python benchmarks/what_if.py --runs 3

Each variant patches a private name of ``jaxckpt._storage`` *in this process only*, to size
what that behaviour costs; none of them is a proposal to drop a safety property as is (see
docs/benchmarks.md for what could replace each one). Variants:

- ``baseline``: jaxckpt as it is.
- ``no syncfs``: skip the file-system flush (``_storage._syncfs``) before the manifest.
- ``no crc32c``: zarr arrays without the ``crc32c`` codec (no checksum computed or verified).
- ``both``.

Besides wall time it prints the process's CPU seconds per call (user + system, all threads),
which a busy shared machine disturbs less.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
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
from jaxckpt import _storage  # noqa: E402

_ORIG = {"spec": _storage._spec, "syncfs": _storage._syncfs}


def _no_crc(kvstore, entry):
    spec = _ORIG["spec"](kvstore, entry)
    codecs = spec["metadata"]["codecs"]
    spec["metadata"]["codecs"] = [c for c in codecs if c.get("name") != "crc32c"]
    return spec


@contextlib.contextmanager
def variant(no_syncfs: bool = False, no_crc: bool = False):
    if no_syncfs:
        _storage._syncfs = lambda path: None
    if no_crc:
        _storage._spec = _no_crc
    try:
        yield
    finally:
        _storage._spec = _ORIG["spec"]
        _storage._syncfs = _ORIG["syncfs"]


VARIANTS = {
    "baseline": {},
    "no syncfs": {"no_syncfs": True},
    "no crc32c": {"no_crc": True},
    "both": {"no_syncfs": True, "no_crc": True},
}


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _timed(fn, *args) -> tuple[float, float]:
    c, t = _cpu(), time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - t, _cpu() - c


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--workload", default="big", choices=sorted(_state.LAYOUTS))
    args = p.parse_args()
    state = _state.build(args.workload)
    target = _state.abstract(args.workload)
    root = tempfile.mkdtemp(prefix="jaxckpt-whatif-")
    try:
        jaxckpt.save(f"{root}/warmup", state)  # cold costs out of the way
        jax.block_until_ready(jaxckpt.restore(f"{root}/warmup", target))
        print(f"Medians of {args.runs} calls; CPU: user + system seconds of all threads.\n")
        print("| variant | save s | save CPU s | restore s | restore CPU s |")
        print("|---|---|---|---|---|")
        for name, kw in VARIANTS.items():
            saves, restores = [], []
            with variant(**kw):
                for r in range(args.runs):
                    path = f"{root}/{name.replace(' ', '_')}-{r}"
                    saves.append(_timed(jaxckpt.save, path, state))
                    restores.append(_timed(jaxckpt.restore, path, target))
                    shutil.rmtree(path)
            cells = [
                statistics.median(x[i] for x in xs) for xs in (saves, restores) for i in (0, 1)
            ]
            print(f"| {name} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
