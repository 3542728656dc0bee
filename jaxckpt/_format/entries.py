"""A manifest's entries: one saved array, one pack of small arrays, one inline value.

Frozen dataclasses with typed fields: the save planner builds them, the sources build them
from other formats' metadata, ``manifest_check`` from a ``manifest.json``; a
``manifest.Manifest`` holds them by key.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

from jaxckpt._format.dtypes import dtype_from_name
from jaxckpt._format.grid import grid_shape


@dataclasses.dataclass(frozen=True)
class ArrayEntry:
    """One saved array: a zarr v3 array under ``path`` with a regular chunk grid.

    ``dtype`` is the logical dtype; ``storage_dtype`` what the zarr array holds (they differ
    only for carried dtypes). ``prng_impl`` is set for PRNG key arrays, whose key data is
    stored (its trailing dimensions are part of ``shape``). ``sharding`` describes the source
    layout for humans; restores never depend on it.
    """

    key: str
    shape: tuple[int, ...]
    dtype: str
    storage_dtype: str
    chunks: tuple[int, ...]
    path: str
    checksum: str = "crc32c"
    # The compressor of its chunks (``codecs.CODECS``; version 4), None for raw chunks. Packed
    # arrays leave it None: their pack's says how its chunks are stored.
    compression: str | None = None
    prng_impl: str | None = None
    sharding: str | None = None
    # Packed (version 2): the array's elements are pack[offset : offset + size] of a shared 1-D
    # pack array at ``path``, in C order; ``chunks`` is then the array's shape (one "chunk").
    pack: PackEntry | None = None
    offset: int = 0
    # Not stored: True for sources whose reads of part of a chunk fetch only that part
    # (safetensors' entries, a subclass), so a shared restore may split any dimension.
    partial_reads: ClassVar[bool] = False

    @property
    def size(self) -> int:
        """Elements of the array."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole array in its logical dtype."""
        return math.prod(self.shape) * dtype_from_name(self.dtype).itemsize

    @property
    def grid(self) -> tuple[int, ...]:
        """Chunks along each dimension."""
        return grid_shape(self.shape, self.chunks)

    @property
    def codec(self) -> str | None:
        """How the bytes it is read from are compressed: its own chunks', or its pack's."""
        return self.pack.compression if self.pack is not None else self.compression


@dataclasses.dataclass(frozen=True)
class PackEntry:
    """A 1-D zarr v3 array holding the flattened bytes of several small arrays (version 2).

    Its members are the ``ArrayEntry``s whose ``pack`` is this entry; it is one chunk, or a few.
    """

    path: str
    size: int
    storage_dtype: str
    chunks: int
    checksum: str = "crc32c"
    compression: str | None = None  # as ArrayEntry's (version 4)

    @property
    def key(self) -> str:
        """The name storage knows this pack by (never a key path of the tree)."""
        return f"<pack {self.path}>"

    def as_array(self) -> ArrayEntry:
        """The pack as a plain 1-D array entry, which storage writes and reads like any other."""
        return ArrayEntry(
            key=self.key,
            shape=(self.size,),
            dtype=self.storage_dtype,
            storage_dtype=self.storage_dtype,
            chunks=(self.chunks,),
            path=self.path,
            checksum=self.checksum,
            compression=self.compression,
        )


@dataclasses.dataclass(frozen=True)
class ValueEntry:
    """A Python scalar (``bool``, ``int``, ``float``, ``complex``), string or ``None`` stored
    inline in the manifest."""

    key: str
    value: int | float | complex | bool | str | None


Entry = ArrayEntry | ValueEntry
