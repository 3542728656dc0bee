"""What-if timings: jaxckpt.save / restore of ``big`` with one storage behaviour switched off.

    .venv/bin/python benchmarks/what_if.py --runs 3

Each variant patches private names of ``jaxckpt._storage`` *in this process only*, to size
what that behaviour costs; none of them is a proposal to drop a safety property as is (see
docs/benchmarks.md for what could replace each one). Variants:

- ``baseline``: jaxckpt as it is.
- ``no syncfs``: skip the file-system flush (``local_commit.syncfs``) of the commit.
- ``no crc32c``: zarr arrays written without the ``crc32c`` codec (``writer.array_spec``
  without it: no checksum computed); save only: the manifest still declares crc32c, so
  restores (which read by the manifest) would refuse these files.
- ``both``.
- ``fsync each file``: instead of ``syncfs``, fsync every file and folder of the staging dir from
  16 threads (only this checkpoint's data, not other processes' dirty pages).
- ``ts file_io_sync``: tensorstore fsyncs each chunk file as it writes it (``file_io_sync``),
  no ``syncfs``: the per-file durability starts early, in parallel with later writes.
- ``ts file_io x16``: tensorstore's file I/O pool at 16 concurrent operations.
- ``no early write-back``: no ``sync_file_range`` hint per written chunk file
  (``writeback.enabled``), so the disk starts writing only when ``syncfs`` asks.

The two ``ts`` variants replace the tensorstore context (``location.CONTEXT``, which
``writer`` and ``reader`` import) for saves and restores alike.

The ``flush s`` column is the time spent in the final flush (``local_commit.syncfs`` or its
replacement), ``dirty MiB`` the machine's Dirty + Writeback pages (``/proc/meminfo``) when it
starts: ``syncfs`` waits for all of the file system's dirty data, other processes' included.

Besides wall time it prints the process's CPU seconds per call (user + system, all threads),
which a busy shared machine disturbs less.
"""

from __future__ import annotations

import argparse
import concurrent.futures
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
import tensorstore as ts  # noqa: E402

import jaxckpt  # noqa: E402
from jaxckpt._storage import local_commit, location, reader, writeback, writer  # noqa: E402

# The names each variant replaces. ``writer`` and ``reader`` import ``CONTEXT`` by name, so a
# new context goes into all three modules; ``syncfs`` and ``array_spec`` are looked up in their
# module at each call.
_CONTEXT_USERS = (location, writer, reader)
_ORIG = {
    "spec": writer.array_spec,
    "syncfs": local_commit.syncfs,
    "context": location.CONTEXT,
    "writeback": writeback.enabled,
}
_FLUSH: list[tuple[float, float]] = []  # (seconds, dirty MiB at the start) per flush


def _dirty_mib() -> float:
    with open("/proc/meminfo") as f:
        kb = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f)}
    return (kb.get("Dirty", 0) + kb.get("Writeback", 0)) / 1024


def _fsync_each(path) -> None:
    paths = [os.path.join(d, f) for d, _, files in os.walk(path) for f in files]
    dirs = [d for d, _, _ in os.walk(path)]

    def sync(p: str) -> None:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(sync, paths))
        list(pool.map(sync, dirs))


def _timed_flush(flush):
    def run(path) -> None:
        dirty, t = _dirty_mib(), time.perf_counter()
        flush(path)
        _FLUSH.append((time.perf_counter() - t, dirty))

    return run


def _no_crc(kvstore, entry):
    spec = _ORIG["spec"](kvstore, entry)
    codecs = spec["metadata"]["codecs"]
    spec["metadata"]["codecs"] = [c for c in codecs if c.get("name") != "crc32c"]
    return spec


@contextlib.contextmanager
def variant(
    no_syncfs: bool = False,
    no_crc: bool = False,
    flush=None,
    context=None,
    early_writeback: bool = True,
):
    writeback.enabled = early_writeback and _ORIG["writeback"]
    flush = (lambda path: None) if no_syncfs else flush or _ORIG["syncfs"]
    local_commit.syncfs = _timed_flush(flush)
    if no_crc:
        writer.array_spec = _no_crc
    if context is not None:
        new = ts.Context({"cache_pool": {"total_bytes_limit": 0}, **context})
        for module in _CONTEXT_USERS:
            module.CONTEXT = new
    try:
        yield
    finally:
        writer.array_spec = _ORIG["spec"]
        local_commit.syncfs = _ORIG["syncfs"]
        for module in _CONTEXT_USERS:
            module.CONTEXT = _ORIG["context"]
        writeback.enabled = _ORIG["writeback"]


VARIANTS = {
    "baseline": {},
    "no syncfs": {"no_syncfs": True},
    "no crc32c": {"no_crc": True},
    "both": {"no_syncfs": True, "no_crc": True},
    "fsync each file": {"flush": _fsync_each},
    "ts file_io_sync": {"no_syncfs": True, "context": {"file_io_sync": True}},
    "no early write-back": {"early_writeback": False},
    "ts file_io x16": {
        "context": {"file_io_sync": False, "file_io_concurrency": {"limit": 16}},
    },
}


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _timed(fn, *args) -> tuple[float, float]:
    c, t = _cpu(), time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - t, _cpu() - c


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
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
        print("| variant | save s | save CPU s | flush s | dirty MiB | restore s | restore CPU s |")
        print("|---|---|---|---|---|---|---|")
        for name, kw in VARIANTS.items():
            saves, restores = [], []
            with variant(**kw):
                for r in range(args.runs):
                    path = f"{root}/{name.replace(' ', '_')}-{r}"
                    saves.append(_timed(jaxckpt.save, path, state))
                    if not kw.get("no_crc"):  # its manifest still names crc32c: not readable
                        restores.append(_timed(jaxckpt.restore, path, target))
                    shutil.rmtree(path)
            flushes = [] if kw.get("no_syncfs") else _FLUSH[-args.runs :]
            _FLUSH.clear()
            med = statistics.median
            cells = [med(x[0] for x in saves), med(x[1] for x in saves)]
            cells += [med(f[i] for f in flushes) if flushes else float("nan") for i in (0, 1)]
            cells += [med(x[i] for x in restores) if restores else float("nan") for i in (0, 1)]
            print(f"| {name} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
