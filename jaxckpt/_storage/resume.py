"""Resuming a failed save: a dead save's leftovers of the same plan are adopted, and the chunks
they already hold with the very bytes this save would write are not written again.

Two separable steps:

1. **Adopt leftovers.** A save records its plan (:func:`plan_id`: its arrays' storage
   layout) where it writes: ``writer.json`` in a local staging directory
   (:func:`mark_local`, removed at the commit) or in an object store's ``writer.json`` lease
   (``jaxckpt._storage.lease``). When a save of the same path starts, its coordinator looks
   for a leftover that no live save holds and that records the same plan (:func:`adopt_local`
   here; ``jaxckpt._storage.generations`` on object stores) and writes into it instead of a
   fresh staging directory or generation. The coordinator chooses; the others learn it with
   the staging name or generation it broadcasts (:func:`tell`, :func:`told`), so every
   process adopts the same leftover.
2. **Skip chunks present** (:class:`Present`): for each chunk a process would write, the
   chunk's expected stored bytes (its elements at full chunk shape, zero-filled at the
   array's edge, then their CRC-32C) are compared with what the leftover holds: byte for byte
   on local files (the file is read: the data may have changed between the failed save and
   this one), by the stored CRC-32C trailer on object stores (a ranged read of 4 bytes; an
   object is written whole or not at all). A chunk that matches is kept; the others are
   written as usual. Compressed arrays are written whole (their stored bytes are not known
   without compressing them).
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import hashlib
import json
import math
import os
import sys
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from jaxckpt._errors import (
    ArgumentTypeError,
    CheckpointError,
    CheckpointExistsError,
    InvalidArgumentError,
    ManifestError,
    PlanValidationError,
    UnsupportedLeafError,
)
from jaxckpt._format.dtypes import dtype_from_name
from jaxckpt._format.grid import chunk_key, chunks_touching
from jaxckpt._format.manifest import ArrayEntry
from jaxckpt._format.names import WRITER, parse_staging
from jaxckpt._format.plan import WriteItem
from jaxckpt._runtime import pools
from jaxckpt._storage import crc
from jaxckpt._storage.lease import Lease, dead_plan, is_lease
from jaxckpt._storage.location import Location, kvstore, wait
from jaxckpt._storage.messages import is_full

_RESUMED = "|resume"  # appended to a broadcast staging name or generation: adopted leftovers
_lock = threading.Lock()
_kept = 0  # see bytes_kept()


def bytes_kept() -> int:
    """Chunk bytes this process found already written by a failed save and did not write
    again (stored bytes, checksums excluded), since it started."""
    with _lock:
        return _kept


_IDS: dict[str, str] = {}  # plan_id's, by the agreed digest and codec


def plan_id(key: str, entries: Iterable[ArrayEntry]) -> str:
    """What identifies a save's plan for a later save to adopt its leftovers: the hash of its
    arrays' storage layout (path, shape, stored dtype, chunks, codec, checksum), which every
    process computes alike; not of Python values or the plan cache's history, as the plan's
    own digest is. Computed once per ``key`` (the plan's digest and codec: the same arrays)."""
    known = _IDS.get(key)
    if known is not None:
        return known
    h = hashlib.sha256()
    for e in sorted(entries, key=lambda e: e.path):
        layout = [e.path, e.shape, e.storage_dtype, e.chunks, e.compression, e.checksum]
        h.update(json.dumps(layout).encode())
    if len(_IDS) >= 1024:  # one per kind of state: bounded for runs of many
        _IDS.clear()
    _IDS[key] = known = h.hexdigest()[:16]
    return known


def tell(name: str, resumed: bool) -> str:
    """The value the coordinator broadcasts: the staging name or generation, and whether it
    adopted a failed save's leftovers there."""
    return name + _RESUMED if resumed else name


def told(value: str) -> tuple[str, bool]:
    """:func:`tell`'s ``(name, resumed)`` back from the broadcast value."""
    if value.endswith(_RESUMED):
        return value[: -len(_RESUMED)], True
    return value, False


def mark_local(staging: Path, plan: str) -> None:
    """Record ``plan`` in a new staging directory (a crash that loses it loses only the resume)."""
    (staging / WRITER).write_bytes(json.dumps({"format": 1, "plan": plan}).encode())


def plan_of(staging: Path) -> str | None:
    """The plan a staging directory records (:func:`mark_local`), if any."""
    try:
        raw = (staging / WRITER).read_bytes()
        plan = json.loads(raw).get("plan")
    except (OSError, ValueError, AttributeError):
        return None
    return plan if isinstance(plan, str) else None


def adopt_local(target: Path, plan: str) -> tuple[Path, Lease] | None:
    """A dead save's staging directory of ``target`` that records ``plan``, leased to this
    save; ``None`` if there is none."""
    try:
        siblings = sorted(target.parent.iterdir())
    except OSError:
        return None
    for path in siblings:
        parsed = parse_staging(path.name)
        if parsed is None or parsed[0] != target.name or parsed[2] or plan_of(path) != plan:
            continue
        lease = Lease.adopt_local(path)
        if lease is None:
            continue
        if plan_of(path) == plan:  # still: not removed and made anew before the lock
            return path, lease
        lease.release()
    return None


def resumable(loc: Location, keys: list[str]) -> bool:
    """Whether an object-store prefix (its ``keys``) holds a dead save's data that records
    its plan (a ``writer.json`` lease that is not live)."""
    kv = kvstore(loc.kvstore, loc)
    for key in keys:
        if is_lease(key):
            got = wait(kv.read(key), loc, f"reading {key}")
            if dead_plan(loc, key, got) is not None:
                return True
    return False


class Present:
    """The chunks an adopted leftover under ``root`` (a kvstore spec) already holds."""

    def __init__(self, root: dict[str, Any], loc: Location) -> None:
        self.loc = loc
        self.local = Path(root["path"]) if root["driver"] == "file" else None
        self._kv = None if self.local is not None else kvstore(root, loc)
        self.kept = 0  # chunk bytes found written and kept by this save
        self._lock = threading.Lock()

    def keep(self, nbytes: int) -> None:
        """Count ``nbytes`` of stored data (checksums excluded) found written and kept."""
        with self._lock:
            self.kept += nbytes
        _count(nbytes)

    def ahead(
        self,
        entries: dict[str, ArrayEntry],
        items: Iterable[tuple[WriteItem, npt.NDArray[Any]]],
        depth: int,
    ) -> Iterator[tuple[ArrayEntry, list[tuple[WriteItem, npt.NDArray[Any]]]]]:
        """Each of ``items`` with its boxes still to write (:meth:`missing`), in order; the
        checks run ``depth`` items ahead on the hash threads (0: here, one at a time), so that
        they overlap each other and the writes."""
        window: collections.deque[tuple[ArrayEntry, Future[Any]]] = collections.deque()
        for item, data in items:
            entry = entries[item.key]
            if depth == 0:  # the list is the only reference to the data once yielded
                boxes = self.missing(entry, item, data)
                del data
                yield entry, boxes
                continue
            window.append((entry, pools.hash_pool().submit(self.missing, entry, item, data)))
            del data  # held by its check only
            while len(window) > depth:
                e, fut = window.popleft()
                yield e, fut.result()
        while window:
            e, fut = window.popleft()
            yield e, fut.result()

    def missing(
        self, entry: ArrayEntry, item: WriteItem, data: npt.NDArray[Any]
    ) -> list[tuple[WriteItem, npt.NDArray[Any]]]:
        """The boxes of ``item`` (``data``) still to write, each whole chunks with its view of
        ``data``; ``[(item, data)]`` where its chunks cannot be checked."""
        boxes = _chunk_boxes(entry, item, data)
        if boxes is None:
            return [(item, data)]
        stored = data.view(dtype_from_name(entry.storage_dtype))
        same = self._same(
            entry, [(idx, *_expected(entry, stored, item, lo, hi)) for idx, lo, hi in boxes]
        )
        nbytes = sum(same) * math.prod(entry.chunks) * stored.dtype.itemsize
        with self._lock:
            self.kept += nbytes
        _count(nbytes)
        if not any(same):
            return [(item, data)]
        out: list[tuple[WriteItem, npt.NDArray[Any]]] = []
        for (_, lo, hi), kept in zip(boxes, same):
            if not kept:
                sizes = tuple(b - a for a, b in zip(lo, hi))
                view = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, item.offsets))
                out.append((dataclasses.replace(item, offsets=lo, sizes=sizes), data[view]))
        return out

    def _same(
        self, entry: ArrayEntry, chunks: list[tuple[tuple[int, ...], npt.NDArray[Any], int]]
    ) -> list[bool]:
        """Whether each chunk ``(idx, expected elements' bytes, their CRC-32C)`` is stored with
        exactly those bytes."""
        if self.local is not None:
            folder = self.local / entry.path
            return [_file_holds(folder / chunk_key(idx), body, c) for idx, body, c in chunks]
        assert self._kv is not None
        n = math.prod(entry.chunks) * dtype_from_name(entry.storage_dtype).itemsize
        reads = [
            self._kv.read(f"{entry.path}/{chunk_key(idx)}", byte_range=slice(n, n + 4))
            for idx, _, _ in chunks
        ]
        out = []
        for fut, (idx, _, want) in zip(reads, chunks):
            try:
                got = wait(fut, self.loc, f"reading chunk {idx} of key {entry.key!r}")
            except ValueError:  # shorter than a chunk: not ours to keep
                out.append(False)
                continue
            out.append(got.state == "value" and bytes(got.value) == want.to_bytes(4, "little"))
        return out


def _chunk_boxes(
    entry: ArrayEntry, item: WriteItem, data: npt.NDArray[Any]
) -> list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]] | None:
    """``(chunk index, low corner, high corner)`` of each chunk ``item`` covers, each within
    the array; ``None`` if they cannot be checked (compressed, no checksum, a chunk the box
    covers only in part)."""
    if entry.compression is not None or entry.checksum != "crc32c":
        return None
    if sys.byteorder != "little" or data.shape != tuple(item.sizes):
        return None
    boxes = []
    for idx in chunks_touching(item.offsets, item.sizes, entry.chunks):
        lo = tuple(i * c for i, c in zip(idx, entry.chunks))
        hi = tuple(min(a + c, n) for a, c, n in zip(lo, entry.chunks, entry.shape))
        if any(a < o or b > o + s for a, b, o, s in zip(lo, hi, item.offsets, item.sizes)):
            return None
        boxes.append((idx, lo, hi))
    return boxes


def _expected(
    entry: ArrayEntry,
    stored: npt.NDArray[Any],
    item: WriteItem,
    lo: tuple[int, ...],
    hi: tuple[int, ...],
) -> tuple[npt.NDArray[np.uint8], int]:
    """What a chunk file of the box ``lo``..``hi`` holds: its elements' bytes at full chunk
    shape (zero beyond the array's edge: then a copy, else a view of ``stored`` where it is
    contiguous), and their CRC-32C, which follows them."""
    part = stored[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, item.offsets))]
    if part.shape != tuple(entry.chunks) or not part.flags.c_contiguous:
        chunk = np.zeros(entry.chunks, stored.dtype)
        chunk[tuple(slice(0, b - a) for a, b in zip(lo, hi))] = part
        part = chunk
    raw = part.reshape(-1).view(np.uint8)
    return raw, crc.crc32c(raw)


_BLOCK = 4 << 20  # bytes of a chunk file read and compared at a time


def _file_holds(path: Path, body: npt.NDArray[np.uint8], want: int) -> bool:
    """Whether the file ``path`` (no link followed) holds exactly ``body`` then the CRC-32C
    ``want`` (little endian)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return False
    try:
        if os.fstat(fd).st_size != body.nbytes + 4:
            return False
        buf = np.empty(min(body.nbytes, _BLOCK) or 1, np.uint8)
        for at in range(0, body.nbytes, _BLOCK):
            n = min(_BLOCK, body.nbytes - at)
            if os.preadv(fd, [memoryview(buf[:n])], at) != n:  # type: ignore[arg-type]
                return False
            if not np.array_equal(buf[:n], body[at : at + n]):
                return False
        return os.pread(fd, 4, body.nbytes) == want.to_bytes(4, "little")
    except OSError:
        return False
    finally:
        os.close(fd)


def _count(n: int) -> None:
    global _kept
    with _lock:
        _kept += n


def whole(
    entries: dict[str, ArrayEntry], items: Iterable[tuple[WriteItem, npt.NDArray[Any]]]
) -> Iterator[tuple[ArrayEntry, list[tuple[WriteItem, npt.NDArray[Any]]]]]:
    """Each item as one box to write (no leftovers adopted); the list it yields is the only
    reference to the data here, so once the writer has taken the box out none is held while the
    next item is made (``Writer.write``'s ``release_each``)."""
    for item, data in items:
        boxes = [(item, data)]
        del data
        yield entries[item.key], boxes


def worth_keeping(error: BaseException) -> bool:
    """Whether a failed save's data is kept for a retry of the same plan to resume: where
    storage or another process failed it (a ``CheckpointError``: a deadline, a refused or
    throttled request, a process that died) or it was interrupted (``KeyboardInterrupt``,
    ``SystemExit``); not where another save took its place (``CheckpointExistsError``), on a
    full disk (the data would keep it full), where the file system refused the operation
    itself (a retry cannot succeed there: a mount that renames no directory), where the save
    itself was refused as wrong (a manifest that would not read back, an invalid plan or
    argument: the same save fails the same way again), nor where the caller's own code raised
    (a planner, a data source: the retry usually changes what is saved)."""
    if isinstance(error, _REFUSED) or is_full(error) or _unsupported(error):
        return False
    return isinstance(error, CheckpointError) or not isinstance(error, Exception)


_REFUSED = (
    CheckpointExistsError,
    ManifestError,
    PlanValidationError,
    InvalidArgumentError,
    ArgumentTypeError,
    UnsupportedLeafError,
)
_UNSUPPORTED = (errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EXDEV)


def _unsupported(error: BaseException | None) -> bool:
    """Whether ``error`` or one it was raised from is the OS refusing an operation outright."""
    while error is not None:
        if isinstance(error, OSError) and error.errno in _UNSUPPORTED:
            return True
        error = error.__cause__
    return False
