"""Reading jaxckpt's own zarr v3 chunks straight from local files, without a decode copy.

A jaxckpt array on a local disk is a zarr v3 array whose codecs are ``bytes`` (little endian)
and, by default, ``crc32c``: each chunk file holds the chunk's elements in C order, at full
chunk shape even at the array's edge, then the 4-byte little-endian CRC-32C of those bytes.
tensorstore reads such a file into a buffer of its own, checks it and copies the decoded chunk
out, a second copy of every byte that dominated restores (docs/benchmarks.md). Here a chunk that a box
needs whole is read by one ``preadv`` into the box's own buffer (which CPU devices then alias)
and checked there, so each byte is copied once, from the page cache. A chunk that boxes need
only part of (a resharded restore) is read once for all the boxes in flight that need it, in
blocks of at most ``_BLOCK`` bytes into a reused scratch buffer: each block is checksummed and
its parts copied out while it is in cache, so the extra host memory is a block per read thread,
however large the chunk.

Everything else (object stores, other codecs, hosts that are not little endian, no C CRC-32C)
stays on tensorstore (``supports``). The files are treated as hostile: opened without
following a link, refused unless regular and exactly the size the manifest implies (so nothing
is allocated that the file does not hold), and checksummed before their bytes are used.
"""

from __future__ import annotations

import itertools
import math
import os
import stat
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from types import EllipsisType
from typing import Any

import numpy as np
import numpy.typing as npt

from jaxckpt._errors import CorruptChunkError
from jaxckpt._format.grid import Region, c_order_blocks, chunk_key, chunks_touching
from jaxckpt._format.manifest import ArrayEntry, dtype_from_name
from jaxckpt._runtime import pools
from jaxckpt._storage.crc import NATIVE, crc32c

# Slices of a box or a chunk, ending in ``...`` so that indexing gives a view (see _pieces)
_Slices = tuple[*tuple[slice, ...], EllipsisType]
# (chunk index, slices of the box, slices of the chunk, whole): see _pieces
_Piece = tuple[tuple[int, ...], _Slices, _Slices, bool]

# bool is left to tensorstore: a byte other than 0/1 is not a numpy bool.
_DTYPES = set(
    "int8 uint8 int16 uint16 int32 uint32 int64 uint64 float16 float32 float64 bfloat16 "
    "complex64 complex128".split()
)
_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
_FLAGS |= getattr(os, "O_CLOEXEC", 0)

enabled = os.environ.get("JAXCKPT_DIRECT_READ", "1") != "0"  # tests flip it to compare paths
_count_lock = threading.Lock()
_bytes_read = 0  # chunk-file bytes read here (tensorstore counts its own): see bytes_read()


def supports(root: Path | None, entry: ArrayEntry) -> bool:
    """Whether ``entry``'s chunks can be read here (else: through tensorstore)."""
    return (
        enabled
        and root is not None
        and sys.byteorder == "little"
        and entry.pack is None
        and entry.compression is None
        and entry.storage_dtype in _DTYPES
        and (entry.checksum is None or (entry.checksum == "crc32c" and NATIVE))
        # a chunk no bigger than its array: a chunk buffer is never more than the array
        and all(0 < c <= max(n, 1) for c, n in zip(entry.chunks, entry.shape))
    )


def bytes_read() -> int:
    """Bytes of chunk files (checksums included) read by this module in this process."""
    return _bytes_read


class InPlace:
    """Reads boxes of one checkpoint's arrays from its local chunk files (one per restore).

    A chunk that several boxes each need part of (a resharded restore: target shards straddle
    saved chunks) is read once for all of them, as tensorstore merges concurrent reads of a
    chunk. :meth:`expect` is told every box before the first :meth:`start`, and a chunk's read
    starts once the last box that needs part of it has started, so it knows where every part
    goes. Should the read-ahead budget not hold all those boxes at once, waiting for one of
    them starts the read for the boxes started so far (the later ones read the chunk again).
    """

    def __init__(self, root: Path, describe: str) -> None:
        self.root, self.describe = root, describe
        # box -> its pieces, from expect()
        self._pieces: dict[tuple[str, tuple[int, ...], tuple[int, ...]], list[_Piece]] = {}
        self._due: dict[tuple[str, tuple[int, ...]], int] = {}  # chunk -> boxes yet to start
        self._gathering: dict[tuple[str, tuple[int, ...]], _Shared] = {}  # chunk -> its parts
        # Block buffers for partial chunks, reused (one per read running at once); list
        # append and pop are atomic under the GIL, which is all the pool threads need.
        self._scratch: list[npt.NDArray[Any]] = []

    def expect(self, entry: ArrayEntry, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> None:
        """Note that the box will be started: the chunks it needs part of wait for it."""
        pieces = self._pieces[(entry.path, offsets, sizes)] = list(_pieces(entry, offsets, sizes))
        for idx, _, _, whole in pieces:
            if not whole:
                key = (entry.path, idx)
                self._due[key] = self._due.get(key, 0) + 1

    def start(
        self,
        entry: ArrayEntry,
        offsets: tuple[int, ...],
        sizes: tuple[int, ...],
        out: npt.NDArray[Any],
    ) -> Callable[[], npt.NDArray[Any]]:
        """Start reading the box ``offsets``/``sizes`` of ``entry`` into ``out``; return a wait.

        Chunks the box needs whole are read by pool tasks straight into ``out``; the others
        are read once for every box that needs part of them (see the class). The wait returns
        ``out``, or raises :class:`CorruptChunkError` naming the key and chunk, once every read
        that writes into ``out`` has finished.
        """
        pool = pools.read_pool()
        folder = self.root / entry.path
        direct: list[Future[None]] = []
        shared: list[_Shared] = []
        pieces = self._pieces.pop((entry.path, offsets, sizes), None)
        pieces = pieces if pieces is not None else list(_pieces(entry, offsets, sizes))
        _prefetch(folder, entry, [p[0] for p in pieces])
        for idx, dst, src, whole in pieces:
            view = out[dst]
            where = self._where(entry, idx)
            if whole and view.flags.c_contiguous:  # straight into the box's buffer
                direct.append(pool.submit(_read_file, folder, idx, entry, view, where))
                continue
            key = (entry.path, idx)
            chunk = self._gathering.get(key)
            if chunk is None:
                chunk = self._gathering[key] = _Shared(key, folder, entry, where)
            chunk.parts.append((view, src[:-1]))
            shared.append(chunk)
            due = self._due.get(key, 0) - (not whole)  # a whole chunk was not expected: 0
            if due > 0:
                self._due[key] = due
            else:
                self._due.pop(key, None)
                self._submit(key)

        def wait() -> npt.NDArray[Any]:
            for chunk in shared:
                if chunk.future is None:  # its other boxes are not started yet: read it now
                    self._submit(chunk.key)
            error = None
            submitted = (c.future for c in shared if c.future is not None)  # all are, now
            for f in itertools.chain(direct, submitted):
                try:  # wait for all, so no task still writes into ``out`` after we raise
                    f.result()
                except Exception as e:  # noqa: BLE001 - re-raised below, the first one
                    error = error or e
            if error is not None:
                raise error
            return out

        return wait

    def _submit(self, key: tuple[str, tuple[int, ...]]) -> None:
        chunk = self._gathering.pop(key)
        chunk.future = pools.read_pool().submit(
            _read_parts,
            chunk.folder,
            chunk.key[1],
            chunk.entry,
            chunk.parts,
            chunk.where,
            self._scratch,
        )

    def _where(self, entry: ArrayEntry, idx: tuple[int, ...]) -> str:
        return f"Key {entry.key!r}: chunk ({','.join(map(str, idx))}) of {entry.path} in {self.describe}"


class _Shared:
    """A chunk read for the boxes that need part of it: the parts, gathered while those boxes
    start, and the read's future once submitted."""

    __slots__ = ("key", "folder", "entry", "where", "parts", "future")

    def __init__(
        self, key: tuple[str, tuple[int, ...]], folder: Path, entry: ArrayEntry, where: str
    ) -> None:
        self.key = key  # (array path, chunk index)
        self.folder, self.entry, self.where = folder, entry, where
        # (view in a box, slices of the chunk)
        self.parts: list[tuple[npt.NDArray[Any], tuple[slice, ...]]] = []
        self.future: Future[None] | None = None


def _pieces(
    entry: ArrayEntry, offsets: tuple[int, ...], sizes: tuple[int, ...]
) -> Iterator[_Piece]:
    """``(chunk index, slices of the box, slices of the chunk, whole)`` for each chunk the box
    touches; ``whole``: the box needs all of the chunk's stored elements. The slices end in
    ``...``, so indexing gives a view even for 0-d arrays (``a[()]`` would copy)."""
    for idx in chunks_touching(offsets, sizes, entry.chunks):
        origin = [i * c for i, c in zip(idx, entry.chunks)]
        a = [max(o, g) for o, g in zip(offsets, origin)]  # the chunk's part in the box
        b = [min(o + s, g + c) for o, s, g, c in zip(offsets, sizes, origin, entry.chunks)]
        dst: _Slices = (*(slice(x - o, y - o) for x, y, o in zip(a, b, offsets)), ...)
        src: _Slices = (*(slice(x - g, y - g) for x, y, g in zip(a, b, origin)), ...)
        whole = all(x == g and y - x == c for x, y, g, c in zip(a, b, origin, entry.chunks))
        yield idx, dst, src, whole


_PREFETCH_MIN = 256 << 10  # smaller chunk files come whole with the kernel's first read-ahead


def _prefetch(folder: Path, entry: ArrayEntry, idxs: list[tuple[int, ...]]) -> None:
    """Ask the kernel to start reading a box's large chunk files now (on a cold cache, all
    the chunks of the boxes in flight are then read at once, not four at a time by the read
    threads). A hint: errors are left to the read itself."""
    size = math.prod(entry.chunks) * dtype_from_name(entry.storage_dtype).itemsize
    if size >= _PREFETCH_MIN and idxs and hasattr(os, "posix_fadvise"):
        pools.prefetch_pool().submit(_will_need, folder, idxs, size)


def _will_need(folder: Path, idxs: list[tuple[int, ...]], size: int) -> None:
    for idx in idxs:
        try:
            fd = os.open(folder / chunk_key(idx), _FLAGS)
        except OSError:
            continue
        try:  # at most what the manifest implies: a bigger (hostile) file gets no more
            os.posix_fadvise(fd, 0, size + 4, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass
        finally:
            os.close(fd)


_BLOCK = 4 << 20  # bytes of a partial chunk read, checksummed and copied out at a time


def _read_file(
    folder: Path, idx: tuple[int, ...], entry: ArrayEntry, buf: npt.NDArray[Any], where: str
) -> None:
    """Read chunk ``idx``'s file into ``buf`` (its stored shape, contiguous) and check it."""
    tail = 4 if entry.checksum == "crc32c" else 0
    stored = bytearray(tail)
    fd = _open_chunk(folder, idx, buf.nbytes + tail, where)
    try:
        data = buf.reshape(-1).view(np.uint8).data  # memoryview(...), typed
        _pread(fd, [data, memoryview(stored)] if tail else [data], 0, where)
    finally:
        os.close(fd)
    if tail:
        _check(crc32c(buf), stored, where)
    _count(buf.nbytes + tail)


def _read_parts(
    folder: Path,
    idx: tuple[int, ...],
    entry: ArrayEntry,
    parts: list[tuple[npt.NDArray[Any], tuple[slice, ...]]],
    where: str,
    scratch: list[npt.NDArray[Any]],
) -> None:
    """Read chunk ``idx``'s file block by block into a scratch buffer, checksumming each block
    and copying its share of each part (``(view in a box, slices of the chunk)``) out while it
    is in cache. The boxes see the bytes only once the checksum of the whole file is checked:
    their waits raise if it fails."""
    dtype = dtype_from_name(entry.storage_dtype)
    tail = 4 if entry.checksum == "crc32c" else 0
    nbytes = math.prod(entry.chunks) * dtype.itemsize
    size = max(min(nbytes, _BLOCK), dtype.itemsize)  # the largest block (see c_order_blocks)
    try:
        buf = scratch.pop()
    except IndexError:  # none spare: every buffer is in a read running now
        buf = None
    if buf is None or buf.nbytes < size:
        buf = np.empty(size, np.uint8)
    fd = -1
    try:
        fd = _open_chunk(folder, idx, nbytes + tail, where)
        crc = 0
        for offset, region in c_order_blocks(entry.chunks, dtype.itemsize, _BLOCK):
            shape = tuple(b - a for a, b in region)
            block = buf[: math.prod(shape) * dtype.itemsize].view(dtype).reshape(shape)
            _pread(fd, [block.reshape(-1).view(np.uint8).data], offset, where)
            if tail:
                crc = crc32c(block, crc)
            for view, src in parts:
                _copy_overlap(view, src, block, region)
        stored = bytearray(tail)
        if tail:
            _pread(fd, [memoryview(stored)], nbytes, where)
    finally:
        if fd >= 0:
            os.close(fd)
        scratch.append(buf)
    if tail:
        _check(crc, stored, where)
    _count(nbytes + tail)


def _copy_overlap(
    view: npt.NDArray[Any], src: tuple[slice, ...], block: npt.NDArray[Any], region: Region
) -> None:
    """Copy what ``block`` (the chunk's ``region``) holds of ``src`` (the chunk's slices that
    ``view`` receives) into ``view``."""
    to: list[slice] = []
    of: list[slice] = []
    for s, (a, b) in zip(src, region):
        lo, hi = max(s.start, a), min(s.stop, b)
        if lo >= hi:
            return
        to.append(slice(lo - s.start, hi - s.start))
        of.append(slice(lo - a, hi - a))
    into: _Slices = (*to, ...)  # typed: mypy infers (*list, ...) as tuple[object, ...]
    part: _Slices = (*of, ...)
    view[into] = block[part]


def _open_chunk(folder: Path, idx: tuple[int, ...], size: int, where: str) -> int:
    """Open chunk ``idx``'s file, refusing a link, anything not a regular file and any size
    but ``size`` (checked before reading: nothing is read beyond what the file holds)."""
    try:
        fd = os.open(folder / chunk_key(idx), _FLAGS)
    except FileNotFoundError:
        raise CorruptChunkError(f"{where} is missing. {_DAMAGED}") from None
    except OSError as e:  # a link (ELOOP under O_NOFOLLOW), no permission, ...
        raise CorruptChunkError(f"{where} cannot be read ({e}). {_DAMAGED}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CorruptChunkError(f"{where} is not a regular file. {_DAMAGED}")
        if st.st_size != size:
            raise CorruptChunkError(
                f"{where} holds {st.st_size} bytes, the manifest implies {size}. {_DAMAGED}"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


def _pread(fd: int, views: list[memoryview], offset: int, where: str) -> None:
    """Fill ``views`` from ``offset`` on (``preadv`` may return short: go on from there)."""
    views = [v for v in views if len(v)]
    while views:
        n = os.preadv(fd, views, offset)
        if n == 0:
            raise CorruptChunkError(f"{where} was truncated while being read. {_DAMAGED}")
        offset += n
        while views and n >= len(views[0]):
            n -= len(views.pop(0))
        if views and n:
            views[0] = views[0][n:]


def _check(have: int, stored: bytearray, where: str) -> None:
    want = int.from_bytes(stored, "little")
    if have != want:
        raise CorruptChunkError(
            f"{where} fails its checksum (stored crc32c {want:08x}, data {have:08x}). {_DAMAGED}"
        )


def _count(n: int) -> None:
    global _bytes_read
    with _count_lock:
        _bytes_read += n


_DAMAGED = (
    "The checkpoint is damaged: restore an earlier one; `jaxckpt verify PATH` lists every bad "
    "chunk."
)
