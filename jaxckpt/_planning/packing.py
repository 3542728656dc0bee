"""Packing small arrays: many small leaves share one 1-D zarr array, a "pack" (format v2).

One zarr array per leaf costs a ``zarr.json`` and a chunk file per leaf: 4,001 files for a
state of 2,000 biases, and on an object store a request each. So the save planner lays leaves
of at most ``pack_bytes`` out end to end in a few 1-D arrays per storage dtype, and records in
each leaf's manifest entry the pack's path and the leaf's element offset (see
``docs/format.md``). Storage still writes and reads boxes of plain arrays: a pack is written
as one box (its bytes assembled on the host, it is small), by one process that holds every
member whole, and a restore reads each pack it needs once and slices it.

This module plans the layout (:func:`plan_packs`, :func:`assign`) and assembles a pack's
bytes (:func:`assemble`); ``jaxckpt._storage.packs`` reads packed items back.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any

import numpy as np
import numpy.typing as npt

from jaxckpt._format.grid import ceil_div
from jaxckpt._format.manifest import ArrayEntry, PackEntry, dtype_from_name
from jaxckpt._format.names import ARRAYS
from jaxckpt._format.plan import IntArray
from jaxckpt._planning.layout import Layout

# Leaves up to 256 KiB hold nearly all the files of a real training state, and copying them
# into a pack costs less than a file each; above that a leaf's own file costs little beside
# its bytes (docs/benchmarks.md).
DEFAULT_PACK_BYTES = 256 << 10
# A sharded array is written as a file per shard, so mid-sized arrays sharded over several
# devices become many small files, as slow to save as unpacked small arrays
# (docs/benchmarks.md). So an array up to this
# many times pack_bytes is packed too when its shards are each at most pack_bytes. Bounded,
# because a packed array is read whole by each host that needs part of it. Shards, not chunks:
# a replicated array is cut into a chunk per holder process so that their reads are shared
# (jaxckpt._planning.global_plan.chunk_limit), and packing it would undo that.
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
    packed: dict[str, ArrayEntry] = {}
    packs = []
    for (sdtype, who), members in _groups(entries, layouts, pack_bytes, max_chunk_bytes).items():
        itemsize = dtype_from_name(sdtype).itemsize
        total = sum(e.size for e in members) * itemsize
        spread = max(1, min(len(who), total // pack_bytes))
        cap = max(min(max_chunk_bytes, ceil_div(total, spread)), max(e.nbytes for e in members))
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
                    e,
                    path=path,
                    chunks=tuple(max(s, 1) for s in e.shape),
                    pack=pack,
                    offset=offset,
                )
                offset += e.size
            packs.append((pack, tuple(e.key for e in part), who))
    return packed, packs


def _groups(
    entries: dict[str, ArrayEntry],
    layouts: dict[str, Layout],
    pack_bytes: int,
    max_chunk_bytes: int,
) -> dict[tuple[str, tuple[int, ...]], list[ArrayEntry]]:
    """The arrays that may be packed, by (storage dtype, holder processes), in key order."""
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
    return groups


def _shard_bytes(e: ArrayEntry, lay: Layout) -> int:
    return math.prod(lay.box) * dtype_from_name(e.storage_dtype).itemsize


def _pack_path(sdtype: str, taken: set[str]) -> str:
    n = 0
    while f"{ARRAYS}/pack.{sdtype}.{n}" in taken:
        n += 1
    taken.add(f"{ARRAYS}/pack.{sdtype}.{n}")
    return f"{ARRAYS}/pack.{sdtype}.{n}"


def assign(packs: list[Candidate], proc_loads: IntArray, *, lowest: bool) -> list[PackPlan]:
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


def assemble(
    pack: PackEntry,
    members: Iterable[tuple[ArrayEntry, Iterable[tuple[Any, Any]]]],
    out: npt.NDArray[Any] | None = None,
) -> npt.NDArray[Any]:
    """The pack's bytes: each member's pieces ``(index, data)`` (an index into the member, in
    its logical dtype; ``()`` for the whole) copied once, straight to its place in the pack;
    into ``out`` (1-D, of the pack's size and storage dtype's itemsize) where given."""
    storage = dtype_from_name(pack.storage_dtype)
    out = np.empty(pack.size, storage) if out is None else out.view(storage)
    for e, pieces in members:
        logical = dtype_from_name(e.dtype)  # of the storage dtype's size: a view, no copy
        slot = out[e.offset : e.offset + e.size].view(logical).reshape(e.shape)
        for index, data in pieces:
            # Assigned as values: a byte-swapped array (">f4") is converted here, where a
            # view to the storage dtype would reinterpret its bytes.
            slot[index] = data
    return out
