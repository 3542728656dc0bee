"""A FUSE file system for the tests: a directory passed through, except that it refuses to
rename a directory (``EOPNOTSUPP``), as bucket mounts do (gcsfuse without
``--rename-dir-limit``, Mountpoint for S3, s3fs for non-empty directories).

``python tests/fuse_mount.py SOURCE MOUNTPOINT`` serves until unmounted (``fusermount -u``).
Needs fusepy and libfuse 2; tests skip where either, or ``/dev/fuse``, is missing.
"""

from __future__ import annotations

import errno
import os
import stat
import sys
from typing import Any

from fuse import FUSE, FuseOSError, Operations  # fusepy


class NoDirRename(Operations):  # type: ignore[misc]
    def __init__(self, root: str) -> None:
        self.root = root

    def _path(self, path: str) -> str:
        return os.path.join(self.root, path.lstrip("/"))

    def getattr(self, path: str, fh: Any = None) -> dict[str, Any]:
        try:
            st = os.lstat(self._path(path))
        except OSError as e:
            raise FuseOSError(e.errno) from e
        keys = "st_mode st_nlink st_uid st_gid st_size st_atime st_mtime st_ctime".split()
        return {k: getattr(st, k) for k in keys}

    def readdir(self, path: str, fh: Any) -> list[str]:
        return [".", "..", *os.listdir(self._path(path))]

    def rename(self, old: str, new: str) -> None:
        if stat.S_ISDIR(os.lstat(self._path(old)).st_mode):
            raise FuseOSError(errno.EOPNOTSUPP)
        os.rename(self._path(old), self._path(new))

    def _call(name: str) -> Any:  # noqa: N805 - builds methods that call os.NAME on the path
        def method(self: NoDirRename, path: str, *args: Any) -> Any:
            try:
                return getattr(os, name)(self._path(path), *args)
            except OSError as e:
                raise FuseOSError(e.errno) from e

        return method

    mkdir = _call("mkdir")
    rmdir = _call("rmdir")
    unlink = _call("unlink")
    chmod = _call("chmod")
    readlink = _call("readlink")

    def utimens(self, path: str, times: Any = None) -> None:
        os.utime(self._path(path), times)

    def truncate(self, path: str, length: int, fh: Any = None) -> None:
        os.truncate(self._path(path), length)

    def open(self, path: str, flags: int) -> int:
        return os.open(self._path(path), flags & ~os.O_DIRECT)

    def create(self, path: str, mode: int, fi: Any = None) -> int:
        return os.open(self._path(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        return os.pread(fh, size, offset)

    def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
        return os.pwrite(fh, data, offset)

    def flush(self, path: str, fh: int) -> None:
        pass

    def fsync(self, path: str, datasync: int, fh: int) -> None:
        os.fsync(fh)

    def release(self, path: str, fh: int) -> None:
        os.close(fh)

    def statfs(self, path: str) -> dict[str, Any]:
        sv = os.statvfs(self._path(path))
        keys = (
            "f_bavail f_bfree f_blocks f_bsize f_favail f_ffree f_files f_flag f_frsize f_namemax"
        )
        return {k: getattr(sv, k) for k in keys.split()}


if __name__ == "__main__":
    FUSE(NoDirRename(sys.argv[1]), sys.argv[2], foreground=True, nothreads=True)
