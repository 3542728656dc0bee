"""CRC-32C of array bytes, the checksum of every jaxckpt chunk, computed without the GIL.

The zarr v3 ``crc32c`` codec appends the CRC-32C (Castagnoli) of a chunk's encoded bytes, as
4 little-endian bytes. Chunk files read in place (``jaxckpt._storage.chunkfile``) and written
straight to disk (``jaxckpt._storage.directwrite``) compute it here, from several threads at
once: through the C function of google-crc32c, called by ctypes, which drops the GIL.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

try:
    import google_crc32c

    # Whether array data can be checksummed at speed: the pure-Python fallback is far too slow.
    NATIVE = google_crc32c.implementation == "c"
except ImportError:  # pragma: no cover - a core dependency; kept optional for odd platforms
    NATIVE = False


def _native_extend() -> Callable[[int, int, int], int] | None:
    """google-crc32c's C ``crc32c_extend``, called through ctypes, which drops the GIL for the
    call: the extension's own ``value()`` holds it, so the checksums of chunks handled by several
    threads would run one at a time and stall the saving or restoring Python thread
    (docs/benchmarks.md). ``None`` where the symbol cannot be found or fails a known answer
    (then ``value()``)."""
    try:
        from google_crc32c import _crc32c  # the C extension; the symbol is in its library

        fn = ctypes.CDLL(_crc32c.__file__).crc32c_extend
        fn.argtypes, fn.restype = (
            [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t],
            ctypes.c_uint32,
        )
        check = b"123456789"
        return fn if fn(0, check, len(check)) == 0xE3069283 else None  # the CRC-32C check value
    except (ImportError, OSError, AttributeError, ctypes.ArgumentError):
        return None


_extend = _native_extend() if NATIVE else None


def crc32c(buf: npt.NDArray[Any], crc: int = 0) -> int:
    """CRC-32C of a C-contiguous array's bytes, continuing ``crc`` (the CRC of what came
    before), without holding the GIL where possible.

    Example:
      >>> hex(crc32c(np.frombuffer(b"123456789", np.uint8)))
      '0xe3069283'
    """
    if _extend is not None:
        return _extend(crc, buf.ctypes.data, buf.nbytes)
    value: int = google_crc32c.extend(crc, buf.reshape(-1).view(np.uint8))
    return value
