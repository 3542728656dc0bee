"""Reading jaxckpt's own zarr v3 chunks straight from local files, without a decode copy.

A jaxckpt array on a local disk is a zarr v3 array whose codecs are ``bytes`` (little endian)
and, by default, ``crc32c``: each chunk file holds the chunk's elements in C order, at full
chunk shape even at the array's edge, then the 4-byte little-endian CRC-32C of those bytes.
tensorstore reads such a file into a buffer of its own, checks it and copies the decoded chunk
out; profiling put that path at ~75% of a restore (docs/benchmarks.md). Here a chunk that a box
needs whole is read by one ``preadv`` into the box's own buffer (which CPU devices then alias)
and checked there, so each byte is copied once, from the page cache. A chunk the box needs only
part of (a resharded restore) is read into a scratch buffer and the part copied out, as
tensorstore does.

Everything else (object stores, other codecs, hosts that are not little endian, no C CRC-32C)
stays on tensorstore (``supports``). The files are treated as hostile: opened without
following a link, refused unless regular and exactly the size the manifest implies (so nothing
is allocated that the file does not hold), and checksummed before their bytes are used.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import itertools
import math
import os
import stat
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from jaxckpt._errors import CorruptChunkError
from jaxckpt._manifest import ArrayEntry, dtype_from_name

try:
    import google_crc32c

    _CRC = google_crc32c.implementation == "c"  # the pure-Python fallback is ~1000x slower
except ImportError:  # pragma: no cover - a core dependency; kept optional for odd platforms
    _CRC = False


def _native_extend() -> Callable[[int, int, int], int] | None:
    """google-crc32c's C ``crc32c_extend``, called through ctypes, which drops the GIL for the
    call: the extension's own ``value()`` holds it, so the checksums of chunks read by several
    threads ran one at a time and stalled the restore's Python thread (~40 ms per 400 MiB).
    ``None`` where the symbol cannot be found or fails a known answer (then ``value()``)."""
    try:
        from google_crc32c import _crc32c  # the C extension; the symbol is in its library

        fn = ctypes.CDLL(_crc32c.__file__).crc32c_extend
        fn.argtypes, fn.restype = (
            [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t],
            ctypes.c_uint32,
        )
        check = b"123456789"
        return fn if fn(0, check, len(check)) == 0xE3069283 else None  # the CRC-32C check value
    except (ImportError, OSError, AttributeError, ctypes.ArgumentError):
        return None


_extend = _native_extend() if _CRC else None


def crc32c(buf: np.ndarray) -> int:
    """CRC-32C of a C-contiguous array's bytes, without holding the GIL where possible."""
    if _extend is not None:
        return _extend(0, buf.ctypes.data, buf.nbytes)
    return google_crc32c.value(buf.reshape(-1).view(np.uint8))


# bool is left to tensorstore: a byte other than 0/1 is not a numpy bool.
_DTYPES = {
    "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
    "float16", "float32", "float64", "bfloat16", "complex64", "complex128",
}  # fmt: skip
_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
_FLAGS |= getattr(os, "O_CLOEXEC", 0)

enabled = os.environ.get("JAXCKPT_DIRECT_READ", "1") != "0"  # tests flip it to compare paths
_pool: ThreadPoolExecutor | None = None
_count_lock = threading.Lock()
_bytes_read = 0  # chunk-file bytes read here (tensorstore counts its own): see bytes_read()


def supports(root: Path | None, entry: ArrayEntry) -> bool:
    """Whether ``entry``'s chunks can be read here (else: through tensorstore)."""
    return (
        enabled
        and root is not None
        and sys.byteorder == "little"
        and entry.pack is None
        and entry.storage_dtype in _DTYPES
        and (entry.checksum is None or (entry.checksum == "crc32c" and _CRC))
        # a chunk no bigger than its array: a chunk buffer is never more than the array
        and all(0 < c <= max(n, 1) for c, n in zip(entry.chunks, entry.shape))
    )


def bytes_read() -> int:
    """Bytes of chunk files (checksums included) read by this module in this process."""
    return _bytes_read


class InPlace:
    """Reads boxes of one checkpoint's arrays from its local chunk files (one per restore).

    A chunk that several boxes in flight each need part of (a resharded restore: target
    shards straddle saved chunks) is read once and shared, as tensorstore merges concurrent
    reads of a chunk; it is dropped when the last of those boxes has taken its part.
    """

    def __init__(self, root: Path, describe: str) -> None:
        self.root, self.describe = root, describe
        self._shared: dict[tuple[str, tuple[int, ...]], list] = {}  # chunk -> [future, users]
        # Chunk buffers whose parts were all taken, reused for the next partial chunk of the
        # same shape: a fresh buffer costs a page fault per 4 KiB, about as much as the read.
        # Never more than were in flight at once, which the read-ahead budget bounds.
        self._spare: dict[tuple, list[np.ndarray]] = collections.defaultdict(list)

    def cost(self, entry: ArrayEntry, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> int:
        """Host bytes the box holds while in flight: itself, plus each chunk it needs only part
        of (an upper bound: a shared chunk counts for each box)."""
        itemsize = dtype_from_name(entry.storage_dtype).itemsize
        chunk = math.prod(entry.chunks) * itemsize
        n = math.prod(sizes) * itemsize
        return n + chunk * sum(not p[3] for p in _pieces(entry, offsets, sizes))

    def start(self, entry: ArrayEntry, offsets: tuple[int, ...], sizes: tuple[int, ...],
              out: np.ndarray) -> Callable[[], np.ndarray]:  # fmt: skip
        """Start reading the box ``offsets``/``sizes`` of ``entry`` into ``out``; return a wait.

        Chunks the box needs whole are read by pool tasks straight into ``out``; the others
        are read (or shared) into chunk buffers and their parts copied into ``out`` by the
        wait, which returns ``out`` or raises :class:`CorruptChunkError` naming the key and
        chunk once every task of the box has finished.
        """
        pool = _get_pool()
        folder = self.root / entry.path
        dtype = dtype_from_name(entry.storage_dtype)
        direct: list[Future] = []
        parts: list[tuple] = []
        for idx, dst, src, whole in _pieces(entry, offsets, sizes):
            view = out[dst]
            where = self._where(entry, idx)
            if whole and view.flags.c_contiguous:  # straight into the box's buffer
                direct.append(pool.submit(_read_file, folder, idx, entry, view, where))
                continue
            key = (entry.path, idx)
            shared = self._shared.get(key)
            if shared is None:
                spare = self._spare.get((entry.chunks, dtype))
                buf = spare.pop() if spare else np.empty(entry.chunks, dtype)
                shared = self._shared[key] = [
                    pool.submit(_read_file, folder, idx, entry, buf, where, result=buf),
                    0,
                ]
            shared[1] += 1
            copied: Future = Future()
            # The part is copied out by the thread that finished the read (or here, if it is
            # done already), so resharded copies run in parallel, not one by one in wait().
            shared[0].add_done_callback(functools.partial(_copy_part, view, src, copied))
            parts.append((key, copied))

        def wait() -> np.ndarray:
            error = None
            for f in direct:  # wait for all, so no task still writes into ``out`` after we raise
                try:
                    f.result()
                except CorruptChunkError as e:
                    error = error or e
            for key, copied in parts:
                try:
                    copied.result()
                except CorruptChunkError as e:
                    error = error or e
                finally:
                    shared = self._shared[key]
                    shared[1] -= 1
                    if shared[1] == 0:  # the last box in flight that needs it has its part
                        del self._shared[key]
                        if shared[0].exception() is None:
                            buf = shared[0].result()
                            self._spare[(buf.shape, buf.dtype)].append(buf)
            if error is not None:
                raise error
            return out

        return wait

    def _where(self, entry: ArrayEntry, idx: tuple[int, ...]) -> str:
        return f"Key {entry.key!r}: chunk ({','.join(map(str, idx))}) of {entry.path} in {self.describe}"


def _copy_part(view: np.ndarray, src: tuple, copied: Future, read: Future) -> None:
    """Copy a box's part of a chunk once the chunk is read (``read``'s result: its buffer)."""
    try:
        view[...] = read.result()[src]
    except BaseException as e:  # CorruptChunkError: wait() raises it for the box
        copied.set_exception(e)
    else:
        copied.set_result(None)


def _get_pool() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:  # as many reads in flight as tensorstore's file I/O default
        _pool = ThreadPoolExecutor(max(4, min(64, os.cpu_count() or 4)), "jaxckpt-read")
    return _pool


def _pieces(entry: ArrayEntry, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Iterator[tuple]:
    """``(chunk index, slices of the box, slices of the chunk, whole)`` for each chunk the box
    touches; ``whole``: the box needs all of the chunk's stored elements. The slices end in
    ``...``, so indexing gives a view even for 0-d arrays (``a[()]`` would copy)."""
    ranges = [range(o // c, -(-(o + s) // c)) for o, s, c in zip(offsets, sizes, entry.chunks)]
    for idx in itertools.product(*ranges):
        origin = [i * c for i, c in zip(idx, entry.chunks)]
        a = [max(o, g) for o, g in zip(offsets, origin)]  # the chunk's part in the box
        b = [min(o + s, g + c) for o, s, g, c in zip(offsets, sizes, origin, entry.chunks)]
        dst = (*(slice(x - o, y - o) for x, y, o in zip(a, b, offsets)), ...)
        src = (*(slice(x - g, y - g) for x, y, g in zip(a, b, origin)), ...)
        whole = all(x == g and y - x == c for x, y, g, c in zip(a, b, origin, entry.chunks))
        yield idx, dst, src, whole


def _read_file(folder: Path, idx: tuple[int, ...], entry: ArrayEntry, buf: np.ndarray, where: str,
               result: np.ndarray | None = None) -> np.ndarray | None:  # fmt: skip
    """Read chunk ``idx``'s file into ``buf`` (its stored shape, contiguous) and check it."""
    global _bytes_read
    tail = 4 if entry.checksum == "crc32c" else 0
    nbytes = buf.nbytes
    try:
        fd = os.open(folder.joinpath("c", *map(str, idx)), _FLAGS)
    except FileNotFoundError:
        raise CorruptChunkError(f"{where} is missing. {_DAMAGED}") from None
    except OSError as e:  # a link (ELOOP under O_NOFOLLOW), no permission, ...
        raise CorruptChunkError(f"{where} cannot be read ({e}). {_DAMAGED}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CorruptChunkError(f"{where} is not a regular file. {_DAMAGED}")
        if st.st_size != nbytes + tail:  # checked before reading: nothing beyond the file
            raise CorruptChunkError(
                f"{where} holds {st.st_size} bytes, the manifest implies {nbytes + tail}. "
                f"{_DAMAGED}"
            )
        data = memoryview(buf.reshape(-1).view(np.uint8))
        stored = bytearray(tail)
        views = [data, memoryview(stored)] if tail else [data]
        done = 0
        while views:  # preadv may return short: go on from where it stopped
            n = os.preadv(fd, views, done)
            if n == 0:
                raise CorruptChunkError(f"{where} was truncated while being read. {_DAMAGED}")
            done += n
            while views and n >= len(views[0]):
                n -= len(views.pop(0))
            if views and n:
                views[0] = views[0][n:]
    finally:
        os.close(fd)
    if tail:
        have = crc32c(buf)
        want = int.from_bytes(stored, "little")
        if have != want:
            raise CorruptChunkError(
                f"{where} fails its checksum (stored crc32c {want:08x}, data {have:08x}). "
                f"{_DAMAGED}"
            )
    with _count_lock:
        _bytes_read += nbytes + tail
    return result


_DAMAGED = (
    "The checkpoint is damaged: restore an earlier one; `jaxckpt verify PATH` lists every bad "
    "chunk."
)
