"""Starting the disk write-back of each chunk file as soon as tensorstore has written it.

A save is durable only once ``Writer.flush`` (``syncfs``) returns, and that call waits for the
kernel to write every dirty page of the checkpoint to the disk. Left alone, the kernel starts
that write-back late (``dirty_expire_centisecs``, 30 s by default), so a save first copies all
of its bytes into the page cache and only then waits for the disk: the two phases add up
instead of overlapping (docs/benchmarks.md). Here each chunk file, once written, gets
``sync_file_range(SYNC_FILE_RANGE_WRITE)``, which queues its pages for write-back and returns
without waiting, so the disk works while later chunks are still being copied and the final
``syncfs`` finds little left to do.

It is only a hint: durability still comes from ``syncfs``, so any failure here (no such call
outside Linux, a file tensorstore has not renamed into place, a file system that refuses) is
ignored. Files are opened read-only, without following a link, and only under the save's own
staging directory. ``JAXCKPT_EARLY_WRITEBACK=0`` turns it off (benchmarks compare both).
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import TYPE_CHECKING

from jaxckpt._format.grid import chunk_key, chunks_touching
from jaxckpt._runtime import pools
from jaxckpt._runtime.libc import libc

if TYPE_CHECKING:
    import tensorstore as ts

enabled = os.environ.get("JAXCKPT_EARLY_WRITEBACK", "1") != "0"
_WRITE = 2  # SYNC_FILE_RANGE_WRITE: start write-back of dirty pages, do not wait for it
_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_lock = threading.Lock()
_started = 0  # files whose write-back was started in this process: see started()


def _load() -> Callable[[int, int, int, int], int] | None:
    try:
        fn = libc().sync_file_range
    except (OSError, AttributeError):
        return None  # not Linux: syncfs / sync alone
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return fn


_sync_file_range = _load()


def started() -> int:
    """Chunk files whose write-back this process started early (tests check the hook runs):
    those tensorstore wrote, and those ``jaxckpt._storage.directwrite`` wrote through the page
    cache (in part, where the rest went around it)."""
    return _started


def chunk_files(
    folder: str, offsets: Iterable[int], sizes: Iterable[int], chunks: Iterable[int]
) -> list[str]:
    """The chunk files under ``folder`` (a zarr v3 array, default ``/`` key encoding) that hold
    the box ``offsets``/``sizes``."""
    return [os.path.join(folder, chunk_key(i)) for i in chunks_touching(offsets, sizes, chunks)]


class Hints:
    """The hints of one writer: files are grouped by ``group_bytes`` of writes, and one pool
    task per group waits for the group's tensorstore writes (which drop the GIL while waiting)
    and then hints its files. No Python runs in tensorstore's threads (a done-callback per write
    would make them queue for the GIL, docs/benchmarks.md), and a group's files still start
    their write-back while later groups are being written."""

    def __init__(self, group_bytes: int = 8 << 20) -> None:
        self.group_bytes = group_bytes
        self._group: list[tuple[ts.WriteFutures, list[str]]] = []
        self._bytes = 0
        self._tasks: list[Future[None]] = []

    def add(self, fut: ts.WriteFutures, paths: list[str], nbytes: int) -> None:
        """Hint ``paths`` once the write ``fut`` (of ``nbytes``) is done."""
        if not (enabled and _sync_file_range is not None and paths):
            return
        self._group.append((fut, paths))
        self._bytes += nbytes
        if self._bytes >= self.group_bytes:
            self._submit()

    def wait(self) -> None:
        """Hint what is left and wait for every hint (they never raise), so none runs after
        the save returns."""
        self._submit()
        for task in self._tasks:
            task.result()
        self._tasks.clear()

    def _submit(self) -> None:
        if self._group:
            # Where the interpreter is exiting, the hints run here, once the group is written.
            self._tasks.append(pools.writeback_pool().submit(_when_written, self._group))
            self._group, self._bytes = [], 0


def _when_written(group: list[tuple[ts.WriteFutures, list[str]]]) -> None:
    for fut, paths in group:
        try:
            fut.result()
        # The writer reports a failed write; no hint for it. A write cancelled on a failing
        # save raises asyncio's CancelledError, which is no Exception.
        except (Exception, asyncio.CancelledError):  # noqa: BLE001
            continue
        _start(paths)


def _start(paths: list[str]) -> None:
    for path in paths:
        try:
            fd = os.open(path, _FLAGS)
        except OSError:
            continue  # a failed write: the writer reports it, syncfs covers the rest
        try:
            start(fd)
        finally:
            os.close(fd)


def start(fd: int, offset: int = 0, nbytes: int = 0) -> bool:
    """Start the write-back of the dirty pages of the open file ``fd`` from ``offset`` on
    (``nbytes`` of them; 0: to its end), without waiting for it; whether it was started
    (never where it is turned off or not offered, nor where the file system refuses).
    ``jaxckpt._storage.directwrite`` calls it for what it wrote through the page cache."""
    global _started
    hint = _sync_file_range
    if not enabled or hint is None or hint(fd, offset, nbytes, _WRITE) != 0:
        return False
    with _lock:
        _started += 1
    return True
