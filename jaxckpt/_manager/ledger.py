"""The run's ledger: one view of every step in each tier, consulted by every manager call.

A run's steps live in up to two tiers: the persistent directory (``jaxckpt._manager.run``)
and, with ``local_directory``, the processes' local disks (``jaxckpt._tiers.local_tier``). The
ledger answers, for both tiers at once, what ``all_steps``, ``latest_step``,
``should_save``, ``save``'s check, ``delete``, ``rollback`` and ``restore``'s choice need;
none of those calls keeps a rule of its own.

The rule that keeps one view simple (docs/manager.md, *Going back to an older step*): **step
numbers grow in the order of saves.** A save of step ``s`` while a step ``s`` or newer is
saved in any tier is refused before anything is written (``CheckpointExistsError``, naming
the newer steps and ``rollback``); ``rollback(s)`` deletes every newer step from every tier
in one call. So the newest step any tier holds whole is always the newest save of the branch
saved last, and "the newest step" answers ``restore()``, ``should_save`` and retention alike,
after any restart. A rollback that a crash interrupts deletes only steps of the abandoned
branch, and no step of the new one exists before it returns.

What the ledger holds in memory is one number, :attr:`Ledger.newest`: the newest step saved
in any tier (committed, or started by this manager), the same on every process. It is read
when the manager opens (a listing of the directory and, with a local tier, the steps the
processes agree some tier holds whole), raised by each save and by ``reload()`` (to a step
saved by hand after it: one listing on each process), and read again after a restore,
a delete or a rollback. So a step whose only copy was lost (a wiped local disk) still
counts until the next of those: the loop that goes on from a ``restore()`` numbers from what
the run holds. Everything else is listed afresh at each call, so steps another process
commits (a plain ``jaxckpt.save`` into the run) show up; ``save`` lists the directory once
(on object stores, only from its own step on: see below).

Cost, local directories: a listing of the run (O(steps) directory entries) per save, delete
and ``all_steps``. Object stores, where a listing returns every object of what it lists, never
list the run: the committed steps come from the run's index (``jaxckpt._manager.run_index``:
one marker per step, one page per 1,000 steps) and the key range of the step names after its
newest step (one page, empty unless steps were saved there unindexed), when the manager opens
(every process), for ``all_steps``, delete and rollback; retention (process 0, in the
background) lists the index alone, after writing the committed step's marker (and any the
index lacks of the steps this process knows), then each deleted step's own prefix. A save
(process 0 alone, its answer agreed with the others) lists only the key range of the step names after the newest step it knows (:meth:`Run.after`:
nothing there but what other processes saved since, so one page), and the older committed steps come from what the
ledger knows (:meth:`Ledger.persistent`: the listing when it opened, plus each commit, minus
each delete). The rule for steps without a marker (a run older than the index, plain
``jaxckpt.save`` steps) is ``run_index``'s: those after the newest marked step are found,
those below it are not. With a local tier one agreement of all processes (O(processes x local steps)
through process 0) when the manager opens and per delete and rollback (collective calls, as
``save``); nothing per ``should_save``. ``all_steps`` and ``latest_step`` ask no other
process, so one process may call them alone: they list the local steps this process holds
its own part of, and those the last agreement found whole that its disk still holds.
Independent of bytes and leaves.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from jaxckpt._errors import CheckpointExistsError, CheckpointNotFoundError
from jaxckpt._format.iterators import Checkpointable
from jaxckpt._format.names import MANIFEST, parse_step
from jaxckpt._manager.cleanup import clean_listed
from jaxckpt._manager.retention import referenced
from jaxckpt._manager.run import Run
from jaxckpt._planning.load_planner import LoadPlanner
from jaxckpt._runtime import agreement as _agreement
from jaxckpt._runtime import distributed as _distributed
from jaxckpt._tiers.local_tier import LocalTier
from jaxckpt._tiers.tier_choice import RestoredFrom

logger = logging.getLogger("jaxckpt")
Tier = Literal["local", "persistent"]


class Ledger:
    """The steps of one run in both tiers (see the module's docstring).

    Args:
      run: the persistent directory.
      local: the local tier, or ``None``.
      read_only: a reader's ledger lists afresh at every question (another process saves).
      listed: the committed persistent steps, just listed (``None``: list them now).
    """

    def __init__(
        self,
        run: Run,
        local: LocalTier | None,
        *,
        read_only: bool = False,
        listed: list[int] | None = None,
    ) -> None:
        self.run, self.local, self.read_only = run, local, read_only
        self._newest: int | None = None
        self._stale = False  # restored: ``newest`` is listed again where it is next needed
        self._before: int | None = None  # ``newest`` before the save in flight began
        self._warned = False  # logged once that an older step is not saved
        # Object stores: the committed persistent steps as this process knows them (see the
        # module's docstring).
        self._known: set[int] = set()
        # What the last save's listing found uncommitted below its step: {name: its keys}.
        self.leftovers: dict[str, list[str]] = {}
        self._lock = threading.Lock()
        self.refresh(listed)

    # -- what the run holds ---------------------------------------------------------------------

    def steps(self, tier: Tier | None = None) -> list[int]:
        """The committed steps of ``tier`` (``None``: the persistent ones and the local ones
        this process knows some tier holds whole), asking no other process."""
        if tier == "local":
            return [] if self.local is None else self.local.steps()
        persistent = self.run.steps()
        with self._lock:
            self._known = set(persistent)
        if tier == "persistent" or self.local is None:
            return persistent
        return sorted(set(persistent) | set(self.local.known_whole()))

    def agreed_steps(self, listed: list[int] | None = None) -> list[int]:
        """The persistent steps (``listed``, else listed now) and the local ones some tier
        holds whole, agreed by all processes (with a local tier every process calls it: at
        start, delete, rollback)."""
        persistent = self.run.steps() if listed is None else listed
        with self._lock:
            self._known = set(persistent)
        if self.local is None:
            return persistent
        agreed = self.local.agree(None, persistent, None)["local_steps"]
        return sorted(set(persistent) | set(agreed))

    @property
    def newest(self) -> int | None:
        """The newest step saved in any tier (see the module's docstring)."""
        if self._stale:
            self.refresh()
        return self._newest

    @newest.setter
    def newest(self, step: int | None) -> None:
        self._newest, self._stale = step, False

    def refresh(self, listed: list[int] | None = None) -> None:
        """Read :attr:`newest` again from both tiers (agreed by all processes)."""
        self.newest = max(self.agreed_steps(listed), default=None)

    def reload(self) -> None:
        """Raise :attr:`newest` to the newest persistent step listed now (one saved by hand
        after it: ``CheckpointManager.reload``), asking no other process: steps after the
        newest are listed alike by every process."""
        found = max(self.steps("persistent"), default=None)
        if self._stale or found is None:
            return  # a stale ``newest`` is listed again where it is next needed
        if self._newest is None or found > self._newest:
            self.newest = found

    def newer(self, step: int) -> list[int]:
        """The steps after ``step`` in any tier, as this process sees them (for messages)."""
        found = set(self.persistent())
        if self.local is not None:
            found |= set(self.local.steps())
        if self.newest is not None:
            found.add(self.newest)
        return sorted(s for s in found if s > step)

    def require_persistent(self, step: int, call: str) -> None:
        """Refuse ``call`` (``pin``) of a ``step`` the persistent directory lacks, saying why:
        held only by the local tier, or not saved at all.

        Raises:
          CheckpointNotFoundError: names the steps of both tiers, as this process sees them.
        """
        persistent = self.run.steps()
        if step in persistent:
            return
        local = [] if self.local is None else self.local.steps()
        listed = sorted(set(persistent) | set(local))
        if step not in local:
            raise CheckpointNotFoundError(
                f"Step {step} is not in {self.run.directory}; committed steps: {listed}. "
                f"{call.capitalize()} one of those."
            )
        assert self.local is not None
        raise CheckpointNotFoundError(
            f"Step {step} is held only by the local tier ({self.local.mine}, on the processes' "
            f"own disks, which keep their newest local_max_to_keep={self.local.max_to_keep} "
            f"steps and nothing else), not by {self.run.directory}: {call}() keeps steps of "
            f"the persistent directory from its retention. all_steps() lists {listed}, of "
            f"which {self.run.directory} holds {persistent}: {call} one of those. To keep step "
            f"{step}'s state for good, restore({step}) and save it to the directory as a later "
            f"step with force=True, then {call} that step."
        )

    # -- saving ---------------------------------------------------------------------------------

    def may_save(self, step: int) -> bool:
        """Whether ``step`` may be saved now: after every step saved in any tier."""
        if self.read_only:
            return False
        if self.newest is None or step > self.newest:
            return True
        if step < self.newest and not self._warned:  # a resumed loop passing them is normal
            self._warned = True
            logger.info(
                "step %d is not saved: step %d is saved already in %s. If the run went back to "
                "an older step, call CheckpointManager.rollback(STEP) to delete the newer ones.",
                step,
                self.newest,
                self.run.directory,
            )
        return False

    def check_new(self, step: int, directory: str, restored: int | None) -> list[int]:
        """Refuse ``step`` unless it is newer than every step of every tier (the directory
        listed now); ``restored``: the step the last ``restore()`` returned, for the advice.
        On object stores with several processes only process 0 lists, and its listing (or its
        refusal) reaches every process through one agreement (O(1) coordination operations
        per process, O(P) on process 0): one listing page per step in all.

        Returns:
          The committed persistent steps, listed now.

        Raises:
          CheckpointExistsError: ``step`` is saved already, or a newer step is (a rollback
            that forgot ``rollback()``): naming them and the call that rolls back.
        """
        if self.run.loc.local is not None or _distributed.process_count() == 1:
            return self._refuse(step, directory, restored, self._listed_for(step))

        def listed_here(posted: dict[int, str]) -> str:  # on process 0
            try:
                steps = self._refuse(step, directory, restored, self._listed_for(step))
            except CheckpointExistsError as e:
                return json.dumps({"refused": str(e)})
            return json.dumps({"steps": steps})

        said = json.loads(
            _agreement.decide(
                "save-check",
                "",
                listed_here,
                scope=_agreement.scope_of(directory, str(step)),
                call=f"CheckpointManager.save({step})",
            )
        )
        if "refused" in said:
            raise CheckpointExistsError(said["refused"])
        with self._lock:
            self._known = set(said["steps"])
        return self._refuse(step, directory, restored, list(said["steps"]))

    def _refuse(
        self, step: int, directory: str, restored: int | None, persistent: list[int]
    ) -> list[int]:
        """``persistent``, unless ``step`` is not newer than every step of every tier."""
        if self.local is None:  # the listing is the whole truth (a step deleted by hand too)
            self.newest = max(persistent, default=None)
        saved = step in persistent or step == self.newest
        newer = sorted(set(self.newer(step)) | {s for s in persistent if s > step})
        if not (saved or newer):
            return persistent
        # Where the run goes on from: the step restore() returned, else the one before.
        back = restored if restored is not None and restored < step else step - 1
        doomed = sorted(set(self.newer(back)) | {s for s in persistent if s > back})
        raise CheckpointExistsError(_refusal(step, directory, saved, newer, back, doomed))

    def _listed_for(self, step: int) -> list[int]:
        """The committed persistent steps before a save of ``step``: listed afresh after the
        newest step this process knows (there the listing is the truth: it also finds steps
        other processes saved since), known below (object stores). What that listing finds
        uncommitted below ``step`` (a failed save) process 0 removes after the next commit."""
        if self.run.loc.local is not None:
            return self.run.steps()
        with self._lock:
            start = min(step, max(self._known) + 1) if self._known else 0
        listing = self.run.after(start)
        named = {n: s for n in listing if (s := parse_step(n)) is not None}
        found = {s for n, s in named.items() if MANIFEST in listing[n]}
        with self._lock:
            self._known = {s for s in self._known if s < start} | found
            self.leftovers = {
                n: listing[n] for n, s in named.items() if s < step and MANIFEST not in listing[n]
            }
            return sorted(self._known)

    def persistent(self) -> list[int]:
        """The committed persistent steps: listed (local), or as known (object stores)."""
        if self.run.loc.local is not None:
            return self.run.steps()
        with self._lock:
            return sorted(self._known)

    def committed(self, step: int) -> None:
        """The persistent save of ``step`` committed (every process)."""
        with self._lock:
            self._known.add(step)

    def index(self, step: int) -> list[int]:
        """(process 0, after ``step``'s commit) Add ``step`` to the run's index, and any
        committed step this process knows of that the index lacks (a plain ``jaxckpt.save``
        of a newer step, a marker whose write failed); returns the committed persistent steps
        as the index now says (object stores; listed on a local directory)."""
        if self.run.loc.local is not None:
            return self.run.steps()
        self.run.mark([step])
        indexed = set(self.run.indexed()) | {step}
        missing = [s for s in self.persistent() if s not in indexed and self.run.holds(s)]
        if missing:
            self.run.mark(missing)
        with self._lock:
            left, self.leftovers = self.leftovers, {}
        if left:  # failed saves older than the committed step: no retry resumes them now
            clean_listed(self.run.loc, lambda n: referenced(self.run.loc, n), left, step)
        return sorted(indexed | set(missing))

    def forget(self, steps: list[int]) -> None:
        """``steps`` were deleted from the persistent directory."""
        with self._lock:
            self._known.difference_update(steps)

    def begin(self, step: int) -> None:
        """A save of ``step`` starts (in either tier) on every process."""
        self._before, self.newest = self.newest, step

    def failed(self, step: int, *, local_saved: bool) -> None:
        """The persistent save of ``step`` failed on every process: unless the local tier
        saved it, ``step`` may be saved again."""
        if self.newest == step and not local_saved:
            self.newest = self._before

    # -- restoring ------------------------------------------------------------------------------

    def restore(
        self,
        step: int | None,
        target: Any,
        *,
        keys: str | Sequence[str] | None,
        strict: bool,
        planner: LoadPlanner | None,
        iterators: Mapping[str, Checkpointable] | None,
    ) -> tuple[Any, RestoredFrom]:
        """``step`` (``None``: the newest step some tier holds whole: by the rule above, the
        newest save of the branch saved last) and where it came from. With a local tier every
        process calls it; a tier that cannot deliver falls back to the other (logged).

        Raises:
          CheckpointNotFoundError: no tier holds ``step`` (or any step).
        """
        if self.local is None:
            tree, got = self.run.restore(
                step, target, keys=keys, strict=strict, planner=planner, iterators=iterators
            )
            self._stale = True  # listed when next needed, not on the restore's path
            return tree, RestoredFrom("persistent", got)
        self.local.settle()
        restored = self.local.restore_newest(
            step,
            target,
            self.run.steps(),
            keys=keys,
            strict=strict,
            planner=planner,
            iterators=iterators,
        )
        # A tier may have lost steps (a wiped disk): number from what the restore found held
        # (no second agreement: after a process died, the survivors have restored already).
        self.newest = max(self.local.agreed_steps, default=None)
        return restored

    # -- deleting -------------------------------------------------------------------------------

    def delete(self, step: int, *, primary: bool, clean_up: Callable[[], object]) -> None:
        """Delete ``step`` from every tier (every process calls it with a local tier); then
        ``clean_up()`` (primary) removes what only the deleted step kept.

        Raises:
          CheckpointNotFoundError: no tier holds ``step``; nothing was deleted.
        """
        persistent = self.run.steps()
        steps = self.agreed_steps(persistent)
        local = self.local is not None and self.local.holds(step)
        if step not in steps and not local:
            raise CheckpointNotFoundError(
                f"Step {step} is not in {self.run.directory}"
                f"{'' if self.local is None else ' or its local tier'}; committed steps: "
                f"{steps}. Nothing was deleted."
            )
        self._remove([step], persistent, primary=primary, clean_up=clean_up)
        self.newest = max((s for s in steps if s != step), default=None)

    def rollback(self, step: int, *, primary: bool, clean_up: Callable[[], object]) -> list[int]:
        """Delete every step after ``step`` from every tier; returns them."""
        persistent = self.run.steps()
        steps = self.agreed_steps(persistent)
        doomed = sorted(
            {s for s in steps if s > step}
            | ({s for s in self.local.all_held() if s > step} if self.local is not None else set())
        )
        self._remove(doomed, persistent, primary=primary, clean_up=clean_up)
        self.newest = max((s for s in steps if s <= step), default=None)
        if doomed:
            logger.info("rolled back %s to step %d: deleted %s", self.run.directory, step, doomed)
        return doomed

    def _remove(
        self,
        doomed: list[int],
        persistent: list[int],
        *,
        primary: bool,
        clean_up: Callable[[], object],
    ) -> None:
        """Delete ``doomed`` from the local tier (this process's disk), then from the
        persistent directory (the primary; ``persistent``: its committed steps, listed just
        before), then clean up after them."""
        if self.local is not None:
            for s in doomed:
                self.local.delete(s)
        if primary:
            remaining = sorted(persistent)
            gone = [s for s in doomed if s in remaining]
            for s in reversed(gone):  # newest first: a crash leaves the oldest of the branch
                self.run.delete(s, remaining)
                remaining.remove(s)
            if gone:
                clean_up()
        self.forget(doomed)


def _refusal(
    step: int, directory: str, saved: bool, newer: list[int], back: int, doomed: list[int]
) -> str:
    """Why ``save(step)`` is refused, and the ``rollback(back)`` that deletes ``doomed``."""
    if saved:
        head = (
            f"Step {step} is already saved in {directory}. A saved step is never replaced, "
            f"force=True included (force only skips save_interval_steps)"
        )
    else:
        head = (
            f"Step {step} is older than steps already saved in {directory} ({newer}, in either "
            f"tier): saving it would leave a newer step of another branch that a restart restores"
        )
    where = "(docs/manager.md, *Going back to an older step*)"
    if back < 0:  # step 0 itself: no step before it to roll back to
        fix = f"call CheckpointManager.rollback(0) and .delete(0) first {where}"
    else:
        fix = (
            f"call CheckpointManager.rollback({back}) first: it deletes steps {doomed} from "
            f"every tier {where}"
        )
    after = max(doomed, default=step)
    return (
        f"{head}. Nothing was saved. To go on from step {max(back, 0)}, {fix}. Or save a later "
        f"step (after {after}), or restore step {after} and go on from there."
    )
