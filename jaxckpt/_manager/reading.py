"""The read side of a ``CheckpointManager``: listing steps, their metrics and metadata, restoring.

A ``read_only=True`` manager (an evaluator beside the trainer) uses only these. Every listing
reads the directory afresh (``jaxckpt._manager.run``), so steps another process commits show
up at once; with a local tier, the processes agree on what it holds (``jaxckpt._tiers.local_tier``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from jaxckpt._api.restoring import metadata
from jaxckpt._errors import InvalidArgumentError
from jaxckpt._format.iterators import Checkpointable
from jaxckpt._manager.ledger import Ledger
from jaxckpt._manager.retention import MetricsFile, Policy
from jaxckpt._manager.run import Run, step_arg
from jaxckpt._planning.abstract import CheckpointMetadata
from jaxckpt._planning.load_planner import LoadPlanner
from jaxckpt._runtime import events as _events
from jaxckpt._tiers.local_tier import LocalTier
from jaxckpt._tiers.tier_choice import RestoredFrom


class RunReader:
    """What every ``CheckpointManager`` can do, read-only or not (see ``CheckpointManager``)."""

    _run: Run
    _metrics: MetricsFile
    _local: LocalTier | None
    _ledger: Ledger
    _pending: Any
    policy: Policy
    restored_from: RestoredFrom | None
    _retiring: Any = None  # the retention after the last commit (a saving manager's primary)
    _primary: bool = False  # this is process 0 (CheckpointManager sets both)
    read_only: bool = True

    def _wait_retiring(self) -> None:
        """Wait for the retention after the last commit (it writes metrics.json, deletes), so
        that what this manager reports follows its own saves (a reader has none)."""
        retiring, self._retiring = self._retiring, None
        if retiring is not None:
            retiring.result()  # never raises: _retire logs its errors

    def all_steps(self, tier: Literal["local", "persistent"] | None = None) -> list[int]:
        """The committed steps, in ascending order (saves in flight are not listed yet).

        Args:
          tier: ``"persistent"``: the steps in ``directory``. ``"local"``: the local steps
            whose own part this process holds (it asks no other process). ``None``: the
            persistent steps, and with a local tier also the local steps some tier holds
            whole, agreed by all processes (then every process must call it, as ``save``).
        """
        if tier not in (None, "local", "persistent"):
            raise InvalidArgumentError(f"tier must be 'local', 'persistent' or None, got {tier!r}")
        self._wait_retiring()
        return self._ledger.steps(tier)

    def latest_step(self, tier: Literal["local", "persistent"] | None = None) -> int | None:
        """The newest committed step (of ``tier``, as for ``all_steps``), or ``None``."""
        return max(self.all_steps(tier), default=None)

    def metrics(self, step: int) -> dict[str, Any] | None:
        """The metrics saved with ``step`` (``None`` if none were)."""
        self._wait_retiring()
        return self._metrics.read().get(str(step_arg(step, "metrics(step)")))

    def best_step(self) -> int | None:
        """The best committed step by ``best_fn`` (NaN and infinite metrics rank below every
        finite one, steps without metrics last; ties go to the newer step); the latest step
        without ``best_fn``; ``None`` if there is none."""
        self._wait_retiring()
        steps = self._run.steps()
        if self.policy.best_fn is None or not steps:
            return max(steps, default=None)
        metrics = self._metrics.read()
        scores = {s: self.policy.score(metrics.get(str(s))) for s in steps}
        return max(steps, key=lambda s: (scores[s] is not None, scores[s] or 0.0, s))

    def pinned_steps(self) -> list[int]:
        """The steps ``pin()`` keeps from retention, ascending."""
        self._wait_retiring()
        return self._metrics.pinned()

    def _record(self, name: str, start: float) -> None:
        """The event ``name``: the seconds since ``start`` (``time.perf_counter``)."""
        if _events.listening():
            secs = time.perf_counter() - start
            _events.record_duration(name, secs, store=_events.store_kind(self._run.loc))

    def reload(self) -> None:
        """See the steps committed since by other processes or by hand. Every listing reads
        the directory afresh, so on a local directory this does nothing (it exists for code
        written for Orbax). On an object store a manager finds its steps from the run's index
        (docs/manager.md, *Steps on object stores*): a step saved by hand with a plain
        ``jaxckpt.save`` below the newest indexed step is not in it. On process 0 of a
        manager that saves, ``reload()`` lists the run whole once (O(objects of the run)) and
        indexes such steps; other processes and read-only managers see them once it has.

        On a manager that saves, a step saved by hand after its newest one then counts as
        its newest: ``should_save`` answers ``False`` up to it, as ``save`` refuses those
        steps. That costs every process one listing of the steps, as ``all_steps``: the
        steps after the newest are listed alike everywhere, so no process asks another."""
        self._wait_retiring()
        if self.read_only:
            return
        if self._primary:
            self._run.rescan()
        self._ledger.reload()

    def metadata(self, step: int) -> CheckpointMetadata:
        """The manifest of ``step`` (``.abstract()`` for a restore target); no array data read.

        Raises:
          CheckpointNotFoundError: ``step`` is not committed.
        """
        step = step_arg(step, "metadata(step)")
        self._run.require(step, "Pick one of all_steps().")
        return metadata(str(self._run.path(step)))

    def restore(
        self,
        step: int | None = None,
        target: Any = None,
        *,
        keys: str | Sequence[str] | None = None,
        strict: bool = True,
        planner: LoadPlanner | None = None,
        iterators: Mapping[str, Checkpointable] | None = None,
    ) -> Any:
        """Restore ``step`` (default: the latest committed one); waits for a save in flight.

        Args:
          step: the step to restore; ``None`` for the latest.
          target, keys, strict, planner: as for :func:`jaxckpt.restore`.
          iterators: data iterators saved with the step (``save(..., iterators=)``), by
            name: each is set to the position this process saved (docs/manager.md,
            *Resuming exactly*).

        With a local tier (``local_directory``), every process must call it: the processes
        agree on the newest step that some tier holds whole (a local step wins over an equally
        new persistent one) and fetch missing local parts from their replicas; a local step
        saved by another process count or for another mesh is resharded, each box read once
        from a process that holds it. The local tier is used with a ``target`` whose arrays
        carry shardings (``jax.Array``, ``ShapeDtypeStruct`` with a sharding, or a bare
        ``Sharding``) and without ``keys``/``planner``. ``restored_from`` then says which tier
        and step (also logged).

        Returns:
          The restored tree.

        Raises:
          CheckpointNotFoundError: no committed step (or not ``step``) in the directory (or,
            with a local tier, whole in any tier).
        """
        start = time.perf_counter()
        if step is not None:
            step = step_arg(step, "restore(step, target)")
        if self._pending is not None:
            self._pending.result()  # its error, if any, is raised by the next save() or wait()
        tree, self.restored_from = self._ledger.restore(
            step, target, keys=keys, strict=strict, planner=planner, iterators=iterators
        )
        self._record(_events.MANAGER_DURATIONS["restore"], start)
        return tree
