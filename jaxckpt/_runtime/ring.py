"""The bounded host buffer a budgeted ``save_async`` stages through, slot after slot.

With ``save_async(..., max_host_bytes=N)`` the items of a save are not staged all at once:
each is copied into a slot of a :class:`Ring` of at most N bytes (an arena of
``jaxckpt._runtime.staging.POOL``), handed to the writer, and the slot is reused once nothing
references its bytes any more. So staging never holds more than N bytes, however large the
state.

**When a slot is free.** By reference count, so that nobody has to report back: each slot's
array and every view of it name one ``memoryview`` of the slot as their base, and a
``weakref.finalize`` on that frees the slot. Every
holder of the bytes keeps the slot (the writer, an incremental save's hash threads); and as
tensorstore may read a source array after ``write`` returned while holding no reference to
it, the writer keeps each item's data until its write has completed
(``Writer.write(..., release_each=True)``), then drops it.

**Order.** Slots are taken in order around the buffer (first in, first out: the order the
writer writes them in); a slot freed out of order is reused once those before it are free.
Each slot starts at a multiple of ``ALIGN`` bytes, so a ring of ``N`` bytes holds any item of
at most ``N - ALIGN`` bytes (:func:`slot_bytes`).
"""

from __future__ import annotations

import collections
import math
import threading
import weakref
from typing import Any

import numpy as np
import numpy.typing as npt

from jaxckpt._format.grid import ALIGN, ceil_div
from jaxckpt._runtime.staging import Arena


def slot_bytes(nbytes: int) -> int:
    """The ring bytes an item of ``nbytes`` takes (its start aligned)."""
    return ceil_div(nbytes, ALIGN) * ALIGN


class Ring:
    """First-in, first-out slots in ``capacity`` bytes of ``arena``; thread-safe.

    Args:
      arena: the host buffer (at least ``capacity`` bytes; the rest is not touched).
      capacity: the most bytes the slots may take at once.

    Example:
      >>> import numpy as np
      >>> from jaxckpt._runtime.staging import Arena
      >>> ring = Ring(Arena(256), 256)
      >>> a = ring.slot((16,), np.dtype(np.float32))  # 64 bytes
      >>> a[:] = 1; ring.held
      64
      >>> del a; ring.held  # nothing references the slot: free again
      0
    """

    def __init__(self, arena: Arena, capacity: int) -> None:
        if capacity > arena.nbytes:
            raise ValueError(f"capacity {capacity} exceeds the arena's {arena.nbytes} bytes")
        self.arena = arena
        self.capacity = capacity
        self.held = 0  # bytes of the slots in use
        self.peak = 0  # the most bytes held at once
        self._cond = threading.Condition()
        self._live: collections.deque[list[int]] = collections.deque()  # [start, end, freed]
        self._head = 0  # where the next slot goes, if it fits there

    def slot(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> npt.NDArray[Any]:
        """An array of ``shape`` and ``dtype`` in the ring, once there is room for it.

        Blocks until enough of the slots before it are free. Its slot is free again once
        nothing references the array or a view of it.

        Raises:
          ValueError: the array can never fit (larger than the capacity).
        """
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes == 0:
            return np.empty(shape, dtype)
        size = slot_bytes(nbytes)
        if size > self.capacity:
            raise ValueError(f"{nbytes} bytes do not fit in a ring of {self.capacity} bytes")
        with self._cond:
            while (start := self._fit(size)) is None:
                self._cond.wait()
            return self._take(start, size, nbytes, shape, dtype)

    def try_slot(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> npt.NDArray[Any] | None:
        """Like :meth:`slot`, but ``None`` at once where there is no room now."""
        nbytes = math.prod(shape) * dtype.itemsize
        size = slot_bytes(max(nbytes, 1))
        if nbytes == 0 or size > self.capacity:
            return self.slot(shape, dtype)  # empty: no room needed; too large: its error
        with self._cond:
            start = self._fit(size)
            return None if start is None else self._take(start, size, nbytes, shape, dtype)

    def _fit(self, size: int) -> int | None:
        """(Under the lock) where a slot of ``size`` bytes goes now, or ``None``."""
        if not self._live:
            self._head = 0
            return 0
        tail = self._live[0][0]
        if self._head > tail:  # used: [tail, head); free: [head, capacity) and [0, tail)
            if self._head + size <= self.capacity:
                return self._head
            return 0 if size <= tail else None
        return self._head if self._head + size <= tail else None  # wrapped: free [head, tail)

    def _take(
        self, start: int, size: int, nbytes: int, shape: tuple[int, ...], dtype: np.dtype[Any]
    ) -> npt.NDArray[Any]:
        """(Under the lock) the array of a new slot at ``start``, freed with its last view."""
        record = [start, start + size, 0]
        self._live.append(record)
        self._head = start + size
        self.held += size
        self.peak = max(self.peak, self.held)
        flat = np.frombuffer(self.arena.buf.data[start : start + nbytes], dtype=dtype)
        # The object that holds the buffer for this array and every view of it (numpy's own
        # memoryview of the slice: views name it as their base, not one another).
        owner = flat.base
        assert owner is not None
        weakref.finalize(owner, self._free, record).atexit = False
        return flat.reshape(shape)

    def _free(self, record: list[int]) -> None:
        with self._cond:
            record[2] = 1
            self.held -= record[1] - record[0]
            while self._live and self._live[0][2]:
                self._live.popleft()
            self._cond.notify_all()
