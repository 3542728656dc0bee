"""Writing jaxckpt's chunk files straight to a local disk: aligned buffers, ``O_DIRECT``, a few
writes in flight, then the save's one durability step.

A chunk file holds the chunk's elements in C order, little endian, at full chunk shape even at
the array's edge (the rest is the fill value: zero bytes), then, with the ``crc32c`` codec, the
4-byte little-endian CRC-32C of those bytes: what tensorstore writes for jaxckpt's zarr v3
arrays, and what ``jaxckpt._storage.chunkfile`` reads in place. tensorstore writes it through
the page cache (each byte copied into an encoded buffer, then into the page cache, then written
back by the kernel). A large chunk is written here the way the disk's write limit is measured
(docs/benchmarks.md, *Limits*):

1. its bytes are copied in C order, ``COPY_BYTES`` at a time, into a page-aligned staging
   buffer (anonymous ``mmap``: one per writer thread, reused), each block checksummed while it
   is in cache; the zero fill of an edge chunk is written into the buffer too;
2. every ``BUFFER_BYTES`` (whole 4096-byte blocks) go to the file with ``O_DIRECT``: the disk
   takes them from the buffer, nothing enters the page cache;
3. the unaligned tail (under 4096 bytes, the checksum included) is written through the page
   cache and its write-back started (``writeback.start``), so the file ends at its last byte;
4. up to ``pools.WRITE_THREADS`` chunks are in flight on ``pools.write_pool``: while some
   threads wait for the disk, the others copy and checksum.

Nothing here makes a file durable: the save's one ``syncfs`` (``jaxckpt._storage.local_commit``)
does, for the ``O_DIRECT`` writes as well (the disk's write cache, the files' sizes and blocks).
Where ``O_DIRECT`` is refused (``EINVAL`` on the open or on a write: some overlay and network
file systems; an OS without it), the same writes go through the page cache, each file's
write-back started once it is written; a refusal is remembered per file system (``st_dev``).
The format does not change: the files are byte for byte tensorstore's (tests/test_directwrite.py).

Files are created new (``O_EXCL``, no link followed): a file already there (a hard link that an
incremental save made before it fell back to writing the box, ``jaxckpt._storage.links``) is
unlinked first, so a write never changes a linked file.
"""

from __future__ import annotations

import errno
import math
import mmap
import os
import sys
import threading
import time
from concurrent.futures import Future
from typing import Any

import numpy as np
import numpy.typing as npt

from jaxckpt._format import dtypes
from jaxckpt._format.grid import Region, c_order_blocks, chunk_key, chunks_touching
from jaxckpt._format.manifest import ArrayEntry
from jaxckpt._runtime import pools
from jaxckpt._storage import crc, writeback

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no O_DIRECT either
    pass

ALIGN = 4096  # O_DIRECT: file offsets, lengths and buffer addresses on (at most) this
# The most one O_DIRECT write takes (this VM's disk splits requests at 4 MiB, max_sectors_kb);
# one buffer per writer thread: WRITE_THREADS x BUFFER_BYTES = 32 MiB kept for the next save.
BUFFER_BYTES = 4 << 20
COPY_BYTES = 1 << 20  # copied then checksummed at a time, while in cache
# Chunks smaller than this stay with tensorstore: written one at a time per thread, the 512 KiB
# chunks of `big` kept too few bytes in flight and were slower (docs/benchmarks.md).
MIN_CHUNK_BYTES = 1 << 20

enabled = os.environ.get("JAXCKPT_DIRECT_WRITE", "1") != "0"  # 0: every chunk via tensorstore
O_DIRECT: int = getattr(os, "O_DIRECT", 0)  # 0: not offered, the page cache (tests set it)
_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
_FLAGS |= getattr(os, "O_CLOEXEC", 0)
# Stored as numpy holds them, zero bytes for the fill value. bool is left to tensorstore,
# which stores any nonzero byte as 1.
_DTYPES = dtypes.NATIVE - {"bool"}
_RAW = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}

_lock = threading.Lock()
_bytes = {"direct": 0, "buffered": 0}  # see bytes_written()
_refused: set[int] = set()  # st_dev of the file systems that refused O_DIRECT


def bytes_written() -> dict[str, int]:
    """Chunk-file bytes this process wrote here: ``{"direct": ..., "buffered": ...}``, those
    written with ``O_DIRECT`` and those through the page cache (tests check which path ran)."""
    with _lock:
        return dict(_bytes)


def supports(
    entry: ArrayEntry, offsets: tuple[int, ...], sizes: tuple[int, ...], data: npt.NDArray[Any]
) -> bool:
    """Whether the box ``offsets``/``sizes`` of ``entry`` (``data``, in the storage dtype) is
    written here (else by tensorstore): chunks of at least ``MIN_CHUNK_BYTES``, a dtype whose
    bytes numpy holds as stored, whole chunks only (up to the array's edge), and a C CRC-32C."""
    if not (enabled and sys.byteorder == "little" and entry.storage_dtype in _DTYPES):
        return False
    if entry.compression is not None:  # tensorstore compresses
        return False
    if entry.checksum not in ("crc32c", None) or (entry.checksum and not crc.NATIVE):
        return False
    dtype = dtypes.dtype_from_name(entry.storage_dtype)
    if data.dtype != dtype or not data.dtype.isnative or data.shape != tuple(sizes):
        return False
    if math.prod(entry.chunks) * dtype.itemsize < MIN_CHUNK_BYTES:
        return False
    return all(
        s > 0 and o % c == 0 and (s % c == 0 or o + s == n)
        for o, s, c, n in zip(offsets, sizes, entry.chunks, entry.shape)
    )


class BoxWrite:
    """The chunk writes of one box, waited for together; ``jaxckpt._storage.location.wait``
    takes it as it takes a tensorstore future (``timeout`` applies to each chunk)."""

    def __init__(self, futures: list[Future[None]]) -> None:
        self._futures = futures

    def result(self, timeout: float | None = None) -> None:
        """Wait for every chunk (none is still writing after this returns or raises); raise
        the first failure."""
        error: BaseException | None = None
        for f in self._futures:
            try:
                f.result(timeout)
            except Exception as e:  # noqa: BLE001 - re-raised below, the first one
                error = error or e
        if error is not None:
            raise error

    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    def cancel(self) -> bool:
        return all([f.cancel() for f in self._futures])


class ChunkWriter:
    """Writes boxes of local arrays as chunk files below ``root`` (a save's staging folder),
    each chunk a task of ``pools.write_pool``. One per ``Writer.write``; after a failure the
    chunks not yet started are not written and raise the same error."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._direct = O_DIRECT != 0 and _device(root) not in _refused
        self._error: OSError | None = None

    def write(
        self,
        entry: ArrayEntry,
        offsets: tuple[int, ...],
        sizes: tuple[int, ...],
        data: npt.NDArray[Any],
    ) -> BoxWrite:
        """Start writing the box (see :func:`supports`); ``data`` must stay unchanged until
        the returned write is done."""
        folder = os.path.join(self.root, entry.path)
        pool = pools.write_pool()
        futures = []
        for idx in chunks_touching(offsets, sizes, entry.chunks):
            part = tuple(
                slice(i * c - o, min(i * c + c, n) - o)
                for i, c, o, n in zip(idx, entry.chunks, offsets, entry.shape)
            )
            path = os.path.join(folder, chunk_key(idx))
            check = entry.checksum == "crc32c"
            futures.append(pool.submit(self._chunk, path, data[part], entry.chunks, check))
        return BoxWrite(futures)

    def _chunk(self, path: str, src: npt.NDArray[Any], shape: tuple[int, ...], check: bool) -> None:
        """Write one chunk file: ``src`` is the chunk's part inside the array."""
        if self._error is not None:  # an earlier chunk failed: the save is failing
            raise OSError(self._error.errno, self._error.strerror, self._error.filename)
        buf = _take()
        try:
            fd, direct = self._open(path)
            try:
                _File(self, fd, direct, buf).write(src, shape, check)
            finally:
                os.close(fd)
        except OSError as e:
            if not e.filename:  # a write's error: name the file
                e.filename = path
            self._error = self._error or e
            raise
        finally:
            _give_back(buf)

    def _open(self, path: str) -> tuple[int, bool]:
        """A new file at ``path``, with ``O_DIRECT`` where the file system takes it."""
        direct = self._direct
        for _ in range(3):  # a folder to make, a file to replace, O_DIRECT refused: once each
            try:
                return os.open(path, _FLAGS | (O_DIRECT if direct else 0), 0o666), direct
            except FileNotFoundError:
                os.makedirs(os.path.dirname(path), exist_ok=True)
            except FileExistsError:
                os.unlink(path)  # never write into it: it may be a hard link to a base's file
            except OSError as e:
                if not (direct and e.errno == errno.EINVAL):
                    raise
                self.refused()
                direct = False
        return os.open(path, _FLAGS | (O_DIRECT if direct else 0), 0o666), direct

    def refused(self) -> None:
        """Note that this file system refuses ``O_DIRECT`` (for later saves too)."""
        self._direct = False
        dev = _device(self.root)
        if dev is not None:
            with _lock:
                _refused.add(dev)


class _File:
    """One chunk file being written from a staging buffer: what went out, and how."""

    def __init__(self, owner: ChunkWriter, fd: int, direct: bool, buf: _Buffer) -> None:
        self.owner, self.fd, self.direct, self.buf = owner, fd, direct, buf
        self.fill = 0  # bytes in the buffer not yet written
        self.offset = 0  # bytes of the file written
        self.cached_from: int | None = None if direct else 0  # first byte via the page cache

    def write(self, src: npt.NDArray[Any], shape: tuple[int, ...], check: bool) -> None:
        """The chunk's bytes in C order (zero outside ``src``), then its CRC-32C if ``check``."""
        whole = src.shape == shape
        value = 0
        room = len(self.buf.array)
        # After a flush under ALIGN bytes are left in the buffer, so a block always fits.
        limit = max(1, min(COPY_BYTES, room - ALIGN))
        for _, region in c_order_blocks(shape, src.dtype.itemsize, limit):
            size = tuple(b - a for a, b in region)
            n = math.prod(size) * src.dtype.itemsize
            if self.fill + n > room:
                self.flush()
            block = self.buf.array[self.fill : self.fill + n].view(src.dtype).reshape(size)
            _copy_in(block, src, region, whole)
            if check:
                value = crc.crc32c(block, value)
            self.fill += n
        if check:
            if self.fill + 4 > room:
                self.flush()
            self.buf.array[self.fill : self.fill + 4] = np.frombuffer(
                value.to_bytes(4, "little"), np.uint8
            )
            self.fill += 4
        self.flush()
        if self.fill:  # the tail: through the page cache, the file ends at its last byte
            self._uncache()
            self._pwrite(self.buf.view[: self.fill])
        if self.cached_from is not None:
            writeback.start(self.fd, self.cached_from)

    def flush(self) -> None:
        """Write the buffer's whole 4096-byte blocks; move the rest to its start."""
        k = self.fill // ALIGN * ALIGN
        if k:
            self._pwrite(self.buf.view[:k])
            rest = self.fill - k
            self.buf.array[:rest] = self.buf.array[k : self.fill]  # rest < ALIGN <= k: apart
            self.fill = rest

    def _pwrite(self, view: memoryview) -> None:
        while len(view):
            try:
                n = os.pwrite(self.fd, view, self.offset)
            except OSError as e:
                if not (self.direct and e.errno == errno.EINVAL):
                    raise
                self.owner.refused()  # refused on the write: the page cache from here on
                self._uncache()
                continue
            if n <= 0:
                raise OSError(errno.EIO, "a write made no progress")
            _count("direct" if self.direct else "buffered", n)
            view, self.offset = view[n:], self.offset + n
            if self.direct and len(view) and n % ALIGN:
                self._uncache()  # a short write: the rest is not aligned any more

    def _uncache(self) -> None:
        """Write the rest of the file through the page cache (clear its ``O_DIRECT``)."""
        if self.direct:
            flags = fcntl.fcntl(self.fd, fcntl.F_GETFL)
            fcntl.fcntl(self.fd, fcntl.F_SETFL, flags & ~O_DIRECT)
            self.direct = False
            self.cached_from = self.offset


def _copy_in(block: npt.NDArray[Any], src: npt.NDArray[Any], region: Region, whole: bool) -> None:
    """Copy the chunk's ``region`` from ``src`` (the chunk's part inside the array) into
    ``block``, zero where the region lies outside it. Copies of unsigned integer views, which
    numpy makes without the GIL (bfloat16 and float8 copies would hold it)."""
    dst = _raw(block)
    if not whole:
        inside = [(a, min(b, n)) for (a, b), n in zip(region, src.shape)]
        if any(a >= b for a, b in inside):
            dst[...] = 0
            return
        if any(b < stop for (_, b), (_, stop) in zip(inside, region)):
            dst[...] = 0
            dst = dst[tuple(slice(0, b - a) for a, b in inside)]
            region = tuple(inside)
    np.copyto(dst, _raw(src[tuple(slice(a, b) for a, b in region)]))


def _raw(a: npt.NDArray[Any]) -> npt.NDArray[Any]:
    raw = _RAW.get(a.dtype.itemsize)
    return a if raw is None else a.view(raw)


class _Buffer:
    """A page-aligned staging buffer, as a numpy array and a memoryview of the same bytes."""

    def __init__(self) -> None:
        self.mm = mmap.mmap(-1, BUFFER_BYTES)
        self.array: npt.NDArray[np.uint8] = np.frombuffer(self.mm, np.uint8)
        self.view = memoryview(self.mm)


# Buffers not in use, kept for the next chunk and the next save: at most one per write
# thread (WRITE_THREADS x BUFFER_BYTES), released once none was used for RELEASE_AFTER_S (as
# the staging pool's arenas, ``jaxckpt._runtime.staging``) or by :func:`clear`.
RELEASE_AFTER_S = 10.0
_spare: list[_Buffer] = []
_idle: dict[str, Any] = {"last": 0.0, "timer": None}


def _take() -> _Buffer:
    with _lock:
        if _spare:
            return _spare.pop()
    return _Buffer()


def _give_back(buf: _Buffer) -> None:
    with _lock:
        _spare.append(buf)
        _idle["last"] = time.monotonic()
        if _idle["timer"] is None:  # one timer at a time: it re-arms while buffers are used
            _idle["timer"] = pools.after(RELEASE_AFTER_S, _release_if_idle)


def _release_if_idle() -> None:
    with _lock:
        left = _idle["last"] + RELEASE_AFTER_S - time.monotonic()
        if left > 0:
            _idle["timer"] = pools.after(left, _release_if_idle)
            return
        _idle["timer"] = None
        _spare.clear()


def clear() -> None:
    """Release the spare write buffers now (``CheckpointManager.close()``)."""
    with _lock:
        _spare.clear()


def _device(path: str) -> int | None:
    try:
        return os.stat(path).st_dev
    except OSError:
        return None


def _count(kind: str, n: int) -> None:
    with _lock:
        _bytes[kind] += n
