"""The run index of an object-store run directory: its committed steps in one small listing.

On object stores a listing returns every object of what it lists, so finding a run's steps
by listing the run costs O(objects of the run) keys. The index makes it O(steps): one empty
object per committed step under a prefix that sorts apart from the step names::

    DIR/.steps/00000100            step 100 is committed (written after its manifest landed)
    DIR/.steps/00000200.deleting   step 200 is being deleted: a step no more

The rules (docs/manager.md, *Steps on object stores*):

- Process 0 writes a step's marker after the step's commit, before the retention that
  follows it (in the background, as the retention).
- A delete writes the ``.deleting`` tombstone first (the step stops being one at once), then
  deletes the step (its manifest first), then the marker, then the tombstone. A manager
  opening the run finishes a delete a crash interrupted (:mod:`jaxckpt._manager.cleanup`).
- The committed steps (:func:`survey`): the marked steps less the tombstoned ones, plus the
  committed steps after the newest marked one, found by one listing of the key range of their
  names (:func:`after`): steps whose marker is not written yet, or saved with a plain
  ``jaxckpt.save`` or an older jaxckpt. Where no step is marked (a run older than the index,
  or a new one), that range is the whole run: listed once, after which process 0 writes the
  missing markers. An unmarked step older than the newest marked one is not seen (a step
  saved by hand below the run's newest: ``jaxckpt ls``, which lists the run whole, shows it).

Local directories have no index: a directory listing costs O(steps) already.

Cost: a survey is two listings (the index, one page per 1,000 steps; the range after its
newest step, one page unless steps were saved there unmarked), independent of the objects of
the run; a marker is one write; a delete two writes and one delete besides the step's own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable, Mapping

from jaxckpt._format.names import MANIFEST, parse_step, step_name
from jaxckpt._storage import catalog as _catalog
from jaxckpt._storage import location as _location

INDEX = ".steps/"
DELETING = ".deleting"


@dataclasses.dataclass(frozen=True)
class Survey:
    """What one look at a run found (see the module's docstring).

    ``marked``: the steps with a marker; ``deleting``: those with a tombstone; ``tail``: the
    keys of each sub-prefix named after the newest marked step, relative to it.
    """

    marked: frozenset[int]
    deleting: frozenset[int]
    tail: Mapping[str, list[str]]

    @property
    def steps(self) -> list[int]:
        """The committed steps, ascending."""
        return sorted((self.marked | set(self.unmarked)) - self.deleting)

    @property
    def unmarked(self) -> list[int]:
        """The committed steps of the tail that have no marker yet."""
        found = (parse_step(n) for n, keys in self.tail.items() if MANIFEST in keys)
        return sorted(s for s in found if s is not None and s not in self.marked)


def read(loc: _location.Location) -> tuple[frozenset[int], frozenset[int]]:
    """The marked and the tombstoned steps of the run at ``loc``: one listing of the index."""
    marked: set[int] = set()
    deleting: set[int] = set()
    for key in _catalog.list_keys(loc, _catalog.prefix_range(INDEX)):
        name = key[len(INDEX) :]
        gone = name.endswith(DELETING)
        step = parse_step(name[: -len(DELETING)] if gone else name)
        if step is not None:
            (deleting if gone else marked).add(step)
    return frozenset(marked), frozenset(deleting)


def after(loc: _location.Location, step: int) -> dict[str, list[str]]:
    """The keys of the steps at or after ``step`` (by name, relative to each): one listing of
    the key range of their names, which holds only those steps' objects. Names sort as numbers
    below 10**7 (``00000100``); from there on a longer name can sort lower, so the range starts
    at ``1`` and holds every such step."""
    name = step_name(step)
    low = name if name.startswith("0") else "1"
    found = _catalog.listing(loc, (low, ":"))  # ":" follows "9"
    steps = {n: parse_step(n) for n in found}
    return {n: keys for n, keys in found.items() if (s := steps[n]) is not None and s >= step}


def survey(loc: _location.Location) -> Survey:
    """The index and the steps after its newest (all of them where none is marked)."""
    marked, deleting = read(loc)
    return Survey(marked, deleting, after(loc, max(marked) + 1 if marked else 0))


def rescan(loc: _location.Location) -> list[int]:
    """The committed steps of the run found by listing it whole (O(objects of the run): only
    on request, ``CheckpointManager.reload``), tombstoned ones left out."""
    _, deleting = read(loc)
    found = (parse_step(n) for n, keys in after(loc, 0).items() if MANIFEST in keys)
    return sorted(s for s in found if s is not None and s not in deleting)


def mark(loc: _location.Location, steps: Iterable[int]) -> None:
    """Write the markers of the committed ``steps`` (process 0), all at once."""
    kv = _location.kvstore(loc.kvstore, loc)
    futures = [kv.write(INDEX + step_name(s), b"") for s in steps]
    for fut in futures:
        _location.wait(fut, loc, "writing the run index")


def unmark(loc: _location.Location, steps: Iterable[int]) -> None:
    """Drop the markers of ``steps`` whose checkpoint is gone (deleted by hand), all at once."""
    kv = _location.kvstore(loc.kvstore, loc)
    futures = [kv.write(INDEX + step_name(s), None) for s in steps]
    for fut in futures:
        _location.wait(fut, loc, "writing the run index")


def delete_step(loc: _location.Location, step: int, *, keep: Collection[str] = ()) -> bool:
    """Delete the checkpoint of ``step`` from the run at ``loc`` (``keep``: as for
    ``jaxckpt._storage.catalog.delete``); on object stores its marker too, in the order of the
    module's docstring.

    Returns:
      Whether the step held anything.
    """
    where = loc.join(step_name(step))
    if loc.local is not None:
        return _catalog.delete(where, keep=keep)
    kv = _location.kvstore(loc.kvstore, loc)
    tomb = INDEX + step_name(step) + DELETING
    _location.wait(kv.write(tomb, b""), loc, "writing the run index")
    held = _catalog.delete(where, keep=keep)
    for key in (INDEX + step_name(step), tomb):  # the marker first: never a marker alone
        _location.wait(kv.write(key, None), loc, "writing the run index")
    return held
