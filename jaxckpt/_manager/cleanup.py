"""What a manager removes when it opens a run directory: the leftovers of dead saves.

A save leaves temporary data until it commits: a hidden staging directory
``.00000100.tmp-XXXXXXXX`` (local), or objects under a step's prefix without a manifest (object
stores). A crash leaves the same behind, and an interrupted delete or overwrite leaves
``-deleted`` and ``-old`` siblings. :func:`clean_up` removes what dead saves left and never a
live save's data: a save holds a lease until it commits (``jaxckpt._storage.lease``), so a
second manager opened on a run while another process saves (an evaluator) changes nothing.
On object stores the arrays other steps reference stay (``jaxckpt._storage.holds``), and what
is looked at comes from the run's index (``jaxckpt._manager.run_index``): the deletes it
names unfinished and the steps after its newest one, never a listing of the whole run
(except ``whole=True``, after an incremental step's delete).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable

from jaxckpt._errors import CheckpointError
from jaxckpt._format.manifest import Manifest
from jaxckpt._format.names import MANIFEST, parse_staging, parse_step, step_name
from jaxckpt._manager import run_index as _index
from jaxckpt._manager.retention import METRICS
from jaxckpt._storage import catalog as _catalog
from jaxckpt._storage import generations as _generations
from jaxckpt._storage import holds as _holds
from jaxckpt._storage import lease as _lease
from jaxckpt._storage import local_commit as _local_commit
from jaxckpt._storage import location as _location
from jaxckpt._storage import resume as _resume

logger = logging.getLogger("jaxckpt")
METRICS_TMP = re.compile(re.escape(f".{METRICS}.tmp-") + r"[0-9a-f]+")

# What committed steps (by name) reference in other steps: {holder: {storage paths}}.
Referenced = Callable[[Iterable[str]], dict[str, set[str]]]


def clean_up(
    run: _location.Location, referenced: Referenced, *, whole: bool = False
) -> list[int] | None:
    """Remove what dead saves and interrupted deletes left in the run directory ``run``.

    Object stores: what the run's index (``jaxckpt._manager.run_index``) says is left: the
    deletes it names unfinished, and the steps after its newest one (a listing of those
    only; ``whole``: of the whole run, which also finds what an interrupted incremental
    delete left in older steps); the committed steps found there without a marker are added
    to the index.

    Returns:
      Object stores: the committed steps, as found; ``None`` on a local directory.
    """
    if run.local is None:
        return _clean_up_objects(run, referenced, whole)
    names = [p.name for p in run.local.iterdir()]
    newest = _newest(n for n in names if (run.local / n / MANIFEST).is_file())
    for p in run.local.iterdir():
        staging = parse_staging(p.name)
        if staging is not None and parse_step(staging[0]) is not None:
            if _for_retry(staging[0], newest) and not staging[2] and _resume.plan_of(p):
                continue  # a failed save of the next step: its retry resumes it
            if not _local_commit.clean_leftover(p, *staging):
                continue
        elif METRICS_TMP.fullmatch(p.name) and not _lease.local_is_live(p):
            p.unlink(missing_ok=True)
        else:
            continue
        logger.info("cleaned up %s (left by an interrupted save or delete)", p)
    return None


def _clean_up_objects(run: _location.Location, referenced: Referenced, whole: bool) -> list[int]:
    """Object stores: finish the deletes the index names unfinished, then clean the steps
    :func:`_clean_listed` is given (the index's tail, or the whole run), then index the
    committed ones the index lacks. Returns the committed steps."""
    found = _index.survey(run)
    if found.deleting:
        keep = referenced(step_name(s) for s in found.steps)
        for step in sorted(found.deleting):
            _index.delete_step(run, step, keep=keep.get(step_name(step), ()))
            logger.info("cleaned up step %d of %s (its delete was interrupted)", step, run)
    listing = _catalog.listing(run) if whole else dict(found.tail)
    for step in found.deleting:
        listing.pop(step_name(step), None)
    committed = clean_listed(run, referenced, listing, max(found.steps, default=None))
    steps = set(found.steps) | {s for s in map(parse_step, committed) if s is not None}
    missing = sorted(steps - found.marked)
    if missing:
        _index.mark(run, missing)
    return sorted(steps)


def clean_listed(
    run: _location.Location,
    referenced: Referenced,
    listing: dict[str, list[str]],
    newest: int | None,
) -> set[str]:
    """The prefixes of ``listing``'s steps without a manifest whose save is not live (arrays
    other steps reference stay), what a save that died right after its commit left in its
    step, and the markers of steps that no longer exist; ``newest``: the newest committed
    step of the run. Returns the names of the committed steps listed."""
    committed = {n for n, keys in listing.items() if MANIFEST in keys}
    steps = [n for n in listing if parse_step(n) is not None]
    live = {n for n in steps if _writing(run.join(n), listing[n])}
    # A save that committed after the listing has let its lease go since: its manifest is
    # looked for again, before its markers or its prefix are taken for a dead save's.
    committed |= {n for n in steps if n not in committed | live and _location.exists(run.join(n))}
    keep = referenced(n for n in steps if n in committed)
    newest = max(newest or -1, _newest(committed) or -1)
    live |= {  # a failed save of the next step, kept: its retry resumes it
        n
        for n in steps
        if n not in committed
        and _for_retry(n, None if newest < 0 else newest)
        and _resume.resumable(run.join(n), listing[n])
    }
    for name in steps:
        loc = run.join(name)
        for referrer in _holds.referrers(listing[name]):
            if referrer not in committed and referrer not in live:
                _holds.release(loc, referrer)
        if name in live:
            continue
        if name in committed:
            if _stale(listing[name]):  # its save died after the commit, or it kept old arrays
                _tidy(loc)
            continue
        try:
            if _catalog.delete(loc, keep=keep.get(name, ())):
                logger.info("cleaned up %s (left by an interrupted save or delete)", loc)
        except CheckpointError as e:  # holds objects jaxckpt did not write: keep
            logger.warning("not cleaning up %s: %s", loc, e)
    return {n for n in committed if parse_step(n) is not None}


def _newest(names: Iterable[str]) -> int | None:
    """The newest step among ``names`` (``None``: none is a step)."""
    steps = [s for s in map(parse_step, names) if s is not None]
    return max(steps) if steps else None


def _for_retry(name: str, newest: int | None) -> bool:
    """Whether the uncommitted step ``name`` is newer than every committed one: a failed save
    of it that recorded its plan stays for a retry to resume (``jaxckpt._storage.resume``);
    the next commit, of it or of a later step, removes it."""
    step = parse_step(name)
    return step is not None and (newest is None or step > newest)


def _tidy(loc: _location.Location) -> None:
    try:
        manifest = Manifest.from_json(_location.read_manifest(loc))
    except CheckpointError:  # damaged, or gone since the listing: nothing to tidy
        return
    _generations.tidy(loc, manifest)
    logger.info("cleaned up %s (left by a save interrupted after its commit)", loc)


def _stale(keys: list[str]) -> bool:
    """Whether a committed step's keys hold more than its commit uses, seen from the listing
    alone: a lease its save left, or arrays of more than one generation (an overwrite's old
    arrays, kept while a marker held them; ``_tidy`` deletes those no marker holds now)."""
    generations = {k.split("/", 1)[0] for k in keys if _catalog.array_of(k) is not None}
    plain = {g for g in generations if not _catalog.is_generation(g)}
    return any(_lease.is_lease(k) for k in keys) or len(generations - plain) + bool(plain) > 1


def _writing(loc: _location.Location, keys: list[str]) -> bool:
    """Whether a live save writes into the step at ``loc`` (a fresh ``writer.json`` there)."""
    return any(_lease.object_is_live(loc, k) for k in keys if _lease.is_lease(k))
