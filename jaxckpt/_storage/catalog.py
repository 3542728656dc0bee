"""Directories of checkpoints on any store: list the steps, delete one.

Used by the ``CheckpointManager`` (retention) and the ``jaxckpt ls`` command. Deleting never
leaves a damaged checkpoint: it stops being one first (renamed away, or its manifest deleted
before its arrays), and paths holding files jaxckpt did not write are refused.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from collections.abc import Collection
from pathlib import Path

import tensorstore as ts

from jaxckpt._errors import CheckpointError, CheckpointNotFoundError
from jaxckpt._format.manifest import MANIFEST
from jaxckpt._format.names import staging_name
from jaxckpt._storage.location import Location, kvstore, wait

# \Z, not $: "$" also matches before a trailing newline ("manifest.json\n" is not ours)
OWN_KEY = re.compile(r"^(manifest\.json\Z|(g[0-9a-f]{8}/)?arrays/)")


def list_keys(loc: Location) -> list[str]:
    """Every key under an object-store location (relative to it)."""
    try:
        return [k.decode() for k in wait(kvstore(loc.kvstore, loc).list(), loc, "listing")]
    except ValueError as e:
        raise CheckpointError(
            f"Cannot list {loc}: {' '.join(str(e).split('[', 1)[0].split())}. Check that the "
            f"bucket exists and that the credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
            f"AWS_ENDPOINT_URL for an S3-compatible server) may list and write it."
        ) from e


def delete(loc: Location, *, keep: Collection[str] = ()) -> None:
    """Delete the checkpoint, or an unfinished save's leftovers, at ``loc`` on any store.

    The checkpoint stops being one first (the local directory is renamed away, the manifest
    object is deleted before the arrays), so an interrupted delete never leaves a damaged
    checkpoint. Nothing at ``loc`` is not an error.

    ``keep`` (object stores): storage paths of arrays that other steps reference
    (incremental steps, ``Manifest.refs``); they stay after the manifest goes, until no
    committed step references them.

    Raises:
      CheckpointError: ``loc`` holds files or objects jaxckpt did not write (e.g. it is the
        parent directory of several checkpoints); nothing is deleted.
    """
    if loc.local is not None:
        if not loc.local.exists():
            return
        names = [p.name for p in loc.local.iterdir()] if loc.local.is_dir() else [loc.local.name]
        foreign = [n for n in names if not OWN_KEY.match(n + "/") and n != MANIFEST]
        if foreign:
            raise _not_ours_to_delete(loc, foreign[0])
        doomed = loc.local.parent / staging_name(loc.local.name, f"{uuid.uuid4().hex[:8]}-deleted")
        os.rename(loc.local, doomed)
        fsync_dir(loc.local.parent)
        shutil.rmtree(doomed, ignore_errors=True)
        return
    kv = kvstore(loc.kvstore, loc)
    foreign = [k for k in list_keys(loc) if not OWN_KEY.match(k)]
    if foreign:
        raise _not_ours_to_delete(loc, foreign[0])
    wait(
        kv.delete_range(ts.KvStore.KeyRange(MANIFEST, MANIFEST + "\0")), loc, f"deleting {MANIFEST}"
    )
    if not keep:
        wait(kv.delete_range(ts.KvStore.KeyRange()), loc, "deleting the arrays")
        return
    kept = tuple(p + "/" for p in keep)
    doomed = [k for k in list_keys(loc) if not k.startswith(kept)]
    for k, f in [(k, kv.delete_range(ts.KvStore.KeyRange(k, k + "\0"))) for k in doomed]:
        wait(f, loc, f"deleting {k}")


def _not_ours_to_delete(loc: Location, name: str) -> CheckpointError:
    """A delete refused: ``name`` is not jaxckpt's, so ``loc`` is not a single checkpoint."""
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
        keys = set(list_keys(loc))
        names = {k.split("/", 1)[0] for k in keys if "/" in k}
        found = [(n, f"{n}/{MANIFEST}" in keys) for n in names]
    return sorted(found, key=_name_order)


def _name_order(child: tuple[str, bool]) -> tuple:
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
