"""Compression of chunks: the names a save accepts, their zarr v3 codecs, and the rule that
applies one to a manifest.

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

import dataclasses
from typing import TYPE_CHECKING, Any

from jaxckpt._errors import InvalidArgumentError
from jaxckpt._format.entries import ArrayEntry, Entry

if TYPE_CHECKING:  # manifest imports manifest_check, which imports this module
    from jaxckpt._format.manifest import Manifest

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


def compressed(manifest: Manifest, name: str | None) -> Manifest:
    """``manifest`` (a ``Manifest``) with every array and pack compressed with ``name``
    (``None``: as it is), and the version that says so. Packed arrays point at their
    compressed pack."""
    if name is None:
        return manifest
    packs = {p: dataclasses.replace(e, compression=name) for p, e in manifest.packs.items()}

    def one(e: Entry) -> Entry:
        if not isinstance(e, ArrayEntry):  # an inline value
            return e
        if e.pack is not None:
            return dataclasses.replace(e, pack=packs[e.pack.path])
        return dataclasses.replace(e, compression=name)

    return dataclasses.replace(
        manifest,
        entries={k: one(e) for k, e in manifest.entries.items()},
        packs=packs,
        version=max(manifest.version, VERSION),
    )
