"""The commit protocol of local files: a hidden staging directory renamed into place.

Everything is written into a hidden sibling ``.NAME.tmp-XXXXXXXX`` (``jaxckpt._format.names``),
``manifest.json`` last; one ``syncfs`` makes it durable; then it is renamed into place:

* ``overwrite=False``: ``renameat2(RENAME_NOREPLACE)``, so a racing save never replaces
  another's commit (a plain rename where the kernel lacks it, which POSIX never lets replace a
  non-empty directory);
* ``overwrite=True``: swapped atomically with the old checkpoint (``RENAME_EXCHANGE``) where the
  kernel allows, else the old one is moved aside to ``.NAME.tmp-XXXXXXXX-old`` first (a crash
  between the two renames leaves it there; the next save of the same path, or a manager, puts
  it back). The replaced checkpoint, now a hidden sibling, is deleted in the background after
  the commit (only what jaxckpt wrote in it): a crash before that leaves it for the next save
  of the same path or a manager to delete.

A crash leaves at most a staging directory, never a damaged checkpoint. While the save runs its
coordinator holds the staging directory's lease (``jaxckpt._storage.lease``), so a clean-up
never removes a live save's directory.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import uuid
from pathlib import Path

from jaxckpt._errors import CheckpointError, CheckpointExistsError
from jaxckpt._format.names import ARRAYS, MANIFEST, parse_staging, staging_name
from jaxckpt._runtime import pools
from jaxckpt._runtime.libc import libc
from jaxckpt._storage.catalog import fsync_dir
from jaxckpt._storage.lease import Lease, LeaseLost, holding
from jaxckpt._storage.location import Location
from jaxckpt._storage.messages import exists_error, lost_error, not_ours_to_replace, write_error


def make_staging(loc: Location, overwrite: bool) -> tuple[Path, Lease]:
    """Check the target (see :func:`check_target_dir`), then make and lease the staging dir."""
    assert loc.local is not None
    clean_leftovers(loc.local)
    check_target_dir(loc.local, overwrite)
    for _ in range(3):
        staging = loc.local.parent / staging_name(loc.local.name, uuid.uuid4().hex[:8])
        try:
            staging.mkdir(parents=True)
            return staging, Lease.local(staging)
        except LeaseLost:
            continue  # a clean-up removed it before it was locked: another one
        except OSError as e:  # a parent that is a file, a read-only file system, ...
            shutil.rmtree(staging, ignore_errors=True)
            raise write_error(loc, f"creating {staging}", e) from e
    raise write_error(loc, "creating its staging directory", OSError("removed 3 times"))


def commit(loc: Location, staging: Path, manifest: bytes, overwrite: bool) -> None:
    """Write ``manifest.json`` into ``staging``, make it durable, rename it into place.

    Raises:
      CheckpointExistsError: ``overwrite=False`` and another save committed meanwhile (only
        this save's staging directory goes, in the caller's abort).
      CheckpointError: the manifest or the rename failed.
    """
    target = loc.local
    assert target is not None
    try:
        with open(staging / MANIFEST, "wb") as f:
            f.write(manifest)
    except OSError as e:
        raise write_error(loc, f"writing {MANIFEST}", e) from e
    try:
        syncfs(staging)
    except OSError as e:
        raise write_error(loc, "making it durable (syncfs)", e) from e
    try:
        if not overwrite:
            _commit_noreplace(loc, staging, target)
        elif target.exists() or target.is_symlink():
            check_target_dir(target, True)  # again: files may have appeared during the save
            if not exchange(staging, target):  # no atomic swap: move the old one aside
                old = staging.with_name(staging.name + "-old")
                os.rename(target, old)
                os.rename(staging, target)
                pools.after_commit(remove_replaced, old)  # off the commit's path
            else:  # now holds the old checkpoint
                pools.after_commit(remove_replaced, staging)
        else:
            os.rename(staging, target)
    except CheckpointError:  # CheckpointExistsError is an OSError too: it passes as it is
        raise
    except OSError as e:
        raise _rename_error(loc, staging, e) from e
    try:
        fsync_dir(target.parent)
    except OSError as e:
        raise CheckpointError(
            f"Save to {loc} is in place (renamed), but flushing its folder {target.parent} "
            f"failed: {e}. It may not survive a crash of the machine: check the disk, then save "
            f"again to be sure."
        ) from e


# What a file system that renames no directory answers (a bucket's FUSE mount: gcsfuse without
# --rename-dir-limit, Mountpoint for S3, s3fs; tests/fuse_mount.py is one).
_NO_DIR_RENAME = (errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EXDEV)


def _rename_error(loc: Location, staging: Path, e: OSError) -> CheckpointError:
    if e.errno not in _NO_DIR_RENAME:
        return write_error(loc, f"renaming {staging.name} into place", e)
    return CheckpointError(
        f"Save to {loc} failed: its file system does not rename directories ({e.strerror}), "
        f"and a local save commits by renaming its staging directory into place. A bucket's "
        f"FUSE mount (gcsfuse, Mountpoint for S3, s3fs) is such a file system: save to the "
        f"bucket's URL instead (gs://BUCKET/PATH or s3://BUCKET/PATH), whose commit needs no "
        f"rename. Nothing was committed; the last committed checkpoint is intact."
    )


def _commit_noreplace(loc: Location, staging: Path, target: Path) -> None:
    for _ in range(3):
        if rename_noreplace(staging, target):
            return
        try:  # an empty directory (the start check allows one) is no checkpoint: it goes
            os.rmdir(target)
        except FileNotFoundError:
            continue
        except OSError:
            break
    raise lost_error(loc, committed=(target / MANIFEST).exists())


def check_target_dir(path: Path, overwrite: bool) -> None:
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
    foreign = [n for n in names if n not in (MANIFEST, ARRAYS) and parse_staging(n) is None]
    if foreign:
        raise not_ours_to_replace(Location(path), foreign[0], committed=MANIFEST in names)
    if names and not overwrite:
        if MANIFEST in names:
            raise exists_error(Location(path))
        raise CheckpointExistsError(
            f"{path} holds the arrays of an unfinished save (no {MANIFEST}). Pass "
            f"overwrite=True to replace them, or choose an empty or new path."
        )


def clean_leftovers(target: Path) -> None:
    """Remove what dead saves, deletes and overwrites of ``target`` left beside it (hidden
    ``.NAME.tmp-XXXXXXXX`` siblings nobody holds), putting back an old checkpoint an
    overwrite moved aside and did not replace (a crash between its two renames)."""
    try:
        siblings = list(target.parent.iterdir())
    except OSError:
        return
    for path in siblings:
        parsed = parse_staging(path.name)
        if parsed is not None and parsed[0] == target.name:
            clean_leftover(path, *parsed)


def clean_leftover(path: Path, name: str, tag: str, suffix: str) -> bool:
    """One hidden sibling ``.NAME.tmp-TAG[-old|-deleted]``: ``False`` (left alone) while the
    save it belongs to holds its lease; otherwise removed, or, if it is an old checkpoint an
    interrupted overwrite moved aside and its name is free, put back."""
    root = path.parent
    save = root / f".{name}.tmp-{tag}"  # the staging directory of the save it belongs to
    # Held while removing: a save that locks one of them meanwhile waits, then sees it gone.
    itself = holding(path) if path != save else contextlib.nullcontext(True)
    target = holding(root / name) if suffix == "-old" else contextlib.nullcontext(True)
    with holding(save) as free, itself as free_too, target as free_three:
        if not (free and free_too and free_three):
            return False
        if suffix == "-old" and (path / MANIFEST).is_file() and not (root / name).exists():
            os.rename(path, root / name)
        else:
            shutil.rmtree(path, ignore_errors=True)
    return True


def remove_replaced(old: Path) -> None:
    """The background half of an overwrite: :func:`remove_own` under ``old``'s lock, so that a
    clean-up of the same leftovers (:func:`clean_leftover`) leaves it alone meanwhile."""
    with holding(old) as free:
        if free:
            remove_own(old)


def remove_own(old: Path) -> None:
    """Delete a replaced checkpoint: only what jaxckpt wrote there (see check_target_dir).

    A file that appeared between the last check and the swap stays, in the hidden old folder.
    """
    if old.is_symlink():  # a link swapped in after the last check: never delete through it
        return
    shutil.rmtree(old / ARRAYS, ignore_errors=True)
    (old / MANIFEST).unlink(missing_ok=True)
    try:
        os.rmdir(old)
    except OSError:
        pass  # not empty: what is left is not ours to delete


def exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths with renameat2(RENAME_EXCHANGE) where Linux allows."""
    at_fdcwd, rename_exchange = -100, 2
    try:
        done: int = libc().renameat2(  # a C int: 0 on success
            at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange
        )
        return done == 0
    except (OSError, AttributeError):
        return False


def rename_noreplace(src: Path, dst: Path) -> bool:
    """Rename ``src`` to ``dst`` unless ``dst`` exists; ``False`` if it does.

    Linux: renameat2(RENAME_NOREPLACE). Where the libc, kernel or file system lacks it, a plain
    rename, which POSIX never lets replace a non-empty directory (a committed checkpoint always
    holds manifest.json), only an empty one.
    """
    at_fdcwd, rename_noreplace_flag = -100, 1
    try:
        rc = libc().renameat2(
            at_fdcwd, os.fsencode(src), at_fdcwd, os.fsencode(dst), rename_noreplace_flag
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


def syncfs(path: Path) -> None:
    """Flush the file system holding ``path`` (Linux ``syncfs``; ``os.sync`` elsewhere).

    Raises:
      OSError: the flush reported an error (``EIO``: the data may not be on disk).
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        os.sync()
        return
    try:
        lib = libc()
        rc = lib.syncfs(fd)
        err = ctypes.get_errno() if rc else 0
    except AttributeError:
        os.sync()
        return
    finally:
        os.close(fd)
    if rc != 0 and err not in (errno.ENOSYS, errno.EINVAL):
        raise OSError(err, os.strerror(err), str(path))
    if rc != 0:
        os.sync()
