"""The zarr v3 chunk grid every layer agrees on: how many chunks, their keys, their order.

An array of ``shape`` stored in chunks of ``chunks`` has ``grid_shape(shape, chunks)`` chunks
along each dimension; chunk ``(i, j)`` is the object ``c/i/j`` below the array's folder (``c``
for a 0-d array: zarr v3's default ``/`` key encoding). Host buffers start on ``ALIGN`` bytes.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

# Bytes: a cache line, and what XLA's CPU client needs to alias a host buffer instead of
# copying it. Staged items and in-place reads both start on it.
ALIGN = 64

_N = TypeVar("_N", int, npt.NDArray[np.integer[Any]])


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype[Any]) -> npt.NDArray[Any]:
    """An uninitialised array of ``shape`` whose data starts on ``ALIGN`` bytes.

    >>> aligned_empty((3, 5), np.dtype(np.float32)).ctypes.data % ALIGN
    0
    """
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + ALIGN, np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def ceil_div(a: _N, b: _N | int) -> _N:
    """``a / b`` rounded up, for non-negative integers (or numpy arrays of them).

    >>> ceil_div(10, 4), ceil_div(8, 4), ceil_div(0, 4)
    (3, 2, 0)
    """
    return -(-a // b)


def grid_shape(shape: Sequence[int], chunks: Sequence[int]) -> tuple[int, ...]:
    """Chunks along each dimension (0 along a dimension of size 0).

    >>> grid_shape((10, 8, 0), (4, 8, 1))
    (3, 1, 0)
    """
    return tuple(ceil_div(s, c) for s, c in zip(shape, chunks))


def chunk_key(idx: Sequence[int]) -> str:
    """The key of chunk ``idx`` below its array's folder.

    >>> chunk_key((2, 0)), chunk_key(())
    ('c/2/0', 'c')
    """
    return "/".join(["c", *map(str, idx)])


def is_chunk_key(name: str) -> bool:
    """Whether ``name`` (relative to an array's folder) is a chunk's key."""
    return name == "c" or name.startswith("c/")


def grid_indices(grid: Sequence[int]) -> Iterator[tuple[int, ...]]:
    """Chunk indices in row-major order, lazily (itertools.product would materialise ranges).

    >>> list(grid_indices((2, 2))), list(grid_indices(())), list(grid_indices((3, 0)))
    ([(0, 0), (0, 1), (1, 0), (1, 1)], [()], [])
    """
    if 0 in grid:
        return
    idx = [0] * len(grid)
    while True:
        yield tuple(idx)
        d = len(grid) - 1
        while d >= 0 and idx[d] == grid[d] - 1:
            idx[d] = 0
            d -= 1
        if d < 0:
            return
        idx[d] += 1


def chunks_touching(
    offsets: Iterable[int], sizes: Iterable[int], chunks: Iterable[int]
) -> Iterator[tuple[int, ...]]:
    """Indices of the chunks that the box ``offsets``/``sizes`` touches, in row-major order.

    >>> list(chunks_touching((3,), (6,), (4,)))
    [(0,), (1,), (2,)]
    """
    ranges = [range(o // c, ceil_div(o + s, c)) for o, s, c in zip(offsets, sizes, chunks)]
    return itertools.product(*ranges)


Region = tuple[tuple[int, int], ...]  # (start, stop) per axis


def c_order_blocks(
    shape: tuple[int, ...], itemsize: int, limit: int
) -> Iterator[tuple[int, Region]]:
    """The C-order blocks of a chunk of ``shape``, each one contiguous run of its file of at
    most ``limit`` bytes (or one element, if that is larger): ``(byte offset, region)`` with
    ``region`` a ``(start, stop)`` per axis. Blocks cut the outermost axes that do not fit.

    >>> list(c_order_blocks((2, 3), 4, 12)), list(c_order_blocks((2, 3), 4, 24))
    ([(0, ((0, 1), (0, 3))), (12, ((1, 2), (0, 3)))], [(0, ((0, 2), (0, 3)))])
    """
    axis, inner = len(shape) - 1, itemsize
    while axis > 0 and inner * shape[axis] <= limit:  # trailing axes that fit whole
        inner *= shape[axis]
        axis -= 1
    if axis < 0:  # 0-d: one element
        yield 0, ()
        return
    step = max(1, limit // inner)
    tail = tuple((0, n) for n in shape[axis + 1 :])
    for lead in itertools.product(*map(range, shape[:axis])):
        flat = 0
        for i, n in zip(lead, shape):
            flat = flat * n + i
        for a in range(0, shape[axis], step):
            region = (*((i, i + 1) for i in lead), (a, min(a + step, shape[axis])), *tail)
            yield (flat * shape[axis] + a) * inner, region
