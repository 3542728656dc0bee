"""Copying a directory from one process to another: a local part to its replica holders.

The multi-tier manager (``jaxckpt._tiers.local_tier``) keeps each process's local checkpoint
part on ``local_replicas`` other processes, and at a restore moves a part from the process
that holds it to the one that needs it. A directory goes as one stream of
``jaxckpt._runtime.streams`` (peer to peer, or relayed by process 0; chunked, a window of
acknowledgements, a crc32 checked on arrival): the head lists its files (``{"files":
[[relative path, size], ...]}``), the bytes are the files' end to end. The receiver checks
the list (every path inside the destination, the sizes within its room) before it writes a
byte, fsyncs each file, and the caller commits the copy by a rename.
"""

from __future__ import annotations

import os
from pathlib import Path

from jaxckpt._errors import DistributedError
from jaxckpt._runtime import streams as _streams

PREFIX = "jaxckpt/tiers"
_BLOCK = 4 << 20  # bytes read or written at a time


def files_of(root: Path) -> list[tuple[str, int]]:
    """The regular files under ``root`` (symbolic links are skipped), relative, sorted."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            path = Path(dirpath) / name
            if path.is_file() and not path.is_symlink():
                out.append((path.relative_to(root).as_posix(), path.stat().st_size))
    return out


def send_dir(
    prefix: str, root: Path | None, *, error: str = "", timeout: float | None = None
) -> int:
    """Send the files under ``root`` to the process that calls ``receive_dir(prefix, ...)``.

    The bytes go peer to peer over this process's transfer server, or through the key-value
    store where there is none (``JAXCKPT_REPLICATION``, see ``jaxckpt._runtime.transfer``);
    the head tells the receiver which.

    Args:
      prefix: the transfer's key prefix (ends with ``/``), known to both processes.
      root: the directory to send; ``None`` with ``error`` tells the receiver why not.
      timeout: seconds to wait for each acknowledgement; default ``JAXCKPT_SYNC_TIMEOUT``.

    Returns:
      The bytes sent.

    Raises:
      DistributedError: the receiver did not acknowledge in time, or reported a bad copy, or
        ``JAXCKPT_REPLICATION=transfer`` and this process has no transfer server.
    """
    if root is None:
        _streams.refuse(prefix, error)
        return 0
    files = files_of(root)
    out = _streams.Outgoing(
        prefix, sum(size for _, size in files), about={"files": files}, timeout=timeout
    )
    try:
        for rel, size in files:
            left = size
            with open(root / rel, "rb") as f:
                while left:
                    block = f.read(min(left, _BLOCK))
                    if not block:
                        raise DistributedError(f"{root / rel} shrank while it was being sent")
                    out.write(block)
                    left -= len(block)
    except BaseException:
        out.abort()
        raise
    return out.close()


def receive_dir(prefix: str, dest: Path, *, max_bytes: int, timeout: float | None = None) -> None:
    """Receive what ``send_dir(prefix, ...)`` sends into the new directory ``dest``.

    The sender is another process: its file list is checked (relative paths inside ``dest``,
    at most ``max_bytes`` in all) before anything is written, and the bytes' crc32 after.

    Raises:
      DistributedError: the sender sent nothing (its reason), failed, or sent a bad copy;
        ``dest`` may then hold a partial copy, which the caller removes.
    """
    stream = _streams.Incoming(
        prefix, max_bytes=max_bytes, what=f"the copy {dest.name}", timeout=timeout
    )
    try:
        files = _check_files(stream.head.get("files"), stream.total)
        _receive_files(dest, files, stream)
    except DistributedError as e:
        stream.fail(e)
        raise
    stream.close()


def _receive_files(dest: Path, files: list[tuple[str, int]], stream: _streams.Incoming) -> None:
    """Write the stream's bytes into ``files`` under ``dest``, each fsynced."""
    dest.mkdir(parents=True)
    for rel, size in files:
        path = dest / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        left = size
        with open(path, "wb") as f:
            while left:
                piece = stream.read(min(left, _BLOCK))
                f.write(piece)
                left -= len(piece)
            f.flush()
            os.fsync(f.fileno())


def _check_files(files: object, total: int) -> list[tuple[str, int]]:
    """The sender's file list, refused unless every path stays inside and the sizes add up
    to the stream's length."""
    ok = isinstance(files, list)
    out: list[tuple[str, int]] = []
    for entry in files if isinstance(files, list) else []:
        if not (isinstance(entry, list) and len(entry) == 2):
            ok = False
            break
        rel, size = entry
        parts = rel.split("/") if isinstance(rel, str) else [""]
        if any(p in ("", ".", "..") or "\0" in p or "\\" in p for p in parts) or not (
            isinstance(size, int) and size >= 0
        ):
            ok = False
            break
        out.append((rel, size))
    if not ok or sum(s for _, s in out) != total:
        raise DistributedError("a transfer's file list is not what jaxckpt sends")
    return out
