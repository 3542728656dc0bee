"""Storage: tensorstore zarr v3 arrays, the manifest, and the commit protocol.

Storage knows nothing of pytrees: it is given manifest entries and (item, data) pairs by the
planner's protocol. Each array is a zarr v3 array with a regular chunk grid aligned to shard
boundaries and a ``crc32c`` checksum on every chunk.

Commit protocol:

* local paths (and ``file://``): everything is written into a hidden temporary sibling
  ``.NAME.tmp-XXXX``, ``manifest.json`` last, then the sibling is renamed into place (swapped
  atomically with an existing checkpoint under ``overwrite=True``, where the kernel allows;
  under ``overwrite=False`` renamed with ``RENAME_NOREPLACE``, so a racing save never replaces
  another's commit). A crash leaves at most a temporary sibling, never a damaged checkpoint.
* other kvstores (``memory://``, ``s3://``, ``gs://``): there is no rename, so the manifest is
  written last and is the commit (conditionally under ``overwrite=False``: only if none
  exists); a directory without ``manifest.json`` is not a checkpoint.
"""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import dataclasses
import errno
import functools
import hashlib
import math
import os
import re
import shutil
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import tensorstore as ts

from jaxckpt import _pack
from jaxckpt._catalog import OWN_KEY, fsync_dir, list_keys
from jaxckpt._errors import (
    CheckpointError,
    CheckpointExistsError,
    CorruptChunkError,
    ManifestError,
)
from jaxckpt._location import _CONTEXT, Location, kvstore
from jaxckpt._manifest import MANIFEST, ArrayEntry, Manifest, dtype_from_name
from jaxckpt._names import TMP, staging_name
from jaxckpt._plan import ReadItem, WriteItem

MAX_INFLIGHT_BYTES = 1 << 30
_STAT_ABOVE = 64 << 20  # arrays this big get their chunk files' sizes checked before a read


def _spec(kvstore: dict, entry: ArrayEntry) -> dict:
    codecs: list[dict] = [{"name": "bytes", "configuration": {"endian": "little"}}]
    if entry.checksum == "crc32c":
        codecs.append({"name": "crc32c"})
    return {
        "driver": "zarr3",
        "kvstore": kvstore,
        "metadata": {
            "shape": list(entry.shape),
            "data_type": entry.storage_dtype,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(entry.chunks)}},
            "codecs": codecs,
        },
    }


class Writer:
    """Writes one checkpoint: ``Writer(loc, overwrite)``, ``write(...)``, then ``commit(...)``.

    On any failure call ``abort()``: the temporary data goes, an existing checkpoint stays.
    """

    def __init__(self, loc: Location, *, overwrite: bool, is_coordinator: bool = True,
                 broadcast: collections.abc.Callable[[str, str], str] | None = None) -> None:  # fmt: skip
        """``broadcast(name, value)``: the coordinator's value on every process (multi-process)."""
        self.loc = loc
        self.overwrite = overwrite
        self.is_coordinator = is_coordinator
        if loc.local is not None:
            # Only the coordinator checks the target and makes the staging dir; the others
            # write into the same dir (shared storage), and only the coordinator commits or
            # removes it, so theirs is None.
            self.staging = None
            name = ""
            if is_coordinator:
                _check_target_dir(loc.local, overwrite)
                name = staging_name(loc.local.name, uuid.uuid4().hex[:8])
                self.staging = loc.local.parent / name
                self.staging.mkdir(parents=True)
            if broadcast is not None:
                name = broadcast("staging", name)
            elif not is_coordinator:
                raise ValueError(
                    "a non-coordinator Writer needs broadcast= to find the staging dir"
                )
            self.root = {"driver": "file", "path": str(loc.local.parent / name) + "/"}
        else:  # object store: no rename, the manifest written last is the commit
            self.staging = None
            self.generation = _prepare_object_store(loc, overwrite, is_coordinator)
            self.root = {**loc.kvstore, "path": loc.kvstore["path"] + self.generation}

    def open_arrays(self, entries: Iterable[ArrayEntry], *, create: bool) -> None:
        """Create (coordinator) or open (others, after it) the zarr arrays, all at once."""
        entries = list(entries)
        futures = [
            ts.open(
                {**_spec(self._child(e.path), e), "store_data_equal_to_fill_value": True},
                create=create,
                open=not create,
                context=_CONTEXT,
            )  # fmt: skip
            for e in entries
        ]
        try:
            self.arrays = {e.key: f.result() for e, f in zip(entries, futures)}
        except ValueError as e:
            if create and not self.overwrite and "ALREADY_EXISTS" in str(e):
                # Object stores: another save to the same prefix created its arrays first.
                raise _lost_error(self.loc, False, writing=True) from e
            raise

    def _child(self, name: str) -> dict:
        return {**self.root, "path": self.root["path"] + name + "/"}

    def write(self, entries: dict[str, ArrayEntry], items: Iterable[tuple[WriteItem, np.ndarray]],
              *, max_inflight_bytes: int = MAX_INFLIGHT_BYTES) -> int:  # fmt: skip
        """Write each item's box into the opened arrays; at most ``max_inflight_bytes`` queued.

        Returns the bytes written.
        """
        pending: collections.deque = collections.deque()
        inflight = total = 0
        self._reference = self.loc.local is not None
        for item, data in items:
            entry = entries[item.key]
            store = self.arrays[item.key]
            if entry.storage_dtype != entry.dtype:
                data = data.view(entry.storage_dtype)
            if item.sizes == entry.shape:  # the whole array: skip building an indexed view
                target = store
            else:
                target = store[tuple(slice(o, o + s) for o, s in zip(item.offsets, item.sizes))]
            # Blocking saves hold the caller's arrays and async saves their own staged copies until
            # the write completes, so on files tensorstore may reference the bytes instead of
            # copying; memory:// would keep the reference as the stored value, so it copies.
            fut = target.write(data, can_reference_source_data_indefinitely=self._reference)
            pending.append((fut, data.nbytes, entry))
            inflight += data.nbytes
            total += data.nbytes
            while inflight > max_inflight_bytes and pending:
                fut, n, e = pending.popleft()
                self._finish(fut, e)
                inflight -= n
        for fut, _, e in pending:
            self._finish(fut, e)
        return total

    def _finish(self, fut: Any, entry: ArrayEntry) -> None:
        try:
            fut.result()
        except (ValueError, OSError) as e:
            raise _write_error(self.loc, f"writing key {entry.key!r} ({entry.path})", e) from e

    def flush(self) -> None:
        """Make this process's writes durable; every process calls it before reporting done,
        so every array byte is on disk before the coordinator writes the manifest."""
        if self.loc.local is not None:
            _syncfs(Path(self.root["path"]))

    def commit(self, manifest: bytes) -> None:
        """Write the manifest last, then make the checkpoint visible.

        With ``overwrite=False`` the commit itself refuses to replace a checkpoint that another
        save committed meanwhile: :class:`CheckpointExistsError`, and only this save's own
        temporary data goes (the caller's ``abort()``).
        """
        if self.loc.local is None:
            self._commit_object_store(manifest)
            return
        target = self.loc.local
        try:
            with open(self.staging / MANIFEST, "wb") as f:
                f.write(manifest)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            raise _write_error(self.loc, f"writing {MANIFEST}", e) from e
        if not self.overwrite:
            self._commit_noreplace(target)
        elif target.exists():
            _check_target_dir(target, True)  # again: files may have appeared during the save
            if not _exchange(self.staging, target):  # no atomic swap: move the old one aside
                old = self.staging.with_name(self.staging.name + "-old")
                os.rename(target, old)
                os.rename(self.staging, target)
                _remove_own(old)
            else:
                _remove_own(self.staging)  # now holds the old checkpoint
        else:
            os.rename(self.staging, target)
        fsync_dir(target.parent)

    def _commit_noreplace(self, target: Path) -> None:
        for _ in range(3):
            if _rename_noreplace(self.staging, target):
                return
            try:  # an empty directory (the start check allows one) is no checkpoint: it goes
                os.rmdir(target)
            except FileNotFoundError:
                continue
            except OSError:
                break
        raise _lost_error(self.loc, (target / MANIFEST).exists())

    def _commit_object_store(self, manifest: bytes) -> None:
        kv = kvstore(self.loc.kvstore)
        if self.generation:
            manifest = _in_generation(manifest, self.generation)
        if self.overwrite:
            kv.write(MANIFEST, manifest).result()  # the commit
        elif not kv.write(MANIFEST, manifest, if_equal=_NO_VALUE).result().generation:
            # Another save's manifest got there first: drop only the arrays it does not use.
            _drop_unused(kv, manifest)
            raise _lost_error(self.loc, True)
        if self.generation:
            _delete_all_but(kv, self.loc, self.generation)  # the replaced arrays go only now

    def abort(self) -> None:
        if self.staging is not None:
            shutil.rmtree(self.staging, ignore_errors=True)


def _write_error(loc: Location, what: str, e: Exception) -> CheckpointError:
    full = "No space left" in str(e) or "RESOURCE_EXHAUSTED" in str(e) or "too large" in str(e)
    hint = "The disk is full: free space, lower max_to_keep, or save elsewhere. " if full else ""
    return CheckpointError(
        f"Save to {loc} failed {what}: {e}. {hint}Nothing was committed; the last committed "
        f"checkpoint is intact."
    )


def _exists_error(loc: Location) -> CheckpointExistsError:
    return CheckpointExistsError(
        f"A checkpoint already exists at {loc}. Pass overwrite=True to replace it (the old one "
        f"stays intact until the new one is committed), or save to a new path."
    )


_OWN_TMP = re.compile(rf"^\..+{re.escape(TMP)}[0-9a-f]+(-old|-deleted)?$")  # see Writer


def _lost_error(loc: Location, committed: bool, writing: bool = False) -> CheckpointExistsError:
    if writing:
        what = "another save is writing its arrays"
    elif committed:
        what = "another save committed a checkpoint"
    else:
        what = "files jaxckpt did not write appeared"
    fix = "pass overwrite=True to replace it" if committed or writing else "move those away"
    return CheckpointExistsError(
        f"Save to {loc} lost the race to one path: {what} there while this one was writing "
        f"(overwrite=False). This save's own data was removed; the other's is untouched. Give "
        f"each concurrent save its own path, or {fix}."
    )


# The generation of a missing key: a conditional write with it succeeds only if none exists.
_NO_VALUE = ts.KvStore.open({"driver": "memory"}).result().read("x").result().stamp.generation


def _drop_unused(kv: ts.KvStore, ours: bytes) -> None:
    """After a lost object-store commit: delete our arrays that the winner's manifest lacks."""
    try:
        theirs = Manifest.from_json(kv.read(MANIFEST).result().value)
    except (CheckpointError, ValueError):
        return  # unreadable: leave everything, deleting nothing we cannot attribute
    used = {e.path for e in theirs.entries.values() if isinstance(e, ArrayEntry)}
    mine = Manifest.from_json(ours).entries.values()
    for fut in [kv.delete_range(_prefix_range(e.path + "/"))
                for e in mine if isinstance(e, ArrayEntry) and e.path not in used]:  # fmt: skip
        fut.result()


def _check_target_dir(path: Path, overwrite: bool) -> None:
    """Refuse a target holding anything jaxckpt did not write, with or without ``overwrite``.

    Overwrite swaps the whole directory and deletes the old one, so it may replace only what
    jaxckpt wrote there: ``manifest.json``, ``arrays/`` and its own temporaries.
    """
    if not path.exists():
        return
    if not path.is_dir():
        raise CheckpointExistsError(f"{path} exists and is not a directory; choose another path.")
    names = sorted(p.name for p in path.iterdir())
    foreign = [n for n in names if n not in (MANIFEST, "arrays") and not _OWN_TMP.match(n)]
    if foreign:
        raise _foreign_error(Location(path), foreign[0], committed=MANIFEST in names)
    if names and not overwrite:
        if MANIFEST in names:
            raise _exists_error(Location(path))
        raise CheckpointExistsError(
            f"{path} holds the arrays of an unfinished save (no {MANIFEST}). Pass "
            f"overwrite=True to replace them, or choose an empty or new path."
        )


def _remove_own(old: Path) -> None:
    """Delete a replaced checkpoint: only what jaxckpt wrote there (see _check_target_dir).

    A file that appeared between the last check and the swap stays, in the hidden old folder.
    """
    shutil.rmtree(old / "arrays", ignore_errors=True)
    (old / MANIFEST).unlink(missing_ok=True)
    try:
        os.rmdir(old)
    except OSError:
        pass  # not empty: what is left is not ours to delete


def _foreign_error(loc: Location, name: str, *, committed: bool) -> CheckpointExistsError:
    what = "a checkpoint and also" if committed else "no checkpoint but"
    return CheckpointExistsError(
        f"{loc} holds {what} {name!r}, which jaxckpt did not write; jaxckpt never replaces "
        f"data it did not write, even with overwrite=True. Save to a new or empty path, or "
        f"move {name!r} away first."
    )


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths with renameat2(RENAME_EXCHANGE) where Linux allows."""
    at_fdcwd, rename_exchange = -100, 2
    try:
        return (
            _libc().renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange)
            == 0
        )
    except (OSError, AttributeError):
        return False


def _rename_noreplace(src: Path, dst: Path) -> bool:
    """Rename ``src`` to ``dst`` unless ``dst`` exists; ``False`` if it does.

    Linux: renameat2(RENAME_NOREPLACE). Where the libc, kernel or file system lacks it, a plain
    rename, which POSIX never lets replace a non-empty directory (a committed checkpoint always
    holds manifest.json), only an empty one.
    """
    at_fdcwd, rename_noreplace = -100, 1
    try:
        rc = _libc().renameat2(at_fdcwd, os.fsencode(src), at_fdcwd, os.fsencode(dst),
                               rename_noreplace)  # fmt: skip
        err = ctypes.get_errno() if rc else 0
    except AttributeError:
        rc, err = -1, errno.ENOSYS
    if rc == 0:
        return True
    if err == errno.EEXIST:
        return False
    if err not in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        raise OSError(err, os.strerror(err), str(src), None, str(dst))
    try:
        os.rename(src, dst)
        return True
    except OSError as e:
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            return False
        raise


def _syncfs(path: Path) -> None:
    """Flush the file system holding ``path`` (Linux ``syncfs``; ``os.sync`` elsewhere)."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            if _libc().syncfs(fd) == 0:
                return
        finally:
            os.close(fd)
    except (OSError, AttributeError):
        pass
    os.sync()


class Reader:
    """Reads boxes of saved arrays; each array is opened once, reads run concurrently."""

    def __init__(self, loc: Location) -> None:
        self.loc = loc
        self._open: dict[str, Any] = {}
        self._link_cache: dict[str, set[str]] = {}
        self._chunks_ok: set[str] = set()
        self._listing: dict[str, set[str]] | None = None

    def _store(self, entry: ArrayEntry) -> Any:
        store = self._open.get(entry.path)
        if store is None:
            self._check_inside(entry)
            self.check_chunks(entry)
            spec = _spec(self.loc.child(entry.path), entry)
            spec["fill_missing_data_reads"] = False  # a missing chunk is an error, not zeros
            try:
                # The manifest is the source of truth for the array's metadata: zarr.json is
                # not read (one file less per array), and cannot change how bytes decode.
                store = ts.open(spec, assume_metadata=True, context=_CONTEXT).result()
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
            links = links or part in self._links(parent)
            parent = f"{parent}/{part}" if parent else part
        if not links:
            return
        root = os.path.realpath(self.loc.local)
        if not os.path.realpath(self.loc.local / entry.path).startswith(root + os.sep):
            raise ManifestError(
                f"Key {entry.key!r}: {entry.path} in {self.loc} is a link outside the checkpoint; "
                f"refusing to read it. Copy the checkpoint without links, or restore another."
            )

    def _links(self, folder: str) -> set[str]:
        """Names in ``folder`` (relative to the checkpoint) that are symlinks: one scandir."""
        found = self._link_cache.get(folder)
        if found is None:
            try:
                with os.scandir(self.loc.local / folder) as it:
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
        if entry.path in self._chunks_ok:
            return
        found = self._chunk_keys(entry)
        grid = [-(-s // c) for s, c in zip(entry.shape, entry.chunks)]
        if (
            math.prod(grid) > len(found) + slack
        ):  # only then can one be missing: find the first, lazily
            for idx in grid_indices(grid):
                name = "/".join(["c", *map(str, idx)])
                if name not in found:
                    raise CorruptChunkError(
                        f"Key {entry.key!r}: chunk ({','.join(map(str, idx))}) of {entry.path} in "
                        f"{self.loc} is missing ({len(found)} of {math.prod(grid)} declared chunks "
                        f"found). The checkpoint is damaged: restore an earlier one; "
                        f"`jaxckpt verify PATH` reports every damaged array."
                    )
        if isinstance(found, dict) and entry.nbytes > _STAT_ABOVE:  # local: sizes, cheap here
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

    def _chunk_keys(self, entry: ArrayEntry) -> set[str] | dict[str, os.DirEntry]:
        """Chunk keys (``c/i/j``, ``c`` for a scalar) of ``entry``'s array, as stored.

        Local: a dict of each key's directory entry (for its size, stat'ed only if asked).
        """
        if self.loc.local is None:
            return self._object_chunks().get(entry.path, set())
        found: dict[str, os.DirEntry] = {}
        stack = [(self.loc.local / entry.path, "")]
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
                    elif name == "c" or name.startswith("c/"):
                        found[name] = e
        return found

    def _object_chunks(self) -> dict[str, set[str]]:
        """Object stores: chunk keys by array path, from one listing of the checkpoint (cached).

        One paginated list for the whole checkpoint costs far less than a request per array.
        """
        if self._listing is None:
            listing: dict[str, set[str]] = collections.defaultdict(set)
            for k in list_keys(self.loc):
                for m in re.finditer(r"/c(?=/|$)", k):  # every ``/c`` segment: an array's chunks?
                    listing[k[: m.start()]].add(k[m.start() + 1 :])
            self._listing = listing
        return self._listing

    def read(self, entries: dict[str, Any], items: Iterable[ReadItem], *,
             max_inflight_bytes: int = MAX_INFLIGHT_BYTES) -> Iterator[tuple[ReadItem, np.ndarray]]:  # fmt: skip
        """Yield ``(item, data)`` for each item, in the logical dtype, reading ahead.

        Packed items come first, each needed pack read once (``jaxckpt._pack``). At most
        ``max_inflight_bytes`` of reads are in flight (at least one item); the caller owns each
        yielded array (storage keeps no reference to it).
        """
        items, packed = _pack.split(entries, items)
        yield from _pack.read(self, entries, packed, max_inflight_bytes=max_inflight_bytes)
        pending: collections.deque = collections.deque()
        inflight = 0
        for item in items:
            entry = entries[item.key]
            store = self._store(entry)
            if item.sizes != entry.shape:
                store = store[tuple(slice(o, o + s) for o, s in zip(item.offsets, item.sizes))]
            n = math.prod(item.sizes) * dtype_from_name(entry.storage_dtype).itemsize
            while pending and inflight + n > max_inflight_bytes:
                inflight -= pending[0][3]
                yield self._result(*pending.popleft())
            if n >= _ALIGNED_MIN_BYTES:  # into an aligned buffer: CPU devices alias it, no copy
                out = _aligned_empty(item.sizes, dtype_from_name(entry.storage_dtype))
                fut = ts.array(out, copy=False, write=True).write(store)
            else:
                out, fut = None, store.read()
            pending.append((item, entry, fut, n, out))
            inflight += n
        while pending:
            yield self._result(*pending.popleft())

    def _result(self, item: ReadItem, entry: ArrayEntry, fut: Any, n: int,
                out: np.ndarray | None) -> tuple[ReadItem, np.ndarray]:  # fmt: skip
        try:
            data = fut.result()
        except ValueError as e:
            raise _chunk_error(entry, self.loc, e) from e
        if out is not None:
            data = out
        if entry.storage_dtype != entry.dtype:
            data = data.view(dtype_from_name(entry.dtype))
        return item, data


def grid_indices(grid: list[int]) -> Iterator[tuple[int, ...]]:
    """Chunk indices in row-major order, lazily (itertools.product would materialise ranges)."""
    if 0 in grid:
        return
    idx = [0] * len(grid)
    while True:
        yield tuple(idx)
        d = len(grid) - 1
        while d >= 0 and idx[d] == grid[d] - 1:
            idx[d] = 0
            d -= 1
        if d < 0:
            return
        idx[d] += 1


_ALIGNED_MIN_BYTES = 1 << 20
_ALIGN = 64  # what XLA's CPU client needs to alias a host buffer instead of copying it


def _aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + _ALIGN, np.uint8)
    start = -raw.ctypes.data % _ALIGN
    return raw[start : start + nbytes].view(dtype).reshape(shape)


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


# Object stores (memory://, s3://, gs://): overwrite by generation, delete, list.
#
# There is no rename, so an overwrite writes the new arrays under a fresh generation prefix
# ``gXXXXXXXX/arrays/...`` beside the old ones, writes the new manifest (the commit), and only
# then deletes everything else under the checkpoint's prefix. The generation is derived from
# the old manifest, so every process of a save computes the same one without talking.
def _prepare_object_store(loc: Location, overwrite: bool, is_coordinator: bool) -> str:
    """Check the target prefix; return the generation prefix (``""`` or ``"gXXXXXXXX/"``)."""
    kv = kvstore(loc.kvstore)
    old = kv.read(MANIFEST).result()
    if old.state == "value" and not overwrite:
        raise _exists_error(loc)
    if is_coordinator:  # overwrite deletes every other key under the prefix: none may be foreign
        keys = list_keys(loc)
        foreign = [k for k in keys if not OWN_KEY.match(k)]
        if foreign:
            raise _foreign_error(loc, foreign[0], committed=old.state == "value")
    if old.state == "value":
        generation = _generation(old.value)
        if is_coordinator:  # leftovers of an earlier failed overwrite of the same checkpoint
            kv.delete_range(_prefix_range(generation)).result()
        return generation
    if is_coordinator and keys:
        kv.delete_range(ts.KvStore.KeyRange()).result()  # an unfinished save's, never committed
    return ""


def _generation(old_manifest: bytes) -> str:
    digest = old_manifest
    while True:  # a prefix the old manifest does not use
        digest = hashlib.sha256(digest).digest()
        generation = f"g{digest.hex()[:8]}/"
        if f'"{generation}'.encode() not in old_manifest:
            return generation


def _prefix_range(prefix: str) -> ts.KvStore.KeyRange:
    return ts.KvStore.KeyRange(prefix, prefix[:-1] + chr(ord(prefix[-1]) + 1))


def _in_generation(manifest: bytes, generation: str) -> bytes:
    m = Manifest.from_json(manifest)
    packs = {
        generation + p: dataclasses.replace(e, path=generation + p) for p, e in m.packs.items()
    }
    entries = {
        k: dataclasses.replace(e, path=generation + e.path, pack=e.pack and packs[generation + e.path])
        if isinstance(e, ArrayEntry) else e
        for k, e in m.entries.items()
    }  # fmt: skip
    return dataclasses.replace(m, entries=entries, packs=packs).to_json()


def _delete_all_but(kv: ts.KvStore, loc: Location, generation: str) -> None:
    """After an overwrite: delete the replaced arrays, only keys jaxckpt writes (``OWN_KEY``).

    One listing; a top-level prefix holding only jaxckpt's keys goes in one range delete, one
    where a foreign object appeared during the save loses only jaxckpt's keys.
    """
    by_top: dict[str, list[str]] = collections.defaultdict(list)
    for k in list_keys(loc):
        if k != MANIFEST and not k.startswith(generation):
            by_top[k.split("/", 1)[0] + "/"].append(k)
    futures = []
    for top, keys in by_top.items():
        if all(OWN_KEY.match(k) for k in keys):
            futures.append(kv.delete_range(_prefix_range(top)))
        else:
            futures += [kv.delete(k) for k in keys if OWN_KEY.match(k)]
    for fut in futures:
        fut.result()
