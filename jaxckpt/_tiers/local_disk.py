"""What one disk of the local tier holds: the committed parts of each step, found by listing.

The layout is ``jaxckpt._tiers.local_tier``'s (``LOCAL_DIR/jaxckpt-<run>/p<P>/<step>/part-Q-of-N``).
:class:`LocalDisk` lists the parts (its own process directory, or every process directory of
the run on this disk), deletes a step's parts, keeps the steps saved last, and removes what
interrupted saves left. It only ever deletes jaxckpt's parts and dead temporaries: anything
else in a step directory, and the directory with it, stays.

A disk wiped, unmounted or replaced while a manager is open holds nothing: a listing that
fails is logged and answers "no parts", so the other tier serves the restore.
"""

from __future__ import annotations

import logging
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

from jaxckpt._errors import CheckpointError
from jaxckpt._format.names import parse_staging, parse_step, step_name
from jaxckpt._storage import catalog as _catalog
from jaxckpt._storage import lease as _lease
from jaxckpt._storage import location as _location
from jaxckpt._tiers import local_part as _part

logger = logging.getLogger("jaxckpt")
_PROCESS = re.compile(r"p[0-9]+")
Held = tuple[int, int, int, str]  # a committed part: (step, part, process count, save)


class LocalDisk:
    """The run's local directory ``root`` on this disk; ``mine``: this process's folder."""

    def __init__(self, root: Path, mine: Path) -> None:
        self.root, self.mine = root, mine

    def holdings(self, *, everywhere: bool = False) -> dict[Held, tuple[str, Path]]:
        """``{(step, part, count, save): (layout, path)}`` of every committed part here (own,
        replicas, parts of another process count): in this process's directory, or with
        ``everywhere`` also in the other process directories of the run on this disk (after a
        restart a process may get another's old disk), its own directory first."""
        out: dict[Held, tuple[str, Path]] = {}
        try:
            for d in self.dirs(everywhere):
                for sd in sorted(d.iterdir()) if d.is_dir() else []:
                    for key, layout, pd in _parts_in(sd):
                        out.setdefault(key, (layout, pd))
        except OSError as e:  # wiped, unmounted or replaced while open: it holds nothing
            logger.warning("local tier %s cannot be read (%s); using the other tiers", self.root, e)
            return {}
        return out

    def dirs(self, everywhere: bool) -> list[Path]:
        """This process's directory, and with ``everywhere`` every process directory of the
        run on this disk (its own first)."""
        if not self.root.is_dir():
            raise FileNotFoundError(f"{self.root} is gone or not a directory")
        if not everywhere:
            return [self.mine]
        others = sorted(self.root.iterdir())
        return [self.mine, *(d for d in others if _PROCESS.fullmatch(d.name) and d != self.mine)]

    def all_held(self) -> set[int]:
        """Every step of which this disk holds a part, in any process directory of the run."""
        return {k[0] for k in self.holdings(everywhere=True)}

    def delete(self, step: int) -> None:
        """Delete every part of ``step`` on this disk (own, replicas, other process
        directories of the run)."""
        try:
            for d in self.dirs(True):
                if (d / step_name(step)).is_dir():
                    _delete_step_dir(d / step_name(step))
        except OSError as e:  # the disk went: nothing of it is restored either
            logger.warning("deleting local step %d in %s: %s", step, self.root, e)

    def retain(self, max_to_keep: int) -> None:
        """Keep the ``max_to_keep`` step directories of this process saved last (by their
        parts' save ids, so a step saved after a rollback outranks an older save of a
        higher step); delete the others' parts."""
        order: dict[int, str] = {}
        for step, _, _, save in self.holdings():  # a foreign dir is no step
            order[step] = max(save, order.get(step, save))
        held = sorted(order, key=lambda s: (order[s], s))
        for step in held[:-max_to_keep]:
            if _delete_step_dir(self.mine / step_name(step)):
                logger.info("deleted local step %d from %s (retention)", step, self.mine)

    def clean_up(self) -> None:
        """Remove what interrupted saves and transfers left (our temporaries only)."""
        for sd in self.mine.iterdir():
            if parse_step(sd.name) is not None and sd.is_dir():
                for child in sd.iterdir():
                    if _is_dead_temporary(child):
                        shutil.rmtree(child, ignore_errors=True)
                        logger.info("cleaned up %s (left by an interrupted local save)", child)


def _delete_step_dir(sd: Path) -> bool:
    """Delete jaxckpt's parts and dead temporaries in the step directory ``sd``, then ``sd``
    if nothing else is in it; whether it went."""
    for child in sd.iterdir():
        if _part.parse_part(child.name) is not None and child.is_dir():
            try:
                _catalog.delete(_location.Location(child))
            except CheckpointError as e:
                logger.warning("local tier: not deleting %s: %s", child, e)
        elif _is_dead_temporary(child):
            shutil.rmtree(child, ignore_errors=True)
    try:
        sd.rmdir()
    except OSError:  # something else is in it: it stays
        return False
    return True


def _parts_in(step_dir: Path) -> Iterator[tuple[Held, str, Path]]:
    """``((step, part, count, save), layout, path)`` of each committed part in ``step_dir``."""
    step = parse_step(step_dir.name)
    if step is None or not step_dir.is_dir():
        return
    for pd in sorted(step_dir.iterdir()):
        part = _part.parse_part(pd.name)
        info = _part.read_info(pd) if part is not None else None
        if part is not None and info is not None:
            if (info.step, info.process, info.process_count) == (step, *part):
                yield (step, *part, info.save), info.layout, pd


def _is_dead_temporary(path: Path) -> bool:
    """A part's staging directory (a save's or a transfer's) that nothing writes into now."""
    staging = parse_staging(path.name)
    if staging is None or _part.parse_part(staging[0]) is None:
        return False
    return not _lease.local_is_live(path)
