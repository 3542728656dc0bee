"""Reading a checkpoint's arrays: boxes of zarr v3 arrays, confined to the checkpoint.

Storage's read side (``jaxckpt._storage`` writes and commits). The :class:`CheckpointReader` is given
manifest entries and read items by the load planner's protocol and yields each box as numpy,
reading ahead within a byte bound. Local: before an array is opened its chunk files are
listed (one directory walk) so that links out of the checkpoint are refused and a manifest
cannot declare more data than the checkpoint holds. Object stores: nothing is listed (a
listing grows with the checkpoint, and every process would send it); the manifest drives the
reads and their own answers say what is missing (a missing chunk is an error, never fill
values), and a box too big to allocate is checked against a listing of its array only then
(:meth:`CheckpointReader.start`).
"""

from __future__ import annotations

import abc
import collections
import functools
import itertools
import math
import os
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy.typing as npt
import tensorstore as ts

from jaxckpt._errors import CheckpointChangedError, CorruptChunkError, ManifestError
from jaxckpt._format.grid import aligned_empty, chunk_key, grid_indices, grid_shape, is_chunk_key
from jaxckpt._format.manifest import ArrayEntry, dtype_from_name
from jaxckpt._format.plan import ReadItem
from jaxckpt._storage import chunkfile as _chunkfile
from jaxckpt._storage import holds
from jaxckpt._storage import packs as _pack
from jaxckpt._storage.catalog import list_keys
from jaxckpt._storage.location import (
    Location,
    Pending,
    Stamp,
    context,
    manifest_changed,
    wait,
)
from jaxckpt._storage.objects import RecordReader
from jaxckpt._storage.writer import MAX_INFLIGHT_BYTES
from jaxckpt._storage.zarr_spec import array_spec

_STAT_ABOVE = 64 << 20  # arrays this big get their chunk files' sizes checked before a read


class Reader(abc.ABC):
    """The read side of storage as restore, ``verify``, ``export`` and ``convert`` see it.

    One subclass per format: :class:`CheckpointReader` (jaxckpt's zarr v3 arrays),
    ``jaxckpt._sources.orbax.OrbaxReader`` and ``jaxckpt._sources.safetensors.SafetensorsReader``;
    each says where a box's bytes come from (:meth:`start`), all read through :meth:`read`.
    The load path calls, on each process:

    1. ``jaxckpt._sources.detect.open_source(loc) -> (Manifest, Reader)``: the manifest (or
       one built from the foreign format's metadata) and the reader of its data. Nothing of
       the arrays is read yet.
    2. ``read(entries, items, max_inflight_bytes=...)``, once or several times: yields
       ``(item, box)`` for every ``ReadItem`` (a box of one entry of ``entries``), each box a
       numpy array of the item's sizes in the entry's logical dtype, owned by the caller.
       At most ``max_inflight_bytes`` of boxes are read ahead (at least one). Errors are
       :class:`CorruptChunkError` (data missing or damaged) or :class:`ManifestError` (the
       metadata promises what the files cannot hold), naming the key and what to do.

    Invariants: a reader reads only below ``loc``; never allocates more than the bytes the
    items ask for plus its read-ahead; never runs code from the checkpoint.
    """

    loc: Location
    kind: str  # "jaxckpt", "orbax" or "safetensors": what the reader reads

    def read(
        self,
        entries: dict[str, Any],
        items: Iterable[ReadItem],
        *,
        max_inflight_bytes: int = MAX_INFLIGHT_BYTES,
    ) -> Iterator[tuple[ReadItem, npt.NDArray[Any]]]:
        """2. Yield each item's box, in order, reading ahead within ``max_inflight_bytes``.

        Every format's one read-and-check path: :meth:`ahead` starts what the format reads
        in groups (jaxckpt's packs), and :meth:`start` each other box, all in one pipeline
        (:func:`pipelined`): a pack and an array are read in the same round trip;
        :meth:`check_unchanged` runs after the read and on its errors.
        """
        try:
            groups, rest = self.ahead(entries, items)
            yield from pipelined(
                entries,
                rest,
                lambda item: self.start(entries[item.key], item),
                max_inflight_bytes=max_inflight_bytes,
                groups=groups,
            )
        except (CorruptChunkError, ManifestError) as e:  # a file gone: often a save replaced it
            self.check_unchanged(e)
            raise
        self.check_unchanged()

    def ahead(
        self, entries: dict[str, Any], items: Iterable[ReadItem]
    ) -> tuple[list[Group], Iterable[ReadItem]]:
        """The groups of boxes this format reads together (read first, in the same pipeline
        as the rest), and the items left (by default: no group, all of them)."""
        return [], items

    @abc.abstractmethod
    def start(self, entry: Any, item: ReadItem) -> Callable[[], npt.NDArray[Any]]:
        """Start reading ``item``'s box of ``entry``; return the call that waits for it and
        checks what came back."""

    def check_unchanged(self, cause: Exception | None = None) -> None:
        """Raise if the checkpoint was replaced since its metadata was read (by default the
        format cannot tell: nothing is checked)."""
        del cause  # nothing to compare it with


class CheckpointReader(Reader):
    """Reads boxes of a jaxckpt checkpoint's arrays; each array is opened once, reads run
    concurrently (the :class:`Reader` protocol)."""

    kind = "jaxckpt"

    def __init__(
        self,
        loc: Location,
        stamp: Stamp | None = None,
        refs: dict[str, str] | None = None,
        *,
        marked: bool = False,
        records: RecordReader | None = None,
    ) -> None:
        """``records``: a v5 checkpoint's, whose boxes are byte ranges of its data objects."""
        self.loc = loc
        self._records = records
        self.stamp = stamp  # of the manifest the entries come from: see check_unchanged
        # Arrays held by a sibling step (incremental steps on object stores), followed only
        # while their holder keeps them for this step (jaxckpt._storage.holds).
        self.refs = holds.References(loc, refs or {}, marked and loc.local is None)
        self._open: dict[str, ts.TensorStore] = {}
        self._link_cache: dict[str, set[str]] = {}
        self._chunks_ok: set[str] = set()
        # Object stores: chunk keys by array path, by step's URL, listed only where asked
        # (``jaxckpt verify``, or a box too big to allocate: see _allocate).
        self._listing: dict[str, dict[str, set[str]]] = {}
        self._inplace = _chunkfile.InPlace(loc.local, str(loc)) if loc.local is not None else None

    def _store(self, entry: ArrayEntry) -> ts.TensorStore:
        store = self._open.get(entry.path)
        if store is None:
            self._check_inside(entry)
            if self.loc.local is not None:
                self.check_chunks(entry)
            # Object stores: the reads' answers say what is missing (fill_missing_data_reads
            # below), and a referenced array's marker is checked as its boxes are taken.
            loc, path = self.holder(entry.path)
            spec = array_spec(loc.child(path), entry)
            spec["fill_missing_data_reads"] = False  # a missing chunk is an error, not zeros
            try:
                # The manifest is the source of truth for the array's metadata: zarr.json is
                # not read (one file less per array), and cannot change how bytes decode.
                store = wait(
                    ts.open(spec, assume_metadata=True, context=context()),
                    self.loc,
                    f"opening array {entry.path} of key {entry.key!r}",
                )
            except ValueError as e:
                raise CorruptChunkError(
                    f"Key {entry.key!r}: array {entry.path} in {self.loc} cannot be opened or does "
                    f"not match the manifest ({e}). The checkpoint is damaged; restore another."
                ) from e
            self._open[entry.path] = store
        return store

    def _check_inside(self, entry: ArrayEntry) -> None:
        # Manifest paths are confined to arrays/ already; a symlink could still point out.
        if self.loc.local is None:
            return
        parent, links = "", False
        for part in entry.path.split("/"):
            links = links or part in self._links(self.loc.local, parent)
            parent = f"{parent}/{part}" if parent else part
        if not links:
            return
        root = os.path.realpath(self.loc.local)
        if not os.path.realpath(self.loc.local / entry.path).startswith(root + os.sep):
            raise ManifestError(
                f"Key {entry.key!r}: {entry.path} in {self.loc} is a link outside the checkpoint; "
                f"refusing to read it. Copy the checkpoint without links, or restore another."
            )

    def _links(self, local: Path, folder: str) -> set[str]:
        """Names in ``folder`` (relative to the checkpoint at ``local``) that are symlinks: one
        scandir."""
        found = self._link_cache.get(folder)
        if found is None:
            try:
                with os.scandir(local / folder) as it:
                    found = {e.name for e in it if e.is_symlink()}
            except OSError:  # missing: the read reports it
                found = set()
            self._link_cache[folder] = found
        return found

    def check_chunks(self, entry: ArrayEntry, *, slack: int = 0) -> None:
        """Check, from one listing of the array's folder, that every declared chunk is there.

        Runs before anything is allocated for the array, so a manifest declaring more chunks
        (or bigger ones) than the checkpoint holds cannot exhaust memory. Cost: one directory
        walk (local) or one list of the ``c`` prefix (object stores) per array.

        ``slack``: how many declared chunks may be missing before it raises (``jaxckpt verify``
        reads the rest one by one to name each missing chunk); the array then counts as checked.

        Raises:
          ManifestError: a link below the array's folder (it could lead outside the checkpoint).
          CorruptChunkError: a declared chunk is missing; names the key and the first one.
        """
        if entry.path in self._chunks_ok or self._v5(entry):
            return  # v5: each read's answer is checked (length, checksum) instead
        self.refs.check_held(entry)
        found = self._chunk_keys(entry)
        grid = grid_shape(entry.shape, entry.chunks)
        if (
            math.prod(grid) > len(found) + slack
        ):  # only then can one be missing: find the first, lazily
            for idx in grid_indices(grid):
                name = chunk_key(idx)
                if name not in found:
                    raise CorruptChunkError(
                        f"Key {entry.key!r}: chunk ({','.join(map(str, idx))}) of {entry.path} in "
                        f"{self.loc} is missing ({len(found)} of {math.prod(grid)} declared chunks "
                        f"found){self.refs.why_missing(entry.path)}. The checkpoint is damaged: "
                        f"restore an earlier one; `jaxckpt verify PATH` reports every damaged "
                        f"array."
                    )
        # Local: sizes, cheap here. A compressed chunk's size is not known before it is read;
        # tensorstore checks that it decodes to exactly the chunk's bytes.
        if isinstance(found, dict) and entry.nbytes > _STAT_ABOVE and not entry.compression:
            per_chunk = math.prod(entry.chunks) * dtype_from_name(entry.storage_dtype).itemsize
            want = math.prod(grid) * (per_chunk + (4 if entry.checksum == "crc32c" else 0))
            have = sum(e.stat().st_size for e in found.values())
            if have < want:  # uncompressed chunks: a file per chunk of exactly the chunk's bytes
                raise CorruptChunkError(
                    f"Key {entry.key!r}: {entry.path} in {self.loc} holds {have} bytes of chunks, "
                    f"the manifest declares {want}. The checkpoint is damaged or hostile: restore "
                    f"an earlier one; `jaxckpt verify PATH` reports every damaged array."
                )
        self._chunks_ok.add(entry.path)

    def _chunk_keys(self, entry: ArrayEntry) -> set[str] | dict[str, os.DirEntry[str]]:
        """Chunk keys (``c/i/j``, ``c`` for a scalar) of ``entry``'s array, as stored.

        Local: a dict of each key's directory entry (for its size, stat'ed only if asked).
        """
        if self.loc.local is None:
            loc, path = self.holder(entry.path)
            return self._object_chunks(loc).get(path, set())
        found: dict[str, os.DirEntry[str]] = {}
        stack: list[tuple[str | Path, str]] = [(self.loc.local / entry.path, "")]
        while stack:  # one scandir per folder; is_symlink() needs no stat (d_type)
            folder, rel = stack.pop()
            try:
                it = os.scandir(folder)
            except OSError:  # missing: reported as missing chunks below, or by the read
                continue
            with it:
                for e in it:
                    name = f"{rel}/{e.name}" if rel else e.name
                    if e.is_symlink():
                        raise ManifestError(
                            f"Key {entry.key!r}: {entry.path}/{name} in {self.loc} is a link; "
                            f"refusing to follow it (it could lead outside the checkpoint). Copy "
                            f"the checkpoint without links (cp -rL), or restore another."
                        )
                    if e.is_dir():
                        stack.append((e.path, name))
                    elif is_chunk_key(name):
                        found[name] = e
        return found

    def holder(self, path: str) -> tuple[Location, str]:
        """Where the array at storage ``path`` lives (:meth:`holds.References.holder`)."""
        return self.refs.holder(path)

    def _object_chunks(self, loc: Location) -> dict[str, set[str]]:
        """Object stores: chunk keys by array path, from one listing of the checkpoint (or of
        a step it references), cached. Only ``jaxckpt verify`` and a box too big to allocate
        ask: a restore otherwise lists nothing.
        """
        listing = self._listing.get(str(loc))
        if listing is None:
            listing = collections.defaultdict(set)
            for k in list_keys(loc):
                for m in re.finditer(r"/c(?=/|\Z)", k):  # every ``/c`` segment: an array's chunks?
                    listing[k[: m.start()]].add(k[m.start() + 1 :])
            self._listing[str(loc)] = listing
        return listing

    def ahead(
        self, entries: dict[str, Any], items: Iterable[ReadItem]
    ) -> tuple[list[Group], Iterable[ReadItem]]:
        """Packed items as groups, each needed pack read once (``jaxckpt._storage.packs``); the
        caller owns each yielded array (storage keeps no reference to it)."""
        items, packed = _pack.split(entries, items)
        for item in items:  # every box first: a chunk shared by boxes is read once for all
            entry = entries[item.key]
            if self._v5(entry):
                continue
            if (inplace := self._in_place(entry)) is not None:
                inplace.expect(entry, item.offsets, item.sizes)
        return _pack.groups(self, entries, packed), items

    def check_unchanged(self, cause: Exception | None = None) -> None:
        """Raise :class:`CheckpointChangedError` if the checkpoint was replaced since its
        manifest was read.

        Called after each :meth:`read` (and on its errors): an overwrite swaps the whole
        checkpoint at once and never brings an older one back, so a manifest still the one
        read means every box yielded came from it. One ``stat`` (or one conditional object
        read) per call, whatever the size of the read.
        """
        if cause is None and self._records is not None and self.loc.local is None:
            return  # v5 data objects are named for their save: a read that answered is its own
        if self.stamp is None or not manifest_changed(self.loc, self.stamp):
            return
        raise CheckpointChangedError(
            f"The checkpoint at {self.loc} was replaced (a save with overwrite=True) while it "
            f"was being read, so what was read may mix two saves; nothing was returned. Retry: "
            f"the next read gets the new checkpoint whole. To read an old one while a run "
            f"overwrites, save each step to its own path (CheckpointManager does)."
        ) from cause

    def _v5(self, entry: ArrayEntry) -> bool:
        return self._records is not None and self._records.covers(entry)

    def _in_place(self, entry: ArrayEntry) -> _chunkfile.InPlace | None:
        """The reader of ``entry``'s chunk files in place, if it can read them (local)."""
        if self._inplace is None or not _chunkfile.supports(self.loc.local, entry):
            return None
        self._check_inside(entry)
        self.check_chunks(entry)
        return self._inplace

    def start(self, entry: ArrayEntry, item: ReadItem) -> Callable[[], npt.NDArray[Any]]:
        if self._records is not None and self._records.covers(entry):  # v5: byte ranges
            return self._records.start(entry, item.offsets, item.sizes)
        if (inplace := self._in_place(entry)) is not None:  # local files: in place, one copy
            buf = aligned_empty(item.sizes, dtype_from_name(entry.storage_dtype))
            wait = inplace.start(entry, item.offsets, item.sizes, buf)
            return lambda: self._view(entry, wait())
        store = self._store(entry)
        if item.sizes != entry.shape:
            store = store[tuple(slice(o, o + s) for o, s in zip(item.offsets, item.sizes))]
        out = None
        dtype = dtype_from_name(entry.storage_dtype)
        if math.prod(item.sizes) * dtype.itemsize >= _ALIGNED_MIN_BYTES:
            # into an aligned buffer: CPU devices alias it, no copy
            out = self._allocate(entry, item.sizes)
            into = ts.array(out, copy=False, write=True)
            fut: ts.Future[Any] | ts.WriteFutures = into.write(store)
        else:
            fut = store.read()
        self.loc.watch(fut)
        nbytes = math.prod(item.sizes) * dtype.itemsize
        return lambda: self._result(entry, fut, out, nbytes)

    def _allocate(self, entry: ArrayEntry, sizes: tuple[int, ...]) -> npt.NDArray[Any]:
        """An aligned buffer for a box of ``entry`` (its pages are touched only as chunks
        arrive, so a manifest declaring more than is stored costs no memory beyond the chunks
        read). Where the box cannot even be reserved, the array's chunks are listed then, and
        only then, so that a missing chunk is reported as such, not as memory.

        Raises:
          CorruptChunkError: a declared chunk is missing (names the key and the chunk).
          MemoryError: the chunks are all there; the box does not fit this host's memory.
        """
        try:
            return aligned_empty(sizes, dtype_from_name(entry.storage_dtype))
        except MemoryError:
            self.check_chunks(entry)  # raises if one is missing
            raise

    def _result(
        self, entry: ArrayEntry, fut: Pending[Any], out: npt.NDArray[Any] | None, nbytes: int = 0
    ) -> npt.NDArray[Any]:
        try:
            data = wait(fut, self.loc, f"reading key {entry.key!r} ({entry.path})", nbytes)
        except ValueError as e:
            self.refs.check_held(entry)  # a referenced array deleted by hand says so
            raise _chunk_error(entry, self.loc, e) from e
        # Its holder's marker was read beside the box: checked before anyone sees the bytes.
        self.refs.check_held(entry)
        return self._view(entry, data if out is None else out)

    @staticmethod
    def _view(entry: ArrayEntry, data: npt.NDArray[Any]) -> npt.NDArray[Any]:
        if entry.storage_dtype != entry.dtype:  # a carried dtype: same bytes, logical view
            data = data.view(dtype_from_name(entry.dtype))
        return data


# A group of boxes read by one request: its bytes, and the call that starts it and returns
# the call that waits for it and yields its boxes.
Group = tuple[int, Callable[[], Callable[[], Iterable[tuple[ReadItem, npt.NDArray[Any]]]]]]


def pipelined(
    entries: dict[str, Any],
    items: Iterable[ReadItem],
    start: Callable[[ReadItem], Callable[[], npt.NDArray[Any]]],
    *,
    max_inflight_bytes: int = MAX_INFLIGHT_BYTES,
    groups: Iterable[Group] = (),
) -> Iterator[tuple[ReadItem, npt.NDArray[Any]]]:
    """Start each of ``groups``, then each item's read, in order (``start(item)`` returns a
    call that waits for its data), yielding the oldest first whenever starting the next would
    put more than ``max_inflight_bytes`` in flight; one read always runs, however large. Every
    reader (jaxckpt's, Orbax's, safetensors') reads ahead through this one loop. An item holds
    its box's bytes in flight (a partial chunk read in place adds a block per read thread, not
    per item: ``jaxckpt._storage.chunkfile``).
    """

    def one(item: ReadItem) -> Callable[[], Iterable[tuple[ReadItem, npt.NDArray[Any]]]]:
        result = start(item)
        return lambda: ((item, result()),)

    def size(item: ReadItem) -> int:
        itemsize = dtype_from_name(entries[item.key].storage_dtype).itemsize
        return math.prod(item.sizes) * itemsize

    units: Iterable[Group] = itertools.chain(
        groups, ((size(i), functools.partial(one, i)) for i in items)
    )
    pending: collections.deque[tuple[int, Callable[[], Iterable[tuple[ReadItem, Any]]]]] = (
        collections.deque()
    )
    inflight = 0
    for n, begin in units:
        while pending and inflight + n > max_inflight_bytes:
            m, result = pending.popleft()
            inflight -= m
            yield from result()
        pending.append((n, begin()))
        inflight += n
    while pending:
        yield from pending.popleft()[1]()


_ALIGNED_MIN_BYTES = 1 << 20


def file_bytes_read() -> int:
    """Bytes of local chunk files this process has read: tensorstore's own counter plus the
    chunks read in place (``jaxckpt._storage.chunkfile``). Tests and benchmarks use it to check that a
    restore reads each region once."""
    found = ts.experimental_collect_matching_metrics("/tensorstore/kvstore/file/bytes_read")
    by_tensorstore: int = sum(v.get("value", 0) for m in found for v in m["values"])
    return by_tensorstore + _chunkfile.bytes_read()


def _chunk_error(entry: ArrayEntry, loc: Location, e: Exception) -> CorruptChunkError:
    msg = str(e)
    where = re.search(r'"([^"]*/c/[0-9/]+)"', msg)
    chunk = where.group(1).rsplit("/c/", 1)[1].replace("/", ",") if where else "?"
    what = (
        "is missing"
        if "NOT_FOUND" in msg
        else "fails its checksum"
        if "igest" in msg
        else "cannot be read"
    )
    return CorruptChunkError(
        f"Key {entry.key!r}: chunk ({chunk}) of {entry.path} in {loc} {what} ({msg}). The "
        f"checkpoint is damaged: restore an earlier one; `jaxckpt verify PATH` lists every bad chunk."
    )
