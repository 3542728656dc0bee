"""``convert``: any source jaxckpt reads (Orbax, safetensors, jaxckpt) as a jaxckpt checkpoint.

Streams in bounded memory: each array gets a chunk grid of row blocks of at most
``BLOCK_BYTES``, the blocks are read from the source one by one (the reader keeps at most
``MAX_INFLIGHT_BYTES`` in flight) and written through the storage ``Writer`` as whole chunks;
the manifest, built from the source's, is written last (the usual commit). Runs in one process.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterator
from typing import Any

import numpy.typing as npt

from jaxckpt._errors import InvalidArgumentError
from jaxckpt._format import dtypes
from jaxckpt._format.manifest import ArrayEntry, Manifest
from jaxckpt._format.names import storage_name
from jaxckpt._format.plan import ReadItem, WriteItem, chunk_boxes
from jaxckpt._runtime import progress as _progress
from jaxckpt._sources import detect as _sources
from jaxckpt._storage import location as _location
from jaxckpt._storage import writer as _storage
from jaxckpt._storage.reader import Reader
from jaxckpt._version import __version__

BLOCK_BYTES = 64 << 20
_INFLIGHT = 256 << 20


def convert(
    src: str,
    dst: str,
    *,
    overwrite: bool = False,
    max_chunk_bytes: int | None = None,
    progress: _progress.ProgressArg = None,
) -> Manifest:
    """Write the checkpoint or weights at ``src`` as a jaxckpt checkpoint at ``dst``.

    ``src`` is anything :func:`restore` reads: a jaxckpt checkpoint, an Orbax checkpoint
    (item or single-item step) or safetensors weights. Memory stays bounded (blocks of at most
    64 MiB, 256 MiB in flight).

    Args:
      src: the source path or URL.
      dst: where to write the jaxckpt checkpoint (path or URL).
      overwrite: replace a checkpoint at ``dst`` (the old one stays until the new is committed).
      max_chunk_bytes: the largest chunk written (blocks of whole rows; default 64 MiB). A chunk
        is read whole, so a checkpoint that many hosts restore, each a part of every array
        (FSDP across hosts, or replicated with reads shared), reads less in smaller chunks:
        e.g. 8 MiB for a pod (docs/multihost.md).
      progress: ``True`` shows bytes done, rate and time left on stderr (a tqdm bar where
        tqdm is installed), a callable ``fn(done_bytes, total_bytes)`` is called as blocks are
        read; ``None`` (default): nothing is shown.

    Returns:
      The written checkpoint's :class:`Manifest`.

    Raises:
      CheckpointNotFoundError: nothing jaxckpt reads is at ``src``.
      CheckpointExistsError: ``dst`` holds a checkpoint and ``overwrite=False``.
      ManifestError, CorruptChunkError: the source is damaged (names the file and key).
      InvalidArgumentError: ``max_chunk_bytes`` is not a positive number of bytes.

    Example:
      >>> import numpy as np, jaxckpt, tempfile
      >>> from safetensors.numpy import save_file
      >>> d = tempfile.mkdtemp()
      >>> save_file({"embed.weight": np.ones((4, 2), np.float32)}, d + "/model.safetensors")
      >>> m = jaxckpt.convert(d + "/model.safetensors", d + "/ckpt")
      >>> jaxckpt.restore(d + "/ckpt")["embed.weight"].shape
      (4, 2)
    """
    progress = _progress.check_arg(progress, "jaxckpt.convert")
    limit = BLOCK_BYTES if max_chunk_bytes is None else max_chunk_bytes
    if not isinstance(limit, numbers.Integral) or isinstance(limit, bool) or limit < 1:
        raise InvalidArgumentError(
            f"max_chunk_bytes must be a positive number of bytes, not {max_chunk_bytes!r} "
            f"(e.g. 8 << 20 for 8 MiB chunks)"
        )
    limit = int(limit)  # a numpy integer would reach the manifest's JSON
    source, reader = _sources.open_source(_location.Location(src))
    manifest = _converted(source, reader.kind, limit)
    writer = _storage.Writer(_location.Location(dst), overwrite=overwrite)
    _copy(source, reader, manifest, writer, progress)
    return manifest


def _copy(
    source: Manifest,
    reader: Reader,
    manifest: Manifest,
    writer: _storage.Writer,
    progress: _progress.ProgressArg,
) -> None:
    """Read ``source``'s arrays block by block and write them as ``manifest`` says; commit."""
    arrays = {k: e for k, e in manifest.entries.items() if isinstance(e, ArrayEntry)}
    items = [
        ReadItem(k, off, size)
        for k, e in arrays.items()
        if 0 not in e.shape
        for off, size in chunk_boxes((0,) * len(e.shape), e.shape, e.chunks)
    ]
    total = sum(
        math.prod(i.sizes) * dtypes.dtype_from_name(arrays[i.key].dtype).itemsize for i in items
    )
    line = _progress.Progress("convert", total, progress)
    try:
        writer.open_arrays(arrays.values(), create=True)

        def blocks() -> Iterator[tuple[WriteItem, npt.NDArray[Any]]]:
            for item, data in reader.read(source.entries, items, max_inflight_bytes=_INFLIGHT):
                line.add(data.nbytes)
                e = arrays[item.key]
                yield WriteItem(item.key, item.offsets, item.sizes, e.dtype, 0), data

        writer.write(arrays, blocks(), max_inflight_bytes=_INFLIGHT)
        writer.flush()
        writer.commit(manifest)
        line.finish()
    except BaseException:
        writer.abort()
        raise
    finally:
        line.close()


def _converted(source: Manifest, kind: str, limit: int) -> Manifest:
    """The manifest of ``source`` as a jaxckpt checkpoint: its arrays in row-block chunks of at
    most ``limit`` bytes, under jaxckpt's storage names."""
    taken: set[str] = set()
    entries: dict[str, Any] = {}
    for key, e in source.entries.items():
        if isinstance(e, ArrayEntry):
            e = ArrayEntry(
                key=key,
                shape=e.shape,
                dtype=e.dtype,
                storage_dtype=dtypes.storage_dtype_name(dtypes.dtype_from_name(e.dtype)),
                chunks=_row_blocks(e, limit),
                path=storage_name(key, taken),
                prng_impl=e.prng_impl,
                sharding=e.sharding,
            )
        entries[key] = e
    created = {"jaxckpt": __version__, "converted_from": kind}
    return Manifest(tree=source.tree, entries=entries, created=created)


def _row_blocks(e: ArrayEntry, limit: int) -> tuple[int, ...]:
    """A chunk shape of whole trailing dimensions and as many leading rows as fit ``limit``."""
    itemsize = dtypes.dtype_from_name(e.dtype).itemsize
    chunks: list[int] = []
    for i, s in enumerate(e.shape):
        inner = math.prod(e.shape[i + 1 :]) * itemsize
        if inner <= limit:
            rows = limit // max(1, inner)
            return (*chunks, max(1, min(s, rows)), *(max(1, d) for d in e.shape[i + 1 :]))
        chunks.append(1)
    return tuple(chunks)
