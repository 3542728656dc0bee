"""When a ``CheckpointManager`` saves: at step multiples, by time, or continuously.

``save(step)`` saves when any of these holds (docs/manager.md, *When to save*):

1. ``force=True``, or a preemption notice asks for the step (the manager checks these);
2. the step is a multiple of ``save_interval_steps`` (or, for a schedule that changes with the
   step such as ``[(0, 1000), (10_000, 5000)]``, of the interval of the last entry whose start
   is at or below the step: every 1,000 steps until 10,000, then every 5,000, as Levanter's
   step policies and Orbax's ``save_decision_policy`` let users say);
3. ``save_interval_secs=S`` is set, no save is in flight (the previous one has committed), and
   at least S seconds have passed since the last save began (any save; the clock starts when
   the manager is made). ``S=0`` is continuous checkpointing: a new save as soon as the last
   one has committed, never two in flight, and the loop never waits for one.

1 and 2 are the same on every process. 3 depends on a clock and on when a background commit
ended, which differ from process to process, so process 0 decides and every other process
takes its answer: one key in the key-value store of ``jax.distributed`` per ``save()`` call
that 1 and 2 do not already settle (none on a single process, none without ``S``). The
answer for a step is kept, so ``should_save(step)`` and ``save(step)`` agree. Once a save has
begun on every process (its plan agreed, so every process has read every answer before it),
process 0 deletes the answers: the store holds at most the answers since the last save.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections.abc import Callable
from typing import Any

from jaxckpt._errors import DistributedError, InvalidArgumentError
from jaxckpt._runtime import distributed as _distributed

PREFIX = "jaxckpt/schedule"
_lock = threading.Lock()
_answers = itertools.count()  # every process asks in the same order, as it saves
_round = 0  # bumped at every save on every process: the folder of the answers since
_posted = False  # (process 0) answers were posted in this round


class Schedule:
    """The save schedule of one manager (see the module's docstring)."""

    def __init__(self, every_steps: Steps | None, every_secs: float | None) -> None:
        self.every_steps, self.every_secs = every_steps, every_secs
        self.clock: Callable[[], float] = time.monotonic  # seconds; tests set another
        self.last_start = self.clock()  # the clock starts with the manager
        self._asked: tuple[int, bool] | None = None  # (step, answer) not saved yet

    def due(self, step: int, in_flight: Callable[[], bool]) -> bool:
        """Whether ``step`` is due by rule 2 or 3 (``in_flight``: whether a save of this
        manager is still running, asked on process 0 only). Every process must ask at the
        same steps."""
        if self._asked is not None and self._asked[0] == step:
            return self._asked[1]
        every = interval_at(self.every_steps, step)
        if every is not None and step % every == 0:
            answer = True
        elif self.every_secs is None:
            answer = False
        else:
            secs = self.every_secs
            answer = agree(step, lambda: not in_flight() and self.clock() - self.last_start >= secs)
        self._asked = (step, answer)
        return answer

    def began(self, at: float) -> None:
        """A save that began at ``at`` (by ``clock``) has started on every process, whatever
        its reason: the clock restarts from ``at``, and the answers read so far are deleted."""
        global _round, _posted
        self.last_start, self._asked = at, None
        with _lock:
            done, _round, posted, _posted = _round, _round + 1, _posted, False
        if posted:
            _distributed.kv_client().key_value_delete(f"{PREFIX}/{done}")


def agree(step: int, decide: Callable[[], bool]) -> bool:
    """``decide()`` on process 0, its answer on every process.

    Raises:
      DistributedError: process 0 did not answer within ``JAXCKPT_SYNC_TIMEOUT``.
    """
    global _posted
    if _distributed.process_count() == 1:
        return decide()
    with _lock:
        key = f"{PREFIX}/{_round}/{next(_answers)}"
    kv = _distributed.kv_client()
    if _distributed.process_index() == 0:
        answer = decide()
        kv.key_value_set(key, "1" if answer else "0")
        _posted = True
        return answer
    timeout = _distributed.sync_timeout()
    try:
        return kv.blocking_key_value_get(key, max(1, int(timeout * 1000))) == "1"
    except Exception as e:  # noqa: BLE001 - the client raises one runtime error type
        raise DistributedError(
            f"Process 0 did not say within {timeout:g} s whether to save step {step} "
            f"(save_interval_secs: process 0 decides for all). It crashed or hangs, or the "
            f"processes do not call save()/should_save() at the same steps; raise "
            f"JAXCKPT_SYNC_TIMEOUT=SECONDS if process 0 is just slower to get there."
        ) from e


Steps = int | tuple[tuple[int, int], ...]  # an interval, or (first step, interval) pairs


def interval_at(every: Steps | None, step: int) -> int | None:
    """The step interval in force at ``step``: ``every``, or the interval of the last pair
    whose first step is at or below ``step`` (``None`` before the first).

    Example:
      >>> [interval_at(((0, 1000), (10_000, 5000)), s) for s in (0, 9999, 10_000, 20_000)]
      [1000, 1000, 5000, 5000]
    """
    if every is None or isinstance(every, int):
        return every
    found = None
    for start, n in every:
        if start <= step:
            found = n
    return found


def check(save_interval_steps: Any, save_interval_secs: float | None) -> Steps | None:
    """The step interval in effect: ``save_interval_steps`` (a positive int, or pairs
    ``(first step, interval)`` in increasing order), or by default (``None``) 1 without
    ``save_interval_secs`` and none with it.

    Raises:
      ValueError: ``save_interval_steps`` is not one of those, or ``save_interval_secs`` is
        not a number of seconds >= 0.
    """
    secs = save_interval_secs
    if secs is not None and (
        isinstance(secs, bool)
        or not isinstance(secs, (int, float))
        or not (math.isfinite(secs) and secs >= 0)
    ):
        raise InvalidArgumentError(
            f"save_interval_secs must be a number of seconds >= 0 (0: continuous "
            f"checkpointing) or None, got {secs!r}"
        )
    if save_interval_steps is None:
        return 1 if secs is None else None
    return _steps_arg(save_interval_steps)


def _steps_arg(every: Any) -> Steps:
    def count(x: Any, least: int) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and x >= least

    if count(every, 1):
        return int(every)
    try:
        pairs = tuple((int(a), int(b)) for a, b in every if count(a, 0) and count(b, 1))
        ok = len(pairs) == len(every) > 0 and all(x[0] < y[0] for x, y in zip(pairs, pairs[1:]))
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise InvalidArgumentError(
            f"save_interval_steps must be a positive int, or (first step, interval) pairs in "
            f"increasing order such as [(0, 1000), (10_000, 5000)] (every 1,000 steps, from "
            f"step 10,000 every 5,000); got {every!r}"
        )
    return pairs
