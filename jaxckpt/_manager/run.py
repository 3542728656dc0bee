"""A run directory: its committed steps, one step's path, restoring or deleting one step.

What a ``CheckpointManager`` knows about the directory it saves into, read-only managers
included: the steps are the sub-directories (or sub-prefixes) whose name is a step name
(``jaxckpt._format.names.step_name``) and that hold a manifest; metrics live in
``metrics.json`` (``jaxckpt._manager.retention``). Every call lists afresh, so steps that
another process commits show up at once: :meth:`Run.steps` the whole directory (object
stores: its index, ``jaxckpt._manager.run_index``, and the names after the index's newest
step), and :meth:`Run.after` only the names from one step on (a save's check).
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Iterable
from typing import Any

import numpy as np

from jaxckpt._api.restoring import restore
from jaxckpt._errors import (
    ArgumentTypeError,
    CheckpointError,
    CheckpointNotFoundError,
    InvalidArgumentError,
)
from jaxckpt._format.names import parse_step, step_name
from jaxckpt._manager import run_index as _index
from jaxckpt._manager.retention import MetricsFile, referenced
from jaxckpt._storage import catalog as _catalog
from jaxckpt._storage import location as _location
from jaxckpt._storage.messages import FULL_HINT, is_full

logger = logging.getLogger("jaxckpt")


class Run:
    """The run directory at ``loc`` (``directory``: as the user named it, for messages)."""

    def __init__(self, loc: _location.Location, directory: str) -> None:
        self.loc, self.directory = loc, directory
        self.metrics = MetricsFile(loc)

    def refuse_checkpoint(self) -> None:
        """Refuse a directory that is one checkpoint: steps would be saved inside it.

        Raises:
          CheckpointError: naming the directory and what to pass instead.
        """
        if _location.exists(self.loc):
            raise CheckpointError(
                f"{self.directory} is a checkpoint (it holds manifest.json), not a run "
                f"directory: a CheckpointManager saves each step into a folder of its own below "
                f"its directory (DIR/00000100, ...). Pass the folder that should hold the steps "
                f"(e.g. its parent), or restore this checkpoint with "
                f"jaxckpt.restore({self.directory!r})."
            )

    def path(self, step: int) -> _location.Location:
        return self.loc.join(step_name(step))

    def steps(self) -> list[int]:
        """The committed steps, ascending; none where the local directory does not exist.
        Object stores: from the run's index (:meth:`survey`), never a listing of the run."""
        if self.loc.local is None:
            return self.survey().steps
        if not self.loc.local.exists():
            return []  # e.g. an evaluator started before the trainer made the directory
        found = (parse_step(n) for n, committed in _catalog.children(self.loc) if committed)
        return sorted(s for s in found if s is not None)

    def survey(self) -> _index.Survey:
        """Object stores: the run's index and the steps after its newest
        (``jaxckpt._manager.run_index``)."""
        return _index.survey(self.loc)

    def indexed(self) -> list[int]:
        """The committed steps as the index alone says (object stores: one listing of the
        index); the listed steps on a local directory."""
        if self.loc.local is not None:
            return self.steps()
        marked, deleting = _index.read(self.loc)
        return sorted(marked - deleting)

    def rescan(self) -> None:
        """(process 0 of a saving manager) Object stores: list the run whole once and add to
        the index the committed steps it lacks (saved by hand below its newest step)."""
        if self.loc.local is None:
            marked, _ = _index.read(self.loc)
            _index.mark(self.loc, set(_index.rescan(self.loc)) - marked)

    def mark(self, steps: Iterable[int]) -> None:
        """(process 0) Add the committed ``steps`` to the index (object stores only)."""
        if self.loc.local is None:
            _index.mark(self.loc, steps)

    def held(self, steps: list[int], *, primary: bool) -> list[int]:
        """``steps`` less the newest ones whose manifest is gone (deleted by hand, marker
        and all but the marker): one read each, from the newest down to one that is there;
        ``primary``: drop the markers of those gone from the index."""
        steps, gone = sorted(steps), []
        while steps and not self.holds(steps[-1]):
            gone.append(steps.pop())
        if gone and primary and self.loc.local is None:
            _index.unmark(self.loc, gone)
        return steps

    def after(self, step: int) -> dict[str, list[str]]:
        """Object stores: the keys of the steps at or after ``step`` (by name), from one
        listing of the key range of their names (``jaxckpt._manager.run_index.after``)."""
        return _index.after(self.loc, step)

    def make(self) -> None:
        """Create the (local) directory if it is missing."""
        if self.loc.local is None:
            return
        try:
            self.loc.local.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CheckpointError(
                f"Cannot create the checkpoint directory {self.loc.local}: {e}. Check that "
                f"its parents are directories and writable, or pass another directory."
            ) from e

    def holds(self, step: int) -> bool:
        """Whether ``step`` is committed (its manifest is there: one read)."""
        return _location.exists(self.path(step))

    def require(self, step: int, then: str, cause: BaseException | None = None) -> None:
        """Raise ``CheckpointNotFoundError`` (ending in ``then``) unless ``step`` is committed."""
        if not self.holds(step):
            raise CheckpointNotFoundError(
                f"Step {step} is not in {self.directory}; committed steps: {self.steps()}. {then}"
            ) from cause

    def restore(self, step: int | None, target: Any, **kwargs: Any) -> tuple[Any, int]:
        """Restore ``step`` (``None``: the newest); returns the tree and the step.

        ``kwargs``: ``keys``, ``strict``, ``planner``, ``iterators`` of :func:`jaxckpt.restore`.

        Raises:
          CheckpointNotFoundError: no committed step (or not ``step``).
        """
        if step is None:
            step = max(self.steps(), default=None)
            if step is None:
                raise CheckpointNotFoundError(
                    f"No committed step in {self.directory}: nothing to restore. Start from a "
                    f"fresh state (check latest_step() is None first), or point at the right "
                    f"directory."
                )
        with _location.deadline(self.loc.io_timeout):
            try:  # a step named: its manifest is read once, by the restore
                return restore(str(self.path(step)), target, **kwargs), step
            except CheckpointNotFoundError as e:
                if self.holds(step):
                    raise
                self.require(step, "Pick one of those (or None for the latest).", e)
                raise

    def delete(self, step: int, steps: list[int] | None = None) -> None:
        """Delete the committed ``step`` and its metrics; on object stores what other steps
        reference stays (``steps``: the committed steps, listed just before; ``None``: list
        them now).

        Raises:
          CheckpointNotFoundError: ``step`` is not committed.
        """
        self.require(step, "Nothing was deleted.")
        listed = self.steps() if steps is None else steps
        others = [step_name(s) for s in listed if s != step]
        keep = referenced(self.loc, others)
        doc = self.metrics.doc()
        metrics, committed = self.metrics.read_all(doc)
        pinned, timings = self.metrics.pinned(doc), self.metrics.timings(doc)
        if str(step) in {*metrics, *committed, *timings} or step in pinned:
            committed.pop(str(step), None)
            timings.pop(str(step), None)
            rest = {k: v for k, v in metrics.items() if k != str(step)}
            self.metrics.write(rest, committed, [p for p in pinned if p != step], timings)
        _index.delete_step(self.loc, step, keep=keep.get(step_name(step), ()))
        logger.info("deleted step %d from %s", step, self.directory)

    def pin(self, step: int, pinned: bool) -> None:
        """Pin (``pinned=True``) or unpin the committed ``step``.

        Raises:
          CheckpointNotFoundError: ``step`` is not committed (to pin); names the steps.
        """
        if pinned:
            self.require(step, "Pin one of those.")
        doc = self.metrics.doc()
        pins = set(self.metrics.pinned(doc))
        if (step in pins) != pinned:
            metrics, committed = self.metrics.read_all(doc)
            pins = pins | {step} if pinned else pins - {step}
            self.metrics.write(metrics, committed, pins, self.metrics.timings(doc))

    def explain(self, step: int, path: str, e: BaseException) -> BaseException:
        """The error a failed save of ``step`` raises: specific errors (exists, distributed,
        ...) as they are; others with the step and the state of the directory."""
        specific = isinstance(e, CheckpointError) and type(e) is not CheckpointError
        if specific or not isinstance(e, Exception):
            return e
        try:
            latest: int | str | None = max(self.steps(), default=None)
        except Exception:  # the directory itself may be what failed
            latest = "unknown"
        where = f"the steps already in {self.directory} are intact (latest: {latest})"
        if type(e) is CheckpointError:  # storage's own error already says what and why
            err = CheckpointError(f"Saving step {step} failed. {e} For this manager: {where}.")
        else:
            hint = FULL_HINT if is_full(e) else ""
            err = CheckpointError(
                f"Saving step {step} to {path} failed: {type(e).__name__}: {e}. {hint}Nothing "
                f"of step {step} was committed; {where}. Fix the cause and call save() again."
            )
        err.__cause__ = e
        return err


def step_arg(step: Any, call: str) -> int:
    """``step`` as an int: a Python int, or an integer scalar of numpy or jax (a 0-d integer
    array, such as Flax's ``TrainState.step``); else a ``TypeError``/``ValueError`` saying
    what ``call`` takes (bools, floats, negatives and other shapes are refused).

    Example:
      >>> import numpy as np
      >>> step_arg(np.array(7, np.int32), "save(step, tree)"), step_arg(np.int64(3), "x")
      (7, 3)
    """
    if _integer_scalar(step):
        step = int(step)
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise ArgumentTypeError(
            f"CheckpointManager.{call}: the step comes first, a non-negative int (for restore, "
            f"None means the latest); got a {type(step).__name__}. Pass the other arguments "
            f"after it, or by name (e.g. restore(target=state))."
        )
    if step < 0:
        raise InvalidArgumentError(f"step must be a non-negative int, got {step}")
    return int(step)


def _integer_scalar(x: Any) -> bool:
    """Whether ``x`` is a 0-d array of an integer dtype (numpy's, jax's), not a bool."""
    dtype, shape = getattr(x, "dtype", None), getattr(x, "shape", None)
    if shape != () or dtype is None or isinstance(x, numbers.Integral):
        return False
    try:
        return bool(np.issubdtype(dtype, np.integer))
    except TypeError:  # a dtype numpy does not know (a PRNG key's)
        return False
