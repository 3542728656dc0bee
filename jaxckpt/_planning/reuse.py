"""Incremental reuse: which boxes of this save the base checkpoint already holds, by content.

A save given a base (``jaxckpt.save(..., base=PREV)``, or ``CheckpointManager(...,
incremental=True)``, whose base is the newest committed step) hashes every box it writes and
records the digests in its manifest (``Manifest.digests``). A box is reused instead of written
when the base holds the same array — same key, shape, dtype, storage dtype, chunk grid and
checksum, and for a pack the same members at the same offsets — and recorded, for the very
same box, the digest this save computes for its bytes. Nothing is compared by identity: a
jitted step hands back new arrays whose bytes did not change, and they are found.

A large box is first probed (:func:`probe`: 64 KiB of it hashed); where the base's probe of
the same box differs, the box changed and is written without its full digest, so a run where
everything changes (pre-training) hashes almost nothing. Otherwise the full digest decides;
where the base took none (the box changed in the base's step), the base's box is read back
and hashed once, so a box that stops changing is reused from the first step it is equal.

The digest is XXH3-128 of the box's bytes in C order and little-endian byte order: 128 bits,
so two different boxes of one array agree by accident with probability 2^-128. It runs at
memory speed (tens of GB/s), so a save that reuses nothing costs what it did. It is no
defence against someone who crafts tensors to collide: the base is trusted like the run's own
directory (docs/format.md).

How a reused box is stored is storage's business: a hard link to the base's chunk files on
local file systems, a reference to the base's whole array on object stores.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable, Iterable, Iterator, Reversible, Sequence
from concurrent import futures
from concurrent.futures import Future
from typing import Any

import numpy as np
import numpy.typing as npt
import xxhash

from jaxckpt._format.manifest import REFS_VERSION, ArrayEntry, Manifest, storage_entries
from jaxckpt._format.manifest_check import box_key
from jaxckpt._format.plan import WriteItem
from jaxckpt._runtime import pools

PROBE_MIN = 256 << 10  # boxes at least this large get a probe before their full digest
PROBE_BLOCKS, PROBE_BLOCK = 16, 4096  # a probe hashes 16 blocks of 4 KiB spread over the box
HASH_AHEAD = 64 << 20  # bytes of boxes hashed ahead of the one being decided
HASH_AHEAD_ITEMS = 8


def digest(data: npt.NDArray[Any]) -> str:
    """The 128-bit content digest of a box: 32 hex digits.

    The bytes are taken in C order and little-endian byte order, so a Fortran-ordered or
    big-endian array has the digest of the values it holds, as stored.

    Example:
      >>> import numpy as np
      >>> a = np.arange(6, dtype=np.float32).reshape(2, 3)
      >>> digest(a) == digest(np.asfortranarray(a)) == digest(a.astype(">f4"))
      True
      >>> digest(a) == digest(np.where(a == 5, -0.0, a).astype(np.float32))
      False
    """
    if data.dtype.byteorder == ">":
        data = data.astype(data.dtype.newbyteorder("<"))
    flat = np.ascontiguousarray(data).reshape(-1)
    return xxhash.xxh3_128_hexdigest(flat.view(np.uint8).data)


def probe(data: npt.NDArray[Any]) -> str | None:
    """The digest of a fixed sample of a large box: 16 blocks of 4 KiB spread evenly over its
    bytes (C order, little-endian, as :func:`digest`); ``None`` for a small box or one that is
    not contiguous (only its full digest is taken).

    Two boxes with different probes differ; equal probes prove nothing (the full digest
    decides). So a box that changes every step (pre-training) costs 64 KiB of hashing, not
    all its bytes.

    Example:
      >>> import numpy as np
      >>> a = np.zeros(1 << 18, np.float32)  # 1 MiB
      >>> b = a.copy(); b[0] = 1.0
      >>> probe(a) != probe(b), probe(a[:10]) is None
      (True, True)
    """
    if data.nbytes < PROBE_MIN or not data.flags.c_contiguous:
        return None
    if data.dtype.byteorder == ">":
        data = data.astype(data.dtype.newbyteorder("<"))
    flat = data.reshape(-1).view(np.uint8).data
    h = xxhash.xxh3_128()
    last = len(flat) - PROBE_BLOCK
    for i in range(PROBE_BLOCKS):
        at = i * last // (PROBE_BLOCKS - 1)
        h.update(flat[at : at + PROBE_BLOCK])
    return h.hexdigest()


@dataclasses.dataclass(frozen=True)
class Match:
    """A box the base already holds: the base's storage entry of the same array."""

    base_entry: ArrayEntry
    base_ref: str | None  # where the base itself found the array (a sibling step), if anywhere


class Reuse:
    """Decides, box by box, whether ``base`` already holds the bytes this save would write.

    Args:
      manifest: the manifest of this save (its plan's).
      base: the base checkpoint's manifest.
    """

    def __init__(self, manifest: Manifest, base: Manifest) -> None:
        new = storage_entries(manifest)
        old = storage_entries(base)
        mine, theirs = _pack_layouts(manifest), _pack_layouts(base)
        self.base = base
        self._same: dict[str, ArrayEntry] = {}
        for key, e in new.items():
            b = old.get(key)
            if b is None or not _same_array(e, b):
                continue
            if (e.path in mine or b.path in theirs) and mine.get(e.path) != theirs.get(b.path):
                continue  # a pack: reused only with the same members at the same offsets
            self._same[key] = b

    def match(
        self,
        key: str,
        offsets: Sequence[int],
        sizes: Sequence[int],
        found: str,
        base_digest: Callable[[ArrayEntry], str | None] | None = None,
    ) -> Match | None:
        """The base's entry if it holds bytes of digest ``found`` for this very box of ``key``.

        ``base_digest(base_entry)``: the digest of the base's box, for a base that recorded
        none (saved without ``base=``, by an older jaxckpt, or a box that changed in the base's
        own step, which took only its probe): it reads the base's bytes.
        """
        b = self._same.get(key)
        if b is None:
            return None
        recorded = self.base.digests.get(b.path, {}).get(box_key(offsets, sizes))
        if recorded is None and base_digest is not None:  # e.g. it changed in the base's step
            recorded = base_digest(b)
        return Match(b, self.base.refs.get(b.path)) if recorded == found else None

    def same_probe(
        self, key: str, offsets: Sequence[int], sizes: Sequence[int], found: str
    ) -> bool | None:
        """Whether the base's probe of this box is ``found``; ``None`` where the base has no
        probe of it (not comparable, or saved without probes)."""
        b = self._same.get(key)
        theirs = None if b is None else self._probes(b.path).get(box_key(offsets, sizes))
        return None if theirs is None else theirs == found

    def order(self, items: Iterable[WriteItem]) -> list[WriteItem]:
        """``items`` in the order to resolve them: the boxes expected to change after the
        first ``HASH_AHEAD_ITEMS`` expected unchanged, then the rest. So the hash threads start
        at once, and the writes of the changed boxes (and the disk's write-back of them)
        overlap the hashing of the others instead of following it. Only an order: the
        digests decide what is written."""
        items = list(items)
        changed = [self._likely_changed(i.key, i.offsets, i.sizes) for i in items]
        same = [i for i, c in zip(items, changed) if not c]
        first = same[:HASH_AHEAD_ITEMS]
        return first + [i for i, c in zip(items, changed) if c] + same[HASH_AHEAD_ITEMS:]

    def _likely_changed(self, key: str, offsets: Sequence[int], sizes: Sequence[int]) -> bool:
        """The base has no comparable array, or took only the box's probe (it changed in the
        base's own step, and will likely change again)."""
        b = self._same.get(key)
        if b is None:
            return True
        box = box_key(offsets, sizes)
        return box in self._probes(b.path) and box not in self.base.digests.get(b.path, {})

    def _probes(self, path: str) -> dict[str, str]:
        return self.base.probes.get(path, {})

    def unrecorded(
        self, key: str, offsets: Sequence[int], sizes: Sequence[int], data: npt.NDArray[Any]
    ) -> ArrayEntry | None:
        """The base's entry of ``key`` where :meth:`match` will read the base's bytes of this
        box (the base recorded no digest of it, and its probe, if any, is ``data``'s): a save
        reads all such boxes at once, not one round trip each."""
        b = self._same.get(key)
        if b is None or box_key(offsets, sizes) in self.base.digests.get(b.path, {}):
            return None
        found = probe(data)
        same = None if found is None else self.same_probe(key, offsets, sizes, found)
        return None if same is False else b

    def match_array(self, key: str) -> Match:
        """The base's entry of ``key``, an array :meth:`whole_arrays` found unchanged."""
        b = self._same[key]
        return Match(b, self.base.refs.get(b.path))

    def whole_arrays(self, changed: Iterable[str]) -> set[str]:
        """Keys of arrays the base holds whole (every box unchanged): all comparable arrays
        but the ``changed`` ones (keys with a box that differs, on any process)."""
        return set(self._same) - set(changed)


class Tracker:
    """Hashes each box on its way to storage and keeps those the base already holds back.

    Args:
      reuse: the decisions against the base.
      entries: this save's storage entries (arrays, and packs as arrays), by key.
      link: ``link(item, match) -> bool``: store the box by reference to the base (a hard link
        of its chunk files); ``False`` where that is impossible, and the box is written.
      base_digest: ``base_digest(item, base_entry)``: the digest of the base's bytes of the
        item's box, read from the base, where the base recorded none.
    """

    def __init__(
        self,
        reuse: Reuse,
        entries: dict[str, ArrayEntry],
        link: Callable[[WriteItem, Match], bool] | None = None,
        base_digest: Callable[[WriteItem, ArrayEntry], str | None] | None = None,
    ) -> None:
        self.reuse, self.entries, self.link, self.base_digest = reuse, entries, link, base_digest
        self.digests: dict[str, dict[str, str]] = {}  # by storage path, then box
        self.probes: dict[str, dict[str, str]] = {}  # likewise
        self.reused_bytes = 0
        self.changed: set[str] = set()  # keys with a box the base does not hold

    def check(
        self, item: WriteItem, data: npt.NDArray[Any], found: str | None = None
    ) -> Match | None:
        """Record the box's digest (``found``, or computed here); the base's match, if the
        base holds the same bytes."""
        found = digest(data) if found is None else found
        self.digests.setdefault(self.entries[item.key].path, {})[
            box_key(item.offsets, item.sizes)
        ] = found
        read = None if self.base_digest is None else functools.partial(self.base_digest, item)
        match = self.reuse.match(item.key, item.offsets, item.sizes, found, read)
        if match is None:
            self.changed.add(item.key)
        return match

    def needs_digest(self, item: WriteItem, data: npt.NDArray[Any]) -> bool:
        """Record the box's probe; whether its full digest is worth taking: not where the
        base's probe of the same box differs (it changed: written, digest left out)."""
        found = probe(data)
        if found is None:
            return True
        path, box = self.entries[item.key].path, box_key(item.offsets, item.sizes)
        self.probes.setdefault(path, {})[box] = found
        if self.reuse.same_probe(item.key, item.offsets, item.sizes, found) is False:
            self.changed.add(item.key)
            return False
        return True

    def decide(self, item: WriteItem, data: npt.NDArray[Any]) -> Match | None:
        """:meth:`check` where the probe leaves it open, else ``None`` (changed)."""
        return self.check(item, data) if self.needs_digest(item, data) else None

    def to_write(
        self,
        items: Iterable[tuple[WriteItem, npt.NDArray[Any]]],
        *,
        ahead_bytes: int | None = None,
    ) -> Iterator[tuple[WriteItem, npt.NDArray[Any]]]:
        """The items to write: every one whose box the base lacks or ``link`` cannot reuse.

        Boxes are hashed on the hash threads a few boxes ahead (the hash releases the GIL),
        at most ``ahead_bytes`` (default ``HASH_AHEAD``) beyond the box being decided; each
        decided box is linked here, while the next ones are hashed (a link is metadata only: a
        hard link per chunk file, a folder per row of chunks). While the box being decided is
        still hashed, this thread hashes a later one itself instead of idling
        (:class:`_Hashing`). No box is referenced here while the next one is asked for beyond
        those hashed ahead (a budgeted save reuses a box's memory once nothing holds it).
        """
        limit = HASH_AHEAD if ahead_bytes is None else ahead_bytes
        pool = pools.hash_pool()
        ahead: collections.deque[_Hashing] = collections.deque()
        held = 0
        try:
            for item, data in items:
                if not self.needs_digest(item, data):  # changed: written without waiting
                    yield item, data
                    del data
                    continue
                ahead.append(_Hashing(item, data, pool.submit(digest, data)))
                del data
                held += item.nbytes
                while ahead and (held > limit or len(ahead) > HASH_AHEAD_ITEMS):
                    held -= ahead[0].item.nbytes
                    yield from self._decide(ahead.popleft(), ahead)
            while ahead:
                yield from self._decide(ahead.popleft(), ahead)
        finally:  # no hash may still read a box after the caller gave up on the save
            futures.wait([h.future for h in ahead])

    def _decide(
        self, box: _Hashing, later: collections.deque[_Hashing]
    ) -> Iterator[tuple[WriteItem, npt.NDArray[Any]]]:
        match = self.check(box.item, box.data, box.result(later))
        if match is not None and self.link is not None and self.link(box.item, match):
            self.reused_bytes += box.item.nbytes
            return
        yield box.item, box.data


@dataclasses.dataclass
class _Hashing:
    """A box on its way through the hash threads."""

    item: WriteItem
    data: npt.NDArray[Any]
    future: Future[str]
    found: str | None = None  # the digest, where the deciding thread took it itself

    def result(self, later: Reversible[_Hashing]) -> str:
        """This box's digest. Until it is known, the calling thread hashes the latest of
        ``later`` (then this box) that no hash thread has started: no core waits idle while
        boxes are left to hash (on two cores: one hash thread, and this one when it would
        wait), and the save goes on where the hash threads are all busy."""
        while self.found is None and not self.future.done():
            free = (b for b in (*reversed(later), self) if b.found is None and b.future.cancel())
            box = next(free, None)
            if box is None:
                break  # a hash thread has this box and every later one: wait for it
            box.found = digest(box.data)
        return self.found if self.found is not None else self.future.result()


def _same_array(e: ArrayEntry, b: ArrayEntry) -> bool:
    return (e.shape, e.dtype, e.storage_dtype, e.chunks, e.checksum, e.compression) == (
        b.shape,
        b.dtype,
        b.storage_dtype,
        b.chunks,
        b.checksum,
        b.compression,
    )


def _pack_layouts(manifest: Manifest) -> dict[str, list[tuple[int, str, tuple[int, ...], str]]]:
    """Per pack path, its members as ``(offset, key, shape, dtype)`` in offset order."""
    out: dict[str, list[tuple[int, str, tuple[int, ...], str]]] = {}
    for e in manifest.entries.values():
        if isinstance(e, ArrayEntry) and e.pack is not None:
            out.setdefault(e.path, []).append((e.offset, e.key, e.shape, e.dtype))
    return {p: sorted(m) for p, m in out.items()}


def recorded(
    manifest: Manifest,
    digests: dict[str, dict[str, str]],
    *,
    refs: dict[str, str] | None = None,
    probes: dict[str, dict[str, str]] | None = None,
    base_name: str | None = None,
    reused_bytes: int = 0,
) -> Manifest:
    """``manifest`` with this save's digests (by storage path), references and base recorded.

    A manifest with references is format version 3: a reader that predates them refuses it
    instead of looking for the arrays in the wrong place.
    """
    created = dict(manifest.created)
    if base_name is not None:
        created.update(base=base_name, reused_bytes=reused_bytes)
    return dataclasses.replace(
        manifest,
        digests=digests,
        probes=probes or {},
        refs=refs or {},
        created=created,
        version=max(REFS_VERSION, manifest.version) if refs else manifest.version,
    )
