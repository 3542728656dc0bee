"""Drop a checkpoint's files from the page cache and prove it, for the cold-cache restores.

``evict(path)`` syncs, asks the kernel to drop every file's pages
(``posix_fadvise(POSIX_FADV_DONTNEED)``) and counts the pages still resident with ``mincore``
(through ctypes on a private mapping of each file, what util-linux's ``fincore`` does). The
kernel keeps pages that are dirty, under write-back or mapped by some process, so the count is
checked, not assumed: a cold-cache restore that starts with resident pages is reported as such.
Linux only; no jax here.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import time

_PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
_MAP_FAILED = ctypes.c_void_p(-1).value


def files(path: str) -> list[str]:
    """Every regular file under ``path`` (symlinks not followed), sorted."""
    out = []
    for d, _, names in os.walk(path):
        out += [os.path.join(d, n) for n in names if os.path.isfile(os.path.join(d, n))]
    return sorted(out)


def resident_pages(file: str) -> int:
    """Pages of ``file`` in the page cache now (``mincore`` on a fresh read-only mapping).

    Mapping a file does not fault its pages in; ``mincore`` reports the page cache's state.
    """
    size = os.path.getsize(file)
    if size == 0:
        return 0
    fd = os.open(file, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, _MAP_FAILED):
            raise OSError(ctypes.get_errno(), f"mmap of {file} failed")
        try:
            vec = ctypes.create_string_buffer((size + _PAGE - 1) // _PAGE)
            if _libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore of {file} failed")
            return sum(b & 1 for b in vec.raw)
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)


def _drop(file: str) -> None:
    fd = os.open(file, os.O_RDONLY)
    try:
        os.fdatasync(fd)  # a dirty page cannot be dropped; the os.sync() before covers most
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def evict(path: str, tries: int = 3) -> dict:
    """Drop ``path``'s files (a folder or one file) from the page cache; verify with mincore.

    Returns ``{"files", "bytes", "resident_pages", "seconds"}``: ``resident_pages`` is what
    was still cached after the last try (0 when the eviction worked). Tries again (after a
    short pause) while pages remain: write-back that was still running keeps its pages.
    """
    t = time.perf_counter()
    found = files(path) if os.path.isdir(path) else [path]
    os.sync()
    left = 0
    for attempt in range(tries):
        for f in found:
            _drop(f)
        left = sum(resident_pages(f) for f in found)
        if not left:
            break
        time.sleep(0.05 * (attempt + 1))
    return {
        "files": len(found),
        "bytes": sum(os.path.getsize(f) for f in found),
        "resident_pages": left,
        "seconds": time.perf_counter() - t,
    }
