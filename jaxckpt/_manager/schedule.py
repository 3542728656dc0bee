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
takes its answer, but only at the steps every process knows alike to ask at: each answer
carries the next step to ask at (process 0's estimate, from the seconds its own steps take,
of the step at which the interval will have passed: on a save's due step it asks again, one
step later if it was early, so a save is at most one step late; while a save is in flight,
after a quarter of the steps it has taken so far). So a step that is not asked costs no
key-value operation, and a save by time costs about two agreements
(``jaxckpt._runtime.agreement``, under the directory's scope: no key is left behind, and no
count kept by each process can fall out of step). None on a single process. The answer for a
step is kept, so ``should_save(step)`` and ``save(step)`` agree; at an asked step both are
collective (every process must ask at the same steps, as they must save).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from typing import Any

from jaxckpt._errors import InvalidArgumentError
from jaxckpt._runtime import agreement as _agreement
from jaxckpt._runtime import distributed as _distributed


class Schedule:
    """The save schedule of one manager (see the module's docstring).

    Args:
      every_steps: the step interval (rule 2), or ``None``.
      every_secs: ``save_interval_secs`` (rule 3), or ``None``.
      scope: what every process derives alike for this manager (its directory).
    """

    def __init__(
        self, every_steps: Steps | None, every_secs: float | None, scope: str = ""
    ) -> None:
        self.every_steps, self.every_secs = every_steps, every_secs
        self.scope = _agreement.scope_of("schedule", scope)
        self.clock: Callable[[], float] = time.monotonic  # seconds; tests set another
        self.last_start = self.clock()  # the clock starts with the manager
        self._asked: tuple[int, bool] | None = None  # (step, answer) not saved yet
        self.next_ask: int | None = None  # agreed: no process asks before this step
        self.saved_at: int | None = None  # the step of the last save begun (on every process)
        self._seen: tuple[int, float] | None = None  # (step, clock) of the last due()
        self.step_secs: float | None = None  # seconds per step here (process 0's counts)

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
            answer = self._timed(step, in_flight)
        self._asked = (step, answer)
        return answer

    def began(self, at: float, step: int | None = None) -> None:
        """A save of ``step`` that began at ``at`` (by ``clock``) has started on every
        process, whatever its reason: the clock restarts from ``at``."""
        self.last_start, self._asked = at, None
        self.saved_at = step if step is not None else self.saved_at

    def _timed(self, step: int, in_flight: Callable[[], bool]) -> bool:
        """Rule 3: decided by process 0 at the agreed steps, ``False`` (by all) between them."""
        self._observe(step)
        if self.next_ask is not None and step < self.next_ask:
            return False
        if _distributed.process_count() == 1:
            return self._decide(step, in_flight)[0]
        verdict = _agreement.decide(
            "due",
            "",
            lambda _: json.dumps(self._decide(step, in_flight)),
            scope=self.scope,
            call=f"CheckpointManager.save({step})",
        )
        answer, self.next_ask = json.loads(verdict)
        return bool(answer)

    def _decide(self, step: int, in_flight: Callable[[], bool]) -> tuple[bool, int]:
        """(process 0) Whether ``step`` is due, and the next step to ask at."""
        secs = float(self.every_secs or 0.0)
        if in_flight():  # ask again after a quarter of the steps the save has taken so far
            return False, step + max(1, (step - (self.saved_at or step)) // 4)
        left = secs - (self.clock() - self.last_start)
        due = left <= 0
        left = secs if due else left
        per = self.step_secs
        ahead = 1 if per is None or per <= 0 else max(1, math.floor(left / per))
        return due, step + ahead

    def _observe(self, step: int) -> None:
        """The seconds a step takes here, smoothed over the last few."""
        now = self.clock()
        if self._seen is not None and step > self._seen[0]:
            per = (now - self._seen[1]) / (step - self._seen[0])
            self.step_secs = per if self.step_secs is None else 0.7 * self.step_secs + 0.3 * per
        self._seen = (step, now)


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
