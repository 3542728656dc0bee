"""Host staging buffers for async saves, reused from one save to the next.

``save_async`` must copy every item it writes off the devices (and out of the caller's numpy
arrays) before it returns, because the caller may donate or overwrite them right after. A
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

import mmap
import threading

import numpy as np

_ALIGN = 64  # bytes; every item starts on a cache line
_GRANULE = 1 << 16  # arenas are sized in 64 KiB steps so small changes of state reuse one
_HUGE = 4 << 20  # arenas from this size on are mapped on huge pages


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _allocate(nbytes: int) -> np.ndarray:
    """A host buffer; large ones on transparent huge pages where Linux allows.

    The first save of a run copies the whole state into a fresh arena: with 4 KiB pages that
    is one page fault per 4 KiB (~0.9 s for 400 MiB here), with 2 MiB pages ~0.1 s.
    """
    if nbytes >= _HUGE and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            mm.madvise(mmap.MADV_HUGEPAGE)
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

    def copy(self, data: np.ndarray) -> np.ndarray:
        """A copy of ``data`` in this arena (or a fresh array, if it does not fit)."""
        data = np.asarray(data)
        n = data.nbytes
        if self.used + n > self.buf.nbytes or data.dtype.hasobject:
            return np.array(data, copy=True)
        out = self.buf[self.used : self.used + n].view(data.dtype).reshape(data.shape)
        np.copyto(out, data, casting="no")
        self.used += _aligned(n)
        return out


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
        nbytes = max(_GRANULE, -(-nbytes // _GRANULE) * _GRANULE)
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


def staged_bytes(sizes: list[int]) -> int:
    """The arena bytes that items of these sizes take."""
    return sum(_aligned(n) for n in sizes)


POOL = StagingPool()
