"""Packing small arrays: many small leaves share one 1-D zarr array, a "pack" (format v2).

One zarr array per leaf costs a ``zarr.json`` and a chunk file per leaf: 4,001 files for a
state of 2,000 biases, and on an object store a request each. So the save planner lays leaves
of at most ``pack_bytes`` out end to end in a few 1-D arrays per storage dtype, and records in
each leaf's manifest entry the pack's path and the leaf's element offset (see
``docs/format.md``). Storage still writes and reads boxes of plain arrays: a pack is written
as one box (its bytes assembled on the host, it is small), by one process that holds every
member whole, and a restore reads each pack it needs once and slices it.

This module plans the layout (:func:`plan_packs`), assembles a pack's bytes
(:func:`assemble`) and reads packed items (:func:`read`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from jaxckpt._errors import CorruptChunkError
from jaxckpt._layout import Layout
from jaxckpt._manifest import ArrayEntry, PackEntry, dtype_from_name
from jaxckpt._names import ARRAYS
from jaxckpt._plan import ReadItem

# Measured on the 2,000 x 1 KiB and a mixed workload (docs/benchmarks.md): leaves up to
# 256 KiB hold nearly all the files of a real training state, and copying them into a pack
# costs less than a file each; above that a leaf's own file costs little beside its bytes.
DEFAULT_PACK_BYTES = 256 << 10
# A sharded array is written as a file per shard: 100 arrays of 390 KiB over 8 devices are 800
# files of 49 KiB, and saved 5x slower than packed (docs/benchmarks.md). So an array up to this
# many times pack_bytes is packed too when its shards are each at most pack_bytes. Bounded,
# because a packed array is read whole by each host that needs part of it. Shards, not chunks:
# a replicated array is cut into a chunk per holder process so that their reads are shared
# (jaxckpt._global_plan.chunk_limit), and packing it would undo that.
SPLIT_PACK_FACTOR = 4


# A planned pack before its writer is chosen: its record, its members, the processes that may write it.
Candidate = tuple[PackEntry, tuple[str, ...], tuple[int, ...]]


@dataclasses.dataclass(frozen=True)
class PackPlan:
    """One pack: its manifest record, its members (key paths, in offset order), its writer."""

    entry: PackEntry
    members: tuple[str, ...]
    process: int


def holders(lay: Layout) -> tuple[int, ...]:
    """The processes that hold every box of ``lay`` (and so can write the array whole)."""
    procs = lay.processes[lay.groups]  # [n_boxes, n_replicas]
    if procs.size == 0:
        return ()
    common = np.unique(procs[0])
    for row in procs[1:]:
        common = np.intersect1d(common, row, assume_unique=False)
        if not len(common):
            break
    return tuple(int(p) for p in common)


def plan_packs(
    entries: dict[str, ArrayEntry],
    layouts: dict[str, Layout],
    *,
    pack_bytes: int,
    max_chunk_bytes: int,
    taken: set[str],
) -> tuple[dict[str, ArrayEntry], list[Candidate]]:
    """Which arrays share which pack, at which offsets.

    Arrays that some process holds whole, of at most ``pack_bytes`` (or of at most
    ``SPLIT_PACK_FACTOR * pack_bytes`` in shards of at most ``pack_bytes``) and never above
    ``max_chunk_bytes``, are grouped by storage dtype and holder processes, in key order, and
    cut into packs of at most ``max_chunk_bytes`` (one chunk each). A group spreads over up to
    one pack per holder process (each still at least ``pack_bytes``), so several processes
    share the writing.
    ``pack_bytes <= 0`` packs nothing.

    Returns:
      The packed entries (key -> entry with ``pack``/``offset`` set), and per pack its record,
      its members and the processes that may write it.
    """
    if pack_bytes <= 0:
        return {}, []
    limit = min(SPLIT_PACK_FACTOR * pack_bytes, max_chunk_bytes)
    groups: dict[tuple[str, tuple[int, ...]], list[ArrayEntry]] = {}
    seen: dict[int, tuple[int, ...]] = {}  # layouts are shared between arrays: one pass each
    for key, e in entries.items():
        lay = layouts[key]
        if e.nbytes > limit or not (e.nbytes <= pack_bytes or _shard_bytes(e, lay) <= pack_bytes):
            continue
        who = seen.get(id(lay))
        if who is None:
            who = seen[id(lay)] = holders(lay)
        if who:
            groups.setdefault((e.storage_dtype, who), []).append(e)
    packed: dict[str, ArrayEntry] = {}
    packs = []
    for (sdtype, who), members in groups.items():
        itemsize = dtype_from_name(sdtype).itemsize
        total = sum(e.size for e in members) * itemsize
        spread = max(1, min(len(who), total // pack_bytes))
        cap = max(min(max_chunk_bytes, -(-total // spread)), max(e.nbytes for e in members))
        cut: list[list[ArrayEntry]] = [[]]
        filled = 0
        for e in members:
            if cut[-1] and filled + e.size * itemsize > cap:
                cut.append([])
                filled = 0
            cut[-1].append(e)
            filled += e.size * itemsize
        for part in cut:
            path = _pack_path(sdtype, taken)
            size = sum(e.size for e in part)
            pack = PackEntry(path=path, size=size, storage_dtype=sdtype, chunks=max(size, 1))
            offset = 0
            for e in part:
                packed[e.key] = dataclasses.replace(
                    e, path=path, chunks=tuple(max(s, 1) for s in e.shape), pack=pack,
                    offset=offset,
                )  # fmt: skip
                offset += e.size
            packs.append((pack, tuple(e.key for e in part), who))
    return packed, packs


def _shard_bytes(e: ArrayEntry, lay: Layout) -> int:
    return math.prod(lay.box) * dtype_from_name(e.storage_dtype).itemsize


def _pack_path(sdtype: str, taken: set[str]) -> str:
    n = 0
    while f"{ARRAYS}/pack.{sdtype}.{n}" in taken:
        n += 1
    taken.add(f"{ARRAYS}/pack.{sdtype}.{n}")
    return f"{ARRAYS}/pack.{sdtype}.{n}"


def assign(packs: list[Candidate], proc_loads: np.ndarray, *, lowest: bool) -> list[PackPlan]:
    """Give each pack to the least-loaded process that holds its members (largest first)."""
    loads = {p: int(v) for p, v in enumerate(proc_loads)}
    out: dict[int, PackPlan] = {}
    order = sorted(range(len(packs)), key=lambda i: -packs[i][0].size)
    for i in order:
        pack, members, who = packs[i]
        if lowest:
            writer = min(who)
        else:
            writer = min(who, key=lambda p: (loads.get(p, 0), p))
        nbytes = pack.size * dtype_from_name(pack.storage_dtype).itemsize
        loads[writer] = loads.get(writer, 0) + nbytes
        out[i] = PackPlan(pack, members, writer)
    return [out[i] for i in range(len(packs))]


def assemble(pack: PackEntry, members: Iterable[tuple[ArrayEntry, Any]]) -> np.ndarray:
    """The pack's bytes: each member's data (whole, logical dtype) at its offset."""
    out = np.empty(pack.size, dtype_from_name(pack.storage_dtype))
    for e, data in members:
        # In the logical dtype first: a byte-swapped array (">f4") converts its values here,
        # where a view to the storage dtype would reinterpret its bytes.
        flat = np.ascontiguousarray(data, dtype=dtype_from_name(e.dtype)).reshape(-1)
        out[e.offset : e.offset + e.size] = (
            flat.view(out.dtype) if flat.dtype != out.dtype else flat
        )
    return out


def storage_entries(manifest: Any) -> dict[str, ArrayEntry]:
    """What storage writes: every unpacked array, and each pack as a 1-D array (by key)."""
    out = {
        k: e for k, e in manifest.entries.items() if isinstance(e, ArrayEntry) and e.pack is None
    }
    out.update((p.key, p.as_array()) for p in manifest.packs.values())
    return out


def split(entries: dict[str, Any], items: Iterable[ReadItem]) -> tuple[list, list]:
    """``items`` as (unpacked, packed), each in the given order."""
    plain, packed = [], []
    for item in items:
        (packed if getattr(entries[item.key], "pack", None) is not None else plain).append(item)
    return plain, packed


def read(reader: Any, entries: dict[str, Any], items: list[ReadItem], *,
         max_inflight_bytes: int) -> Iterator[tuple[ReadItem, np.ndarray]]:  # fmt: skip
    """Yield ``(item, data)`` for packed items, reading each needed pack once (the span of it
    the items need), at most ``max_inflight_bytes`` ahead.

    ``reader`` is a ``jaxckpt._reader.Reader``: a pack is read as its plain 1-D array.
    """
    by_pack: dict[str, list[ReadItem]] = {}
    for item in items:
        by_pack.setdefault(entries[item.key].path, []).append(item)
    pending: list[tuple[int, tuple]] = []
    inflight = 0
    for mine in by_pack.values():
        pack = entries[mine[0].key].pack
        lo = min(entries[i.key].offset for i in mine)
        hi = max(entries[i.key].offset + entries[i.key].size for i in mine)
        try:  # opening lists the pack's chunks first: a missing one is reported here
            array = pack.as_array()  # read like any array: in place from local files
            fut = reader._start(array, ReadItem(array.key, (lo,), (hi - lo,))) if hi > lo else None
        except CorruptChunkError as e:
            raise _corrupt(reader, pack, [i.key for i in mine], e) from e
        n = (hi - lo) * dtype_from_name(pack.storage_dtype).itemsize
        pending.append((n, (pack, mine, lo, fut)))
        inflight += n
        while inflight > max_inflight_bytes and len(pending) > 1:
            n, done = pending.pop(0)
            inflight -= n
            yield from _slices(reader, entries, *done)
    for _, done in pending:
        yield from _slices(reader, entries, *done)


def _slices(reader: Any, entries: dict[str, Any], pack: PackEntry, items: list[ReadItem], lo: int,
            fut: Any) -> Iterator[tuple[ReadItem, np.ndarray]]:  # fmt: skip
    data = np.empty(0, dtype_from_name(pack.storage_dtype))
    if fut is not None:
        try:
            data = fut()
        except CorruptChunkError as e:
            raise _corrupt(reader, pack, [i.key for i in items], e) from e
    for item in items:
        e = entries[item.key]
        a = data[e.offset - lo : e.offset - lo + e.size].reshape(e.shape)
        if item.sizes != e.shape:
            a = a[tuple(slice(o, o + s) for o, s in zip(item.offsets, item.sizes))]
        if e.storage_dtype != e.dtype:
            a = a.view(dtype_from_name(e.dtype))
        yield item, a


def _corrupt(reader: Any, pack: PackEntry, keys: list[str], e: Exception) -> CorruptChunkError:
    msg = str(e)
    gone = "NOT_FOUND" in msg or "is missing" in msg  # a read, or the listing before it
    bad = "igest" in msg or "checksum" in msg  # tensorstore's words, or jaxckpt._chunkfile's
    what = "is missing" if gone else "fails its checksum" if bad else "cannot be read"
    others = sorted(set(keys) - {keys[0]})
    also = f" (and {len(others)} more keys packed with it: {others[:3]!r})" if others else ""
    return CorruptChunkError(
        f"Key {keys[0]!r}{also}: pack {pack.path} in {reader.loc}, which holds these keys, "
        f"{what} ({msg}). The checkpoint is damaged: restore an earlier one; `jaxckpt verify "
        f"PATH` lists every bad chunk and the keys in it."
    )
