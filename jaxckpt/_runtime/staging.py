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

The pool gives its memory back when no save needs it: free arenas are released once no save
has taken one for :data:`RELEASE_AFTER_S` seconds, so a run that saves again soon reuses its
arena and a process that saved once does not keep the arena's RSS (docs/manager.md). The C
heap's free pages go back then too (``malloc_trim``): the device copies that a save on CPU
devices makes come from ``malloc``, and glibc keeps freed chunks below its mmap threshold
(which rises to the size of the chunks freed, up to 32 MiB) in the heap for reuse.
A budgeted save (``save_async(..., max_host_bytes=N)``) takes an arena of at most N bytes and
stages through it slot by slot (``jaxckpt._runtime.ring``).
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
from jaxckpt._runtime.libc import libc

_Job = tuple[npt.NDArray[Any], npt.NDArray[Any]]  # (destination, source) of one copy

_GRANULE = 1 << 16  # arenas are sized in 64 KiB steps so small changes of state reuse one
_MAPPED = 4 << 20  # arenas from this size on get a mapping of their own
_SPLIT = 16 << 20  # a larger item is copied in row blocks of about this size, in parallel
# Free arenas are released after this many seconds without a save taking one: long enough for
# the saves of a loop that checkpoints every few seconds to reuse one, short enough that a
# process does not keep a state-sized buffer between saves minutes apart.
RELEASE_AFTER_S = 10.0


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
            jobs += _row_blocks(out, data)
        _run(jobs)
        return outs


def copy_into(out: npt.NDArray[Any], data: npt.NDArray[Any]) -> None:
    """Copy ``data`` into ``out`` (same shape; the dtype may differ in byte order only), in
    row blocks on the staging threads where it is large."""
    _run(_row_blocks(out, np.asarray(data)))


def _row_blocks(out: npt.NDArray[Any], data: npt.NDArray[Any]) -> list[_Job]:
    """The copy of ``data`` into ``out`` as blocks of rows of about ``_SPLIT`` bytes."""
    n = data.nbytes
    rows = math.ceil(n / _SPLIT) if data.ndim and n > _SPLIT else 1
    step = max(1, ceil_div(data.shape[0], rows)) if data.ndim else 1
    jobs: list[_Job] = []
    for r in range(0, data.shape[0] if data.ndim else 1, step):
        part: slice | EllipsisType = slice(r, r + step) if data.ndim else ...
        jobs.append((out[part], data[part]))
    return jobs


def _run(jobs: list[_Job]) -> None:
    """Run the copies, spread over the staging threads by bytes where they are large."""
    total = sum(o.nbytes for o, _ in jobs)
    if total < _SPLIT or len(jobs) == 1:
        _copy(jobs)
        return
    bins: list[list[_Job]] = [[] for _ in range(pools.STAGE_THREADS)]  # near-equal bytes
    size = [0] * pools.STAGE_THREADS
    for job in sorted(jobs, key=lambda j: -j[0].nbytes):
        i = size.index(min(size))
        bins[i].append(job)
        size[i] += job[0].nbytes
    for f in [pools.stage_pool().submit(_copy, b) for b in bins if b]:
        f.result()


class StagingPool:
    """Arenas for the saves of this process; thread-safe.

    Args:
      keep: free arenas to keep for reuse (the largest ones); the others are released.
      release_after: seconds after which free arenas are released when no save took one
        meanwhile (on a daemon timer thread); ``None`` keeps them until :meth:`clear`.

    Example:
      >>> import numpy as np
      >>> pool = StagingPool()
      >>> arena = pool.take(1000)
      >>> arena.copy(np.arange(3)).tolist()
      [0, 1, 2]
      >>> pool.give_back(arena); pool.take(10) is arena
      True
    """

    def __init__(self, keep: int = 1, release_after: float | None = RELEASE_AFTER_S) -> None:
        self.keep = keep
        self.release_after = release_after
        self._free: list[Arena] = []
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self._generation = 0  # changed by every take, give_back and clear

    def take(self, nbytes: int, *, reuse: bool = True) -> Arena:
        """An empty arena of at least ``nbytes``: the smallest free one that fits, or a new one.

        With ``reuse=False`` always a new one, which ``give_back`` will not keep.
        """
        if not reuse:
            return Arena(nbytes, reusable=False)
        nbytes = max(_GRANULE, ceil_div(nbytes, _GRANULE) * _GRANULE)
        with self._lock:
            self._cancel_release()  # a save runs: what is free may serve the next one
            fits = [a for a in self._free if a.nbytes >= nbytes]
            if fits:
                arena = min(fits, key=lambda a: a.nbytes)
                self._free.remove(arena)
                arena.used = 0
                return arena
        return Arena(nbytes)

    def give_back(self, arena: Arena) -> None:
        """Return an arena whose data is no longer needed (a save has ended); keep the
        ``keep`` largest, for ``release_after`` seconds unless a save takes one meanwhile."""
        with self._lock:
            if arena.reusable:
                self._free.append(arena)
                self._free.sort(key=lambda a: a.nbytes, reverse=True)
                del self._free[self.keep :]
            self._cancel_release()
            if self.release_after is not None:
                generation = self._generation
                self._timer = pools.after(self.release_after, lambda: self._release(generation))

    def clear(self) -> None:
        """Release every free arena (arenas of saves in flight are released when they end),
        and the C heap's free pages."""
        with self._lock:
            self._cancel_release()
            self._free.clear()
        trim()

    def _cancel_release(self) -> None:
        """(Under the lock) no release of what is free now: a save has used the pool since."""
        self._generation += 1
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _release(self, generation: int) -> None:
        """The timer's call: release the free arenas and the C heap's free pages, if no save
        used the pool since."""
        with self._lock:
            if generation != self._generation:
                return
            self._free.clear()
            self._timer = None
        trim()

    @property
    def free_bytes(self) -> int:
        """Bytes held in free arenas, kept for the next save."""
        with self._lock:
            return sum(a.nbytes for a in self._free)


def trim() -> None:
    """Give the C heap's free pages back to the kernel (glibc's ``malloc_trim``; nothing
    where the C library has none)."""
    try:
        libc().malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _copy(jobs: list[_Job]) -> None:
    for out, data in jobs:
        np.copyto(out, data, casting="equiv")


def staged_bytes(sizes: list[int]) -> int:
    """The arena bytes that items of these sizes take."""
    return sum(_aligned(n) for n in sizes)


POOL = StagingPool()
