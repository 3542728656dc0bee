"""CheckpointManager: a directory of numbered checkpoints, saved in the background.

Layout (every step is a plain checkpoint: ``jaxckpt.restore(DIR + "/00000100")`` reads it)::

    DIR/
      00000100/                  step 100: manifest.json + arrays/
      00000200/
      .00000300.tmp-1a2b3c4d/    a save in progress, or one a crash interrupted
      metrics.json               {"format": 1, "steps": {"100": {"loss": 0.31}, ...}}

Step directories are zero-padded to 8 digits, so ``ls`` lists them in order.

Crash safety comes from the commit protocol of ``save`` (a step appears, whole, when it
commits) and from the other modules here: ``run`` lists only committed steps, ``cleanup``
removes what dead saves left (never a live save's), ``retention`` deletes a step by making
it stop being one first and writes metrics after the commit (docs/manager.md, *Crash safety*).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from types import TracebackType
from typing import Any, Literal

from jaxckpt._api.entry import SaveHandle, save_async
from jaxckpt._api.staged import BudgetError, budget_arg
from jaxckpt._errors import CheckpointError, CheckpointNotFoundError
from jaxckpt._format import codecs as _codecs
from jaxckpt._format.iterators import Checkpointable
from jaxckpt._manager import cleanup as _cleanup
from jaxckpt._manager import options as _options
from jaxckpt._manager import retention as _retention
from jaxckpt._manager.ledger import Ledger
from jaxckpt._manager.reading import RunReader
from jaxckpt._manager.retention import json_metrics, referenced
from jaxckpt._manager.run import Run, step_arg
from jaxckpt._manager.schedule import Schedule, check
from jaxckpt._runtime import distributed as _distributed
from jaxckpt._runtime import events as _events
from jaxckpt._runtime import pools
from jaxckpt._runtime import staging as _staging
from jaxckpt._runtime.preemption import PreemptionWatcher
from jaxckpt._storage import directwrite as _directwrite
from jaxckpt._storage import location as _location
from jaxckpt._tiers.tier_choice import RestoredFrom

logger = logging.getLogger("jaxckpt")


class CheckpointManager(RunReader):
    """Saves a training run's state every few steps into ``directory``, keeps the best or the
    newest few, and restores the latest.

    Saves are asynchronous by default: ``save()`` returns once the state is copied to host
    memory, and the write and commit run in the background. At most one save is in flight;
    the next ``save()`` first waits for the previous one to commit (and re-raises its error).

    Args:
      directory: where the steps go (a local directory, created if missing, or a URL).
      max_to_keep: keep this many steps (the newest, or the best with ``best_fn``);
        ``None`` keeps all. The newest committed step is never deleted, so with ``best_fn``
        it is kept on top of the best ones when it is not among them.
      keep_every_n_steps: also keep, forever, for each multiple of this the first step saved
        at or after it (the multiple itself where it was saved: one step per span with
        continuous or time-based saves); those steps do not count toward ``max_to_keep``
        (unlike Orbax's ``keep_period``).
      save_interval_steps: ``save()`` saves the steps that are multiples of this (and those
        ``force=True``, a preemption or ``save_interval_secs`` asks for); or a schedule that
        changes with the step, ``(first step, interval)`` pairs such as ``[(0, 1000),
        (10_000, 5000)]``. Default: 1 (every step) without ``save_interval_secs``, none with
        it.
      async_save: write in the background (default); ``False`` makes ``save()`` block until
        the step is committed.
      best_fn: ``metrics -> float``; with it, ``max_to_keep`` keeps the best steps instead of
        the newest. Steps saved without metrics are kept (see the next argument); NaN and
        infinities rank worst, so the steps of a diverged run go like others. A ``save``
        whose metrics ``best_fn`` cannot score (it raises or gives no number) is refused.
      best_mode: ``"min"`` (lower is better, e.g. a loss) or ``"max"``.
      save_on_preemption: on SIGTERM (or JAX's multi-host preemption notice), the next
        ``save()`` saves its step whatever the interval and waits for the commit;
        ``reached_preemption(step)`` then tells the loop to stop.
      incremental: save each step against the newest committed one: boxes whose bytes did not
        change (frozen weights, their optimizer states) are hard-linked from it (local files)
        or, for arrays unchanged as a whole, referenced (object stores) instead of written.
        Every step stays a whole checkpoint; deleting any step never breaks another
        (docs/manager.md, "Incremental steps").
      io_timeout: seconds each object-store operation of this manager (its saves, restores,
        listings, deletes) may take before it fails with a ``CheckpointError``; ``None``:
        ``$JAXCKPT_IO_TIMEOUT``, else 30 (docs/object_storage.md, *Deadlines*). Local
        directories have no deadline.
      local_directory: turns on the local tier (docs/tiers.md): each process also saves its
        own part of the state to this node-local directory every
        ``local_save_interval_steps`` steps, kept by ``local_replicas`` other processes, and
        ``restore()`` takes the newest step that a tier holds whole. Every process passes one.
      local_save_interval_steps: how often the local tier saves (a multiple of it).
      local_max_to_keep: local steps each process keeps (its replicas of others' included).
      local_replicas: how many other processes keep a copy of each process's local part.
      read_only: a manager that only reads: it lists and restores the steps another process
        saves (each call lists them afresh), and never saves, cleans up or deletes anything,
        so it can run beside the trainer's (an evaluator; docs/manager.md). The directory
        need not exist yet.
      save_interval_secs: also save when at least this many seconds have passed since the
        last save began and the previous save has committed (it never waits for one); ``0``
        is continuous checkpointing: the next save as soon as the last one has committed. On
        several processes process 0 decides for all (docs/manager.md, *When to save*).
      keep_every_n_secs: also keep, forever, the first step committed in each window of
        this many seconds; like ``keep_every_n_steps``, those do not count toward
        ``max_to_keep`` (the rule: ``jaxckpt._manager.retention``).
      keep_checkpoints_without_metrics: with ``best_fn``, keep the steps saved without
        metrics for good (the default, as Orbax and t5x do); ``False`` ranks them last, so
        ``max_to_keep`` deletes them first.
      max_host_bytes: the host memory each save of the directory may stage in at once, in
        bytes, on each process (``jaxckpt.save_async``'s): ``save()`` then blocks until all
        but about this much of the state is written (docs/manager.md, "Asynchronous
        saves"). ``None``: the whole share at once. The local tier's copy is not bounded by
        it (docs/tiers.md).
      compression: ``"zstd"`` or ``"lz4"``: every step in the directory is saved with its
        chunks compressed (``jaxckpt.save``'s); ``None`` (default): raw. The local tier
        stays raw (a local disk reads raw chunks in place). An incremental step compressed
        otherwise than its base rewrites every array.

    Raises:
      ValueError: an argument is out of range (``max_host_bytes`` not a positive int).
      InvalidArgumentError: ``compression`` is not one of the names above.

    Example:
      >>> import jax.numpy as jnp, jaxckpt, tempfile
      >>> with jaxckpt.CheckpointManager(tempfile.mkdtemp(), max_to_keep=2) as mgr:
      ...     for step in range(5):
      ...         _ = mgr.save(step, {"w": jnp.full(3, step)}, metrics={"loss": 1 / (step + 1)})
      ...     mgr.wait()
      ...     mgr.all_steps(), mgr.restore()["w"].tolist()
      ([3, 4], [4, 4, 4])
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        max_to_keep: int | None = None,
        keep_every_n_steps: int | None = None,
        save_interval_steps: int | Sequence[tuple[int, int]] | None = None,
        async_save: bool = True,
        best_fn: Callable[[Mapping[str, Any]], float] | None = None,
        best_mode: Literal["min", "max"] = "min",
        save_on_preemption: bool = False,
        incremental: bool = False,
        io_timeout: float | None = None,
        local_directory: str | os.PathLike[str] | None = None,
        local_save_interval_steps: int = 1,
        local_max_to_keep: int = 2,
        local_replicas: int = 1,
        read_only: bool = False,
        save_interval_secs: float | None = None,
        keep_every_n_secs: float | None = None,
        max_host_bytes: int | None = None,
        keep_checkpoints_without_metrics: bool = True,
        compression: str | None = None,
    ) -> None:
        counts = {"local_save_interval_steps": local_save_interval_steps}
        counts["local_max_to_keep"] = local_max_to_keep
        _options.check_options(best_mode, local_replicas, read_only, local_directory, counts)
        self.directory = os.path.expanduser(os.fspath(directory))  # as Location reads it
        keep = (max_to_keep, keep_every_n_steps, best_fn, best_mode, keep_every_n_secs)
        self.policy = _options.policy(*keep, keep_without_metrics=keep_checkpoints_without_metrics)
        self.save_interval_steps = check(save_interval_steps, save_interval_secs)
        self._schedule = Schedule(self.save_interval_steps, save_interval_secs, self.directory)
        self.async_save = async_save
        self.max_host_bytes = budget_arg(max_host_bytes)
        self.compression = _codecs.check_arg(compression, "CheckpointManager")
        self.last_save: SaveHandle | None = None
        self.io_timeout = _options.timeout_arg(io_timeout)
        with _location.deadline(io_timeout):
            self._loc = _location.Location(self.directory)
        self._run = Run(self._loc, self.directory)
        self._run.refuse_checkpoint()
        self._metrics = self._run.metrics
        self._primary = _distributed.process_index() == 0
        self._pending: Future[None] | None = None  # the commit of the save in flight
        self._retiring: Future[None] | None = None  # the retention after the last commit
        self._error: BaseException | None = None
        self._closed = False
        self.read_only, self.incremental = read_only, incremental
        listed = None  # the committed steps, where the clean-up listed them
        if not read_only:
            self._run.make()
            if self._primary:
                listed = self._clean_up()
        self._watcher = PreemptionWatcher() if save_on_preemption else None
        self.restored_from: RestoredFrom | None = None  # set by restore()
        self._local = _options.local_tier(
            local_directory, self._loc, local_save_interval_steps, local_max_to_keep, local_replicas
        )
        self._ledger = Ledger(self._run, self._local, read_only=read_only, listed=listed)

    # -- saving ---------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        tree: Any,
        *,
        metrics: Mapping[str, Any] | None = None,
        force: bool = False,
        iterators: Mapping[str, Checkpointable] | None = None,
    ) -> bool:
        """Save ``tree`` as ``step`` if the step is due; call it at every step.

        Args:
          step: the training step (a non-negative int), the name of the checkpoint.
          tree: the state, as for :func:`jaxckpt.save`. Its buffers may be donated or
            overwritten as soon as this returns.
          metrics: JSON-able numbers for this step (e.g. ``{"loss": 0.3}``, jax/numpy scalars
            allowed), stored in ``metrics.json`` and used by ``best_fn``.
          force: save even if ``step`` is not due (a step already saved is never replaced,
            ``force`` or not).
          iterators: data iterators by name (Grain's, or any with ``get_state()`` and
            ``set_state()``) whose positions go into the step, each process its own, as they
            are during the call; ``restore(..., iterators=)`` sets them back.

        Returns:
          Whether a save was started, in either tier (committed when ``wait()`` returns).

        Raises:
          CheckpointExistsError: ``step`` is already saved in the directory (also with
            ``force=True``).
          UnsupportedLeafError: a metric is not a JSON-able number or string.
          InvalidArgumentError: ``best_fn`` cannot score ``metrics`` (it raises, or gives no
            number); nothing is saved.
          CheckpointError: the previous save failed (its error, raised once), or the manager
            is closed.
        """
        self._check_open()
        start = time.perf_counter()
        step = step_arg(step, "save(step, tree)")
        preempted = self.reached_preemption(step)
        tier = self._local if self._local is not None and step % self._local.interval == 0 else None
        due = force or preempted or self._schedule.due(step, self._in_flight)
        if not (due or tier is not None):
            return False
        try:
            record = json_metrics(step, metrics)
            if record is not None:
                self.policy.check(step, record)  # fail here, not in the background
            self._wait_persistent()
            restored = None if self.restored_from is None else self.restored_from.step
            steps = self._ledger.check_new(step, self.directory, restored)
            self._ledger.begin(step)
            if tier is not None:  # before the persistent save: the faster copy is staged first
                tier.save(step, tree, iterators)
        except BaseException as e:
            if due:  # the others wait at this save's first step: they hear why, not a timeout
                _distributed.SaveSync(str(self._run.path(step))).failed(e)
            raise
        if due:
            self._start(step, tree, record, iterators, preempted, steps)
        self._record(_events.MANAGER_DURATIONS["save"], start)
        return True

    def _start(
        self,
        step: int,
        tree: Any,
        record: dict[str, Any] | None,
        iterators: Mapping[str, Checkpointable] | None,
        preempted: bool,
        steps: list[int],
    ) -> None:
        """Save ``step`` to the directory (``steps``: the committed steps, listed now): staged
        here, committed in the background (here with ``async_save=False`` or at a
        preemption)."""
        loc = self._run.path(step)
        base = str(self._run.path(max(steps))) if self.incremental and steps else None
        began = self._schedule.clock()

        def start(base: str | None) -> SaveHandle:
            with _location.deadline(self._loc.io_timeout):
                return save_async(
                    str(loc),
                    tree,
                    base=base,
                    digests=self.incremental,
                    iterators=iterators,
                    max_host_bytes=self.max_host_bytes,
                    compression=self.compression,
                )

        try:
            try:  # the base's manifest is read beside the save's first requests
                handle = start(base)
            except CheckpointNotFoundError:
                if base is None:
                    raise
                # Object stores know older steps from the ledger: one deleted by hand is
                # listed out, its marker dropped from the run's index, and the save made again.
                listed = self._run.steps()
                steps = self._run.held(listed, primary=self._primary)
                self._ledger.forget(sorted(set(listed) - set(steps)))
                handle = start(str(self._run.path(max(steps))) if steps else None)
        except BaseException as e:
            self._ledger.failed(step, local_saved=self._local_saves(step))
            if isinstance(e, BudgetError):  # save_async's advice names its own arguments
                raise CheckpointError(
                    f"CheckpointManager(max_host_bytes={self.max_host_bytes}) cannot save step "
                    f"{step}: a chunk of key {e.key!r} needs {e.need} bytes of host memory at "
                    f"once, and a budgeted save stages whole chunks. Make the manager with "
                    f"max_host_bytes={e.need} or more (or None). Nothing was written."
                ) from e
            raise
        self._schedule.began(began, step)
        self.last_save = handle
        if preempted:
            logger.warning("preemption: saving step %d to %s before exiting", step, loc)
        if self.async_save and not preempted:
            # On the save threads: at exit Python waits for it, so the last step is committed.
            self._pending = pools.in_background(self._finish, step, handle, record)
        elif preempted:  # the job exits next: all of it lands first
            self._finish(step, handle, record)
            self.wait()
        else:  # committed on return; retention stays off its path (the readers wait for it)
            self._finish(step, handle, record)
            self._wait_persistent()
            if self._local is not None:
                self._local.wait()

    def _in_flight(self) -> bool:
        return self._pending is not None and not self._pending.done()

    def _finish(self, step: int, handle: SaveHandle, record: dict[str, Any] | None) -> None:
        """After the commit: log, write metrics and apply retention (the primary process)."""
        try:
            handle.wait()
        except BaseException as e:  # re-raised by the next save() or wait()
            self._error = self._run.explain(step, handle.path, e)
            self._ledger.failed(step, local_saved=self._local_saves(step))
            return
        t = handle.timings
        logger.info(
            "step %d committed: %.1f MB, %.2f GB/s (blocked %.3f s, total %.3f s: plan %.3f s, "
            "stage %.3f s, write %.3f s, commit %.3f s, waiting for other processes %.3f s)",
            step,
            handle.nbytes / 1e6,
            handle.gbps,
            *(t.get(k, 0) for k in ("blocking", "total", "plan", "stage", "write", "commit")),
            t.get("wait", 0),
        )
        self._ledger.committed(step)
        if not self._primary:
            return
        # Off the next save's path: save() waits for the commit only; wait() and close()
        # wait for this too. One retention at a time, in the order of the commits.
        before, self._retiring = self._retiring, None
        timings, at = step_timings(handle), _retention.now()  # committed at
        self._retiring = pools.in_background(self._retire, step, record, timings, before, at)

    def _retire(
        self,
        step: int,
        record: dict[str, Any] | None,
        timings: dict[str, Any],
        before: Future[None] | None,
        at: float,
    ) -> None:
        """(primary, in the background) Metrics and retention after ``step``'s commit (at
        ``at``, seconds since the epoch)."""
        if before is not None:
            before.result()  # never raises: see below
        try:
            steps = self._ledger.index(step)  # marks the step; what the index holds
            deleted = _retention.after_commit(
                self._loc, self.policy, self._metrics, step, record, steps, timings, at
            )
            self._ledger.forget(deleted)
            if deleted and self._loc.local is None and self.incremental:
                self._clean_up()  # arrays kept for a step deleted now may be referenced no more
        except Exception:  # the step is committed; a failed cleanup must not stop training
            logger.warning(
                "retention after step %d in %s failed", step, self.directory, exc_info=True
            )

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed and old steps are deleted (and
        what commits left to the background, such as a replaced checkpoint, is gone).

        Raises:
          CheckpointError: the save failed; raised once, the next ``save()`` goes ahead.
        """
        start = time.perf_counter()
        try:
            self._wait_persistent()
        finally:
            self._wait_retiring()
            if self._local is not None:
                self._local.wait()
            pools.settle()
        self._record(_events.MANAGER_DURATIONS["wait"], start)

    def delete(self, step: int) -> None:
        """Delete ``step`` from every tier, with its metrics (and what only it kept: arrays,
        markers, old generations on object stores). With a local tier every process calls
        it (each deletes its disk's parts of the step); otherwise the primary process
        deletes and every process may call it.

        A deleted step stops being one at once (renamed away, or its manifest deleted first);
        on object stores the arrays other steps reference stay until they go too. To go back
        to an older step, :meth:`rollback` deletes every newer one in one call.

        Raises:
          CheckpointNotFoundError: no tier holds ``step`` (names the steps there are).
          CheckpointError: the manager is read-only or closed.
        """
        self._check_open()
        step = step_arg(step, "delete(step)")
        self._wait_persistent()
        self._wait_retiring()  # no two deletes of one step at once
        self._ledger.delete(step, primary=self._primary, clean_up=self._clean_up)

    def rollback(self, step: int) -> list[int]:
        """Go back to ``step``: delete every step after it from every tier (persistent and
        local, with their metrics), so the run goes on from ``step`` and a restart restores
        the new branch, never the abandoned one. With a local tier every process calls it.

        ``save()`` refuses a step older than one already saved and names this call; a loop
        restores ``step``, calls ``rollback(step)`` and trains on (docs/manager.md, *Going
        back to an older step*).

        Args:
          step: the step to go on from (a non-negative int; it need not be saved).

        Returns:
          The steps deleted, ascending.

        Raises:
          CheckpointError: the manager is read-only or closed.
        """
        self._check_open()
        step = step_arg(step, "rollback(step)")
        self._wait_persistent()
        self._wait_retiring()
        return self._ledger.rollback(step, primary=self._primary, clean_up=self._clean_up)

    def pin(self, step: int) -> None:
        """Keep the committed ``step`` whatever the retention policy (t5x's pinned
        checkpoints, Orbax's preservation of chosen steps); ``unpin`` gives it back to the
        policy. Stored with the run (``metrics.json``), listed by ``pinned_steps()`` and by
        ``jaxckpt ls``. ``delete`` and ``rollback`` still delete a pinned step.

        Raises:
          CheckpointNotFoundError: ``step`` is not a committed step of the directory (a step
            only the local tier holds: its message says why it cannot be pinned).
          CheckpointError: the manager is read-only or closed.
        """
        self._check_open()
        step = step_arg(step, "pin(step)")
        self._wait_persistent()
        self._wait_retiring()  # it writes metrics.json too
        self._ledger.require_persistent(step, "pin")
        if self._primary:
            self._run.pin(step, True)

    def unpin(self, step: int) -> None:
        """Give a pinned ``step`` back to the retention policy (nothing if it is not pinned);
        it goes at the next save that the policy deletes it at."""
        self._check_open()
        step = step_arg(step, "unpin(step)")
        self._wait_persistent()
        self._wait_retiring()  # it writes metrics.json too
        if self._primary:
            self._run.pin(step, False)

    def _wait_persistent(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()
        error, self._error = self._error, None
        if error is not None:
            raise error

    def reached_preemption(self, step: int) -> bool:
        """Whether a preemption notice asks to save at ``step`` and stop (``save_on_preemption``).

        Args:
          step: the current training step; every process must ask at every step.

        Returns:
          ``False`` unless ``save_on_preemption=True`` and a notice has arrived (multi-host:
          once every host has reached the step JAX agreed on).
        """
        return self._watcher is not None and self._watcher.reached(step)

    def should_save(self, step: int) -> bool:
        """Whether ``save(step, ...)`` would save now, in either tier: ``False`` on a
        read-only manager and for a step at or below the newest one saved in any tier (as
        Orbax answers: a loop resumed after ``restore()`` skips the steps already saved);
        else whether it is due: a multiple of ``save_interval_steps`` or of
        ``local_save_interval_steps``, due by ``save_interval_secs`` (the answer is kept, so
        the ``save(step)`` that follows agrees), or asked for by a preemption notice. It reads
        no storage; on several processes, every process must ask at the same steps."""
        step = step_arg(step, "should_save(step)")
        if self._closed or not self._ledger.may_save(step):
            return False
        if self._local is not None and step % self._local.interval == 0:
            return True
        return self._schedule.due(step, self._in_flight) or self.reached_preemption(step)

    def _local_saves(self, step: int) -> bool:
        return self._local is not None and step % self._local.interval == 0

    # -- life cycle -----------------------------------------------------------------------------

    def close(self) -> None:
        """Wait for the save in flight, then release signal handlers and staging memory.

        Raises:
          CheckpointError: the last save failed.
        """
        if self._closed:
            return
        self._closed = True
        try:
            self.wait()
        finally:
            if self._watcher is not None:
                self._watcher.close()
            _staging.POOL.clear()
            _directwrite.clear()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except Exception:  # do not hide the error already on its way out
            logger.error("while closing %s after an error", self.directory, exc_info=True)

    def _clean_up(self) -> list[int] | None:
        """Remove what dead saves left (``opening``: when the manager opens); the committed
        steps, if listed. Incremental steps on object stores: from the whole run (what only a
        deleted or crashed step held in older steps)."""
        return _cleanup.clean_up(
            self._loc, lambda n: referenced(self._loc, n), whole=self.incremental
        )

    def _check_open(self) -> None:
        if self.read_only:
            raise CheckpointError(
                f"This CheckpointManager of {self.directory} is read-only (read_only=True): it "
                f"lists and restores steps, and never saves or deletes. Save from a manager "
                f"made without read_only=True (the trainer's)."
            )
        if self._closed:
            raise CheckpointError(
                f"The CheckpointManager of {self.directory} is closed; create a new one to save."
            )


def step_timings(handle: SaveHandle) -> dict[str, Any]:
    """What ``metrics.json`` keeps of a committed step's save: its phases, blocking and total
    seconds, the bytes every process wrote and this one reused, the slowest processes."""
    out: dict[str, Any] = {k: round(v, 6) for k, v in handle.timings.items()}
    wrote = [p.get("bytes", 0.0) for p in handle.processes.values()]
    out["bytes_written"] = int(sum(wrote)) if wrote else handle.nbytes
    out["bytes_reused"] = handle.reused_bytes
    if handle.slowest:
        out["slowest"] = handle.slowest
    return out
