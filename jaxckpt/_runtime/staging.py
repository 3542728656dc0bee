"""Host staging buffers for async saves, reused from one save to the next.

``save_async`` must copy every item it writes off the devices (and out of the caller's numpy
arrays) before it returns, because the caller may donate or overwrite them right after.
(Items the planner detaches itself skip staging: ``DefaultSavePlanner.detach`` copies shards
on CPU devices with one asynchronous device copy.) A
fresh allocation per save costs page faults on every save and lets the allocator's heap grow;
instead each save takes one :class:`Arena` (a flat byte buffer big enough for all its items)
from :data:`POOL`, copies each item into an aligned slice of it, and gives it back once its
writes are done. The pool keeps at most ``keep`` free arenas, so host memory is bounded by
the arenas of the saves in flight plus ``keep`` spare ones; with one save in flight at a time
(what ``CheckpointManager`` does) a run uses a single arena over and over.

Reuse is only safe where the store is done with the bytes once the write has completed. The
writer lets tensorstore reference the staged arrays instead of copying them, and the
``memory://`` kvstore keeps such references as its contents, so saves there (and to any
store other than a local file system) take an arena of their own that is never reused.
"""

from __future__ import annotations

import math
import mmap
import threading
from types import EllipsisType
from typing import Any

import numpy as np
import numpy.typing as npt

from jaxckpt._format.grid import ALIGN, ceil_div
from jaxckpt._runtime import pools

_Job = tuple[npt.NDArray[Any], npt.NDArray[Any]]  # (destination, source) of one copy

_GRANULE = 1 << 16  # arenas are sized in 64 KiB steps so small changes of state reuse one
_MAPPED = 4 << 20  # arenas from this size on get a mapping of their own
_SPLIT = 16 << 20  # a larger item is copied in row blocks of about this size, in parallel


def _aligned(n: int) -> int:
    return ceil_div(n, ALIGN) * ALIGN


def _allocate(nbytes: int) -> npt.NDArray[np.uint8]:
    """A host buffer: large ones page-aligned from a mapping of their own (unmapped with it).

    Not on huge pages: the first huge-page fault of a fresh process can wait for the kernel
    to compact memory, longer than 4 KiB pages take with the copy split over threads (see
    :meth:`Arena.copy_all`; docs/benchmarks.md).
    """
    if nbytes >= _MAPPED and hasattr(mmap, "MAP_ANONYMOUS"):
        try:
            mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            return np.frombuffer(mm, dtype=np.uint8)
        except (OSError, ValueError):
            pass
    return np.empty(nbytes, dtype=np.uint8)


class Arena:
    """A flat host buffer that items are copied into, one after the other."""

    def __init__(self, nbytes: int, *, reusable: bool = True) -> None:
        self.buf = _allocate(nbytes)
        self.used = 0
        self.reusable = reusable

    @property
    def nbytes(self) -> int:
        return self.buf.nbytes

    def copy(self, data: npt.NDArray[Any]) -> npt.NDArray[Any]:
        """A copy of ``data`` in this arena (or a fresh array, if it does not fit)."""
        return self.copy_all([data])[0]

    def copy_all(self, arrays: list[npt.NDArray[Any]]) -> list[npt.NDArray[Any]]:
        """Copies of ``arrays`` in this arena (fresh arrays for any that do not fit).

        The copies run on a few threads at once: a fresh arena's first touch (a page fault
        per 4 KiB) costs as much as the copy itself, and both scale with cores.
        """
        outs: list[npt.NDArray[Any]] = []
        jobs: list[_Job] = []
        for data in arrays:
            data = np.asarray(data)
            n = data.nbytes
            if self.used + n > self.buf.nbytes or data.dtype.hasobject:
                outs.append(np.array(data, copy=True))
                continue
            out = self.buf[self.used : self.used + n].view(data.dtype).reshape(data.shape)
            self.used += _aligned(n)
            outs.append(out)
            rows = math.ceil(n / _SPLIT) if data.ndim and n > _SPLIT else 1
            step = max(1, ceil_div(data.shape[0], rows)) if data.ndim else 1
            for r in range(0, data.shape[0] if data.ndim else 1, step):
                part: slice | EllipsisType = slice(r, r + step) if data.ndim else ...
                jobs.append((out[part], data[part]))
        total = sum(o.nbytes for o, _ in jobs)
        if total < _SPLIT or len(jobs) == 1:
            for out, data in jobs:
                np.copyto(out, data, casting="no")
            return outs
        bins: list[list[_Job]] = [[] for _ in range(pools.STAGE_THREADS)]  # near-equal bytes
        size = [0] * pools.STAGE_THREADS
        for job in sorted(jobs, key=lambda j: -j[0].nbytes):
            i = size.index(min(size))
            bins[i].append(job)
            size[i] += job[0].nbytes
        for f in [pools.stage_pool().submit(_copy, b) for b in bins if b]:
            f.result()
        return outs


class StagingPool:
    """Arenas for the saves of this process; thread-safe.

    Args:
      keep: free arenas to keep for reuse (the largest ones); the others are released.

    Example:
      >>> import numpy as np
      >>> pool = StagingPool()
      >>> arena = pool.take(1000)
      >>> arena.copy(np.arange(3)).tolist()
      [0, 1, 2]
      >>> pool.give_back(arena); pool.take(10) is arena
      True
    """

    def __init__(self, keep: int = 1) -> None:
        self.keep = keep
        self._free: list[Arena] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int, *, reuse: bool = True) -> Arena:
        """An empty arena of at least ``nbytes``: the smallest free one that fits, or a new one.

        With ``reuse=False`` always a new one, which ``give_back`` will not keep.
        """
        if not reuse:
            return Arena(nbytes, reusable=False)
        nbytes = max(_GRANULE, ceil_div(nbytes, _GRANULE) * _GRANULE)
        with self._lock:
            fits = [a for a in self._free if a.nbytes >= nbytes]
            if fits:
                arena = min(fits, key=lambda a: a.nbytes)
                self._free.remove(arena)
                arena.used = 0
                return arena
        return Arena(nbytes)

    def give_back(self, arena: Arena) -> None:
        """Return an arena whose data is no longer needed; keep the ``keep`` largest."""
        if not arena.reusable:
            return
        with self._lock:
            self._free.append(arena)
            self._free.sort(key=lambda a: a.nbytes, reverse=True)
            del self._free[self.keep :]

    def clear(self) -> None:
        """Release every free arena (arenas of saves in flight are released when they end)."""
        with self._lock:
            self._free.clear()

    @property
    def free_bytes(self) -> int:
        """Bytes held in free arenas, kept for the next save."""
        with self._lock:
            return sum(a.nbytes for a in self._free)


def _copy(jobs: list[_Job]) -> None:
    for out, data in jobs:
        np.copyto(out, data, casting="no")


def staged_bytes(sizes: list[int]) -> int:
    """The arena bytes that items of these sizes take."""
    return sum(_aligned(n) for n in sizes)


POOL = StagingPool()
