"""Compression of chunks: the names a save accepts and their zarr v3 codecs
(``Manifest.compressed`` applies one to a checkpoint).

A compressed array is a zarr v3 array whose codecs are ``bytes`` (little endian), then
``blosc`` (the compressor, after a byte shuffle by element size: the bytes of like
significance of every element side by side, which is what makes float weights compress),
then ``crc32c`` over the compressed bytes. The manifest names the compressor per array
(``"compression": "zstd"``), so a reader opens the array from the manifest alone, as it
does an uncompressed one; the level is the writer's business (blosc's header carries all a
decoder needs). Checkpoints with any compressed array are format version 4, so a jaxckpt
that predates compression refuses them instead of reading compressed bytes as raw.

Compression is lossless and per save (``jaxckpt.save(..., compression="zstd")``) or per
manager (``CheckpointManager(..., compression=...)``). Uncompressed arrays keep every fast
path (in-place reads and direct writes of chunk files on local disks); compressed ones go
through tensorstore.
"""

from __future__ import annotations

from typing import Any

from jaxckpt._errors import InvalidArgumentError

# name -> (blosc compressor, level). zstd at level 1: within a few percent of level 3's bytes
# on weights and moments, at twice its speed (docs/object_storage.md, "Compression").
CODECS: dict[str, tuple[str, int]] = {"zstd": ("zstd", 1), "lz4": ("lz4", 5)}

VERSION = 4  # the manifest version that adds "compression" to arrays and packs


def check_arg(compression: object, where: str) -> str | None:
    """``compression`` as given to ``where`` (a function's name), checked.

    Raises:
      InvalidArgumentError: not ``None`` nor one of ``CODECS``' names; says which are.
    """
    if compression is None or (isinstance(compression, str) and compression in CODECS):
        return compression
    raise InvalidArgumentError(
        f"{where}: compression={compression!r} is not supported; use one of "
        f"{', '.join(repr(n) for n in CODECS)} or None (no compression)."
    )


def zarr_codec(name: str, itemsize: int) -> dict[str, Any]:
    """The ``blosc`` codec of compressor ``name`` for elements of ``itemsize`` bytes."""
    cname, level = CODECS[name]
    return {
        "name": "blosc",
        "configuration": {
            "cname": cname,
            "clevel": level,
            "shuffle": "shuffle" if itemsize > 1 else "noshuffle",
            "typesize": itemsize,
            "blocksize": 0,
        },
    }
