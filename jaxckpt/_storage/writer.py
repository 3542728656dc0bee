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
import dataclasses
import errno
import hashlib
import os
import re
import shutil
import stat
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import tensorstore as ts

from jaxckpt._errors import (
    CheckpointError,
    CheckpointExistsError,
)
from jaxckpt._format.grid import chunk_key, chunks_touching
from jaxckpt._format.manifest import MANIFEST, ArrayEntry, Manifest
from jaxckpt._format.names import TMP, staging_name
from jaxckpt._format.plan import WriteItem
from jaxckpt._storage import writeback as _writeback
from jaxckpt._storage.catalog import OWN_KEY, fsync_dir, list_keys
from jaxckpt._storage.libc import libc
from jaxckpt._storage.location import CONTEXT, Location, kvstore, wait

MAX_INFLIGHT_BYTES = 1 << 30


def array_spec(kvstore: dict, entry: ArrayEntry) -> dict:
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
    """Writes one checkpoint. The storage side of the save protocol; ``jaxckpt.save`` calls,
    with every process's ``Writer`` for the same ``loc``:

    1. ``Writer(loc, overwrite=..., is_coordinator=..., broadcast=...)`` (all processes): the
       coordinator checks the target (``CheckpointExistsError``, or foreign files) and makes
       the hidden staging directory (local) or generation prefix (object stores, under
       ``overwrite``); the others learn its name through ``broadcast``.
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

    On any failure, ``abort()`` (every process that made one): the temporary data goes; the
    last committed checkpoint at ``loc`` is never touched.
    """

    def __init__(
        self,
        loc: Location,
        *,
        overwrite: bool,
        is_coordinator: bool = True,
        broadcast: collections.abc.Callable[[str, str], str] | None = None,
    ) -> None:
        """``broadcast(name, value)``: the coordinator's value on every process (multi-process)."""
        self.loc = loc
        self.overwrite = overwrite
        self.is_coordinator = is_coordinator
        self._plain: dict[str, bool] = {}  # base folders reached without a link (link())
        self._folders: set[str] = set()  # chunk folders link() has made
        self._regular: dict[str, frozenset[str]] = {}  # base chunk folder: its regular files
        self.arrays: dict[str, Any] = {}  # by key, once opened
        self._opening: dict[str, tuple[ArrayEntry, Any]] = {}  # by key, still being opened
        self._create = False
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
                try:
                    self.staging.mkdir(parents=True)
                except OSError as e:  # a parent that is a file, a read-only file system, ...
                    self.staging = None
                    raise _write_error(loc, f"creating {loc.local.parent / name}", e) from e
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
        """Start creating (coordinator) or opening (others, after it) the zarr arrays, all at
        once. Each is waited for where it is first written, and all by :meth:`opened`, which
        ``flush`` calls: the first boxes are resolved and hashed meanwhile."""
        self._create = create
        for e in entries:
            spec = {**array_spec(self._child(e.path), e), "store_data_equal_to_fill_value": True}
            self._opening[e.key] = (
                e,
                ts.open(spec, create=create, open=not create, context=CONTEXT),
            )

    def opened(self) -> None:
        """Wait until every array :meth:`open_arrays` started exists (before the barrier that
        lets the other processes open them, and before the commit)."""
        for key in list(self._opening):
            self._array(key)

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
                raise _lost_error(self.loc, False, writing=True) from err
            raise _write_error(self.loc, what, err) from err
        return store

    def _child(self, name: str) -> dict:
        return {**self.root, "path": self.root["path"] + name + "/"}

    def write(
        self,
        entries: dict[str, ArrayEntry],
        items: Iterable[tuple[WriteItem, np.ndarray]],
        *,
        max_inflight_bytes: int = MAX_INFLIGHT_BYTES,
    ) -> int:
        """Write each item's box into the opened arrays; at most ``max_inflight_bytes`` queued.

        Returns the bytes written.
        """
        pending: collections.deque = collections.deque()
        inflight = total = 0
        self._reference = self.loc.local is not None
        hints = _writeback.Hints()  # early write-back of each written chunk file (local only)
        try:
            for item, data in items:
                entry = entries[item.key]
                store = self._array(item.key)
                if entry.storage_dtype != entry.dtype:
                    data = data.view(entry.storage_dtype)
                if item.sizes == entry.shape:  # the whole array: skip building an indexed view
                    target = store
                else:
                    target = store[tuple(slice(o, o + s) for o, s in zip(item.offsets, item.sizes))]
                # Blocking saves hold the caller's arrays and async saves their own staged
                # copies until the write completes, so on files tensorstore may reference the
                # bytes instead of copying; memory:// would keep the reference as the stored
                # value, so it copies.
                fut = target.write(data, can_reference_source_data_indefinitely=self._reference)
                if self._reference:
                    folder = self.root["path"] + entry.path
                    files = _writeback.chunk_files(folder, item.offsets, item.sizes, entry.chunks)
                    hints.add(fut, files, data.nbytes)
                pending.append((fut, data.nbytes, entry))
                inflight += data.nbytes
                total += data.nbytes
                while inflight > max_inflight_bytes and pending:
                    fut, n, e = pending.popleft()
                    self._finish(fut, e, n)
                    inflight -= n
            while pending:
                fut, n, e = pending.popleft()
                self._finish(fut, e, n)
        finally:
            for fut, _, _ in pending:  # after an error: stop what is still queued
                fut.cancel()
            hints.wait()
        return total

    def _finish(self, fut: Any, entry: ArrayEntry, nbytes: int) -> None:
        try:
            wait(fut, self.loc, f"writing key {entry.key!r} ({entry.path})", nbytes)
        except (ValueError, OSError) as e:
            raise _write_error(self.loc, f"writing key {entry.key!r} ({entry.path})", e) from e

    def flush(self) -> None:
        """Make this process's writes durable; every process calls it before reporting done,
        so every array byte is on disk before the coordinator commits. The coordinator of a
        local save leaves its own bytes to :meth:`commit`, which flushes them with the
        manifest in one ``syncfs`` (one disk cache flush fewer per save): nothing in the
        staging directory is visible before the rename that follows it."""
        self.opened()
        if self.loc.local is not None and not self.is_coordinator:
            _syncfs(Path(self.root["path"]))

    def commit(self, manifest: bytes) -> None:
        """Write the manifest last, make the staging directory durable (its data and the
        manifest), then make the checkpoint visible by renaming it into place.

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
        except OSError as e:
            raise _write_error(self.loc, f"writing {MANIFEST}", e) from e
        _syncfs(self.staging)
        try:
            if not self.overwrite:
                self._commit_noreplace(target)
            elif target.exists() or target.is_symlink():
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
        except CheckpointError:  # CheckpointExistsError is an OSError too: it passes as it is
            raise
        except OSError as e:
            raise _write_error(self.loc, f"renaming {self.staging.name} into place", e) from e
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
        kv = kvstore(self.loc.kvstore, self.loc)
        if self.generation:
            manifest = _in_generation(manifest, self.generation)
        what = f"writing {MANIFEST} (the commit)"
        if self.overwrite:
            wait(kv.write(MANIFEST, manifest), self.loc, what)
        elif not wait(kv.write(MANIFEST, manifest, if_equal=_NO_VALUE), self.loc, what).generation:
            # Another save's manifest got there first: drop only the arrays it does not use.
            _drop_unused(kv, self.loc, manifest)
            raise _lost_error(self.loc, True)
        if self.generation:
            _delete_all_but(kv, self.loc, self.generation)  # the replaced arrays go only now

    def link(
        self,
        base: Location,
        base_path: str,
        entry: ArrayEntry,
        offsets: tuple[int, ...],
        sizes: tuple[int, ...],
    ) -> bool:
        """Store a box as hard links to the base checkpoint's chunk files of it (an
        incremental save, local files only); ``False`` where that cannot be done (another
        file system, an object store, a chunk file that is missing or not a regular file),
        and the caller writes the box instead.

        A link is another name for the same file: deleting the base later leaves this one
        whole, and a write never changes a linked file (tensorstore replaces files by rename).
        """
        if self.loc.local is None or base.local is None:
            return False
        root = os.fspath(base.local)
        src_dir = os.path.join(root, base_path)
        dst_dir = os.path.join(self.root["path"], entry.path)
        try:
            for idx in chunks_touching(offsets, sizes, entry.chunks):
                name = chunk_key(idx)
                src, dst = os.path.join(src_dir, name), os.path.join(dst_dir, name)
                src_folder = os.path.dirname(src)
                if not self._plain_folder(root, src_folder):
                    return False  # a folder on the way is a link: it may lead out of the base
                if os.path.basename(src) not in self._regular_files(src_folder):
                    return False
                folder = os.path.dirname(dst)
                if folder not in self._folders:
                    os.makedirs(folder, exist_ok=True)
                    self._folders.add(folder)
                os.link(src, dst, follow_symlinks=False)
        except OSError:  # a link made already is replaced by the write
            return False
        return True

    def _plain_folder(self, root: str, folder: str) -> bool:
        """Whether every folder from below ``root`` down to ``folder`` is a directory, not a
        link to one, so that what is linked from it lies inside the base. One ``lstat`` per
        folder of the base, remembered."""
        plain = self._plain.get(folder)
        if plain is None:
            parent = os.path.dirname(folder)
            if not folder.startswith(root + os.sep) or parent == folder:
                plain = False
            else:
                above = parent == root or self._plain_folder(root, parent)
                plain = above and stat.S_ISDIR(os.lstat(folder).st_mode)
            self._plain[folder] = plain
        return plain

    def _regular_files(self, folder: str) -> frozenset[str]:
        """The names of the regular files in ``folder`` (not links), listed once: one
        ``scandir`` per chunk folder instead of an ``lstat`` per chunk."""
        names = self._regular.get(folder)
        if names is None:
            with os.scandir(folder) as it:
                names = frozenset(e.name for e in it if e.is_file(follow_symlinks=False))
            self._regular[folder] = names
        return names

    def abort(self) -> None:
        for key in list(self._opening):  # none may create a file after the removal
            try:
                self._array(key)
            except Exception:  # noqa: BLE001 - the save failed already; only its data goes
                pass
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


def _drop_unused(kv: ts.KvStore, loc: Location, ours: bytes) -> None:
    """After a lost object-store commit: delete our arrays that the winner's manifest lacks."""
    try:
        theirs = Manifest.from_json(wait(kv.read(MANIFEST), loc, f"reading {MANIFEST}").value)
    except (CheckpointError, ValueError):
        return  # unreadable: leave everything, deleting nothing we cannot attribute
    used = {e.path for e in theirs.entries.values() if isinstance(e, ArrayEntry)}
    mine = Manifest.from_json(ours).entries.values()
    for fut in [
        kv.delete_range(_prefix_range(e.path + "/"))
        for e in mine
        if isinstance(e, ArrayEntry) and e.path not in used
    ]:
        wait(fut, loc, "deleting this save's arrays")


_OWN_TMP = re.compile(rf"\..+{re.escape(TMP)}[0-9a-f]+(-old|-deleted)?")  # fullmatch; see Writer


def _check_target_dir(path: Path, overwrite: bool) -> None:
    """Refuse a target holding anything jaxckpt did not write, with or without ``overwrite``.

    Overwrite swaps the whole directory and deletes the old one, so it may replace only what
    jaxckpt wrote there: ``manifest.json``, ``arrays/`` and its own temporaries.
    """
    if path.is_symlink():  # an overwrite would swap the link for a directory, deleting through it
        raise CheckpointExistsError(
            f"{path} is a symbolic link (to {os.readlink(path)}); jaxckpt never saves through or "
            f"replaces a link. Save to the link's target ({os.path.realpath(path)}) instead, or "
            f"remove the link first."
        )
    if not path.exists():
        return
    if not path.is_dir():
        raise CheckpointExistsError(f"{path} exists and is not a directory; choose another path.")
    names = sorted(p.name for p in path.iterdir())
    foreign = [n for n in names if n not in (MANIFEST, "arrays") and not _OWN_TMP.fullmatch(n)]
    if foreign:
        raise _not_ours_to_replace(Location(path), foreign[0], committed=MANIFEST in names)
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
    if old.is_symlink():  # a link swapped in after the last check: never delete through it
        return
    shutil.rmtree(old / "arrays", ignore_errors=True)
    (old / MANIFEST).unlink(missing_ok=True)
    try:
        os.rmdir(old)
    except OSError:
        pass  # not empty: what is left is not ours to delete


def _not_ours_to_replace(loc: Location, name: str, *, committed: bool) -> CheckpointExistsError:
    """A save refused: ``name`` at the target is not jaxckpt's (catalog refuses deletes alike)."""
    what = "a checkpoint and also" if committed else "no checkpoint but"
    return CheckpointExistsError(
        f"{loc} holds {what} {name!r}, which jaxckpt did not write; jaxckpt never replaces "
        f"data it did not write, even with overwrite=True. Save to a new or empty path, or "
        f"move {name!r} away first."
    )


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths with renameat2(RENAME_EXCHANGE) where Linux allows."""
    at_fdcwd, rename_exchange = -100, 2
    try:
        return (
            libc().renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange)
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
        rc = libc().renameat2(
            at_fdcwd, os.fsencode(src), at_fdcwd, os.fsencode(dst), rename_noreplace
        )
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
            if libc().syncfs(fd) == 0:
                return
        finally:
            os.close(fd)
    except (OSError, AttributeError):
        pass
    os.sync()


# Object stores (memory://, s3://, gs://): overwrite by generation, delete, list.
#
# There is no rename, so an overwrite writes the new arrays under a fresh generation prefix
# ``gXXXXXXXX/arrays/...`` beside the old ones, writes the new manifest (the commit), and only
# then deletes everything else under the checkpoint's prefix. The generation is derived from
# the old manifest, so every process of a save computes the same one without talking.
def _prepare_object_store(loc: Location, overwrite: bool, is_coordinator: bool) -> str:
    """Check the target prefix; return the generation prefix (``""`` or ``"gXXXXXXXX/"``)."""
    kv = kvstore(loc.kvstore, loc)
    old = wait(kv.read(MANIFEST), loc, f"reading {MANIFEST}")
    if old.state == "value" and not overwrite:
        raise _exists_error(loc)
    if is_coordinator:  # overwrite deletes every other key under the prefix: none may be foreign
        keys = list_keys(loc)
        foreign = [k for k in keys if not OWN_KEY.match(k)]
        if foreign:
            raise _not_ours_to_replace(loc, foreign[0], committed=old.state == "value")
    if old.state == "value":
        generation = _generation(old.value)
        if is_coordinator:  # leftovers of an earlier failed overwrite of the same checkpoint
            wait(kv.delete_range(_prefix_range(generation)), loc, "deleting leftovers")
        return generation
    if is_coordinator and keys:
        # an unfinished save's, never committed
        wait(kv.delete_range(ts.KvStore.KeyRange()), loc, "deleting leftovers")
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
        k: dataclasses.replace(
            e, path=generation + e.path, pack=e.pack and packs[generation + e.path]
        )
        if isinstance(e, ArrayEntry)
        else e
        for k, e in m.entries.items()
    }
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
        wait(fut, loc, "deleting the replaced arrays")
