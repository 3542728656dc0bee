"""Writing and reading format v5's data objects: each process's chunks as records.

The layout (record bytes, order, object names, offsets) is ``jaxckpt._format.objects``'s. A
:class:`RecordWriter` copies each chunk of the boxes it is given into its record's place in
the object being filled, with the record's CRC-32C, and writes each object once it is whole
(no object is replaced: its name is unique to the save's generation). A :class:`RecordReader`
reads the byte ranges a box needs (adjacent records of one object in one request), checks each
record's length and checksum, and copies the box's part out. Object stores only: local disks
keep a file per chunk (O_DIRECT writes, in-place reads; docs/architecture.md says why).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import numpy.typing as npt
import tensorstore as ts

from jaxckpt._errors import CheckpointError, CorruptChunkError
from jaxckpt._format.grid import aligned_empty, chunks_touching
from jaxckpt._format.manifest import ArrayEntry, dtype_from_name
from jaxckpt._format.objects import DataObjects, Table, table
from jaxckpt._format.plan import WriteItem
from jaxckpt._storage.crc import crc32c
from jaxckpt._storage.location import Location, Pending, kvstore, wait
from jaxckpt._storage.messages import write_error
from jaxckpt._storage.resume import Present

PART_BYTES = 4 << 20  # a record range is read in requests of at most this (``RecordReader.start``)

# (object index, first byte, end byte, [(chunk index, offset in the read, record length)])
_Read = tuple[int, int, int, list[tuple[tuple[int, ...], int, int]]]


def _chunk_box(
    entry: ArrayEntry, idx: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...]
) -> tuple[tuple[int, ...], tuple[slice, ...], tuple[slice, ...]]:
    """Chunk ``idx``'s stored shape, and the slices of the box and of the chunk they share."""
    shape, in_box, in_chunk = [], [], []
    for i, c, n, o, s in zip(idx, entry.chunks, entry.shape, offsets, sizes):
        lo, hi = i * c, min((i + 1) * c, n)
        a, b = max(lo, o), min(hi, o + s)
        shape.append(hi - lo)
        in_box.append(slice(a - o, b - o))
        in_chunk.append(slice(a - lo, b - lo))
    return tuple(shape), tuple(in_box), tuple(in_chunk)


def _whole(entry: ArrayEntry, idx: tuple[int, ...], sizes: tuple[int, ...]) -> bool:
    """Whether chunk ``idx`` is exactly the box of ``sizes`` (a read of it is the box)."""
    return (
        _chunk_box(entry, idx, tuple(i * c for i, c in zip(idx, entry.chunks)), sizes)[0] == sizes
    )


def _flat(entry: ArrayEntry, idx: tuple[int, ...]) -> int:
    return int(np.ravel_multi_index(idx, entry.grid)) if idx else 0


class RecordWriter:
    """Writes one process's records (``Writer.write`` on an object store, format v5).

    Args:
      kv: the save's root kvstore (its generation).
      loc: where the save goes (deadlines, messages).
      objects: the save's layout; ``entries`` its stored arrays by storage path.
      process: this process's index: it writes the objects named for it.
      present: a failed save of the same plan whose generation this save adopted
        (``jaxckpt._storage.resume``): an object it already holds with exactly the bytes
        this save would write is not written again. Each of the object's records is checked
        by its CRC-32C trailer (a ranged read of 4 bytes each, all at once; an object is
        written whole or not at all), as chunk files are.
    """

    def __init__(
        self,
        kv: Callable[[], ts.KvStore],
        loc: Location,
        objects: DataObjects,
        entries: dict[str, ArrayEntry],
        process: int,
        present: Present | None = None,
    ) -> None:
        self.kv, self.loc, self.objects = kv, loc, objects
        self.table: Table = table(objects, entries)
        mine = f"{objects.folder}/{process}."
        sizes = np.zeros(len(self.table.names), np.int64)
        for obj, _, length in self.table.where.values():
            np.add.at(sizes, obj, length)
        names = self.table.names
        self._size = {o: int(sizes[o]) for o in range(len(names)) if names[o].startswith(mine)}
        self._left = collections.Counter(self._size)  # bytes each object still awaits
        self._buf: dict[int, bytearray] = {}
        # (name, size, its write; or, resuming, its records' checks, and its bytes and ends)
        self._pending: collections.deque[tuple[str, int, Any, tuple[bytearray, Any] | None]] = (
            collections.deque()
        )
        self._present = present
        self._ends = _record_ends(self.table, entries, self._size) if present else {}

    def write(
        self,
        entries: dict[str, ArrayEntry],
        items: Iterable[tuple[WriteItem, npt.NDArray[Any]]],
        max_inflight_bytes: int,
    ) -> int:
        """Copy each item's chunks into their records, writing each object once whole; at most
        ``max_inflight_bytes`` of objects in flight. Returns the bytes written: the items'
        bytes, less those a resumed save found already written."""
        total = inflight = 0
        kept = self._present.kept if self._present is not None else 0
        try:
            for item, data in items:
                entry = entries[item.key]
                if entry.storage_dtype != entry.dtype:
                    data = data.view(entry.storage_dtype)
                total += data.nbytes
                done = self._add(entry, item.offsets, item.sizes, data)
                del data  # copied: not held while the next item is made (a budgeted save)
                for o in done:
                    inflight += self._start(o)
                    while inflight > max_inflight_bytes and len(self._pending) > 1:
                        inflight -= self._finish()
            while self._pending:
                self._finish()
        finally:  # after an error: let what is in flight land, so that abort() deletes it
            while self._pending:
                try:
                    self._finish()
                except Exception:  # noqa: BLE001 - failed already
                    pass
        unwritten = [self.table.names[o] for o, n in self._left.items() if n]
        if unwritten:
            raise CheckpointError(
                f"Saving to {self.loc}: the plan's records for {unwritten[:3]} were not all "
                f"written (a planner yielded fewer boxes than it planned). Nothing was committed; "
                f"report this with the planner used."
            )
        return total - (self._present.kept - kept if self._present is not None else 0)

    def _add(
        self, entry: ArrayEntry, offsets: tuple[int, ...], sizes: tuple[int, ...], data: Any
    ) -> list[int]:
        """Copy the box's chunks into their records; return the objects now whole."""
        obj, off, length = self.table.where[entry.path]
        dtype = dtype_from_name(entry.storage_dtype).newbyteorder("<")
        crc = entry.checksum == "crc32c"
        done = []
        for idx in chunks_touching(offsets, sizes, entry.chunks):
            f = _flat(entry, idx)
            o, start, n = int(obj[f]), int(off[f]), int(length[f])
            buf = self._buf.get(o)
            if buf is None:
                buf = self._buf[o] = bytearray(self._size[o])
            shape, in_box, _ = _chunk_box(entry, idx, offsets, sizes)
            body = n - 4 * crc
            view = np.frombuffer(buf, np.uint8, count=body, offset=start)
            view.view(dtype).reshape(shape)[...] = data[in_box]
            if crc:
                buf[start + body : start + n] = crc32c(view).to_bytes(4, "little")
            self._left[o] -= n
            if self._left[o] == 0:
                done.append(o)
        return done

    def _start(self, o: int) -> int:
        name = self.table.names[o]
        value = self._buf.pop(o)
        ends = self._ends.get(o)
        if ends is not None and len(ends):  # resuming: its records are checked first
            kv = self.kv()
            checks = [kv.read(name, byte_range=slice(int(e) - 4, int(e))) for e in ends]
            self._pending.append((name, len(value), checks, (value, ends)))
        else:
            self._pending.append((name, len(value), self._write(name, value), None))
        return len(value)

    def _write(self, name: str, value: bytearray) -> Pending[Any]:
        fut = self.kv().write(name, value)  # type: ignore[arg-type]  # copied at the call
        self.loc.watch(fut)
        return fut

    def _finish(self) -> int:
        name, n, fut, resumed = self._pending.popleft()
        if resumed is not None:  # kept if every record's trailer is this save's
            value, ends = resumed
            if self._holds(name, fut, value, ends):
                assert self._present is not None
                self._present.keep(n - 4 * len(ends))
                return n
            fut = self._write(name, value)
        what = f"writing data object {name}"
        try:
            wait(fut, self.loc, what, n)
        except (ValueError, OSError) as e:
            raise write_error(self.loc, what, e) from e
        return n

    def _holds(self, name: str, checks: list[Any], value: bytearray, ends: Any) -> bool:
        """Whether the stored object ``name`` ends each record with ``value``'s trailer."""
        for fut, e in zip(checks, ends):
            try:
                got = wait(fut, self.loc, f"reading data object {name}")
            except ValueError:  # shorter: not this save's object
                return False
            if got.state != "value" or bytes(got.value) != value[int(e) - 4 : int(e)]:
                return False
        return True


def _record_ends(
    t: Table, entries: dict[str, ArrayEntry], objects: Iterable[int]
) -> dict[int, npt.NDArray[np.int64]]:
    """The end offset of each record of ``objects`` (those with a CRC-32C trailer in every
    record only: the others cannot be checked, and are written again)."""
    ends: dict[int, list[npt.NDArray[np.int64]]] = {o: [] for o in objects}
    unchecked: set[int] = set()
    for path, (obj, off, length) in t.where.items():
        crc = entries[path].checksum == "crc32c"
        for o in ends.keys() & set(np.unique(obj).tolist()):
            if not crc:
                unchecked.add(o)
            ends[o].append((off + length)[obj == o])
    return {o: np.concatenate(e) for o, e in ends.items() if e and o not in unchecked}


class RecordReader:
    """Reads boxes of a v5 checkpoint's arrays from its data objects by byte ranges."""

    def __init__(
        self,
        kv: Callable[[], ts.KvStore],
        loc: Location,
        objects: DataObjects,
        entries: Callable[[], dict[str, ArrayEntry]],
    ) -> None:
        self.kv, self.loc, self.objects = kv, loc, objects
        self._entries = entries
        self._table: Table | None = None
        self._kv: ts.KvStore | None = None

    @classmethod
    def of(cls, loc: Location, objects: DataObjects, stored: dict[str, ArrayEntry]) -> RecordReader:
        """The reader of the checkpoint at ``loc`` (``stored``: its arrays by storage path)."""
        return cls(lambda: kvstore(loc.kvstore, loc), loc, objects, lambda: stored)

    def covers(self, entry: Any) -> bool:
        return isinstance(entry, ArrayEntry) and entry.path in self.objects.owners

    def start(
        self, entry: ArrayEntry, offsets: tuple[int, ...], sizes: tuple[int, ...]
    ) -> Callable[[], npt.NDArray[Any]]:
        """Start the reads of the box's records; return the call that checks and copies them.

        A range longer than ``PART_BYTES`` is read as several requests at once: an object
        store serves each request at a rate of its own, so more, smaller requests fill a link
        that one large one cannot (the bytes in flight are the same). Nothing is allocated
        until the data is taken: a read in flight holds only its bytes."""
        if self._table is None:
            self._table = table(self.objects, self._entries())
        names = self._table.names
        reads = _ranges(self._table, entry, offsets, sizes)
        if self._kv is None:
            self._kv = self.kv()
        kv = self._kv
        futs = [
            [
                kv.read(names[o], byte_range=slice(p, min(p + PART_BYTES, b)))
                for p in range(a, b, PART_BYTES)
            ]
            for o, a, b, _ in reads
        ]
        for parts in futs:
            for fut in parts:
                self.loc.watch(fut)
        dtype = dtype_from_name(entry.storage_dtype)

        def result() -> npt.NDArray[Any]:
            out: npt.NDArray[Any] | None = None
            for (o, a, b, recs), parts in zip(reads, futs):
                whole = len(reads) == 1 and len(recs) == 1 and _whole(entry, recs[0][0], sizes)
                value = self._value(entry, names[o], recs[0][0], parts, a, b, aligned=whole)
                if whole and len(parts) > 1:  # the assembled range is the box: no second copy
                    out = self._check(entry, recs[0][0], value, 0, b - a, names[o]).reshape(sizes)
                    break
                if out is None:
                    out = aligned_empty(sizes, dtype)
                for idx, at, n in recs:
                    chunk = self._check(entry, idx, value, at, n, names[o])
                    shape, in_box, in_chunk = _chunk_box(entry, idx, offsets, sizes)
                    out[in_box] = chunk.reshape(shape)[in_chunk]
            if out is None:  # an empty box
                out = aligned_empty(sizes, dtype)
            if entry.storage_dtype != entry.dtype:
                return out.view(dtype_from_name(entry.dtype))
            return out

        return result

    def _value(
        self,
        entry: ArrayEntry,
        name: str,
        idx: tuple[int, ...],
        parts: list[Any],
        a: int,
        b: int,
        aligned: bool,
    ) -> npt.NDArray[np.uint8]:
        """Bytes ``a:b`` of object ``name`` as read by ``parts`` (one view, or the parts
        copied into one buffer, aligned where ``aligned``), each part's length checked."""
        what = f"reading data object {name} for key {entry.key!r}"
        buf: npt.NDArray[np.uint8] | None = None
        if len(parts) > 1:
            buf = (
                aligned_empty((b - a,), np.dtype(np.uint8))
                if aligned
                else np.empty(b - a, np.uint8)
            )
        for i, fut in enumerate(parts):
            lo = a + i * PART_BYTES
            n = min(PART_BYTES, b - lo)
            try:
                r = wait(fut, self.loc, what, n)
            except ValueError as e:
                short = "OUT_OF_RANGE" in str(e)
                why = "is shorter than the manifest says" if short else f"cannot be read ({e})"
                raise self._error(entry, idx, name, why) from e
            if r.state != "value":
                raise self._error(entry, idx, name, "is missing")
            if len(r.value) != n:
                raise self._error(entry, idx, name, f"answered {len(r.value)} bytes of {n}")
            got = np.frombuffer(r.value, np.uint8)
            if buf is None:
                return got
            buf[lo - a : lo - a + n] = got
        assert buf is not None
        return buf

    def _check(
        self,
        entry: ArrayEntry,
        idx: tuple[int, ...],
        value: npt.NDArray[np.uint8],
        at: int,
        n: int,
        name: str,
    ) -> npt.NDArray[Any]:
        """The record at ``value[at:at + n]``, its checksum checked, as a flat array."""
        crc = entry.checksum == "crc32c"
        body = n - 4 * crc
        raw = value[at : at + body]
        if crc and crc32c(raw) != int.from_bytes(value[at + body : at + n].tobytes(), "little"):
            raise self._error(entry, idx, name, "fails its checksum")
        dtype = dtype_from_name(entry.storage_dtype)
        if dtype == np.bool_ and (raw > 1).any():
            raise self._error(entry, idx, name, "holds a bool byte other than 0 or 1")
        return raw.view(dtype.newbyteorder("<"))

    def _error(
        self, entry: ArrayEntry, idx: tuple[int, ...], name: str, what: str
    ) -> CorruptChunkError:
        return CorruptChunkError(
            f"Key {entry.key!r}: the record of chunk ({','.join(map(str, idx))}) of {entry.path} "
            f"in data object {name} of {self.loc} {what}. The checkpoint is damaged: restore an "
            f"earlier one; `jaxckpt verify PATH` lists every bad chunk."
        )


def _ranges(
    t: Table, entry: ArrayEntry, offsets: tuple[int, ...], sizes: tuple[int, ...]
) -> list[_Read]:
    """The byte ranges holding the box's records: records adjacent in one object, one range."""
    obj, off, length = t.where[entry.path]
    recs = sorted(
        (int(obj[f]), int(off[f]), int(length[f]), idx)
        for idx in chunks_touching(offsets, sizes, entry.chunks)
        for f in (_flat(entry, idx),)
    )
    reads: list[_Read] = []
    for o, a, n, idx in recs:
        if reads and reads[-1][0] == o and reads[-1][2] == a:
            last = reads[-1]
            last[3].append((idx, a - last[1], n))
            reads[-1] = (o, last[1], a + n, last[3])
        else:
            reads.append((o, a, a + n, [(idx, 0, n)]))
    return reads
