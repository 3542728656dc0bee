"""``save_async``'s staging: every item this process writes, copied off the caller's buffers.

``save_async`` returns once this is done, so that the caller may donate or overwrite the
arrays. Two ways, chosen by ``max_host_bytes`` (docs/manager.md, "Asynchronous saves"):

* **At once** (no budget, :func:`stage_all`): ``SavePlanner.detach`` (the default's device
  copies on CPU devices) and one host arena of ``jaxckpt._runtime.staging.POOL`` for the other
  items, all before the background write starts.
* **Streaming** (``max_host_bytes=N``, :class:`Stream`): the items pass one after the other
  through a ring of at most N host bytes (``jaxckpt._runtime.ring``): ``SavePlanner.resolve_into``
  copies an item into a slot, the writer writes it, and the slot is reused once the write
  has completed. What fits is staged here before the background write starts; the rest is
  staged by the writer's thread as slots free up, and ``save_async`` waits until the last
  item is staged. Only where the whole share fits in N at once does the planner detach
  items as without a budget (on CPU devices a device copy is host memory too: within N then).

The smallest unit is one item (one chunk): a budget smaller than this process's largest chunk
is an error before anything is written.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

import numpy as np

from jaxckpt._errors import CheckpointError, InvalidArgumentError
from jaxckpt._format.manifest import dtype_from_name
from jaxckpt._format.plan import WriteItem
from jaxckpt._planning.reuse import HASH_AHEAD
from jaxckpt._planning.save_planner import SavePlanner
from jaxckpt._runtime import distributed as _distributed
from jaxckpt._runtime import ring as _ring
from jaxckpt._runtime import staging as _staging
from jaxckpt._storage import location as _location
from jaxckpt._storage import writer as _storage

Items = Iterator[tuple[WriteItem, Any]]


def budget_arg(value: object) -> int | None:
    """``max_host_bytes`` as given to ``save_async`` or ``CheckpointManager``, checked.

    Raises:
      InvalidArgumentError: not ``None`` nor a positive int.
    """
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise InvalidArgumentError(
            f"max_host_bytes must be a positive int (bytes of host memory) or None, got "
            f"{value!r} of type {type(value).__name__}: e.g. max_host_bytes=1 << 30 for 1 GiB."
        )
    if value <= 0:
        raise InvalidArgumentError(
            f"max_host_bytes must be a positive number of bytes, got {value}: pass None for no "
            f"budget (the whole share staged at once), or e.g. 1 << 30 for 1 GiB."
        )
    return int(value)


class Staged:
    """The items of a save, off the caller's buffers, and the arena that holds them.

    ``items`` is what the writer writes (popped by it, so that nothing else holds the staged
    bytes once written); :meth:`wait` returns once every item is staged (``complete``) or the
    save has ended (:meth:`settle`, called when the background write ends).
    """

    def __init__(self, items: Items, arena: _staging.Arena | None) -> None:
        self.items = items
        self.arena = arena
        self.complete = True  # every item is staged
        self.release_each = False  # the writer drops each item's data once written
        self.ahead_bytes: int | None = None  # an incremental save's hashing ahead, at most

    def wait(self) -> None:
        """Return once every item is staged, or the save has ended (here: at once)."""

    def settle(self) -> None:
        """The save has ended: :meth:`wait` returns, every item staged or not."""


def stage_all(
    planner: SavePlanner,
    items: Sequence[WriteItem],
    loc: _location.Location,
    sync: _distributed.SaveSync,
    writer: _storage.Writer,
) -> Staged:
    """Every item off the caller's buffers now: detached by the planner, or in one arena.

    Never numpy views of the caller's CPU-device buffers: XLA may donate them under our feet.
    """
    arena = None
    try:
        detached = planner.detach(items)  # the default: device copies on CPU devices
        rest = [i for n, i in enumerate(items) if n not in detached]
        nbytes = _staging.staged_bytes([i.nbytes for i in rest])
        arena = _staging.POOL.take(nbytes, reuse=loc.local is not None)  # see _staging
        staged = iter(arena.copy_all([np.asarray(planner.resolve_data(i)) for i in rest]))
        # lazy: a detached copy is read (and waited for) in the writer's thread
        data = ((i, detached[n]() if n in detached else next(staged)) for n, i in enumerate(items))
    except BaseException as e:
        _failed(e, sync, writer, arena)
    return Staged(data, arena)


class Stream(Staged):
    """The items of a budgeted save, in order: those ``detached`` (index -> thunk, as
    ``SavePlanner.detach`` returns them), the others staged through ``ring``."""

    def __init__(
        self,
        planner: SavePlanner,
        items: Sequence[WriteItem],
        ring: _ring.Ring,
        detached: dict[int, Callable[[], Any]],
    ) -> None:
        super().__init__(self._merged(items), ring.arena)
        self.planner, self.ring, self._detached = planner, ring, detached
        self.release_each = True
        rest = [i for n, i in enumerate(items) if n not in detached]
        largest = max((_ring.slot_bytes(i.nbytes) for i in rest), default=0)
        # Boxes hashed ahead stay in the ring: leave room for a box after them (_ring).
        self.ahead_bytes = min(HASH_AHEAD, max(0, ring.capacity - 3 * largest))
        self._todo = collections.deque(rest)
        self._ready: collections.deque[tuple[WriteItem, Any]] = collections.deque()
        self._settled = threading.Event()  # every item staged, or the save ended
        self.complete = not rest
        if self.complete:
            self._settled.set()

    def prefill(self) -> None:
        """Stage items while the ring has room for them without waiting (the caller's thread)."""
        while self._todo:
            item = self._todo[0]
            out = self.ring.try_slot(item.sizes, dtype_from_name(item.dtype))
            if out is None:
                return
            self._ready.append(self._fill(self._todo.popleft(), out))
            del out

    def _merged(self, items: Sequence[WriteItem]) -> Items:
        """Every item in order: a detached one read from its copy (in the writer's thread),
        the others from the ring."""
        staged = self._stream()
        for n, item in enumerate(items):
            thunk = self._detached.pop(n, None)
            yield (item, thunk()) if thunk is not None else next(staged)
            del thunk

    def _stream(self) -> Items:
        """The items in order (in the writer's thread): the prefilled ones, then each staged
        as soon as the ring has room. Holds none of them once handed on."""
        while self._ready:
            yield self._ready.popleft()
        while self._todo:
            item = self._todo.popleft()
            yield self._fill(item, self.ring.slot(item.sizes, dtype_from_name(item.dtype)))

    def _fill(self, item: WriteItem, out: Any) -> tuple[WriteItem, Any]:
        self.planner.resolve_into(item, out)
        if not self._todo:
            self.complete = True
            self._settled.set()
        return item, out

    def wait(self) -> None:
        """Block until the last item is staged (``complete``), or the save has ended."""
        self._settled.wait()

    def settle(self) -> None:
        self._settled.set()


def stream(
    planner: SavePlanner,
    items: Sequence[WriteItem],
    loc: _location.Location,
    sync: _distributed.SaveSync,
    writer: _storage.Writer,
    *,
    budget: int,
    hash_all_first: bool = False,
) -> Stream:
    """A :class:`Stream` of ``items`` within ``budget`` host bytes, prefilled.

    Where every item fits in the budget at once the planner detaches what it can
    (``SavePlanner.detach``: device copies on CPU devices, which are host memory there and
    which ``save_async`` need not wait for), and the ring holds the rest.
    ``hash_all_first``: an incremental save to an object store, which hashes every item
    before it writes one, so they must all fit at once.

    Raises:
      CheckpointError: the budget cannot hold this process's largest item (or, with
        ``hash_all_first``, all of them); nothing is written.
    """
    arena = None
    try:
        whole = sum(_ring.slot_bytes(i.nbytes) for i in items)
        detached = planner.detach(items) if whole <= budget else {}
        rest = [i for n, i in enumerate(items) if n not in detached]
        capacity = check_budget(budget, rest, hash_all_first=hash_all_first)
        arena = _staging.POOL.take(capacity, reuse=loc.local is not None)
        out = Stream(planner, items, _ring.Ring(arena, capacity), detached)
        out.prefill()
    except BaseException as e:
        _failed(e, sync, writer, arena)
    return out


class BudgetError(CheckpointError):
    """``max_host_bytes`` cannot hold a chunk a budgeted save must stage whole: ``need``
    bytes (``key``: the key of the chunk)."""

    def __init__(self, message: str, *, key: str, need: int) -> None:
        super().__init__(message)
        self.key, self.need = key, need


def check_budget(budget: int, items: Sequence[WriteItem], *, hash_all_first: bool) -> int:
    """The ring bytes a save of ``items`` within ``budget`` uses.

    Raises:
      CheckpointError: ``budget`` cannot hold the largest item (with ``hash_all_first``: all).
    """
    total = sum(_ring.slot_bytes(i.nbytes) for i in items)
    capacity = max(min(budget, total), 1)
    big = max(items, key=lambda i: i.nbytes, default=None)
    if big is not None and _ring.slot_bytes(big.nbytes) > capacity:
        need = _ring.slot_bytes(big.nbytes)
        raise BudgetError(
            f"save_async(max_host_bytes={budget}) cannot stage chunk {list(big.offsets)} of key "
            f"{big.key!r} ({big.nbytes} bytes): a budgeted save stages whole chunks, so the "
            f"budget must hold this process's largest one ({need} bytes with alignment). Pass "
            f"max_host_bytes={need} or more, or save with planner=jaxckpt.DefaultSavePlanner("
            f"max_chunk_bytes={max(budget // 2, 1)}) for smaller chunks. Nothing was written.",
            key=big.key,
            need=need,
        )
    if hash_all_first and total > budget:
        raise CheckpointError(
            f"save_async(max_host_bytes={budget}) with base= on an object store: an incremental "
            f"save there hashes every box this process writes ({total} bytes) before it writes "
            f"one, so the budget must hold them all. Pass max_host_bytes={total} or more, or "
            f"save without base= (or to a local directory, where boxes stream). Nothing was "
            f"written."
        )
    return capacity


def _failed(
    e: BaseException,
    sync: _distributed.SaveSync,
    writer: _storage.Writer,
    arena: _staging.Arena | None,
) -> NoReturn:
    """Staging failed before the background write started: stop the others, remove what
    this save made, and raise."""
    err = sync.failed(e)  # the others stop too; returns once they stopped writing
    writer.abort()
    if arena is not None:
        _staging.POOL.give_back(arena)
    if err is e:
        raise e
    raise err from e
