"""Storage: tensorstore zarr v3 arrays, the manifest, and the commit protocol.

Storage knows nothing of pytrees: it is given manifest entries and (item, data) pairs by the
planner's protocol. Each array is a zarr v3 array with a regular chunk grid aligned to shard
boundaries and a ``crc32c`` checksum on every chunk.

Commit protocol:

* local paths (and ``file://``): everything is written into a hidden temporary sibling
  ``.NAME.tmp-XXXX``, ``manifest.json`` last, then the sibling is renamed into place (swapped
  atomically with an existing checkpoint under ``overwrite=True``, where the kernel allows).
  A crash leaves at most a temporary sibling, never a damaged checkpoint.
* other kvstores (``memory://``, ``s3://``, ``gs://``): there is no rename, so the manifest is
  written last and is the commit; a directory without ``manifest.json`` is not a checkpoint.
"""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import dataclasses
import hashlib
import os
import re
import shutil
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import tensorstore as ts

from jaxckpt._errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptChunkError,
    ManifestError,
)
from jaxckpt._manifest import MANIFEST, ArrayEntry, Manifest, dtype_from_name
from jaxckpt._plan import ReadItem, WriteItem

MAX_INFLIGHT_BYTES = 1 << 30
_TMP = ".tmp-"
# One context for the process: memory:// stores live in it, and no chunk cache is kept.
# Files are not fsynced one by one (that costs ~4x on many small arrays); the commit syncs
# the staging dir's file system once before writing the manifest.
_CONTEXT = ts.Context({"cache_pool": {"total_bytes_limit": 0}, "file_io_sync": False})


class Location:
    """Where a checkpoint lives: a local directory or a tensorstore kvstore URL."""

    def __init__(self, path: str | os.PathLike) -> None:
        text = os.fspath(path)
        self.url = text
        if text.startswith("file://"):
            text = text[len("file://") :]
        if "://" in text:
            self.local: Path | None = None
            self.kvstore = _kvstore_for_url(text)
        else:
            self.local = Path(text).absolute()
            self.kvstore = {"driver": "file", "path": str(self.local) + "/"}

    def __str__(self) -> str:
        return self.url

    def child(self, name: str) -> dict:
        """The kvstore spec of ``name`` under this location (for a zarr array: a folder)."""
        return {**self.kvstore, "path": self.kvstore["path"] + name + "/"}

    def join(self, name: str) -> Location:
        """The location ``name`` below this one (e.g. a step of a checkpoint directory)."""
        if self.local is not None:
            return Location(self.local / name)
        return Location(self.url.rstrip("/") + "/" + name)


def _kvstore_for_url(url: str) -> dict:
    scheme, rest = url.split("://", 1)
    if scheme == "memory":
        rest = rest.strip("/")
        return {"driver": "memory", "path": rest + "/" if rest else ""}
    if scheme in ("gs", "s3"):
        bucket, _, prefix = rest.rstrip("/").partition("/")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{1,254}", bucket):
            raise CheckpointError(
                f"{url!r} names no valid bucket ({bucket!r}): write {scheme}://BUCKET/PREFIX with "
                f"a bucket name of 3 or more letters, digits, '.', '-' or '_'."
            )
        spec: dict[str, Any] = {"driver": "gcs" if scheme == "gs" else "s3", "bucket": bucket,
                                "path": prefix.strip("/") + "/" if prefix else ""}  # fmt: skip
        if scheme == "s3":
            spec.update(_s3_options())
        return spec
    raise CheckpointError(
        f"Unsupported path scheme {scheme!r} in {url!r}: use a local path, file://, memory://, "
        f"gs:// or s3://."
    )


def _s3_options() -> dict:
    """Endpoint, region and credentials for ``s3://`` from the standard AWS variables.

    ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL`` select an S3-compatible server (MinIO,
    moto, ...; addressed path-style, ``ENDPOINT/BUCKET/KEY``); ``AWS_REGION`` or
    ``AWS_DEFAULT_REGION`` the region (otherwise tensorstore asks the bucket). With
    ``AWS_ACCESS_KEY_ID`` and ``AWS_SECRET_ACCESS_KEY`` set, those keys (and
    ``AWS_SESSION_TOKEN``) are used; otherwise tensorstore's default chain (profile, instance
    metadata).
    """
    env = os.environ
    opts: dict[str, Any] = {}
    endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
    if endpoint:
        opts["endpoint"] = endpoint.rstrip("/")
    region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
    if region:
        opts["aws_region"] = region
    if env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
        opts["aws_credentials"] = {"type": "environment"}
    return opts


def _kv(spec: dict) -> ts.KvStore:
    return ts.KvStore.open(spec, context=_CONTEXT).result()


def read_manifest(loc: Location) -> bytes:
    """The bytes of ``manifest.json``, or :class:`CheckpointNotFoundError`."""
    if loc.local is not None:
        try:
            return (loc.local / MANIFEST).read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            pass
    else:
        got = _kv(loc.kvstore).read(MANIFEST).result()
        if got.state == "value":
            return got.value
    raise CheckpointNotFoundError(
        f"No checkpoint at {loc}: {MANIFEST} is missing. A directory without a manifest is an "
        f"unfinished or failed save; pick a committed one (e.g. CheckpointManager.latest_step())."
    )


def exists(loc: Location) -> bool:
    try:
        read_manifest(loc)
        return True
    except CheckpointNotFoundError:
        return False


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
                name = f".{loc.local.name}{_TMP}{uuid.uuid4().hex[:8]}"
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
        self.arrays = {e.key: f.result() for e, f in zip(entries, futures)}

    def _child(self, name: str) -> dict:
        return {**self.root, "path": self.root["path"] + name + "/"}

    def write(self, entries: dict[str, ArrayEntry], items: Iterable[tuple[WriteItem, np.ndarray]],
              *, max_inflight_bytes: int = MAX_INFLIGHT_BYTES) -> int:  # fmt: skip
        """Write each item's box into the opened arrays; at most ``max_inflight_bytes`` queued.

        Returns the bytes written.
        """
        pending: collections.deque = collections.deque()
        inflight = total = 0
        for item, data in items:
            entry = entries[item.key]
            store = self.arrays[item.key]
            if entry.storage_dtype != entry.dtype:
                data = data.view(entry.storage_dtype)
            box = tuple(slice(o, o + s) for o, s in zip(item.offsets, item.sizes))
            # Blocking saves hold the caller's arrays and async saves their own staged copies until
            # the write completes, so tensorstore may reference the bytes instead of copying.
            fut = store[box].write(data, can_reference_source_data_indefinitely=True)
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
        """Write the manifest last, then make the checkpoint visible."""
        if self.loc.local is None:
            kv = _kv(self.loc.kvstore)
            if self.generation:
                manifest = _in_generation(manifest, self.generation)
            kv.write(MANIFEST, manifest).result()  # the commit
            if self.generation:
                _delete_all_but(kv, self.generation)  # the replaced arrays go only now
            return
        target = self.loc.local
        try:
            with open(self.staging / MANIFEST, "wb") as f:
                f.write(manifest)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            raise _write_error(self.loc, f"writing {MANIFEST}", e) from e
        if target.exists():
            if not _exchange(self.staging, target):  # no atomic swap: move the old one aside
                os.rename(target, self.staging.with_name(self.staging.name + "-old"))
                os.rename(self.staging, target)
                shutil.rmtree(
                    self.staging.with_name(self.staging.name + "-old"), ignore_errors=True
                )
            else:
                shutil.rmtree(self.staging, ignore_errors=True)  # now holds the old checkpoint
        else:
            os.rename(self.staging, target)
        _fsync_dir(target.parent)

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


def _check_target_dir(path: Path, overwrite: bool) -> None:
    if not path.exists():
        return
    if not path.is_dir():
        raise CheckpointExistsError(f"{path} exists and is not a directory; choose another path.")
    if (path / MANIFEST).exists():
        if not overwrite:
            raise _exists_error(Location(path))
    elif any(path.iterdir()) and not overwrite:
        raise CheckpointExistsError(
            f"{path} exists, is not empty and holds no checkpoint. jaxckpt will not replace "
            f"files it did not write: pass overwrite=True, or choose an empty or new path."
        )


_libc = None


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths with renameat2(RENAME_EXCHANGE) where Linux allows."""
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        at_fdcwd, rename_exchange = -100, 2
        return (
            _libc.renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange)
            == 0
        )
    except (OSError, AttributeError):
        return False


def _syncfs(path: Path) -> None:
    """Flush the file system holding ``path`` (Linux ``syncfs``; ``os.sync`` elsewhere)."""
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fd = os.open(path, os.O_RDONLY)
        try:
            if _libc.syncfs(fd) == 0:
                return
        finally:
            os.close(fd)
    except (OSError, AttributeError):
        pass
    os.sync()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Reader:
    """Reads boxes of saved arrays; each array is opened once, reads run concurrently."""

    def __init__(self, loc: Location) -> None:
        self.loc = loc
        self._open: dict[str, Any] = {}

    def _store(self, entry: ArrayEntry) -> Any:
        store = self._open.get(entry.path)
        if store is None:
            self._check_inside(entry)
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
        path, links = self.loc.local, False
        for part in entry.path.split("/"):  # one lstat per component, no full realpath
            path = path / part
            links = links or path.is_symlink()
        root = os.path.realpath(self.loc.local)
        if links and not os.path.realpath(path).startswith(root + os.sep):
            raise ManifestError(
                f"Key {entry.key!r}: {entry.path} in {self.loc} is a link outside the checkpoint; "
                f"refusing to read it. Copy the checkpoint without links, or restore another."
            )

    def read(self, entries: dict[str, Any], items: Iterable[ReadItem], *,
             max_inflight_bytes: int = MAX_INFLIGHT_BYTES) -> Iterator[tuple[ReadItem, np.ndarray]]:  # fmt: skip
        """Yield ``(item, data)`` for each item, in the logical dtype, reading ahead."""
        pending: collections.deque = collections.deque()
        inflight = 0
        for item in items:
            entry = entries[item.key]
            box = tuple(slice(o, o + s) for o, s in zip(item.offsets, item.sizes))
            fut = self._store(entry)[box].read()
            n = int(np.prod(item.sizes)) * dtype_from_name(entry.storage_dtype).itemsize
            pending.append((item, entry, fut, n))
            inflight += n
            while inflight > max_inflight_bytes and pending:
                inflight -= pending[0][3]
                yield self._result(*pending.popleft()[:3])
        while pending:
            yield self._result(*pending.popleft()[:3])

    def _result(self, item: ReadItem, entry: ArrayEntry, fut: Any) -> tuple[ReadItem, np.ndarray]:
        try:
            data = fut.result()
        except ValueError as e:
            raise _chunk_error(entry, self.loc, e) from e
        if entry.storage_dtype != entry.dtype:
            data = data.view(dtype_from_name(entry.dtype))
        return item, data


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
_OWN_KEY = re.compile(r"^(manifest\.json$|(g[0-9a-f]{8}/)?arrays/)")


def _prepare_object_store(loc: Location, overwrite: bool, is_coordinator: bool) -> str:
    """Check the target prefix; return the generation prefix (``""`` or ``"gXXXXXXXX/"``)."""
    kv = _kv(loc.kvstore)
    old = kv.read(MANIFEST).result()
    if old.state == "value":
        if not overwrite:
            raise _exists_error(loc)
        generation = _generation(old.value)
        if is_coordinator:  # leftovers of an earlier failed overwrite of the same checkpoint
            kv.delete_range(_prefix_range(generation)).result()
        return generation
    if is_coordinator:
        keys = _list(loc)
        foreign = [k for k in keys if not _OWN_KEY.match(k)]
        if foreign and not overwrite:
            raise CheckpointExistsError(
                f"{loc} holds no checkpoint but other objects (e.g. {foreign[0]!r}). jaxckpt "
                f"will not replace data it did not write: pass overwrite=True, or choose an "
                f"empty or new prefix."
            )
        if keys:  # an unfinished save's arrays, never committed
            kv.delete_range(ts.KvStore.KeyRange()).result()
    return ""


def _list(loc: Location) -> list[str]:
    """Every key under an object-store location (relative to it)."""
    try:
        return [k.decode() for k in _kv(loc.kvstore).list().result()]
    except ValueError as e:
        raise CheckpointError(
            f"Cannot list {loc}: {' '.join(str(e).split('[', 1)[0].split())}. Check that the "
            f"bucket exists and that the credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
            f"AWS_ENDPOINT_URL for an S3-compatible server) may list and write it."
        ) from e


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
    entries = {
        k: dataclasses.replace(e, path=generation + e.path) if isinstance(e, ArrayEntry) else e
        for k, e in m.entries.items()
    }
    return dataclasses.replace(m, entries=entries).to_json()


def _delete_all_but(kv: ts.KvStore, generation: str) -> None:
    keep = sorted([_prefix_range(generation), ts.KvStore.KeyRange(MANIFEST, MANIFEST + "\0")],
                  key=lambda r: r.inclusive_min)  # fmt: skip
    gaps, low = [], b""
    for r in keep:
        gaps.append(ts.KvStore.KeyRange(low, r.inclusive_min))
        low = r.exclusive_max
    gaps.append(ts.KvStore.KeyRange(low, b""))
    for fut in [kv.delete_range(g) for g in gaps if not g.empty]:
        fut.result()


def delete(loc: Location) -> None:
    """Delete the checkpoint, or an unfinished save's leftovers, at ``loc`` on any store.

    The checkpoint stops being one first (the local directory is renamed away, the manifest
    object is deleted before the arrays), so an interrupted delete never leaves a damaged
    checkpoint. Nothing at ``loc`` is not an error.

    Raises:
      CheckpointError: ``loc`` holds files or objects jaxckpt did not write (e.g. it is the
        parent directory of several checkpoints); nothing is deleted.
    """
    if loc.local is not None:
        if not loc.local.exists():
            return
        names = [p.name for p in loc.local.iterdir()] if loc.local.is_dir() else [loc.local.name]
        foreign = [n for n in names if not _OWN_KEY.match(n + "/") and n != MANIFEST]
        if foreign:
            raise _foreign_error(loc, foreign[0])
        doomed = loc.local.parent / f".{loc.local.name}{_TMP}{uuid.uuid4().hex[:8]}-deleted"
        os.rename(loc.local, doomed)
        _fsync_dir(loc.local.parent)
        shutil.rmtree(doomed, ignore_errors=True)
        return
    kv = _kv(loc.kvstore)
    foreign = [k for k in _list(loc) if not _OWN_KEY.match(k)]
    if foreign:
        raise _foreign_error(loc, foreign[0])
    kv.delete_range(ts.KvStore.KeyRange(MANIFEST, MANIFEST + "\0")).result()
    kv.delete_range(ts.KvStore.KeyRange()).result()


def _foreign_error(loc: Location, name: str) -> CheckpointError:
    return CheckpointError(
        f"Refusing to delete {loc}: it holds {name!r}, which jaxckpt did not write, so it is "
        f"not a single checkpoint. Pass the checkpoint's own path (e.g. DIR/000100), or delete "
        f"it by hand."
    )


def children(loc: Location) -> list[tuple[str, bool]]:
    """The sub-directories (or sub-prefixes) of ``loc`` and whether each holds a checkpoint.

    Names are sorted, numbers (step directories such as ``000100``) by value. Local hidden
    directories (e.g. the ``.NAME.tmp-XXXX`` of a save in progress) are included.

    Raises:
      CheckpointNotFoundError: ``loc`` is a local path that is not a directory.
    """
    if loc.local is not None:
        if not loc.local.is_dir():
            raise CheckpointNotFoundError(
                f"{loc} is not a directory. Check the path (a checkpoint directory such as the "
                f"one given to CheckpointManager)."
            )
        found = [(p.name, (p / MANIFEST).is_file()) for p in loc.local.iterdir() if p.is_dir()]
    else:
        keys = set(_list(loc))
        names = {k.split("/", 1)[0] for k in keys if "/" in k}
        found = [(n, f"{n}/{MANIFEST}" in keys) for n in names]
    return sorted(found, key=_name_order)


def _name_order(child: tuple[str, bool]) -> tuple:
    name = child[0]
    return (not name.isdigit(), int(name) if name.isdigit() else 0, name)
