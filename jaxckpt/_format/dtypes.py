"""The dtypes a checkpoint stores, by name, and the dtype each one's bytes are stored as.

tensorstore writes the ``NATIVE`` zarr v3 data types as they are; the other dtypes jaxckpt
saves are stored bit-exactly under an unsigned integer carrier of the same width. A manifest
names dtypes by these names only, and reading one never looks up any other.
"""

from __future__ import annotations

import functools
from typing import Any

import ml_dtypes
import numpy as np

from jaxckpt._errors import ManifestError

# zarr v3 data types tensorstore writes natively; everything else goes under a carrier.
NATIVE = frozenset(
    "bool int8 int16 int32 int64 uint8 uint16 uint32 uint64 float16 float32 float64 complex64 "
    "complex128 bfloat16 int4 float8_e4m3fn float8_e5m2 float8_e4m3fnuz float8_e4m3b11fnuz "
    "float8_e5m2fnuz".split()
)
# Logical dtypes stored bit-exactly as an unsigned integer view of the same width.
_CARRIED = frozenset(
    {
        "uint4",
        "uint2",
        "int2",
        "float4_e2m1fn",
        "float8_e8m0fnu",
        "float8_e3m4",
        "float8_e4m3",
    }
)


@functools.cache
def dtype_from_name(name: str) -> np.dtype[Any]:
    """The numpy dtype for a manifest dtype name, refusing anything not on the list.

    >>> dtype_from_name("bfloat16").itemsize
    2
    """
    if name not in NATIVE and name not in _CARRIED:
        raise ManifestError(f"dtype {name!r} is not one jaxckpt reads")
    return np.dtype(getattr(ml_dtypes, name, None) or name)


def storage_dtype_name(dtype: np.dtype[Any]) -> str:
    """The dtype the bytes are stored as: the dtype itself, or an unsigned carrier.

    >>> storage_dtype_name(np.dtype("float32")), storage_dtype_name(dtype_from_name("int2"))
    ('float32', 'uint8')
    """
    name = np.dtype(dtype).name
    if name in NATIVE:
        return name
    if name in _CARRIED:
        return f"uint{8 * np.dtype(dtype).itemsize}"
    raise ValueError(name)


def is_supported_dtype(dtype: Any) -> bool:
    """Whether jaxckpt stores arrays of ``dtype`` (natively or under a carrier)."""
    try:
        return _supported(np.dtype(dtype))
    except TypeError:
        return False


@functools.lru_cache(maxsize=256)  # a state has a handful of dtypes; .name costs ~10 us a leaf
def _supported(dtype: np.dtype[Any]) -> bool:
    return dtype.name in NATIVE or dtype.name in _CARRIED
