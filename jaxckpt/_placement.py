"""Placing boxes read on the host onto devices: batched, overlapped, inside a host budget.

A restore reads boxes on the host and must end with them on devices. Holding every box until
the end doubles the host memory a restore needs (the boxes, then the device buffers); placing
each box alone costs a ``jax.device_put`` call per box (slow for thousands of small leaves).
:class:`Placement` sits between: boxes queue until a group of ``group_bytes`` is ready, the
group goes to its devices in one batched ``jax.device_put`` (asynchronous: the transfer runs
while storage reads the next boxes), and the host references are dropped at once. Transfers
still in flight keep their host buffers alive, so :class:`Placement` waits for the oldest ones
whenever queued plus in-flight bytes would pass ``max_bytes``.

On CPU devices ``jax.device_put`` may alias a 64-byte aligned numpy buffer instead of copying
it (storage reads into such buffers): the box then *is* the device buffer and costs no copy.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable, Sequence
from typing import Any

import jax
import numpy as np


class Placement:
    """Queue host boxes for their devices; place them in budget-sized batched transfers.

    Args:
      max_bytes: host bytes that queued and in-flight boxes may hold together (a single box
        larger than this is still placed, alone).
      group_bytes: queue this many bytes before one batched ``device_put``; default a quarter
        of ``max_bytes``.
    """

    def __init__(self, max_bytes: int, group_bytes: int | None = None) -> None:
        self.max_bytes = max(int(max_bytes), 1)
        self.group_bytes = max(group_bytes if group_bytes is not None else self.max_bytes // 4, 1)
        self.placed: dict[Hashable, list[jax.Array]] = collections.defaultdict(list)
        self.groups = 0  # batched device_put calls made
        self.peak_bytes = 0  # most host bytes held at once
        self._queue: list[tuple[Hashable, np.ndarray, Sequence[Any]]] = []
        self._queued = 0
        self._inflight: collections.deque[tuple[int, list[jax.Array]]] = collections.deque()
        self._inflight_bytes = 0

    @property
    def host_bytes(self) -> int:
        """Bytes of boxes queued or still being transferred."""
        return self._queued + self._inflight_bytes

    def add(self, slot: Hashable, array: np.ndarray, targets: Sequence[Any]) -> None:
        """Place ``array`` on each of ``targets`` (devices or shardings); results under ``slot``."""
        if self._queue and self.host_bytes + array.nbytes > self.max_bytes:
            self.flush()
        self._wait(self.max_bytes - array.nbytes)
        self._queue.append((slot, array, targets))
        self._queued += array.nbytes
        self.peak_bytes = max(self.peak_bytes, self.host_bytes)
        if self._queued >= self.group_bytes:
            self.flush()

    def flush(self) -> None:
        """Start the transfer of every queued box (one batched ``jax.device_put``)."""
        if not self._queue:
            return
        arrays, targets, slots = [], [], []
        for slot, array, where in self._queue:
            for t in where:
                arrays.append(array)
                targets.append(t)
                slots.append(slot)
        out = jax.device_put(arrays, targets)
        for slot, a in zip(slots, out):
            self.placed[slot].append(a)
        self._inflight.append((self._queued, out))
        self._inflight_bytes += self._queued
        self._queue, self._queued = [], 0
        self.groups += 1

    def _wait(self, limit: int) -> None:
        """Wait for the oldest transfers until at most ``limit`` bytes are in flight."""
        while self._inflight and self._inflight_bytes > max(limit, 0):
            n, arrays = self._inflight.popleft()
            jax.block_until_ready(arrays)  # the transfer is done: its host buffer can go
            self._inflight_bytes -= n
