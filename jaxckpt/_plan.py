"""Plan items and the free functions the default planners are made of.

Items are frozen dataclasses; a planner subclass changes one with ``dataclasses.replace`` or
overrides the one step it needs. Nothing here knows about tensorstore or files.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Iterable, Sequence

import numpy as np

from jaxckpt._errors import PlanValidationError

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


@dataclasses.dataclass(frozen=True)
class WriteItem:
    """One box of one array that one process writes, as whole chunks.

    ``device`` is the id of the device whose shard holds the data, or ``None`` for a host
    (numpy) array, which every process holds.
    """

    key: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    dtype: str
    process: int
    device: int | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.sizes) * np.dtype(_np_dtype(self.dtype)).itemsize


@dataclasses.dataclass(frozen=True)
class SavePlan:
    """What one process writes."""

    items: tuple[WriteItem, ...]

    @property
    def nbytes(self) -> int:
        return sum(i.nbytes for i in self.items)


@dataclasses.dataclass(frozen=True)
class ReadItem:
    """One box of one saved array to read once on this host.

    ``devices`` are the local devices whose target shard is exactly this box; empty means the
    box goes to the host (a numpy result).
    """

    key: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    devices: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class LoadPlan:
    """What this process reads."""

    items: tuple[ReadItem, ...]


def _np_dtype(name: str):
    import ml_dtypes

    return getattr(ml_dtypes, name, None) or name


def index_to_box(index: Sequence[slice], shape: Sequence[int]) -> Box:
    """A shard's ``index`` (a tuple of slices, as in ``shard.index``) as (offsets, sizes)."""
    offsets, sizes = [], []
    for sl, dim in zip(index, shape):
        start, stop, step = sl.indices(dim)
        if step != 1:
            raise ValueError(f"strided shard index {sl} is not supported")
        offsets.append(start)
        sizes.append(max(stop - start, 0))
    return tuple(offsets), tuple(sizes)


def chunk_shape(shape: Sequence[int], boxes: Iterable[Box]) -> tuple[int, ...]:
    """The largest regular chunk grid whose boundaries include every box boundary.

    For the usual evenly divided shardings this is the shard shape, so each shard is exactly
    one chunk and no two writers ever touch the same chunk.
    """
    chunks = [dim for dim in shape]
    for offsets, sizes in boxes:
        for d, (o, s) in enumerate(zip(offsets, sizes)):
            chunks[d] = math.gcd(chunks[d], o)
            if o + s != shape[d]:
                chunks[d] = math.gcd(chunks[d], o + s)
    return tuple(max(c, 1) for c in chunks)


def split_box(box: Box, chunks: Sequence[int], shape: Sequence[int], max_bytes: int,
              itemsize: int) -> list[Box]:  # fmt: skip
    """Split ``box`` along chunk boundaries into pieces of at most ``max_bytes`` if possible."""
    offsets, sizes = box
    if math.prod(sizes) * itemsize <= max_bytes or not sizes:
        return [box]
    # Split the outermost dimension that spans more than one chunk.
    for d, (o, s) in enumerate(zip(offsets, sizes)):
        n = -(-s // chunks[d])
        if n > 1:
            cuts = range(o, o + s, chunks[d])
            out: list[Box] = []
            for c in cuts:
                size = min(chunks[d], o + s - c)
                sub = (offsets[:d] + (c,) + offsets[d + 1 :], sizes[:d] + (size,) + sizes[d + 1 :])
                out.extend(split_box(sub, chunks, shape, max_bytes, itemsize))
            return out
    return [box]


def assign_writers(
    groups: Sequence[tuple[str, Box, str, Sequence[tuple[int, int | None]]]],
    *,
    lowest: bool = False,
) -> list[WriteItem]:
    """Pick one writer for each replicated box (the seed's ``dedup_save_plans``).

    ``groups`` holds ``(key, box, dtype, holders)`` where ``holders`` lists the
    ``(process, device)`` pairs that hold the box. The default gives each box to the holder
    with the fewest bytes planned so far, largest boxes first, so replicated data is spread
    across devices and hosts; ``lowest=True`` gives it to the lowest (process, device) instead.
    Deterministic: every process computes the same answer from the same input.
    """
    load: dict[tuple[int, int | None], int] = {}
    proc_load: dict[int, int] = {}
    out: list[WriteItem] = []
    order = sorted(range(len(groups)), key=lambda i: -_box_bytes(groups[i]))
    for i in order:
        key, (offsets, sizes), dtype, holders = groups[i]
        if lowest:
            proc, dev = min(holders, key=_holder_order)
        else:
            proc, dev = min(
                holders, key=lambda h: (load.get(h, 0), proc_load.get(h[0], 0), _holder_order(h))
            )
        item = WriteItem(key, offsets, sizes, dtype, proc, dev)
        load[(proc, dev)] = load.get((proc, dev), 0) + item.nbytes
        proc_load[proc] = proc_load.get(proc, 0) + item.nbytes
        out.append(item)
    out.sort(key=lambda it: (it.key, it.offsets))
    return out


def _holder_order(h: tuple[int, int | None]) -> tuple[int, int]:
    return (h[0], -1 if h[1] is None else h[1])


def _box_bytes(group) -> int:
    _, (_, sizes), dtype, _ = group
    return math.prod(sizes) * np.dtype(_np_dtype(dtype)).itemsize


def validate_plan(
    items: Iterable[WriteItem], arrays: dict[str, tuple[tuple[int, ...], str, tuple[int, ...]]]
) -> None:
    """Check a global plan: bounds, chunk alignment, no overlaps, full coverage, one dtype.

    ``arrays`` maps each key to ``(shape, dtype, chunks)``. Overlaps are found with a sweep
    along the first dimension (O(n log n) for the boxes of a grid); full coverage follows from
    no overlap plus equal volume.

    Raises:
        PlanValidationError: naming each bad key, truncated after a few.
    """
    by_key: dict[str, list[WriteItem]] = {}
    for it in items:
        by_key.setdefault(it.key, []).append(it)
    errors: list[str] = []
    for key in by_key.keys() - arrays.keys():
        errors.append(f"key {key!r}: written but not in the manifest")
    for key, (shape, dtype, chunks) in arrays.items():
        errors.extend(_check_key(key, shape, dtype, chunks, by_key.get(key, [])))
    if errors:
        summary = "; ".join(errors[:8])
        more = f" (and {len(errors) - 8} more)" if len(errors) > 8 else ""
        raise PlanValidationError(
            f"Invalid save plan: {summary}{more}. A custom planner produced boxes that do not "
            f"tile each array exactly once along its chunk grid; fix its create_global_plan."
        )


def _check_key(key, shape, dtype, chunks, items: list[WriteItem]) -> list[str]:
    errors = []
    for it in items:
        if it.dtype != dtype:
            errors.append(f"key {key!r}: item dtype {it.dtype} differs from {dtype}")
        if len(it.offsets) != len(shape) or len(it.sizes) != len(shape):
            errors.append(f"key {key!r}: box {it.offsets}/{it.sizes} has the wrong rank")
            return errors
        for o, s, dim, c in zip(it.offsets, it.sizes, shape, chunks):
            if o < 0 or s < 0 or o + s > dim:
                errors.append(
                    f"key {key!r}: box at {it.offsets} size {it.sizes} is out of bounds {shape}"
                )
                break
            if o % c or ((o + s) % c and o + s != dim):
                errors.append(
                    f"key {key!r}: box at {it.offsets} size {it.sizes} is not aligned to chunks {chunks}"
                )
                break
    if errors:
        return errors
    if shape and math.prod(shape) == 0:
        return errors
    cells = [_cell(it, chunks, shape) for it in items]
    if all(c is not None for c in cells):  # the usual case: one chunk per box, checked as a grid
        if len(set(cells)) != len(cells):
            errors.append(f"key {key!r}: two boxes write the same chunk (overlap)")
        elif len(cells) != math.prod(-(-d // c) for d, c in zip(shape, chunks)):
            errors.append(f"key {key!r}: boxes cover {len(cells)} chunks of the grid (a gap)")
        return errors
    # Sweep along dim 0: keep boxes whose extent along dim 0 is still open.
    ordered = sorted(items, key=lambda it: it.offsets)
    active: list[tuple[int, int]] = []  # (end along dim 0, index)
    for i, it in enumerate(ordered):
        start = it.offsets[0] if shape else 0
        cut = bisect.bisect_right(active, (start, len(ordered)))
        del active[:cut]
        for _, j in active:
            if _overlap(it, ordered[j]):
                errors.append(
                    f"key {key!r}: boxes at {it.offsets} and {ordered[j].offsets} overlap"
                )
                break
        bisect.insort(active, ((it.offsets[0] + it.sizes[0]) if shape else 1, i))
    volume = sum(math.prod(it.sizes) for it in items)
    if not errors and volume != math.prod(shape):
        errors.append(f"key {key!r}: boxes cover {volume} of {math.prod(shape)} elements (a gap)")
    return errors


def _cell(it: WriteItem, chunks, shape) -> tuple[int, ...] | None:
    """The grid cell of a box that is exactly one chunk, else ``None``."""
    for o, s, c, dim in zip(it.offsets, it.sizes, chunks, shape):
        if s != min(c, dim - o):
            return None
    return tuple(o // c for o, c in zip(it.offsets, chunks))


def _overlap(a: WriteItem, b: WriteItem) -> bool:
    return all(
        ao < bo + bs and bo < ao + as_
        for ao, as_, bo, bs in zip(a.offsets, a.sizes, b.offsets, b.sizes)
    )


def intersect(a: Box, b: Box) -> Box | None:
    """The intersection of two boxes, or ``None`` when they do not meet."""
    offsets, sizes = [], []
    for ao, as_, bo, bs in zip(*a, *b):
        lo, hi = max(ao, bo), min(ao + as_, bo + bs)
        if hi <= lo:
            return None
        offsets.append(lo)
        sizes.append(hi - lo)
    return tuple(offsets), tuple(sizes)
