"""The plan of an elastic restore: which saved box each process reads, and for whom.

A local step saved by N processes is restored onto M processes and another layout: each new
process needs the boxes of its devices in the target's shardings (its *target boxes*), and
the step's parts, wherever they survived, hold the saved boxes (each part's description,
``local_part.PartInfo``, lists them). Process 0 computes the whole plan once
(:func:`plan_layouts`, a pure function of what the holders posted and of the target), and
each process gets its own share of it (``jaxckpt._tiers.elastic_restore`` posts it and
carries it out).

The plan is made per **layout**: leaves that share their shape, element size, saved boxes
(in every part) and target boxes (of every process) are one :class:`Layout`, planned once,
and every leaf of it takes the same readers and pieces (:meth:`Plan.expand`). A model's many
layers share a few layouts, so process 0's work and the shares it posts grow with the
layouts and the processes, not with the leaves.

For each layout the distinct saved boxes must tile it (checked: a part's description is read
from another host's disk). Each target box is cut along the saved boxes it overlaps into
*pieces*, ``target box ∩ saved box``. Then, per saved box:

1. a process that needs pieces of it and holds it (in any part on its disk: its own, a
   replica, or a part of another old process) reads them from its own disk: nothing moves;
2. for the processes that need pieces of it and lack it, one holder reads the box once and
   sends each its pieces: a holder that needs the box itself where there is one (it reads the
   box anyway), else the holder with the fewest bytes to send so far, counting every leaf of
   the layout (ties: the lowest process number).

So no process reads a box twice, the box is read once for all the processes that lack it,
nothing crosses the network that its destination holds, and the sending is spread over the
holders. The bytes move in *slabs* (:func:`slabs`): runs of a saved box of at most one
transfer chunk, so neither side holds more than a few chunks of a box at a time.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import itertools
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from jaxckpt._format.plan import Box, check_boxes


@dataclasses.dataclass(frozen=True)
class Layout:
    """Leaves planned as one: the same shape, element size, saved and target boxes.

    Attributes:
      shape: the leaves' shape.
      itemsize: the bytes of one element (a PRNG key's data included): the sending is
        balanced by bytes.
      saved: per part, the part's boxes of each leaf, in the part's order.
      needs: per process, its distinct target boxes of each leaf.
      leaves: the leaves' numbers (their sorted key order in the parts).
    """

    shape: tuple[int, ...]
    itemsize: int
    saved: Mapping[int, Sequence[Box]]
    needs: Mapping[int, Sequence[Box]]
    leaves: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Piece:
    """The part of one saved box that one target box of one process needs.

    Attributes:
      process: the process that needs it.
      target: the target box's number among that process's target boxes of the leaf.
      region: the piece, in the leaf's coordinates.
    """

    process: int
    target: int
    region: Box


@dataclasses.dataclass(frozen=True)
class Read:
    """One saved box, read once by the process whose plan lists it, and cut into pieces.

    Attributes:
      leaf: the leaf's number in the parts (their sorted key order); in a plan per layout
        (:func:`plan_layouts`), the layout's number.
      part: the part it is read from (the old process's number).
      index: the box's number in that part (``boxes/<leaf>/<index>`` in the part's tree).
      box: the saved box, in the leaf's coordinates.
      pieces: who gets which piece (the reader's own ones included), in sending order.
    """

    leaf: int
    part: int
    index: int
    box: Box
    pieces: tuple[Piece, ...]


@dataclasses.dataclass(frozen=True)
class Plan:
    """One process's share of an elastic restore.

    Attributes:
      reads: the saved boxes it reads from its own disk, in order, with every piece each
        yields (for itself and for others).
      incoming: per sending process, the reads whose pieces it receives from it, restricted to
        those pieces, in the sender's order.
    """

    reads: tuple[Read, ...] = ()
    incoming: Mapping[int, tuple[Read, ...]] = dataclasses.field(default_factory=dict)

    def to_json(self) -> list[Any]:
        """A JSON-able form of the plan (:func:`plan_from_json` reads it back)."""
        return [_reads_json(self.reads), [[h, _reads_json(r)] for h, r in self.incoming.items()]]

    def expand(self, leaves: Sequence[Sequence[int]]) -> Plan:
        """The plan per leaf of this plan per layout, ``leaves`` the leaves of each layout:
        leaf by leaf (in their order), each leaf taking its layout's reads in order; the
        order both ends of a stream follow.

        Example:
          >>> p = Plan((Read(0, 1, 0, ((0,), (4,)), ()),), {})
          >>> [(r.leaf, r.part) for r in p.expand([[5, 2]]).reads]
          [(2, 1), (5, 1)]
        """
        return Plan(
            _expanded(self.reads, leaves),
            {h: _expanded(r, leaves) for h, r in self.incoming.items()},
        )


def _expanded(reads: Sequence[Read], leaves: Sequence[Sequence[int]]) -> tuple[Read, ...]:
    by_layout: dict[int, list[Read]] = collections.defaultdict(list)
    for r in reads:
        by_layout[r.leaf].append(r)
    order = sorted((i, n) for n in by_layout for i in leaves[n])
    return tuple(Read(i, r.part, r.index, r.box, r.pieces) for i, n in order for r in by_layout[n])


def plan_from_json(raw: Any) -> Plan:
    """The :class:`Plan` that ``Plan.to_json()`` gave.

    Example:
      >>> p = Plan((Read(0, 1, 0, ((0,), (4,)), (Piece(2, 0, ((0,), (2,))),)),), {})
      >>> plan_from_json(p.to_json()) == p
      True
    """
    reads, incoming = raw
    return Plan(_reads(reads), {int(h): _reads(r) for h, r in incoming})


def _reads_json(reads: Sequence[Read]) -> list[Any]:
    return [
        [r.leaf, r.part, r.index, r.box, [[c.process, c.target, c.region] for c in r.pieces]]
        for r in reads
    ]


def box_of(raw: Any) -> Box:
    """The box ``[[offsets], [sizes]]`` (JSON) stands for.

    Example:
      >>> box_of([[0, 2], [4, 2]])
      ((0, 2), (4, 2))
    """
    return tuple(int(x) for x in raw[0]), tuple(int(x) for x in raw[1])


def _reads(raw: Any) -> tuple[Read, ...]:
    return tuple(
        Read(
            int(i),
            int(q),
            int(j),
            box_of(b),
            tuple(Piece(int(p), int(t), box_of(r)) for p, t, r in c),
        )
        for i, q, j, b, c in raw
    )


def plan(
    shapes: Mapping[int, tuple[int, ...]],
    saved: Mapping[int, Mapping[int, Sequence[Box]]],
    holders: Mapping[int, Sequence[int]],
    needs: Mapping[int, Mapping[int, Sequence[Box]]],
    itemsize: Mapping[int, int],
) -> dict[int, Plan]:
    """Who reads which saved box and sends which piece to whom, leaf by leaf: the leaves
    grouped into layouts (:func:`layouts_of`), planned per layout (:func:`plan_layouts`) and
    each process's plan expanded to its leaves (:meth:`Plan.expand`).

    Args:
      shapes: per leaf, its shape (the leaves to restore as arrays).
      saved: per leaf, per part, the part's boxes of it, in the part's order.
      holders: per part, the processes that hold it.
      needs: per process, per leaf, its distinct target boxes.
      itemsize: per leaf, the bytes of one element.

    Returns:
      Per process (every one that reads or needs something), its :class:`Plan`.

    Raises:
      ValueError: as :func:`plan_layouts`.

    Example:
      Rows 0-3 were part 0's, rows 4-7 part 1's; both parts are on process 0 now, and
      process 1 needs rows 2-5:

      >>> p = plan({0: (8,)}, {0: {0: [((0,), (4,))], 1: [((4,), (4,))]}}, {0: [0], 1: [0]},
      ...          {1: {0: [((2,), (4,))]}}, {0: 4})
      >>> [(r.part, [(c.process, c.region) for c in r.pieces]) for r in p[0].reads]
      [(0, [(1, ((2,), (2,)))]), (1, [(1, ((4,), (2,)))])]
      >>> [r.part for r in p[1].incoming[0]], p[1].reads
      ([0, 1], ())
    """
    layouts = layouts_of(shapes, saved, needs, itemsize)
    leaves = [layout.leaves for layout in layouts]
    plans = plan_layouts(layouts, holders)
    return {p: plans.get(p, Plan()).expand(leaves) for p in sorted(set(plans) | set(needs))}


def layouts_of(
    shapes: Mapping[int, tuple[int, ...]],
    saved: Mapping[int, Mapping[int, Sequence[Box]]],
    needs: Mapping[int, Mapping[int, Sequence[Box]]],
    itemsize: Mapping[int, int],
) -> list[Layout]:
    """The leaves given one by one (as :func:`plan`'s arguments), grouped into layouts. It
    looks at every leaf's boxes: ``elastic_restore`` groups what the holders post instead,
    without building any leaf's boxes."""
    groups: dict[Any, list[int]] = {}
    for i in sorted(shapes):
        key = (
            shapes[i],
            itemsize[i],
            tuple((q, tuple(b)) for q, b in sorted(saved.get(i, {}).items())),
            tuple((p, tuple(needs[p][i])) for p in sorted(needs) if needs[p].get(i)),
        )
        groups.setdefault(key, []).append(i)
    return [
        Layout(shape, size, dict(parts), dict(wanted), tuple(leaves))
        for (shape, size, parts, wanted), leaves in groups.items()
    ]


def plan_layouts(
    layouts: Sequence[Layout], holders: Mapping[int, Sequence[int]]
) -> dict[int, Plan]:
    """Who reads which saved box and sends which piece to whom (see the module's docstring),
    once per layout: each :class:`Read`'s ``leaf`` is the layout's number in ``layouts``, and
    :meth:`Plan.expand` gives each leaf of it the same reads.

    Args:
      layouts: the leaves to restore as arrays, by layout.
      holders: per part, the processes that hold it.

    Returns:
      Per process that reads something or receives something, its :class:`Plan`.

    Raises:
      ValueError: a layout's saved boxes do not tile it, a saved box is held by no process,
        or a target box is not covered.

    Example:
      Two leaves of one layout; process 1 needs the rows that only process 0's disk holds:

      >>> rows = Layout((8,), 4, {0: [((0,), (8,))]}, {1: [((0,), (8,))]}, (0, 3))
      >>> p = plan_layouts([rows], {0: [0]})
      >>> [(r.leaf, r.part) for r in p[0].reads], list(p[1].incoming)
      ([(0, 0)], [0])
      >>> [r.leaf for r in p[1].expand([rows.leaves]).incoming[0]]
      [0, 3]
    """
    load: dict[int, int] = collections.defaultdict(int)  # bytes each process sends
    reads: dict[int, list[Read]] = collections.defaultdict(list)
    order = sorted(range(len(layouts)), key=lambda n: min(layouts[n].leaves, default=0))
    for n in order:
        for reader, read in _layout(n, layouts[n], holders, load):
            reads[reader].append(read)
    incoming = _incoming(reads)
    return {
        p: Plan(tuple(reads.get(p, ())), {h: tuple(r) for h, r in incoming.get(p, {}).items()})
        for p in sorted(set(reads) | set(incoming))
    }


def _incoming(reads: Mapping[int, Sequence[Read]]) -> dict[int, dict[int, list[Read]]]:
    """Per receiver, per sender, the sender's reads restricted to the receiver's pieces, in
    the sender's order."""
    incoming: dict[int, dict[int, list[Read]]] = collections.defaultdict(dict)
    for h in sorted(reads):
        for read in reads[h]:
            mine: dict[int, list[Piece]] = collections.defaultdict(list)
            for c in read.pieces:
                if c.process != h:
                    mine[c.process].append(c)
            for p, pieces in mine.items():
                incoming[p].setdefault(h, []).append(
                    Read(read.leaf, read.part, read.index, read.box, tuple(pieces))
                )
    return incoming


def _layout(
    n: int, layout: Layout, holders: Mapping[int, Sequence[int]], load: dict[int, int]
) -> Iterator[tuple[int, Read]]:
    """``(reader, read)`` of each saved box of layout ``n`` that some process needs."""
    where: dict[Box, list[tuple[int, int]]] = {}  # distinct saved box -> (part, index)s
    for q in sorted(layout.saved):
        for j, b in enumerate(layout.saved[q]):
            where.setdefault(b, []).append((q, j))
    name = f"leaf {min(layout.leaves, default=n)}"
    _check_tiling(name, layout.shape, list(where))
    grid = _Grid(list(where))
    wanted: dict[Box, list[Piece]] = collections.defaultdict(list)
    for p in sorted(layout.needs):
        for k, t in enumerate(layout.needs[p]):
            covered = 0
            for b in grid.overlapping(t):
                region = intersect(t, b)
                if region is not None:  # not empty either
                    wanted[b].append(Piece(p, k, region))
                    covered += volume(region)
            if covered != volume(t):
                raise ValueError(f"{name}: target box {t} of process {p} is not covered")
    weight = layout.itemsize * len(layout.leaves)  # bytes sent per element of a piece
    for b in sorted(wanted):
        holds: dict[int, tuple[int, int]] = {}  # holder -> the first (part, index) it holds
        for q, j in where[b]:  # in part order
            for h in holders.get(q, ()):
                if h not in holds:
                    holds[h] = (q, j)
        if not holds:
            raise ValueError(f"{name}: saved box {b} is held by no process")
        by_reader: dict[int, list[Piece]] = {}
        remote: list[Piece] = []
        for c in wanted[b]:
            if c.process in holds:
                by_reader.setdefault(c.process, []).append(c)
            else:
                remote.append(c)
        if remote:
            reader = min(by_reader or holds, key=lambda h: (load[h], h))
            load[reader] += sum([math.prod(c.region[1]) for c in remote]) * weight
            by_reader.setdefault(reader, []).extend(remote)
        for h in sorted(by_reader):
            q, j = holds[h]
            yield h, Read(n, q, j, b, tuple(by_reader[h]))


def _check_tiling(name: str, shape: tuple[int, ...], boxes: list[Box]) -> None:
    if not boxes:
        if math.prod(shape):
            raise ValueError(f"{name}: no part holds a box of it")
        return
    offsets = np.array([b[0] for b in boxes], np.int64).reshape(len(boxes), len(shape))
    sizes = np.array([b[1] for b in boxes], np.int64).reshape(len(boxes), len(shape))
    errors = check_boxes(name, shape, (1,) * len(shape), offsets, sizes)
    if errors:
        raise ValueError(f"the saved boxes do not tile the array: {errors[0]}")


class _Grid:
    """The saved boxes that overlap a box: by bisection on each dimension's box starts where
    the boxes form a grid (every sharding does), else by a scan."""

    def __init__(self, boxes: list[Box]) -> None:
        self.boxes = boxes
        nd = len(boxes[0][0]) if boxes else 0
        self.starts = [sorted({b[0][d] for b in boxes}) for d in range(nd)]
        self.at = {b[0]: b for b in boxes}
        self.is_grid = bool(boxes) and math.prod(len(s) for s in self.starts) == len(boxes)

    def overlapping(self, t: Box) -> list[Box]:
        if not self.is_grid:
            return [b for b in self.boxes if intersect(t, b) is not None]
        ranges = []
        for d, starts in enumerate(self.starts):
            lo = max(bisect.bisect_right(starts, t[0][d]) - 1, 0)
            hi = bisect.bisect_left(starts, t[0][d] + t[1][d])
            ranges.append(starts[lo:hi])
        corners = (self.at.get(tuple(c)) for c in itertools.product(*ranges))
        return [b for b in corners if b is not None]


def intersect(a: Box, b: Box) -> Box | None:
    """The box common to ``a`` and ``b``; ``None`` if they do not overlap (or one is empty).

    Example:
      >>> intersect(((0, 0), (4, 4)), ((2, 3), (4, 4))), intersect(((0,), (2,)), ((2,), (2,)))
      (((2, 3), (2, 1)), None)
    """
    lo, sizes = [], []
    for x, m, y, n in zip(a[0], a[1], b[0], b[1]):
        low, high = max(x, y), min(x + m, y + n)
        if high <= low:
            return None
        lo.append(low)
        sizes.append(high - low)
    return tuple(lo), tuple(sizes)


def volume(box: Box) -> int:
    """The elements in ``box``."""
    return math.prod(box[1])


def slabs(box: Box, itemsize: int, limit: int) -> list[Box]:
    """``box`` cut, in C order, into runs of at most ``limit`` bytes (one element at least),
    each contiguous in the box's C order: the leading dimensions one index at a time, one
    dimension in runs, the trailing ones whole.

    Example:
      >>> slabs(((0, 0), (4, 6)), 4, 48)
      [((0, 0), (2, 6)), ((2, 0), (2, 6))]
      >>> slabs(((2, 0), (2, 6)), 4, 8)[:4]
      [((2, 0), (1, 2)), ((2, 2), (1, 2)), ((2, 4), (1, 2)), ((3, 0), (1, 2))]
    """
    offsets, sizes = box
    d, inner = len(sizes), itemsize
    while d > 0 and inner * sizes[d - 1] <= limit:
        inner *= sizes[d - 1]
        d -= 1
    if d == 0:
        return [box]
    run = max(1, limit // inner)
    axis, out = d - 1, []
    lead = itertools.product(*(range(o, o + s) for o, s in zip(offsets[:axis], sizes[:axis])))
    for corner in lead:
        for start in range(offsets[axis], offsets[axis] + sizes[axis], run):
            n = min(run, offsets[axis] + sizes[axis] - start)
            out.append(((*corner, start, *offsets[d:]), (*(1,) * axis, n, *sizes[d:])))
    return out
