"""The local tier of a ``CheckpointManager``: frequent saves to node-local disks, kept by peers.

Each process writes only what its own devices hold (its part, see ``local_part``) to its own
local directory, and the parts of ``local_replicas`` other processes (the next ones in process
order) reach it over JAX's distributed runtime (``jaxckpt._runtime.replication``)::

    LOCAL_DIR/jaxckpt-<run>/
      run.json                       {"format": 1, "run": ..., "persistent": DIR}
      p<P>/                          what process P holds
        00000012/
          part-P-of-N/               its own part: a single-process checkpoint
          part-Q-of-N/               a replica of process Q's part (Q = P - 1, ...)
          .part-Q-of-N.tmp-1a2b3c4d  a save or a transfer in progress (cleaned up at start)

``<run>`` is the id stored in the persistent directory (``DIR/local-tier.json``, made by the
first manager on it), so a local directory of another run (or of an earlier run into a
persistent directory since deleted) is never used and never deleted; neither is anything in
``LOCAL_DIR`` that does not match these names.

Every save has its own id (the manager's, made by process 0, and the save's number), so a step
saved again (after a rollback, or by a restart) replaces its parts and their replicas. A local
step counts as complete only when every part of the process count that saved it, or a replica
of it, is committed on some process's disk (in any process directory of the run there), all
from the step's newest save (an older save of a step is never used); that is decided once, at
the restore, by process 0 from what every process reports through the key-value store
(:func:`choose`), never by a shared file system. A step cut for the target's layout is rebuilt
part by part; any other is resharded (``elastic_restore``). Retention keeps the newest
``local_max_to_keep`` step directories of each process, replicas included.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from jaxckpt._api.restoring import metadata, restore
from jaxckpt._errors import CheckpointError, CheckpointNotFoundError
from jaxckpt._format import iterators as _iterators
from jaxckpt._format.names import staging_name, step_name
from jaxckpt._runtime import agreement as _agreement
from jaxckpt._runtime import distributed as _distributed
from jaxckpt._runtime import pools
from jaxckpt._runtime import replication as _replication
from jaxckpt._storage import catalog as _catalog
from jaxckpt._storage import location as _location
from jaxckpt._tiers import elastic_restore as _elastic
from jaxckpt._tiers import local_part as _part
from jaxckpt._tiers.elastic_moves import Stats
from jaxckpt._tiers.local_disk import Held, LocalDisk
from jaxckpt._tiers.local_run import MARKER, run_id, write_marker
from jaxckpt._tiers.tier_choice import RestoredFrom, choose

logger = logging.getLogger("jaxckpt")


class LocalTier:
    """The local tier of one manager on this process (see the module's docstring).

    Made on every process at once (it agrees on the run with the others).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        persistent: _location.Location,
        *,
        interval: int,
        max_to_keep: int,
        replicas: int,
    ) -> None:
        self.process = _distributed.process_index()
        self.count = _distributed.process_count()
        self.persistent = persistent
        self.interval, self.max_to_keep = interval, max_to_keep
        self.replicas = min(replicas, self.count - 1)
        primary = ""
        if self.process == 0:
            manager = f"{time.time_ns():016x}-{uuid.uuid4().hex[:8]}"  # later ones sort later
            primary = json.dumps([run_id(persistent), manager])
        self.scope = _agreement.scope_of("tier", str(persistent))  # alike on every process
        agreed = _agreement.decide("run", primary, lambda v: v[0], scope=self.scope)
        self.run, self.manager = json.loads(agreed)
        self.root = Path(os.path.expanduser(os.fspath(directory))) / f"jaxckpt-{self.run}"
        self.mine = self.root / f"p{self.process}"
        self.mine.mkdir(parents=True, exist_ok=True)
        self.disk = LocalDisk(self.root, self.mine)
        write_marker(self.root / MARKER, self.run, str(persistent))
        self.disk.clean_up()
        self._pending: Future[None] | None = None
        self._error: BaseException | None = None
        self._restores = 0
        self._attempt = (-1, -1)  # (step, attempt) of the last local save
        self._held: dict[Held, tuple[str, Path]] = {}  # as the last agreement found them
        self.last_elastic: Stats | None = None  # what the last elastic restore did
        self.agreed_steps: list[int] = []  # every step whole in a tier, as the last restore saw
        self.whole: set[int] = set()  # the local steps whole somewhere, as the last agreement saw
        self._lock = threading.Lock()

    # -- saving ---------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        tree: Any,
        iterators: Mapping[str, _iterators.Checkpointable] | None = None,
    ) -> None:
        """Copy this process's part of ``tree`` off its buffers (and take the ``iterators``'
        states), then write and replicate it in the background (one local save in flight)."""
        self.wait()
        # This save's id, from what every process knows alike (the manager, the step, how
        # often this step was saved before: a retry), never a count of saves that a process
        # failing here would stop in step with the others. Later saves of a step sort later.
        attempt = self._attempt[1] + 1 if self._attempt[0] == step else 0
        self._attempt = (step, attempt)
        save = f"{self.manager}-{step:012d}-{attempt:04d}"
        prefix = f"{_replication.PREFIX}/s{save}"
        try:
            records = _iterators.capture(iterators)
            snap = _part.snapshot(
                tree, step=step, save=save, process=self.process, count=self.count, records=records
            )
        except BaseException as e:  # the peers waiting for this part hear why at once
            error = f"{type(e).__name__}: {e}"
            self._pending = pools.in_background(self._replicate, step, None, error, prefix)
            raise
        self._pending = pools.in_background(self._finish, step, snap, prefix)

    def _finish(self, step: int, snap: _part.Snapshot, prefix: str) -> None:
        t0 = time.perf_counter()
        error, own = "", None
        try:
            own = self._write_own(step, snap)
        except Exception as e:  # raised by the next save(), once; the peers hear why
            error = f"{type(e).__name__}: {e}"
            self._error = CheckpointError(
                f"Saving local step {step} to {self.mine} failed: {error}. The other tiers and "
                f"the local steps already saved are intact."
            )
            self._error.__cause__ = e
        snap.copies.clear()  # the device or host copies go before the transfers
        t1 = time.perf_counter()
        self._replicate(step, own, error, prefix)
        logger.info(
            "local step %d: part written in %.3f s, replicated in %.3f s",
            step,
            t1 - t0,
            time.perf_counter() - t1,
        )
        try:
            self.disk.retain(self.max_to_keep)
        except Exception:  # a failed cleanup must not stop training
            logger.warning("local retention in %s failed", self.mine, exc_info=True)

    def _write_own(self, step: int, snap: _part.Snapshot) -> Path:
        """Write the own part of ``step``; a part of an earlier save of it goes first, so a
        save that fails leaves no part of the step rather than an older one."""
        path = self.mine / step_name(step) / _part.part_name(self.process, self.count)
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            _catalog.delete(_location.Location(path))  # refuses what jaxckpt did not write
        _part.write_part(path, snap, overwrite=False)
        return path

    def _replicate(self, step: int, own: Path | None, error: str, prefix: str) -> None:
        """Send the own part to the next ``replicas`` processes, receive the previous ones'."""
        jobs: list[Future[int] | Future[None]] = []
        for k in range(1, self.replicas + 1):
            to, src = (self.process + k) % self.count, (self.process - k) % self.count
            jobs.append(
                pools.save_pool().submit(
                    _replication.send_dir, f"{prefix}/{self.process}-{to}/", own, error=error
                )
            )
            jobs.append(
                pools.save_pool().submit(
                    self._receive, step, src, f"{prefix}/{src}-{self.process}/"
                )
            )
        for job in jobs:
            try:
                job.result()
            except Exception as e:  # a lost replica costs redundancy, not the step
                logger.warning(
                    "replication of local step %d on process %d: %s", step, self.process, e
                )

    def _receive(self, step: int, src: int, prefix: str) -> None:
        """Receive process ``src``'s part of ``step`` and commit it here (rename into place);
        a copy of an earlier save of it goes first, received or not."""
        final = self.mine / step_name(step) / _part.part_name(src, self.count)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / staging_name(final.name, uuid.uuid4().hex[:8])
        try:
            if final.exists():
                _catalog.delete(_location.Location(final))  # refuses what jaxckpt did not write
            room = shutil.disk_usage(final.parent).free
            _replication.receive_dir(prefix, tmp, max_bytes=room)
            info = _part.read_info(tmp)
            if info is None or (info.step, info.process, info.process_count) != (
                step,
                src,
                self.count,
            ):
                raise CheckpointError(f"{tmp} is not part {src} of local step {step}")
            os.rename(tmp, final)
            _catalog.fsync_dir(final.parent)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def settle(self) -> None:
        """Block until the local save in flight is done; its error stays for ``wait()``."""
        if self._pending is not None:
            self._pending.result()

    def wait(self) -> None:
        """Block until the local save in flight is written and replicated; raise its error."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()
        error, self._error = self._error, None
        if error is not None:
            raise error

    # -- what is here ---------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """The steps whose own part this process holds, committed (no other process asked)."""
        mine = (k[0] for k in self.disk.holdings() if k[1:3] == (self.process, self.count))
        return sorted(set(mine))

    def known_whole(self) -> list[int]:
        """The local steps this process knows some tier holds whole, asking no other: those
        whose own part it holds, and those the last agreement found whole that its disk still
        holds (in any process directory of the run)."""
        held = self.disk.all_held()
        return sorted(set(self.steps()) | {s for s in self.whole if s in held})

    def holds(self, step: int) -> bool:
        """Whether any part of ``step`` (complete or not) is on this process's disk."""
        return step in self.disk.all_held()

    def all_held(self) -> set[int]:
        """Every step of which this disk holds a part, in any process directory of the run."""
        return self.disk.all_held()

    def delete(self, step: int) -> None:
        """Delete every part of ``step`` on this disk (after the local save in flight)."""
        self.settle()
        self.disk.delete(step)

    # -- restoring ------------------------------------------------------------------------------

    def agree(
        self,
        target: Any,
        persistent: list[int],
        step: int | None,
        *,
        elastic: bool = True,
        why: str = "",
    ) -> dict[str, Any]:
        """:func:`choose` on every process's holdings (every process calls it); ``elastic``:
        whether a step of another layout may be resharded (not with data iterators, whose
        positions belong to the processes that saved them); ``why``: why this process's
        restore cannot use the local tier at all (for the log), if it cannot."""
        self._held = self.disk.holdings(everywhere=True)
        layout = _part.target_layout(target, self.count, self._newest_info())
        if not why and target is not None and layout is None:
            why = (
                "the target's leaves are not all jax.Arrays, ShapeDtypeStructs with shardings, "
                "bare Shardings or None"
            )
        mine = {
            "parts": [[*k, layout] for k, (layout, _) in self._held.items()],
            "target": layout,
            "elastic": _elastic.target_digest(target) if elastic else None,
            "persistent": persistent if self.process == 0 else [],
            "why": why or ("" if elastic else "iterators= were given"),
        }
        count = self.count

        def decide(posted: dict[int, str]) -> str:
            return json.dumps(
                choose(count, {p: json.loads(v) for p, v in posted.items()}, step=step)
            )

        chosen: dict[str, Any] = json.loads(
            _agreement.decide("holdings", json.dumps(mine), decide, scope=self.scope)
        )
        self.whole = set(chosen["local_steps"])
        return chosen

    def _newest_info(self) -> _part.PartInfo | None:
        """The description of the part here saved last (for a target of bare shardings)."""
        if not self._held:
            return None
        newest = max(self._held, key=lambda k: (k[3], k[0]))
        return _part.read_info(self._held[newest][1])

    def restore_newest(
        self,
        step: int | None,
        target: Any,
        persistent: list[int],
        *,
        keys: str | Sequence[str] | None = None,
        strict: bool = True,
        planner: Any = None,
        iterators: Mapping[str, _iterators.Checkpointable] | None = None,
    ) -> tuple[Any, RestoredFrom]:
        """The newest step (or ``step``) that some tier holds whole: the local tier when it is
        as new as the persistent one (the faster copy), else ``persistent`` (the committed
        steps of the persistent directory). Every process calls it.

        Raises:
          CheckpointNotFoundError: no tier holds a whole step (or ``step``).
        """
        # The local tier rebuilds whole targets only.
        why = "keys= or planner= were given" if keys is not None or planner is not None else ""
        why = why or ("restore() was given no target" if target is None else "")
        choice = self.agree(
            None if why else target, persistent, step, elastic=not iterators, why=why
        )
        self.agreed_steps = sorted(set(persistent) | set(choice["local_steps"]))
        if choice["tier"] == "local":
            restored = self.restore(choice, target, iterators)
            if restored is not None:
                return restored
            choice = {"tier": "persistent", "step": choice["fallback"], "why": "see above"}
        if choice["tier"] is None or choice["step"] is None:
            raise CheckpointNotFoundError(
                f"No committed step{'' if step is None else f' {step}'} in {self.persistent} "
                f"or its local tier ({choice.get('why')}): nothing to restore. Start from a "
                f"fresh state (check latest_step() is None first), or point at the right "
                f"directory."
            )
        logger.info(
            "restored step %d from the persistent tier (%s)", choice["step"], choice.get("why")
        )
        path = str(self.persistent.join(step_name(choice["step"])))
        tree = restore(path, target, keys=keys, strict=strict, planner=planner, iterators=iterators)
        return tree, RestoredFrom("persistent", choice["step"])

    def restore(
        self,
        choice: Mapping[str, Any],
        target: Any,
        iterators: Mapping[str, _iterators.Checkpointable] | None = None,
    ) -> tuple[Any, RestoredFrom] | None:
        """Restore the chosen local step: on its own layout (fetch the parts their owners
        lack, set the ``iterators`` to this process's states in its part, rebuild from it) or
        resharded (``elastic_restore``, never with ``iterators``); ``None`` on every process if
        any process could not, or died meanwhile (then the caller falls back to the persistent
        tier)."""
        step, n = choice["step"], self._restores
        self._restores += 1
        prefix = f"{_replication.PREFIX}/r{n}"
        if choice["mode"] == "elastic":
            key = (step, choice["count"], choice["save"])
            paths = {k[1]: v[1] for k, v in self._held.items() if (k[0], *k[2:]) == key}
            tree, self.last_elastic, error = _elastic.restore(
                choice, target, paths, prefix, self.process, self.count
            )
        else:
            tree, error = self._rebuild(choice, target, prefix, iterators)
        if error:
            logger.warning("local step %d cannot be restored here: %s", step, error)
        if not self._verdict(step, error):
            return None
        peers = tuple(sorted(int(q) for q in choice["fetch"]))
        if choice["mode"] == "elastic":
            got = RestoredFrom("local", step, resharded_from=choice["count"])
            logger.info("restored step %d from the local tier (%s)", step, self.last_elastic)
        else:
            got = RestoredFrom("local", step, peers)
            logger.info(
                "restored step %d from the local tier%s",
                step,
                f" (parts of processes {list(peers)} from their replicas)" if peers else "",
            )
        return tree, got

    def _rebuild(
        self,
        choice: Mapping[str, Any],
        target: Any,
        prefix: str,
        iterators: Mapping[str, _iterators.Checkpointable] | None,
    ) -> tuple[Any, str]:
        """The chosen step on its own layout: the tree, or why not (for every process)."""
        step, save = choice["step"], choice["save"]
        fetch = {int(q): h for q, h in choice["fetch"].items()}
        try:
            self._fetch(step, save, fetch, prefix)
            path = self.mine / step_name(step) / _part.part_name(self.process, self.count)
            if self.process not in fetch:  # held here, maybe in another process directory
                path = self._held[(step, self.process, self.count, save)][1]
            info = _part.read_info(path)
            if info is None or info.save != save:
                raise CheckpointError(f"{path} is not the part of local step {step} agreed on")
            saved = metadata(str(path)).iterators if iterators else {}
            set_iterators = _iterators.restore_states(
                iterators, saved, str(path), self.process, self.count
            )
            tree = _part.rebuild(path, info, target)
            set_iterators()  # only once the part is read: a refused restore moves none
            return tree, ""
        except Exception as e:  # every process hears of it and falls back together
            return None, f"process {self.process}: {type(e).__name__}: {e}"

    def _verdict(self, step: int, error: str) -> bool:
        """Whether every process restored its share of local step ``step``; a process that
        does not report in time (it died) counts as one that failed."""
        count = self.count

        def verdict(got: dict[int, str]) -> str:
            why = [v for _, v in sorted(got.items()) if v]
            if missing := sorted(set(range(count)) - set(got)):
                why.append(f"processes {missing} did not report (dead?)")
            return "; ".join(why)

        said = _agreement.decide("rebuilt", error, verdict, survivors=True, scope=self.scope)
        if said:
            logger.warning("local step %d not restored (%s): using the persistent tier", step, said)
        return not said

    def _fetch(self, step: int, save: str, fetch: dict[int, int], prefix: str) -> None:
        """Move each part its owner lacks from the holder ``fetch`` names."""
        jobs = []
        for q, h in fetch.items():
            if h == self.process:
                part = self._held[(step, q, self.count, save)][1]
                jobs.append(pools.save_pool().submit(_replication.send_dir, f"{prefix}/{q}/", part))
        try:
            if self.process in fetch:
                self._receive(step, self.process, f"{prefix}/{self.process}/")
        finally:
            for job in jobs:
                job.result()

    # -- housekeeping ---------------------------------------------------------------------------
