"""Storage's side of a save: the ``Writer`` of one checkpoint's zarr v3 arrays.

Storage knows nothing of pytrees: it is given manifest entries and (item, data) pairs by the
planner's protocol. Each array is a zarr v3 array with a regular chunk grid aligned to shard
boundaries and a ``crc32c`` checksum on every chunk. How a save becomes visible at once and
whole is each store's commit protocol: ``jaxckpt._storage.local_commit`` (a staging directory
renamed into place) and ``jaxckpt._storage.generations`` (object stores: the manifest written
last). Boxes an incremental save takes from its base are hard links (``jaxckpt._storage.links``).
"""

from __future__ import annotations

import asyncio
import collections
import os
import queue
import shutil
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy.typing as npt
import tensorstore as ts

from jaxckpt._format.manifest import ArrayEntry, Manifest
from jaxckpt._format.objects import DataObjects
from jaxckpt._format.plan import WriteItem
from jaxckpt._runtime import pools
from jaxckpt._storage import directwrite, generations, local_commit, resume, writeback
from jaxckpt._storage.lease import Lease
from jaxckpt._storage.links import Linker
from jaxckpt._storage.location import ABSENT, Location, Pending, context, kvstore, wait
from jaxckpt._storage.messages import lost_error, write_error
from jaxckpt._storage.objects import RecordWriter
from jaxckpt._storage.zarr_spec import array_spec, zarr_json

MAX_INFLIGHT_BYTES = 1 << 30


class Writer:
    """Writes one checkpoint. The storage side of the save protocol; ``jaxckpt.save`` calls,
    with every process's ``Writer`` for the same ``loc``:

    1. ``Writer(loc, overwrite=..., is_coordinator=..., broadcast=...)`` (all processes): the
       coordinator checks the target (``CheckpointExistsError``, or foreign files) and makes
       and leases the hidden staging directory (local) or chooses the generation (object
       stores), or, with ``plan=``, adopts a dead save's of the same plan
       (``jaxckpt._storage.resume``); the others learn its name through ``broadcast``.
    2. ``open_arrays(entries, create=True)`` (coordinator), then, after a barrier,
       ``open_arrays(own entries, create=False)`` (the others): one zarr array per entry.
    3. ``write(entries, items)`` (all processes): each item's box into its array, as whole
       chunks (the planner aligned every box to the chunk grid, so no two processes touch one
       chunk); at most ``max_inflight_bytes`` queued. Data comes from the planner only.
    4. ``flush()`` (all processes): this process's bytes are durable (the coordinator's on
       local files: at the commit, with the manifest).
    5. After a barrier, ``commit(manifest)`` (coordinator): ``manifest.json`` is written last,
       then made visible at once (``syncfs`` and a rename, or the manifest is the commit on
       object stores).

    On any failure, ``abort(error)`` (every process that made one): this save's own data goes,
    or stays for a retry of the same plan where ``resume.worth_keeping`` says so; the last committed
    checkpoint at ``loc`` is never touched (nor, where the outcome of an object-store commit is
    unknown, this save's data).
    """

    def __init__(
        self,
        loc: Location,
        *,
        overwrite: bool,
        is_coordinator: bool = True,
        broadcast: Callable[[str, str], str] | None = None,
        plan: str | None = None,
    ) -> None:
        """``broadcast(name, value)``: the coordinator's value on every process (multi-process).

        ``plan``: what identifies the save's plan (its agreed digest): a failed save's
        leftovers of the same plan are adopted, and the chunks they hold already are not
        written again (``jaxckpt._storage.resume``); ``None``: always start afresh."""
        self.loc = loc
        self.overwrite = overwrite
        self.is_coordinator = is_coordinator
        self.arrays: dict[str, Any] = {}  # by key, once opened
        self._opening: dict[str, tuple[ArrayEntry, Any]] = {}  # by key, still being opened
        # By key: each entry and its zarr.json's write (object stores).
        self._metadata: dict[str, tuple[ArrayEntry, Any]] = {}
        self._kv: ts.KvStore | None = None
        self._create = False
        self._linkers: dict[str, Linker] = {}  # by base folder (link())
        self.staging: Path | None = None  # the coordinator's, on local files
        self._lease: Lease | None = None
        self._target: generations.Target | None = None  # object stores
        self._ahead: tuple[Manifest, Future[tuple[Manifest, bytes]]] | None = None
        self._keep = False  # an object-store commit of unknown outcome: abort deletes nothing
        self._records: RecordWriter | None = None  # format v5 (use_objects)
        self._plan = plan
        resumed = False
        if loc.local is not None:
            name = ""
            if is_coordinator:  # the others write into the same dir (shared storage)
                self.staging, self._lease, resumed = local_commit.make_staging(loc, overwrite, plan)
                name = resume.tell(self.staging.name, resumed)
            elif broadcast is None:
                raise ValueError("a non-coordinator Writer needs broadcast= to find the staging")
            if broadcast is not None:
                try:
                    name = broadcast("staging", name)
                except BaseException:
                    self.abort()
                    raise
            name, resumed = resume.told(name)
            self.root = {"driver": "file", "path": str(loc.local.parent / name) + "/"}
        else:  # object store: no rename, the manifest written last is the commit
            try:
                self._target = generations.prepare(loc, overwrite, is_coordinator, broadcast, plan)
            except ValueError as e:  # the store refused a read, a listing or the lease
                raise write_error(loc, "preparing its target", e) from e
            self.root = {**loc.kvstore, "path": loc.kvstore["path"] + self._target.generation}
            resumed = self._target.resumed
        # A failed save's leftovers adopted: each chunk is checked before it is written.
        self.resumed = resume.Present(self.root, loc) if resumed else None

    def use_objects(
        self, objects: DataObjects | None, entries: dict[str, ArrayEntry], process: int
    ) -> None:
        """Write format v5 (object stores): this process's chunks as records in its few data
        objects (``jaxckpt._storage.objects``), no zarr arrays. Call before ``open_arrays``;
        ``None``: a file per chunk, as without the call."""
        if objects is None:
            return
        if self.loc.local is not None:
            raise ValueError("data objects are written on object stores only")
        by_path = {e.path: e for e in entries.values()}
        self._records = RecordWriter(
            self._root_kv, self.loc, objects, by_path, process, self.resumed
        )

    def open_arrays(self, entries: Iterable[ArrayEntry], *, create: bool) -> None:
        """Start creating (coordinator) or opening (others, after it) the zarr arrays, all at
        once. Each is waited for where it is first written, and all by :meth:`opened`, which
        ``flush`` calls: the first boxes are resolved and hashed meanwhile.

        On object stores no array waits on a request: each is opened from the manifest's
        metadata (``assume_metadata``, as a reader does), and its ``zarr.json`` (the bytes
        tensorstore would write, :func:`zarr_json`) is created, only if absent, beside the
        chunks; ``flush`` waits for it."""
        self._create = create
        if self._records is not None:  # format v5: no arrays, no zarr.json
            return
        for e in entries:
            spec = {**array_spec(self._child(e.path), e), "store_data_equal_to_fill_value": True}
            if self.loc.local is None:  # object stores: no round trip before the data
                self._opening[e.key] = (e, ts.open(spec, assume_metadata=True, context=context()))
                if create:  # an adopted generation's are this plan's: written again
                    fut = self._root_kv().write(
                        f"{e.path}/zarr.json",
                        zarr_json(e),
                        if_equal=ABSENT if self.resumed is None else None,
                    )
                    self.loc.watch(fut)
                    self._metadata[e.key] = (e, fut)
                continue
            self._opening[e.key] = (  # adopted leftovers: an array may exist already
                e,
                ts.open(
                    spec,
                    create=create,
                    open=not create or self.resumed is not None,
                    context=context(),
                ),
            )

    def _root_kv(self) -> ts.KvStore:
        if self._kv is None:
            self._kv = kvstore(self.root, self.loc)
        return self._kv

    def opened(self) -> None:
        """Wait until every array :meth:`open_arrays` started exists (before the barrier that
        lets the other processes open them, and before the commit)."""
        for key in list(self._opening):
            self._array(key)

    def _described(self) -> None:
        """Object stores: wait until each array's ``zarr.json`` is created (if absent), the
        writes that :meth:`open_arrays` started beside the data (no other process needs them:
        every array is opened from the manifest's metadata)."""
        for key in list(self._metadata):
            what = f"creating the zarr.json of key {key!r}"
            e, fut = self._metadata.pop(key)
            try:
                done = wait(fut, self.loc, what)
            except ValueError as err:
                raise write_error(self.loc, what, err) from err
            if not done.generation and not self._own_metadata(e):
                raise lost_error(self.loc, committed=False, writing=True)

    def _own_metadata(self, e: ArrayEntry) -> bool:
        """Whether the ``zarr.json`` whose create-if-absent was refused holds this save's
        bytes: its first write landed but the answer was lost, and tensorstore's retry was
        refused. One save writes into a generation: the one whose lease (created only if
        absent, naming its holder) is there; so the same bytes, with this save's lease there,
        are this save's own. Anything else is another save's."""
        lease = self._target.lease if self._target is not None else None
        what = f"reading back the zarr.json of key {e.key!r}"
        try:
            got = wait(self._root_kv().read(f"{e.path}/zarr.json"), self.loc, what)
        except ValueError:
            return False
        same = got.state == "value" and got.value == zarr_json(e)
        return same and lease is not None and lease.is_mine()

    def _array(self, key: str) -> Any:
        store = self.arrays.get(key)
        if store is not None:
            return store
        e, fut = self._opening.pop(key)
        what = f"{'creating' if self._create else 'opening'} array {e.path} of key {key!r}"
        try:
            store = self.arrays[key] = wait(fut, self.loc, what)
        except ValueError as err:
            if self._create and not self.overwrite and "ALREADY_EXISTS" in str(err):
                # Object stores: another save to the same prefix created its arrays first.
                raise lost_error(self.loc, committed=False, writing=True) from err
            raise write_error(self.loc, what, err) from err
        return store

    def _child(self, name: str) -> dict[str, Any]:
        return {**self.root, "path": self.root["path"] + name + "/"}

    def write(
        self,
        entries: dict[str, ArrayEntry],
        items: Iterable[tuple[WriteItem, npt.NDArray[Any]]],
        *,
        max_inflight_bytes: int = MAX_INFLIGHT_BYTES,
        release_each: bool = False,
    ) -> int:
        """Write each item's box into the opened arrays; at most ``max_inflight_bytes`` queued.

        With ``release_each``, each item's data is referenced until its write has completed
        and dropped at once then, not at the end (:class:`Holder`): a budgeted save reuses
        the memory of a staged item as soon as nothing references it
        (``jaxckpt._runtime.ring``). Items are taken from ``items`` one at a time, and none is
        referenced here while the next is asked for.

        Returns the bytes written.
        """
        if self._records is not None:  # format v5: copied into records (nothing to hold)
            return self._records.write(entries, items, max_inflight_bytes)
        pending: collections.deque[tuple[Pending[Any], int, ArrayEntry]] = collections.deque()
        inflight = total = 0
        self._reference = self.loc.local is not None
        hints = writeback.Hints()  # early write-back of each written chunk file (local only)
        holder = Holder(self.loc) if release_each else None
        # Large chunks of local arrays are written straight to disk (directwrite), the rest
        # by tensorstore; not in a budgeted save, whose host memory its ring bounds alone.
        direct = None
        if self._reference and not release_each:
            direct = directwrite.ChunkWriter(self.root["path"])
        try:
            # Adopted leftovers: each item's chunks are checked first, a few items ahead (one
            # at a time in a budgeted save, whose ring holds only what it bounds).
            todo = (
                resume.whole(entries, items)
                if self.resumed is None
                else self.resumed.ahead(entries, items, 0 if release_each else 4)
            )
            for entry, boxes in todo:  # none held here while the next is made (release_each)
                while boxes:  # popped: the list is shared with where it was made
                    part, box = boxes.pop(0)
                    fut = self._start(entry, part, box, hints, direct)
                    pending.append((fut, box.nbytes, entry))
                    inflight += box.nbytes
                    total += box.nbytes
                    if holder is not None:
                        holder.add(fut, box)
                    del part, box
                while inflight > max_inflight_bytes and pending:
                    fut, n, e = pending.popleft()
                    self._finish(fut, e, n)
                    inflight -= n
            while pending:
                fut, n, e = pending.popleft()
                self._finish(fut, e, n)
        finally:  # after an error: let what is in flight land (a cancelled request already
            for fut, n, e in pending:  # sent may land later), so that abort() deletes it all
                try:
                    self._finish(fut, e, n)
                except (Exception, asyncio.CancelledError):  # noqa: BLE001 - failed already
                    pass
            hints.wait()
            if holder is not None:
                holder.close()
        return total

    def _start(
        self,
        entry: ArrayEntry,
        item: WriteItem,
        data: npt.NDArray[Any],
        hints: writeback.Hints,
        direct: directwrite.ChunkWriter | None,
    ) -> Pending[Any]:
        """Start the write of ``data`` as ``item``'s box: straight to disk where ``direct``
        takes it, else handed to tensorstore as whole chunks (on local files, with their
        write-back hinted)."""
        if entry.storage_dtype != entry.dtype:
            data = data.view(entry.storage_dtype)
        if direct is not None and directwrite.supports(entry, item.offsets, item.sizes, data):
            return direct.write(entry, item.offsets, item.sizes, data)
        store = self._array(item.key)
        if item.sizes == entry.shape:  # the whole array: skip building an indexed view
            target = store
        else:
            target = store[tuple(slice(o, o + s) for o, s in zip(item.offsets, item.sizes))]
        # Blocking saves hold the caller's arrays and async saves their own staged copies
        # until the write completes, so on files tensorstore may reference the bytes instead
        # of copying; memory:// would keep the reference as the stored value, so it copies.
        fut: ts.WriteFutures = target.write(
            data, can_reference_source_data_indefinitely=self._reference
        )
        self.loc.watch(fut)
        if self._reference:
            folder = self.root["path"] + entry.path
            files = writeback.chunk_files(folder, item.offsets, item.sizes, entry.chunks)
            hints.add(fut, files, data.nbytes)
        return fut

    def _finish(self, fut: Pending[Any], entry: ArrayEntry, nbytes: int) -> None:
        try:
            wait(fut, self.loc, f"writing key {entry.key!r} ({entry.path})", nbytes)
        except (ValueError, OSError) as e:
            raise write_error(self.loc, f"writing key {entry.key!r} ({entry.path})", e) from e

    def flush(self) -> None:
        """Make this process's writes durable; every process calls it before reporting done,
        so every array byte is on disk before the coordinator commits. The coordinator of a
        local save leaves its own bytes to :meth:`commit`, which flushes them with the
        manifest in one ``syncfs`` (one disk cache flush fewer per save): nothing in the
        staging directory is visible before the rename that follows it."""
        self.opened()
        self._described()
        if self.loc.local is not None and not self.is_coordinator:
            try:
                local_commit.syncfs(Path(self.root["path"]))
            except OSError as e:
                raise write_error(self.loc, "making its data durable (syncfs)", e) from e

    def encode_ahead(self, manifest: Manifest) -> None:
        """Object stores (coordinator): encode ``manifest`` for the commit, and parse it once
        more, on another thread while the data is written; :meth:`commit` of this same object
        takes the result (and raises its error, if any), so that check no longer delays the
        commit (its cost per leaf: docs/benchmarks.md, issue 52's second pass)."""
        if self._target is not None:
            done = pools.stage_pool().submit(generations.encode, self.loc, self._target, manifest)
            self._ahead = (manifest, done)

    def hold_early(self, refs: dict[str, str]) -> None:
        """Object stores (coordinator): start the ``held-by`` markers of the references
        ``refs`` (``Manifest.refs``) now, beside the data; :meth:`commit` waits for them."""
        if self._target is not None and self.is_coordinator:
            generations.hold_early(self.loc, self._target, refs, self.loc.name)

    def commit(self, manifest: Manifest) -> None:
        """Write the manifest last and make the checkpoint visible (the store's protocol).

        Raises:
          CheckpointExistsError: ``overwrite=False`` and another save committed meanwhile
            (``abort()`` then removes only this save's own data).
          CheckpointError: the commit failed (or its outcome is unknown: see ``generations``).
        """
        if self._target is not None:
            ahead, self._ahead = self._ahead, None
            # Encoded ahead only for this very manifest (the object, not an equal one).
            encoded = ahead[1].result() if ahead is not None and ahead[0] is manifest else None
            try:
                generations.commit(self.loc, self._target, manifest, self.loc.name, encoded)
            except generations.OutcomeUnknown:
                self._keep = True
                raise
            return
        assert self.staging is not None
        local_commit.commit(self.loc, self.staging, manifest.to_json(), self.overwrite)
        self.staging = None  # renamed into place
        self._release()

    def link(
        self,
        base: Location,
        base_path: str,
        entry: ArrayEntry,
        offsets: tuple[int, ...],
        sizes: tuple[int, ...],
    ) -> bool:
        """Store a box as hard links to the base checkpoint's chunk files of it (an
        incremental save, local files only); ``False`` where that cannot be done (an object
        store, or see ``Linker.link``), and the caller writes the box instead."""
        if self.loc.local is None or base.local is None:
            return False
        root = os.fspath(base.local)
        linker = self._linkers.get(root)
        if linker is None:
            linker = self._linkers[root] = Linker(root, self.root["path"])
        return linker.link(base_path, entry.path, entry.chunks, offsets, sizes)

    def abort(self, error: BaseException | None = None) -> None:
        """After a failure (``error``): remove this save's own data, or, where a retry of the
        same plan may resume it (see ``resume.worth_keeping``), leave it for that retry, its lease
        released (never raises)."""
        keep = self._plan is not None and error is not None and resume.worth_keeping(error)
        for key in list(self._opening):  # none may create a file after the removal
            try:
                self._array(key)
            except Exception:  # noqa: BLE001 - the save failed already; only its data goes
                pass
        for _, fut in self._metadata.values():
            try:
                wait(fut, self.loc, "creating a zarr.json")
            except Exception:  # noqa: BLE001 - the save failed already; only its data goes
                pass
        self._metadata.clear()
        if self.staging is not None and not keep:
            shutil.rmtree(self.staging, ignore_errors=True)
        self.staging = None
        if self._target is not None and self.is_coordinator and not (self._keep or keep):
            generations.drop(self.loc, self._target)
        self._release(delete=not self._keep, resumable=keep and not self._keep)

    def _release(self, *, delete: bool = True, resumable: bool = False) -> None:
        lease = self._lease or (self._target.lease if self._target is not None else None)
        if lease is not None:
            lease.release(delete=delete, resumable=resumable)


class Holder:
    """Keeps each write's source data until tensorstore has completed the write, then drops it.

    tensorstore may read a source array after ``write`` returned, holding no reference to it
    (the array must stay unchanged until the write completes), so whoever reuses the memory
    of a written array once nothing references it must find this reference. One task on a
    save thread waits for the writes in order and drops each one's data as it completes: no
    Python runs in tensorstore's threads (as in ``writeback.Hints``). Where no thread can be
    started (at interpreter exit) each write is waited for as it is added.

    Args:
      loc: where the writes go (their deadlines: a write that misses it is dropped too, and
        the writer reports it).
    """

    def __init__(self, loc: Location) -> None:
        self.loc = loc
        self._queue: queue.SimpleQueue[tuple[Any, Any] | None] = queue.SimpleQueue()
        # None where the interpreter is exiting: no new threads, and _run waits for add()
        self._task = pools.start(pools.save_pool(), self._run)

    def add(self, fut: Any, data: Any) -> None:
        """Drop ``data`` once the write ``fut`` of it has completed."""
        if self._task is None:
            self._wait(fut)
            return
        self._queue.put((fut, data))

    def close(self) -> None:
        """Wait until every write added has completed and its data is dropped."""
        if self._task is not None:
            self._queue.put(None)
            self._task.result()

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            self._wait(job[0])
            del job  # the last reference to the data, where nothing else holds it

    def _wait(self, fut: Any) -> None:
        try:
            wait(fut, self.loc, "writing")
        except (Exception, asyncio.CancelledError):  # noqa: BLE001 - the writer reports it
            pass
