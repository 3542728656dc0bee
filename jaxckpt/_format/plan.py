"""Plan items and the free functions the default planners are made of.

Items are frozen dataclasses; a planner subclass changes one with ``dataclasses.replace`` or
overrides the one step it needs. Nothing here knows about tensorstore or files.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
from collections.abc import Iterable, Sequence

import numpy as np
import numpy.typing as npt

from jaxckpt._errors import InvalidArgumentError, PlanValidationError
from jaxckpt._format.dtypes import dtype_from_name
from jaxckpt._format.grid import ceil_div

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)
IntArray = npt.NDArray[np.int64]  # e.g. the offsets or sizes of boxes, one row per box


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
        """Bytes of this box."""
        return math.prod(self.sizes) * dtype_from_name(self.dtype).itemsize


@dataclasses.dataclass(frozen=True)
class SavePlan:
    """What one process writes."""

    items: tuple[WriteItem, ...]

    @property
    def nbytes(self) -> int:
        """Bytes this process writes."""
        return sum(i.nbytes for i in self.items)


@dataclasses.dataclass(frozen=True)
class ReadItem:
    """One box of one saved array to read once on this host.

    ``devices`` are the local devices whose target shard is exactly this box, or, when the box
    is a whole small array all on this host (placed with its sharding in one put), every local
    device of it; empty means the box goes to the host (a numpy result).
    """

    key: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    devices: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class LoadPlan:
    """What this process reads."""

    items: tuple[ReadItem, ...]


def index_to_box(index: Sequence[slice], shape: Sequence[int]) -> Box:
    """A shard's ``index`` (a tuple of slices, as in ``shard.index``) as (offsets, sizes)."""
    offsets, sizes = [], []
    for sl, dim in zip(index, shape):
        start, stop, step = sl.indices(dim)
        if step != 1:
            raise InvalidArgumentError(
                f"strided shard index {sl} is not supported: a shard must be a contiguous box "
                f"of its array; put the array on a NamedSharding (jax.device_put) first."
            )
        offsets.append(start)
        sizes.append(max(stop - start, 0))
    return tuple(offsets), tuple(sizes)


def chunk_shape(box: Sequence[int], itemsize: int, max_bytes: int) -> tuple[int, ...]:
    """The chunk shape for shards of shape ``box``: the box itself, halved (outer dimensions
    first) while it exceeds ``max_bytes``, so chunk boundaries stay shard boundaries."""
    out = [max(int(b), 1) for b in box]
    for d in range(len(out)):
        while math.prod(out) * itemsize > max_bytes and out[d] % 2 == 0:
            out[d] //= 2
    return tuple(out)


def chunk_boxes(offsets: Sequence[int], sizes: Sequence[int], chunks: Sequence[int]) -> list[Box]:
    """Split a chunk-aligned box into its chunks (row-major)."""
    ranges = [
        range(o, o + s, c) if s else range(o, o + 1) for o, s, c in zip(offsets, sizes, chunks)
    ]
    out = []
    for corner in itertools.product(*ranges):
        size = tuple(min(c, o + s - k) for k, o, s, c in zip(corner, offsets, sizes, chunks))
        out.append((tuple(corner), size))
    return out


def validate_plan(
    items: Iterable[WriteItem], arrays: dict[str, tuple[tuple[int, ...], str, tuple[int, ...]]]
) -> None:
    """Check a list of write items against ``arrays`` (key -> ``(shape, dtype, chunks)``).

    Raises:
        PlanValidationError: naming each bad key, truncated after a few.
    """
    by_key: dict[str, list[WriteItem]] = {}
    for it in items:
        by_key.setdefault(it.key, []).append(it)
    errors = [f"key {k!r}: written but not in the manifest" for k in by_key.keys() - arrays.keys()]
    for key, (shape, dtype, chunks) in arrays.items():
        mine = by_key.get(key, [])
        errors += [
            f"key {key!r}: item dtype {i.dtype} differs from {dtype}"
            for i in mine
            if i.dtype != dtype
        ]
        if any(len(i.offsets) != len(shape) or len(i.sizes) != len(shape) for i in mine):
            errors.append(f"key {key!r}: a box has the wrong rank for shape {shape}")
            continue
        offsets = np.array([i.offsets for i in mine], np.int64).reshape(len(mine), len(shape))
        sizes = np.array([i.sizes for i in mine], np.int64).reshape(len(mine), len(shape))
        errors += check_boxes(key, shape, chunks, offsets, sizes)
    raise_if(errors)


def raise_if(errors: list[str]) -> None:
    if errors:
        summary = "; ".join(errors[:8])
        more = f" (and {len(errors) - 8} more)" if len(errors) > 8 else ""
        raise PlanValidationError(
            f"Invalid save plan: {summary}{more}. A custom planner produced boxes that do not "
            f"tile each array exactly once along its chunk grid; fix its create_global_plan."
        )


def check_boxes(
    key: str, shape: Sequence[int], chunks: Sequence[int], offsets: IntArray, sizes: IntArray
) -> list[str]:
    """Bounds, chunk alignment, no overlap and full coverage of one array's boxes.

    Vectorized. Boxes on a regular grid (the usual case) are checked as a grid in O(n): each
    cell counted once. Other boxes go through a sweep along dimension 0, O(n log n) for
    non-pathological layouts; with no overlap, equal volume means full coverage.
    """
    shape_a = np.array(shape, np.int64)
    chunks_a = np.array(chunks, np.int64)
    ends = offsets + sizes
    if (offsets < 0).any() or (sizes < 0).any() or (ends > shape_a).any():
        i = int(np.argmax((offsets < 0).any(1) | (sizes < 0).any(1) | (ends > shape_a).any(1)))
        return [
            f"key {key!r}: box at {tuple(offsets[i])} size {tuple(sizes[i])} is out of bounds {tuple(shape)}"
        ]
    if math.prod(shape) == 0:
        return []
    if len(offsets) == 0:
        return [f"key {key!r}: no box covers it (a gap)"]
    box = sizes.max(0)
    if (box > 0).all():
        cell = offsets // box
        if (cell * box == offsets).all() and (sizes == np.minimum(box, shape_a - offsets)).all():
            return _check_grid(key, shape_a, chunks_a, box, cell)
    misaligned = (offsets % chunks_a != 0).any(1) | (
        (ends % chunks_a != 0) & (ends != shape_a)
    ).any(1)
    if misaligned.any():
        i = int(np.argmax(misaligned))
        return [_misaligned(key, offsets[i], sizes[i], chunks)]
    return _sweep(key, shape, offsets, sizes)


def _misaligned(
    key: str, offsets: IntArray, sizes: IntArray, chunks: Sequence[int] | IntArray
) -> str:
    return f"key {key!r}: box at {tuple(offsets)} size {tuple(sizes)} is not aligned to chunks {tuple(chunks)}"


def _check_grid(
    key: str, shape: IntArray, chunks: IntArray, box: IntArray, cell: IntArray
) -> list[str]:
    # Boxes of one size on multiples of it: aligned to chunks iff the box size is.
    if ((box % chunks != 0) & (box < shape)).any():
        return [_misaligned(key, cell[0] * box, box, chunks)]
    grid = ceil_div(shape, box)
    cells = (
        np.ravel_multi_index(tuple(cell.T), tuple(grid))
        if len(shape)
        else np.zeros(len(cell), np.int64)
    )
    counts = np.bincount(cells, minlength=math.prod(grid.tolist()))
    if (counts > 1).any():
        return [f"key {key!r}: two boxes write the same chunk (overlap)"]
    if (counts == 0).any():
        return [
            f"key {key!r}: boxes cover {int((counts > 0).sum())} of {len(counts)} cells of the grid (a gap)"
        ]
    return []


def _sweep(key: str, shape: Sequence[int], offsets: IntArray, sizes: IntArray) -> list[str]:
    order = np.lexsort(offsets.T[::-1]) if len(shape) else np.arange(len(offsets))
    active: list[tuple[int, int]] = []  # (end along dim 0, index), sorted
    for i in order.tolist():
        start = int(offsets[i, 0]) if len(shape) else 0
        del active[: bisect.bisect_right(active, (start, len(order)))]
        for _, j in active:
            if (offsets[i] < offsets[j] + sizes[j]).all() and (
                offsets[j] < offsets[i] + sizes[i]
            ).all():
                return [
                    f"key {key!r}: boxes at {tuple(offsets[i])} and {tuple(offsets[j])} overlap"
                ]
        bisect.insort(active, (int(offsets[i, 0] + sizes[i, 0]) if len(shape) else 1, i))
    volume = int(np.prod(sizes, axis=1).sum())
    if volume != math.prod(shape):
        return [f"key {key!r}: boxes cover {volume} of {math.prod(shape)} elements (a gap)"]
    return []
