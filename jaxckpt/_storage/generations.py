"""The commit protocol of object stores (``memory://``, ``s3://``, ``gs://``): no rename.

A checkpoint is a prefix whose ``manifest.json`` names its arrays; the manifest written last is
the commit. The steps of one save:

1. :func:`prepare` (coordinator; the others receive the generation by broadcast): list the
   prefix (an object jaxckpt did not write refuses the save) and read the manifest (one there
   refuses a save without ``overwrite``), both at once. An empty prefix is written as it is;
   a prefix holding anything (the checkpoint being replaced, a failed save's leftovers,
   arrays kept for other steps, another save in progress) gets a fresh **generation**
   ``gXXXXXXXX/`` that no key there starts with: a save never writes over an object it did
   not make. Taking the empty prefix is a conditional create of its ``writer.json``, the
   save's lease (``jaxckpt._storage.lease``), so two saves never share one generation; it is
   sent with the listing and the read (one round trip for the three) and deleted again if
   the prefix was not empty.
2. The arrays are written under the generation (all processes).
3. :func:`commit` (coordinator): the manifest's paths are moved into the generation
   (``Manifest.relocated``) and parsed once more; the ``held-by`` markers of its references
   are written (``jaxckpt._storage.holds``), or waited for where an incremental save started
   them beside its data (:func:`hold_early`); then ``manifest.json`` is written only if it is
   still the one step 1 saw (compare-and-swap on its generation), so a save that another
   commit overtook fails and leaves the winner whole.
4. :func:`clean_up` after the commit, in the background (the save returns once committed):
   every other object the prefix held when step 1 listed it goes (the replaced generation,
   leftovers), except the markers and the arrays they hold (listed afresh then). It never
   raises: the checkpoint is committed whatever happens there, and what is left goes at the
   next save or delete of the same prefix, or a manager's clean-up.

Nothing is deleted before the commit, so a save that fails, or that a crash stops, leaves the
last committed checkpoint and everything it references as they were.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from jaxckpt._errors import CheckpointError, ManifestError
from jaxckpt._format.manifest import Manifest, storage_entries
from jaxckpt._format.names import DATA, HELD_BY, MANIFEST, WRITER, is_own_key
from jaxckpt._runtime import pools
from jaxckpt._storage import holds, resume
from jaxckpt._storage.catalog import (
    Listing,
    array_of,
    delete_keys,
    exactly,
    is_generation,
    list_keys,
    prefix_range,
)
from jaxckpt._storage.lease import Lease, dead_plan, is_lease
from jaxckpt._storage.location import ABSENT, DeadlineError, Location, kvstore, wait
from jaxckpt._storage.messages import exists_error, lost_error, not_ours_to_replace, write_error
from jaxckpt._storage.urls import endpoint

logger = logging.getLogger("jaxckpt")


class OutcomeUnknown(CheckpointError):
    """The commit write failed in a way that may still have written it: nothing is deleted."""


@dataclasses.dataclass
class Target:
    """What :func:`prepare` found at the prefix, for :func:`commit`."""

    generation: str  # "" or "gXXXXXXXX/": where this save's arrays go
    seen: Any = ABSENT  # the stamp generation of the manifest step 1 read (coordinator)
    old_refs: dict[str, str] = dataclasses.field(default_factory=dict)  # the replaced one's
    lease: Lease | None = None  # the coordinator's
    probe: Any = None  # the future of :func:`_probe`'s write, if this save checks the store
    before: set[str] | None = None  # the prefix's keys step 1 listed (coordinator)
    resumed: bool = False  # a failed save's generation of the same plan, adopted
    # The held-by markers started beside the data (:func:`hold_early`): what, and their wait.
    held: tuple[dict[str, set[str]], Callable[[], None]] | None = None


def prepare(
    loc: Location,
    overwrite: bool,
    is_coordinator: bool,
    broadcast: Callable[[str, str], str] | None,
    plan: str | None = None,
) -> Target:
    """Step 1: check the prefix and choose the generation (see the module's docstring).

    ``plan``: this save's plan, recorded in its ``writer.json``; a dead save's generation
    that records the same one is adopted instead of a fresh one (``jaxckpt._storage.resume``).
    """
    if not is_coordinator:
        if broadcast is None:
            raise ValueError("a non-coordinator Writer needs broadcast= to find the generation")
        generation, resumed = resume.told(broadcast("generation", ""))
        return Target(generation, resumed=resumed)
    kv = kvstore(loc.kvstore, loc)
    # The listing, the manifest's read and the plain prefix's lease (created only if absent)
    # go out together: a save to an empty prefix waits on one round trip here.
    listing = Listing(loc)
    reading = kv.read(MANIFEST)
    plain, taking = Lease.start_object_store(loc, "", only_if_absent=True, plan=plan)
    try:
        old = wait(reading, loc, f"reading {MANIFEST}")
        keys = listing.keys()
        _refuse(loc, overwrite, old.state == "value", keys)  # before the lease's own errors
    except BaseException:
        _let_go(plain, taking)
        raise
    held = plain.taken(taking)
    try:
        target = _choose(loc, old, keys, held, plan)
    except BaseException:
        if held is not None:
            held.release()
        raise
    target.probe = _probe(loc, target.lease)
    if broadcast is not None:
        try:
            broadcast("generation", resume.tell(target.generation, target.resumed))
        except BaseException:
            if target.lease is not None:
                target.lease.release()
            raise
    return target


# The stores checked by this process, and those found to ignore preconditions (or not known
# to honour them): (driver, endpoint, bucket).
_probed: set[tuple[str, str, str]] = set()
_ignoring: set[tuple[str, str, str]] = set()


def _store_of(loc: Location) -> tuple[str, str, str]:
    spec = loc.kvstore
    return (spec["driver"], endpoint(spec), str(spec.get("bucket", "")))


def _probe(loc: Location, lease: Lease | None) -> Any:
    """Once per process and store: start a write that a store honouring the preconditions the
    commit relies on must refuse (see :meth:`Lease.probe`); :func:`_check_probe` reads its
    answer at the commit. It runs beside the data: no round trip is waited for."""
    store = _store_of(loc)
    if lease is None or loc.kvstore["driver"] == "memory" or store in _probed:
        return None
    _probed.add(store)
    return lease.probe()


def _check_probe(loc: Location, probe: Any) -> bool:
    """Whether the store honours preconditions, as far as known: warn (once per process and
    store) if it wrote what :func:`_probe` asked only if absent, so that concurrent saves to
    one path are not protected."""
    store = _store_of(loc)
    if probe is None:
        return store not in _ignoring
    try:
        written = wait(probe, loc, "checking that the store honours preconditions").generation
    except (CheckpointError, ValueError):  # unknown: the commit goes on; checked no more
        _ignoring.add(store)  # unknown counts as ignored: markers are merged as before
        return False
    if written:
        _ignoring.add(store)
        logger.warning(
            "%s: the store at %s ignores write preconditions (a create-only-if-absent of an "
            "existing object succeeded), which jaxckpt's commit relies on to keep two saves to "
            "one path apart. A save by one writer is safe; concurrent saves to one path are "
            "NOT protected on this store (both may report success, one checkpoint wins). "
            "Emulators such as fake-gcs-server do this; GCS and AWS S3 honour them. Save each "
            "writer to its own path (CheckpointManager steps are), or use a store that honours "
            "them. Said once per process and store (docs/object_storage.md).",
            loc,
            endpoint(loc.kvstore),
        )
    return not written


def _let_go(lease: Lease, taking: Any) -> None:
    """Release ``lease`` if the write ``taking`` made it (never raises)."""
    try:
        held = lease.taken(taking)
    except Exception:  # noqa: BLE001 - not taken, or unknown: a stale writer.json only waits
        return
    if held is not None:
        held.release()


def _refuse(loc: Location, overwrite: bool, committed: bool, keys: list[str]) -> None:
    """Step 1's checks: a committed checkpoint without ``overwrite``, a listing the
    credentials may not make, an object jaxckpt did not write."""
    if committed and not overwrite:
        raise exists_error(loc)
    if committed and not keys:  # tensorstore reads some refused listings as empty ones (gcs)
        raise CheckpointError(
            f"Save to {loc}: its {MANIFEST} exists but listing the prefix found nothing, so the "
            f"credentials may read but not list it. Grant list permission on the bucket; "
            f"nothing was written."
        )
    foreign = [k for k in keys if not is_own_key(k)]
    if foreign:
        raise not_ours_to_replace(loc, foreign[0], committed=committed)


def _choose(
    loc: Location, old: Any, keys: list[str], held: Lease | None, plan: str | None = None
) -> Target:
    """Step 1's decision from the manifest read (``old``), the listing (``keys``) and the
    plain prefix's lease if this save took it (``held``): the plain prefix if it was empty,
    else a dead save's generation of the same ``plan``, else a fresh generation (``held`` is
    released then)."""
    committed = old.state == "value"
    target = Target("", old.stamp.generation if committed else ABSENT, _refs(old.value))
    mine = {WRITER} if held is not None else set()  # the listing may have seen it
    target.before = set(keys) - mine
    if held is not None and not target.before:  # empty, and no other save took it first
        target.lease = held
        return target
    adopted = _adopt(loc, old, sorted(target.before), plan) if plan is not None else None
    if adopted is not None:
        if held is not None:
            held.release()
        target.generation, target.lease = adopted
        target.resumed = True
        return target
    target.generation = _fresh_generation(keys)
    lease, taking = Lease.start_object_store(loc, target.generation, plan=plan)
    if held is not None:
        held.release()  # beside the generation's lease
    target.lease = lease.taken(taking)
    return target


def _adopt(loc: Location, old: Any, keys: list[str], plan: str) -> tuple[str, Lease] | None:
    """A generation (or the plain prefix) a dead save of ``plan`` left, its lease taken over
    by compare-and-swap on its ``writer.json``; never the committed checkpoint's own."""
    committed = None
    if old.state == "value":
        try:
            committed = generation_of(Manifest.from_json(old.value))
        except ManifestError:
            return None  # which generation it uses is unknown: none is adopted
    kv = kvstore(loc.kvstore, loc)
    for top in sorted({k[: -len(WRITER)] for k in keys if is_lease(k)} - {committed}):
        got = wait(kv.read(top + WRITER), loc, f"reading {top}{WRITER}")
        if dead_plan(loc, top + WRITER, got) != plan:
            continue
        lease, taking = Lease.start_object_store(loc, top, plan=plan, if_equal=got.stamp.generation)
        held = lease.taken(taking)
        if held is not None:
            return top, held
    return None


def generation_of(manifest: Manifest) -> str:
    """The generation (``""``: the plain prefix) a committed manifest's arrays are in."""
    entries = storage_entries(manifest).values()
    top = next(iter(entries)).path.split("/", 1)[0] if entries else ""
    return top + "/" if is_generation(top) else ""


def _fresh_generation(keys: Iterable[str]) -> str:
    tops = {k.split("/", 1)[0] for k in keys}
    while True:
        generation = f"g{uuid.uuid4().hex[:8]}"
        if generation not in tops:
            return generation + "/"


def _refs(raw: bytes | None) -> dict[str, str]:
    if not raw:
        return {}
    try:
        return Manifest.from_json(raw).refs
    except ManifestError:
        return {}  # what it referenced is unknown: its markers stay (they only keep data)


def encode(loc: Location, target: Target, manifest: Manifest) -> tuple[Manifest, bytes]:
    """Step 3's manifest: ``manifest`` moved into the target's generation, and the bytes
    :func:`commit` writes, parsed once more (CPU only: a save may run it while its data is
    written, see ``Writer.encode_ahead``).

    Raises:
      ManifestError: the bytes would not read back as a manifest.
    """
    moved = manifest.relocated(target.generation)
    if moved.refs:  # its reader checks the markers commit writes (jaxckpt._storage.holds)
        moved = dataclasses.replace(moved, created={**moved.created, "held_by": True})
    data = moved.to_json()
    Manifest.from_json(data, where=f"{loc}/{MANIFEST} (about to be committed)")
    return moved, data


def hold_early(loc: Location, target: Target, refs: dict[str, str], name: str) -> None:
    """Step 3's markers, started beside the data once the references are known (every
    process knows them after the incremental save's exchange): the commit then waits for
    them instead of writing them, one round trip fewer. Only where the store honours
    preconditions (known from step 1's probe); elsewhere the commit writes them as before."""
    referenced = holds.by_holder(refs)
    if referenced and _check_probe(loc, target.probe):
        held = {loc.sibling(h): p for h, p in referenced.items()}
        target.held = (referenced, holds.start_hold_new(held, name))


def commit(
    loc: Location,
    target: Target,
    manifest: Manifest,
    name: str,
    encoded: tuple[Manifest, bytes] | None = None,
) -> None:
    """Steps 3 and 4: the markers, the manifest (compare-and-swap), then the clean-up.

    ``encoded``: what :func:`encode` returned for ``manifest`` and ``target``, if it ran already.

    Raises:
      CheckpointExistsError: another save committed at the prefix meanwhile (this one's arrays
        are deleted; the other checkpoint is untouched).
      CheckpointError: the commit write failed, or its outcome is unknown (then nothing is
        deleted, and the message says which checkpoint is committed where it could tell).
    """
    moved, data = encoded if encoded is not None else encode(loc, target, manifest)
    referenced = holds.by_holder(moved.refs)
    honoured = _check_probe(loc, target.probe)
    early, target.held = target.held, None
    try:
        if early is not None and early[0] == referenced:  # written beside the data
            early[1]()
        elif honoured:  # all at once, created if absent
            if early is not None:
                early[1]()  # merged into below: a marker only keeps data
            holds.hold_new({loc.sibling(h): p for h, p in referenced.items()}, name)
        else:  # read, merge, write each: what a create-only-if-absent would do
            for holder, paths in referenced.items():
                holds.hold(loc.sibling(holder), name, paths)
        kv = kvstore(loc.kvstore, loc)
    except ValueError as e:  # the store refused: nothing is committed
        raise write_error(loc, "writing the held-by markers of its references", e) from e
    what = f"writing {MANIFEST} (the commit)"
    try:
        done = wait(kv.write(MANIFEST, data, if_equal=target.seen), loc, what)
    except (CheckpointError, ValueError) as e:  # past the deadline, or the store's error
        if not _committed_after_all(loc, data, e):
            raise
    else:
        if not done.generation and not _own_after_all(loc, data):
            drop(loc, target)
            raise lost_error(loc, committed=True)
    # The clean-up lists in the background (no round trip after the commit is waited for) and
    # deletes only keys step 1 listed too: never a generation of a save that started later.
    pools.after_commit(_clean_up_later, loc, target, referenced, name)


def _clean_up_later(
    loc: Location, target: Target, keep_markers_of: dict[str, set[str]], name: str
) -> None:
    # A prefix that was empty before the save holds nothing to delete: no listing (it would
    # return every object this save wrote).
    empty = target.before is not None and not target.before and not target.old_refs
    clean_up(loc, target, keep_markers_of, name, [] if empty else _listed(loc), target.before)


def _own_after_all(loc: Location, data: bytes) -> bool:
    """After the commit's compare-and-swap was refused: whether the manifest there is this
    save's all the same. A write whose answer was lost is retried (tensorstore's retries), and
    the retry is refused because the first one landed: the bytes read back are this save's
    (they name its generation). Anything else is another save's commit."""
    try:
        mine = read_once(loc) == data
    except (CheckpointError, ValueError):
        return False  # unknown: taken for a competing save, as before
    if mine:
        logger.warning(
            "%s: the commit's answer was lost and its retry refused; it is in place", loc
        )
    return mine


def _committed_after_all(loc: Location, data: bytes, error: Exception) -> bool:
    """After the commit write failed: read the manifest once more (within a fresh deadline).
    ``True`` if it is this save's; otherwise raise what is known, deleting nothing."""
    try:
        now = read_once(loc)
    except (CheckpointError, ValueError):
        now = None
        state = (
            "It could not be read back either, so it is unknown whether this save or the "
            "previous checkpoint is committed there"
        )
    else:
        if now == data:
            logger.warning("%s: the commit write failed (%s), but it is in place", loc, error)
            return True
        state = (
            "Read back now, the previous checkpoint is committed there"
            if now
            else "Read back now, no checkpoint is committed there"
        ) + " (the write may still land later)"
    cause = error.cause if isinstance(error, DeadlineError) else error  # no "not committed"
    raise OutcomeUnknown(
        f"Save to {loc}: the outcome of its commit is unknown: writing {MANIFEST} failed "
        f"({cause}). {state}. Nothing was deleted, so both checkpoints' data is kept. Check "
        f"with `jaxckpt inspect {loc}` once the store answers, then save again if needed."
    ) from error


def read_once(loc: Location) -> bytes | None:
    """The manifest's bytes at ``loc`` (``None`` if absent), within a fresh deadline."""
    fresh = Location(loc.url)
    got = wait(kvstore(fresh.kvstore, fresh).read(MANIFEST), fresh, f"re-reading {MANIFEST}")
    return got.value if got.state == "value" else None


def clean_up(
    loc: Location,
    target: Target,
    keep_markers_of: dict[str, set[str]],
    name: str,
    keys: list[str] | None,
    before: set[str] | None = None,
) -> None:
    """Step 4 (never raises; in the background after a commit): delete, of ``keys`` (the
    prefix listed after the commit; of them only those in ``before``, if given: the keys the
    prefix held before the save), what the committed manifest does not use; release the
    markers the replaced checkpoint needed and this one does not; release the lease."""
    try:
        if keys is None:
            raise CheckpointError(f"listing {loc} after the commit failed")
        kv = kvstore(loc.kvstore, loc)
        kept = holds.held(loc, keys)
        if kept is None:
            logger.warning("%s: a held-by marker cannot be read; keeping all old arrays", loc)
        else:
            doomed = [
                k
                for k in keys
                if _replaced(k, target.generation, kept) and (before is None or k in before)
            ]
            delete_keys(kv, loc, doomed, keys)
        old = holds.by_holder(target.old_refs)
        for holder in old.keys() - keep_markers_of.keys():
            holds.release(loc.sibling(holder), name)
        for holder in old.keys() & keep_markers_of.keys():  # hold exactly what is used now
            holds.hold(loc.sibling(holder), name, keep_markers_of[holder], merge=False)
    except Exception as e:  # noqa: BLE001 - the checkpoint is committed
        logger.warning(
            "%s is committed, but cleaning up after it failed (%s); what is left goes at the "
            "next save or delete of it",
            loc,
            e,
        )
    finally:
        if target.lease is not None:
            target.lease.release()


def tidy(loc: Location, manifest: Manifest) -> None:
    """Step 4 for a committed checkpoint whose save died after its commit (a clean-up found its
    ``writer.json`` dead): delete what that save's step 4 would have; never raises."""
    generation = generation_of(manifest)
    try:
        kv = kvstore(loc.kvstore, loc)
        wait(kv.delete_range(exactly(generation + WRITER)), loc, f"deleting {WRITER}")
    except CheckpointError as e:
        logger.warning("could not tidy %s: %s", loc, e)
        return
    clean_up(loc, Target(generation), {}, loc.name, _listed(loc))


def _listed(loc: Location) -> list[str] | None:
    """The keys at ``loc``'s prefix for :func:`clean_up`; ``None`` if listing failed."""
    try:
        return list_keys(loc)
    except CheckpointError:
        return None


def _replaced(key: str, generation: str, kept: set[str]) -> bool:
    """Whether the clean-up after a commit into ``generation`` deletes ``key``: it is in
    another generation (the plain prefix counting as one) and neither the manifest, a marker
    nor an array a marker keeps."""
    top = key.split("/", 1)[0]
    mine = key.startswith(generation) if generation else not (is_generation(top) and "/" in key)
    if mine or key == MANIFEST or top == HELD_BY or not is_own_key(key):
        return False
    return array_of(key) not in kept


def drop(loc: Location, target: Target) -> None:
    """After a failed or lost save: delete this save's own objects (its generation's, and the
    markers it wrote stay: they only keep data), nothing else; never raises."""
    try:
        kv = kvstore(loc.kvstore, loc)
        if target.generation:
            wait(kv.delete_range(prefix_range(target.generation)), loc, "deleting this save's data")
            return
        # The plain prefix was empty when this save took it: its arrays/ (or data/) are its own.
        keys = list_keys(loc)
        ours = [k for k in keys if k.startswith(("arrays/", DATA + "/"))]
        delete_keys(kv, loc, ours, keys)
    except Exception as e:  # noqa: BLE001 - leftovers go at a later save or clean-up
        logger.warning("could not delete the data of a failed save at %s: %s", loc, e)
