"""Directories of checkpoints on any store: list the steps, delete one.

Used by the ``CheckpointManager`` (retention) and the ``jaxckpt ls`` command. Deleting never
leaves a damaged checkpoint: it stops being one first (renamed away, or its manifest deleted
before its arrays), paths holding files jaxckpt did not write are refused, and on object stores
the arrays that other steps reference (``jaxckpt._storage.holds``) stay.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import Any

import tensorstore as ts

from jaxckpt._errors import CheckpointError, CheckpointNotFoundError
from jaxckpt._format.manifest import Manifest
from jaxckpt._format.names import HELD_BY, MANIFEST, is_own_key, staging_name
from jaxckpt._storage import holds
from jaxckpt._storage.location import Location, kvstore, wait
from jaxckpt._storage.messages import not_ours_to_delete
from jaxckpt._storage.urls import credentials_hint

logger = logging.getLogger("jaxckpt")


def list_keys(loc: Location, within: ts.KvStore.KeyRange | None = None) -> list[str]:
    """Every key under an object-store location (relative to it); ``within``: only those in
    that key range (a listing of the range alone: its cost grows with what is in it)."""
    return Listing(loc, within).keys()


class Listing:
    """A listing of an object-store location (``within``: of that key range only), started at
    once and waited for by :meth:`keys`: issued beside another request (a manifest read), it
    costs no round trip of its own."""

    def __init__(self, loc: Location, within: ts.KvStore.KeyRange | None = None) -> None:
        self.loc = loc
        self._error: ValueError | None = None
        self._fut: Any = None
        try:
            kv = kvstore(loc.kvstore, loc)
            self._fut = kv.list() if within is None else kv.list(within)
        except ValueError as e:  # the store cannot be opened: said by keys()
            self._error = e

    def keys(self) -> list[str]:
        """The keys, relative to the location.

        Raises:
          CheckpointError: the store refused the listing (names the credentials to check), or
            it missed its deadline.
        """
        try:
            if self._error is not None:
                raise self._error
            return [k.decode() for k in wait(self._fut, self.loc, "listing")]
        except ValueError as e:
            raise CheckpointError(
                f"Cannot list {self.loc}: {' '.join(str(e).split('[', 1)[0].split())}. Check "
                f"that the bucket exists and that the credentials "
                f"({credentials_hint(self.loc.kvstore)}) may list and write it."
            ) from e


def delete(loc: Location, *, keep: Collection[str] = ()) -> bool:
    """Delete the checkpoint, or an unfinished save's leftovers, at ``loc`` on any store.

    The checkpoint stops being one first (the local directory is renamed away, the manifest
    object is deleted before the arrays), so an interrupted delete never leaves a damaged
    checkpoint. Nothing at ``loc`` is not an error.

    Object stores: the arrays that other steps reference stay, those their ``held-by/``
    markers name (``jaxckpt._storage.holds``) and ``keep`` (storage paths found by reading the
    other steps' manifests); they go when the last step referencing them goes. The markers
    this checkpoint's own references put into other steps are released.

    Returns:
      Whether anything was there to delete.

    Raises:
      CheckpointError: ``loc`` holds files or objects jaxckpt did not write (e.g. it is the
        parent directory of several checkpoints); nothing is deleted.
    """
    if loc.local is not None:
        return _delete_local(loc)
    keys = list_keys(loc)
    foreign = [k for k in keys if not is_own_key(k)]
    if foreign:
        raise not_ours_to_delete(loc, foreign[0])
    if not keys:
        return False
    kv = kvstore(loc.kvstore, loc)
    refs: dict[str, str] = {}
    if MANIFEST in keys:
        refs = _refs(kv, loc)
        wait(kv.write(MANIFEST, None), loc, f"deleting {MANIFEST}")  # one DELETE, no listing
    kept = holds.held(loc, keys)
    if kept is None:
        logger.warning("%s: a held-by marker cannot be read; keeping all its arrays", loc)
    else:
        kept |= set(keep)
        delete_keys(kv, loc, [k for k in keys if _unheld(k, kept)], keys)
    for holder in holds.by_holder(refs):
        holds.release(loc.sibling(holder), loc.name)
    return True


def _delete_local(loc: Location) -> bool:
    assert loc.local is not None
    if not loc.local.exists():
        return False
    names = [p.name for p in loc.local.iterdir()] if loc.local.is_dir() else [loc.local.name]
    foreign = [n for n in names if not is_own_key(n if n == MANIFEST else n + "/x")]
    if foreign:
        raise not_ours_to_delete(loc, foreign[0])
    doomed = loc.local.parent / staging_name(loc.local.name, f"{uuid.uuid4().hex[:8]}-deleted")
    os.rename(loc.local, doomed)
    fsync_dir(loc.local.parent)
    shutil.rmtree(doomed, ignore_errors=True)
    return True


def _refs(kv: ts.KvStore, loc: Location) -> dict[str, str]:
    """The references of the manifest at ``loc`` ({} if it is damaged: nothing to release)."""
    got = wait(kv.read(MANIFEST), loc, f"reading {MANIFEST}")
    try:
        return Manifest.from_json(got.value).refs if got.state == "value" else {}
    except CheckpointError:
        return {}


def _unheld(key: str, kept: set[str]) -> bool:
    if key == MANIFEST or key.startswith(HELD_BY + "/"):
        return False
    return array_of(key) not in kept


def array_of(key: str) -> str | None:
    """The storage path of the array a key belongs to (``arrays/NAME`` or
    ``gXXXXXXXX/arrays/NAME``), or ``None`` for a key outside ``arrays/``.

    Example:
      >>> array_of("g0a1b2c3d/arrays/w/c/0/1"), array_of("arrays/w/zarr.json"), array_of("x")
      ('g0a1b2c3d/arrays/w', 'arrays/w', None)
    """
    parts = key.split("/", 3)
    skip = 1 if is_generation(parts[0]) else 0
    if len(parts) < skip + 3 or parts[skip] != "arrays":
        return None
    return "/".join(parts[: skip + 2])


def exactly(key: str) -> ts.KvStore.KeyRange:
    """The key range of ``key`` alone."""
    return ts.KvStore.KeyRange(key, key + "\0")


def prefix_range(prefix: str) -> ts.KvStore.KeyRange:
    """The key range of every key starting with ``prefix`` (which ends in ``/``)."""
    return ts.KvStore.KeyRange(prefix, prefix[:-1] + chr(ord(prefix[-1]) + 1))


def is_generation(top: str) -> bool:
    """Whether ``top`` (a key's first part) is an object-store generation ``gXXXXXXXX``."""
    return len(top) == 9 and top[0] == "g" and all(c in "0123456789abcdef" for c in top[1:])


def delete_keys(kv: ts.KvStore, loc: Location, doomed: Iterable[str], listing: list[str]) -> None:
    """Delete exactly the ``doomed`` keys of ``listing`` (listed before; only keys jaxckpt
    wrote): a generation whose every listed key is doomed as one range, other keys one by one,
    so that a save starting meanwhile (in a generation of its own) loses nothing."""
    doomed = set(doomed)
    assert all(is_own_key(k) for k in doomed)
    whole = {_generation_of(k) for k in doomed} - {None}
    whole -= {_generation_of(k) for k in listing if k not in doomed}
    futures: list[Any] = [kv.delete_range(prefix_range(g)) for g in whole if g is not None]
    # One DELETE per key, all at once (a range delete of one key lists it first: a request
    # more per key on GCS).
    futures += [kv.write(k, None) for k in doomed if _generation_of(k) not in whole]
    for fut in futures:
        wait(fut, loc, "deleting objects")


def _generation_of(key: str) -> str | None:
    top, _, rest = key.partition("/")
    return top + "/" if rest and is_generation(top) else None


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
        found = [(n, MANIFEST in keys) for n, keys in listing(loc).items()]
    return sorted(found, key=_name_order)


def listing(loc: Location, between: tuple[str, str] | None = None) -> dict[str, list[str]]:
    """Object stores: every key under ``loc`` in a sub-prefix, grouped by the sub-prefix (a
    step's name) and relative to it; one listing of the whole directory (``between``: of the
    keys from the first string, inclusive, to the second, exclusive, only)."""
    out: dict[str, list[str]] = {}
    within = None if between is None else ts.KvStore.KeyRange(*between)
    for key in list_keys(loc, within):
        top, sep, rest = key.partition("/")
        if sep:
            out.setdefault(top, []).append(rest)
    return out


def _name_order(child: tuple[str, bool]) -> tuple[bool, int, str]:
    name = child[0]
    return (not name.isdigit(), int(name) if name.isdigit() else 0, name)


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
