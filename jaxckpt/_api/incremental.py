"""A save against a base checkpoint: the planner's content decisions, storage's links.

``jaxckpt._planning.reuse`` decides from content which boxes the base already holds;
this module carries those decisions out for one save, on every process:

* **local files**: each process hashes its boxes as they pass to the writer and hard-links the
  base's chunk files for the boxes the base holds (``Writer.link``), writing the rest. No
  exchange: the digests travel to the coordinator with the "written" barrier.
* **object stores** (no links): every process hashes its boxes first, the processes agree in
  one small exchange which arrays changed anywhere, and each array that changed nowhere is
  recorded as a reference to the base's copy (``Manifest.refs``); the others are written whole.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy.typing as npt

from jaxckpt._errors import CheckpointError, CheckpointNotFoundError
from jaxckpt._format.manifest import ArrayEntry, Manifest, storage_entries
from jaxckpt._format.plan import ReadItem, WriteItem
from jaxckpt._planning.reuse import Match, Reuse, Tracker, digest, recorded
from jaxckpt._runtime.distributed import SaveSync
from jaxckpt._storage import writer as _storage
from jaxckpt._storage.location import Location, Stamp, start_read_stamped
from jaxckpt._storage.reader import CheckpointReader

Items = Iterable[tuple[WriteItem, npt.NDArray[Any]]]
Box = tuple[str, tuple[int, ...], tuple[int, ...]]  # (key, offsets, sizes)


class Increment:
    """One save's reuse of ``base``.

    Args:
      base: the base checkpoint (committed; e.g. the run's previous step); ``None``: nothing
        to reuse, the save only records its digests (the first step of an incremental run,
        so that the second compares without reading it back).
      loc: where this save goes.
      manifest: this save's planned manifest.
      entries: this save's storage entries (arrays, and packs as arrays), by key.

    Raises:
      CheckpointNotFoundError, ManifestError: ``base`` is no readable checkpoint.
    """

    def __init__(
        self,
        base: Location | None,
        loc: Location,
        manifest: Manifest,
        entries: dict[str, ArrayEntry],
        base_read: Callable[[], tuple[bytes, Stamp]] | None = None,
    ) -> None:
        if base is not None and (base.local is None) != (loc.local is None):
            raise CheckpointError(
                f"Incremental save to {loc} from base {base}: the base must be on the same kind "
                f"of storage (a local path for a local save, the same bucket for an object "
                f"store). Save without base=, or pick a base beside the new checkpoint."
            )
        self.base, self.loc, self.entries = base, loc, entries
        self.writer: _storage.Writer | None = None
        self.base_manifest = (
            Manifest(tree={}, entries={})  # holds nothing: every box is new
            if base is None
            else _base_manifest(base, base_read or start_read_stamped(base))
        )
        if self.base_manifest.objects is not None:  # a v5 base: its records are neither
            self.base_manifest = Manifest(tree={}, entries={})  # linked nor referenced yet
        self.reuse = Reuse(manifest, self.base_manifest)
        self.base_name = None if base is None else _sibling_name(base, loc)
        # References are to a sibling step only, never to this path's own older generation.
        self.refs_ok = loc.local is None and self.base_name not in (None, loc.name)
        link = self._link if loc.local is not None and base is not None else None
        self._base_reader = (
            None if base is None else CheckpointReader(base, None, self.base_manifest.refs)
        )
        self._base_entries = storage_entries(self.base_manifest)
        self.tracker = Tracker(self.reuse, entries, link, self._read_digest)
        self.refs: dict[str, str] = {}
        self._read_ahead: dict[Box, str | None] = {}  # base digests read for to_write

    def _link(self, item: WriteItem, match: Match) -> bool:
        entry = self.entries[item.key]
        # to_write sets the writer; a link is made only with a base
        assert self.writer is not None and self.base is not None
        return self.writer.link(self.base, match.base_entry.path, entry, item.offsets, item.sizes)

    def _read_digest(self, item: WriteItem, base_entry: ArrayEntry) -> str | None:
        """The digest of the base's bytes of ``item``'s box, read from the base (which
        recorded none); ``None`` where they cannot be read, and the box is written."""
        box = (base_entry.key, item.offsets, item.sizes)
        if box in self._read_ahead:
            return self._read_ahead.pop(box)
        return self._read_base([ReadItem(*box)]).get(box)

    def _base_digests(self, items: list[tuple[WriteItem, Any]]) -> dict[Box, str | None]:
        """The digests of the base's boxes that deciding ``items`` will read (see
        ``Reuse.unrecorded``), read in one pipeline: one round trip for all, not one each."""
        want = []
        for item, data in items:
            b = self.reuse.unrecorded(item.key, item.offsets, item.sizes, data)
            if b is not None:
                want.append(ReadItem(b.key, item.offsets, item.sizes))
        return self._read_base(want) if want else {}

    def _read_base(self, want: list[ReadItem]) -> dict[Box, str | None]:
        """The digest of each box of ``want`` in the base (``None``: it cannot be read)."""
        assert self._base_reader is not None  # only a base's entries match
        got: dict[Box, str | None] = {(w.key, w.offsets, w.sizes): None for w in want}
        try:
            for w, data in self._base_reader.read(self._base_entries, want):
                got[(w.key, w.offsets, w.sizes)] = digest(data)
        except CheckpointError:
            pass  # the boxes not read yet are written
        return got

    @property
    def hashes_all_first(self) -> bool:
        """Whether :meth:`to_write` hashes every box before it hands one on (an object store
        with a base), rather than lazily as the boxes pass."""
        return self.loc.local is None and self.base is not None

    def to_write(
        self,
        items: Items,
        sync: SaveSync,
        writer: _storage.Writer,
        *,
        ahead_bytes: int | None = None,
    ) -> tuple[Iterator[tuple[WriteItem, Any]], set[str]]:
        """The items ``writer`` still writes, and the keys of arrays nobody writes.

        Local files: lazily, linking as the items pass, hashing at most ``ahead_bytes`` ahead
        (``None``: ``reuse.HASH_AHEAD``; a budgeted save's ring holds those boxes). Object
        stores: every box is hashed first, then one exchange settles which arrays changed on
        no process; those become references and are neither created nor written.
        """
        self.writer = writer
        if not self.hashes_all_first:  # no exchange without a base
            return self.tracker.to_write(items, ahead_bytes=ahead_bytes), set()
        items = list(items)  # every box is held until the exchange below anyway
        self._read_ahead = self._base_digests(items)
        hashed = [(item, data, self.tracker.decide(item, data)) for item, data in items]
        changed = json.loads(sync.reduce("reuse", json.dumps(sorted(self.tracker.changed)), _union))
        whole = self.reuse.whole_arrays(changed) if self.refs_ok else set()
        for key in sorted(whole):
            match = self.reuse.match_array(key)
            target = match.base_ref or f"../{self.base_name}/{match.base_entry.path}"
            if not target.startswith(f"../{self.loc.name}/"):  # a step saved again never
                self.refs[self.entries[key].path] = target  # refers to its own name: written
        whole = {k for k in whole if self.entries[k].path in self.refs}
        writer.hold_early(self.refs)  # alike on every process now: the markers go with the data
        self.tracker.reused_bytes = sum(i.nbytes for i, _, _ in hashed if i.key in whole)
        return ((i, d) for i, d, _ in hashed if i.key not in whole), whole

    def order(self, items: Iterable[WriteItem]) -> list[WriteItem]:
        """The order in which to resolve this process's items (``Reuse.order``)."""
        return self.reuse.order(items)

    def payload(self) -> str:
        """What this process tells the coordinator at the "written" barrier."""
        t = self.tracker
        return json.dumps({"digests": t.digests, "probes": t.probes, "reused": t.reused_bytes})

    def manifest(self, planned: Manifest, payloads: dict[int, str]) -> Manifest:
        """The manifest to commit: the planned one with every process's digests and the
        references recorded (coordinator)."""
        digests: dict[str, dict[str, str]] = {}
        probes: dict[str, dict[str, str]] = {}
        reused = 0
        for text in payloads.values():
            got = json.loads(text)
            reused += got["reused"]
            for merged, field in ((digests, "digests"), (probes, "probes")):
                for path, boxes in got[field].items():
                    merged.setdefault(path, {}).update(boxes)
        name = None if self.base is None else self.base_name or str(self.base)
        return recorded(
            planned, digests, refs=self.refs, probes=probes, base_name=name, reused_bytes=reused
        )

    @property
    def reused_bytes(self) -> int:
        """Bytes of this process's boxes that were not written, being the base's already."""
        return self.tracker.reused_bytes


def _base_manifest(base: Location, read: Callable[[], tuple[bytes, Stamp]]) -> Manifest:
    try:
        raw = read()[0]
    except CheckpointNotFoundError:
        raise CheckpointNotFoundError(
            f"The base of this incremental save, {base}, holds no committed checkpoint. Pass "
            f"base= a committed checkpoint (e.g. the previous step), or save without base=."
        ) from None
    return Manifest.from_json(raw, where=f"{base}/manifest.json")


def _union(values: list[str]) -> str:
    return json.dumps(sorted({k for v in values for k in json.loads(v)}))


def _sibling_name(base: Location, loc: Location) -> str | None:
    """The base's name if it sits beside ``loc`` (the steps of one run), else ``None``."""
    if base.local is not None and loc.local is not None:
        return base.local.name if base.local.parent == loc.local.parent else None
    parent = loc.url.rstrip("/").rpartition("/")[0]
    return base.name if base.url.rstrip("/").rpartition("/")[0] == parent else None
