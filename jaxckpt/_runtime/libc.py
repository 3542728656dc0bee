"""The C library, loaded once, for the calls Python does not wrap (storage's ``renameat2``,
``syncfs``, ``sync_file_range``; the staging pool's ``malloc_trim``)."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def libc() -> ctypes.CDLL:
    """The process's libc, with ``errno`` kept for ``ctypes.get_errno()``.

    Raises:
      OSError: no C library can be loaded here; callers fall back to what Python offers.
    """
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
