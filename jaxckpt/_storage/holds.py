"""What a checkpoint keeps for its siblings: the ``held-by/`` markers of object stores.

An incremental step B on an object store does not copy an array its base already holds: its
manifest's ``refs`` point at the holder's copy (``"arrays/w": "../A/arrays/w"``). Before B
commits, B's save writes a marker into the holder, ``A/held-by/B``::

    {"format": 1, "paths": ["arrays/w"]}

Whatever deletes objects in A (an overwrite's clean-up after its commit, retention, a manager's
clean-up of leftovers, ``catalog.delete``) keeps every array a marker names, so no save, delete
or overwrite of A can break B. A marker only ever keeps data: a marker that cannot be read keeps
everything in A. It goes when B no longer needs it: B deleted by jaxckpt, B saved again without
references into A, or B's save failed before its commit (a crash there leaves a marker that
keeps A's arrays until a later save or delete of B replaces or removes it).

A manifest whose references have markers says so (``"held_by": true`` in ``created``), and its
reader checks the marker before it reads a referenced array: were the holder deleted by hand
and saved again, its new arrays at the same path are not the referenced ones, and the read
fails instead of returning them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping

import tensorstore as ts

from jaxckpt._errors import CorruptChunkError, ManifestError
from jaxckpt._format.manifest import ArrayEntry
from jaxckpt._format.names import HELD_BY, is_storage_path
from jaxckpt._storage.location import ABSENT, Location, kvstore, wait

_MARKER_BYTES = 1 << 24  # far above any real marker: a bigger one is damage, never read


def by_holder(refs: Mapping[str, str]) -> dict[str, set[str]]:
    """``{holder step: {its storage paths}}`` of a manifest's ``refs`` (``../A/arrays/w``).

    Example:
      >>> got = by_holder({"arrays/w": "../00000001/arrays/w", "arrays/b": "../00000001/arrays/b"})
      >>> {holder: sorted(paths) for holder, paths in got.items()}
      {'00000001': ['arrays/b', 'arrays/w']}
    """
    out: dict[str, set[str]] = {}
    for target in refs.values():
        _, holder, path = target.split("/", 2)
        out.setdefault(holder, set()).add(path)
    return out


def marker(referrer: str) -> str:
    """The key of ``referrer``'s marker in a holder."""
    return f"{HELD_BY}/{referrer}"


def hold(holder: Location, referrer: str, paths: Iterable[str], *, merge: bool = True) -> None:
    """Write ``referrer``'s marker into ``holder``: it keeps ``paths`` (and, with ``merge``,
    what the marker kept already: a save replacing ``referrer`` still needs the old ones until
    it commits)."""
    kv = kvstore(holder.kvstore, holder)
    keep = set(paths)
    if merge:
        keep |= _read(kv, holder, marker(referrer)) or set()
    wait(kv.write(marker(referrer), _record(keep)), holder, f"writing {marker(referrer)}")


def hold_new(holders: Mapping[Location, set[str]], referrer: str) -> None:
    """:func:`hold` into every holder at once, for a save's commit: each marker is created
    only if absent (one round trip for all, the usual case: ``referrer`` is a new step);
    where one exists already (``referrer`` saved again), it is read and merged, all at once.
    Only for stores that honour preconditions (``jaxckpt._storage.generations`` knows)."""
    start_hold_new(holders, referrer)()


def start_hold_new(holders: Mapping[Location, set[str]], referrer: str) -> Callable[[], None]:
    """:func:`hold_new`'s writes, started; the call that waits for them (and merges where a
    marker existed). A save starts them beside its data, once it knows its references."""
    key = marker(referrer)
    created = []
    for loc, paths in holders.items():
        kv = kvstore(loc.kvstore, loc)
        created.append((loc, kv, paths, kv.write(key, _record(paths), if_equal=ABSENT)))

    def finish() -> None:
        reads = [
            (loc, kv, paths, kv.read(key))
            for loc, kv, paths, fut in created
            if not wait(fut, loc, f"writing {key}").generation
        ]
        writes = []
        for loc, kv, paths, fut in reads:
            old = _parse(wait(fut, loc, f"reading {key}"))
            writes.append((loc, kv.write(key, _record(paths | (old or set())))))
        for loc, written in writes:
            wait(written, loc, f"writing {key}")

    return finish


def _record(paths: Iterable[str]) -> bytes:
    return json.dumps({"format": 1, "paths": sorted(paths)}).encode()


def release(holder: Location, referrer: str) -> None:
    """Remove ``referrer``'s marker from ``holder`` (the arrays stay until a delete)."""
    kv = kvstore(holder.kvstore, holder)
    key = marker(referrer)
    wait(kv.delete_range(ts.KvStore.KeyRange(key, key + "\0")), holder, f"deleting {key}")


def referrers(keys: Iterable[str]) -> list[str]:
    """The steps whose markers a checkpoint's listing ``keys`` holds."""
    return [k[len(HELD_BY) + 1 :] for k in keys if k.startswith(HELD_BY + "/")]


def held_for(holder: Location, referrer: str) -> set[str]:
    """The paths ``holder`` keeps for ``referrer`` (none if its marker is gone or damaged)."""
    return start_held_for(holder, referrer)()


def start_held_for(holder: Location, referrer: str) -> Callable[[], set[str]]:
    """:func:`held_for` in two steps: the marker's read starts now (beside other requests),
    the call returned waits for it."""
    key = marker(referrer)
    fut = kvstore(holder.kvstore, holder).read(key)
    return lambda: _parse(wait(fut, holder, f"reading {key}")) or set()


def held(loc: Location, keys: Iterable[str]) -> set[str] | None:
    """The storage paths of ``loc`` that its markers keep (``keys``: its listing), or ``None``
    where a marker cannot be read: then everything is kept."""
    kv = None
    out: set[str] = set()
    for key in keys:
        if not key.startswith(HELD_BY + "/"):
            continue
        kv = kv or kvstore(loc.kvstore, loc)
        paths = _read(kv, loc, key)
        if paths is None:
            return None
        out |= paths
    return out


def _read(kv: ts.KvStore, loc: Location, key: str) -> set[str] | None:
    """The paths a marker keeps; ``set()`` if there is none, ``None`` if it is damaged."""
    return _parse(wait(kv.read(key), loc, f"reading {key}"))


def _parse(got: ts.KvStore.ReadResult) -> set[str] | None:
    if got.state != "value":
        return set()
    if len(got.value) > _MARKER_BYTES:
        return None
    try:
        paths = json.loads(got.value)["paths"]
    except (ValueError, KeyError, TypeError):
        return None
    if not isinstance(paths, list) or not all(is_storage_path(p) for p in paths):
        return None
    return set(paths)


class References:
    """An incremental step's references into its siblings, as its reader follows them: where
    each referenced array lives, and whether its holder still keeps it for this step.

    ``refs``: the manifest's (storage path -> ``../STEP/arrays/NAME``); ``marked``: the holders
    keep held-by markers for them (the manifest says so), read beside the step's first reads.

    Raises:
      ManifestError: the step is on a local disk (references are followed on object stores only).
    """

    def __init__(self, loc: Location, refs: dict[str, str], marked: bool) -> None:
        self.loc = loc
        self.refs = refs
        self._marked = marked
        self._held: dict[str, set[str]] = {}  # by holder: what it keeps for this step
        if refs and loc.local is not None:
            raise ManifestError(
                f"{loc} is an incremental step saved on an object store: {len(refs)} of its "
                f"arrays live in sibling steps ({next(iter(refs.values()))}), which jaxckpt "
                f"reads only on object stores. Restore it there, or `jaxckpt convert` it there "
                f"into a self-contained checkpoint first."
            )
        self._markers: dict[str, Callable[[], set[str]]] = {}
        if refs and marked:
            for name in by_holder(refs):
                holder = loc.sibling(name)
                self._markers[str(holder)] = start_held_for(holder, loc.name)

    def holder(self, path: str) -> tuple[Location, str]:
        """Where the array at storage ``path`` lives: this checkpoint, or the sibling step an
        incremental step references (``../STEP/arrays/NAME``), and its path there."""
        ref = self.refs.get(path)
        if ref is None:
            return self.loc, path
        _, step, rest = ref.split("/", 2)
        return self.loc.sibling(step), rest

    def check_held(self, entry: ArrayEntry) -> None:
        """A referenced array is read only while its holder keeps it for this step (its
        held-by marker names it): never another save's array at the same path.

        Raises:
          CorruptChunkError: the holder's marker no longer names the array.
        """
        if not self._marked or entry.path not in self.refs:
            return
        loc, path = self.holder(entry.path)
        held = self._held.get(str(loc))
        if held is None:
            started = self._markers.pop(str(loc), None)
            held = started() if started is not None else held_for(loc, self.loc.name)
            self._held[str(loc)] = held
        if path not in held:
            raise CorruptChunkError(
                f"Key {entry.key!r}: this incremental step references {path} in {loc}, which no "
                f"longer keeps it for this step (its held-by marker is gone: that step was "
                f"deleted or replaced by hand). The checkpoint is damaged: restore an earlier "
                f"one; `jaxckpt verify PATH` reports every damaged array."
            )

    def why_missing(self, path: str) -> str:
        """The words a missing-chunk error adds for a referenced array (else nothing)."""
        if path not in self.refs:
            return ""
        loc, _ = self.holder(path)
        return (
            f"; this incremental step references that array in {loc}, whose data is gone "
            f"(deleted by hand? retention never deletes what a kept step references)"
        )
