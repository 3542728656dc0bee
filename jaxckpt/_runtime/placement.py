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

An array whose boxes all sit in one group (:meth:`Placement.expect_array`: up to half the
budget on this host) is made by one ``jax.make_array_from_callback``, a single batched
transfer: jax's Python work per box (a ``device_put`` each, then
``make_array_from_single_device_arrays``) would weigh on the restore's main thread
(docs/benchmarks.md).
"""

from __future__ import annotations

import collections
from collections.abc import Hashable, Sequence
from typing import Any

import jax
import numpy.typing as npt

# A box waiting for its transfer: (slot, host array, targets)
_Queued = tuple[Hashable, npt.NDArray[Any], Sequence[Any]]


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
        self.whole: set[Hashable] = set()  # slots placed as one array: ``placed[slot][0]``
        self._arrays: dict[Hashable, tuple[tuple[int, ...], Any, int]] = {}  # expect_array
        self.groups = 0  # batched device_put calls made
        self.peak_bytes = 0  # most host bytes held at once
        self._queue: list[_Queued] = []
        self._queued = 0
        self._inflight: collections.deque[tuple[int, list[jax.Array]]] = collections.deque()
        self._inflight_bytes = 0

    @property
    def host_bytes(self) -> int:
        """Bytes of boxes queued or still being transferred."""
        return self._queued + self._inflight_bytes

    def expect_array(
        self, slot: Hashable, shape: tuple[int, ...], sharding: Any, boxes: int, nbytes: int
    ) -> None:
        """The ``boxes`` boxes to come under ``slot`` (``nbytes`` in all, each added with its
        single-device targets) are the addressable shards of one array of ``shape`` on
        ``sharding``. If they are all queued when a group is placed, the array is made in one
        call and ``placed[slot]`` is that array (``slot`` in :attr:`whole`); else each box is
        placed alone, as for any slot. Only arrays of up to half of ``max_bytes``: the boxes
        of one may wait for the next group."""
        if nbytes <= self.max_bytes // 2:
            self._arrays[slot] = (shape, sharding, boxes)

    def add(self, slot: Hashable, array: npt.NDArray[Any], targets: Sequence[Any]) -> None:
        """Place ``array`` on each of ``targets`` (devices or shardings); results under ``slot``."""
        if self._queue and self.host_bytes + array.nbytes > self.max_bytes:
            self._retire()  # finished transfers hold nothing: the queue may fit after all
            if self.host_bytes + array.nbytes > self.max_bytes:
                self.flush()
        self._wait(self.max_bytes - array.nbytes)
        self._queue.append((slot, array, targets))
        self._queued += array.nbytes
        self.peak_bytes = max(self.peak_bytes, self.host_bytes)
        if self._queued >= self.group_bytes:
            self.flush(keep_last=True)

    def flush(self, keep_last: bool = False) -> None:
        """Start the transfer of every queued box (one batched ``jax.device_put``, and one
        call per whole array). ``keep_last``: an expected array whose last boxes are still to
        come stays queued, so that it can be made whole by the next group."""
        queue, kept = self._queue, []
        if keep_last and queue and queue[-1][0] in self._arrays:
            last = queue[-1][0]
            if sum(q[0] == last for q in queue) < self._arrays[last][2]:
                kept = [q for q in queue if q[0] == last]
                queue = [q for q in queue if q[0] != last]
        if not queue:
            return
        by_slot: dict[Hashable, list[_Queued]] = collections.defaultdict(list)
        for q in queue:
            by_slot[q[0]].append(q)
        arrays, targets, slots, out = [], [], [], []
        for slot, boxes in by_slot.items():
            expected = self._arrays.pop(slot, None)
            if expected is not None and len(boxes) == expected[2]:
                whole = _make_array(expected[0], expected[1], boxes)
                self.placed[slot] = [whole]
                self.whole.add(slot)
                out.append(whole)
                continue
            for _, array, where in boxes:
                for t in where:
                    arrays.append(array)
                    targets.append(t)
                    slots.append(slot)
        if arrays:
            put = jax.device_put(arrays, targets)
            for slot, a in zip(slots, put):
                self.placed[slot].append(a)
            out.extend(put)
        nbytes = self._queued - sum(a.nbytes for _, a, _ in kept)
        self._inflight.append((nbytes, out))
        self._inflight_bytes += nbytes
        self._queue, self._queued = kept, self._queued - nbytes
        self.groups += 1

    def _retire(self) -> None:
        """Drop the oldest transfers that have finished, without waiting for any."""
        # jax.Array's stub lacks is_ready, which every concrete jax array (ArrayImpl) has
        while self._inflight and all(a.is_ready() for a in self._inflight[0][1]):  # type: ignore[attr-defined]
            self._inflight_bytes -= self._inflight.popleft()[0]

    def _wait(self, limit: int) -> None:
        """Wait for the oldest transfers until at most ``limit`` bytes are in flight."""
        while self._inflight and self._inflight_bytes > max(limit, 0):
            n, arrays = self._inflight.popleft()
            jax.block_until_ready(arrays)  # the transfer is done: its host buffer can go
            self._inflight_bytes -= n


def _make_array(shape: tuple[int, ...], sharding: Any, boxes: list[_Queued]) -> jax.Array:
    """The array of ``shape`` on ``sharding`` from its boxes ``(slot, host array, targets)``,
    each target a single-device sharding, in one batched transfer."""
    by_device: dict[jax.Device, npt.NDArray[Any]] = {}
    for _, array, where in boxes:
        for t in where:
            by_device[next(iter(t.device_set))] = array
    by_index = {
        _index_key(index): by_device[d]
        for d, index in sharding.addressable_devices_indices_map(shape).items()
    }
    return jax.make_array_from_callback(shape, sharding, lambda i: by_index[_index_key(i)])


def _index_key(index: tuple[slice, ...] | None) -> tuple[tuple[int | None, ...], ...]:
    # None: jax's callback type admits it, but jax never passes it
    return tuple((s.start, s.stop, s.step) for s in index or ())
