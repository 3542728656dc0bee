"""Orbax PyTree/Standard items as a read-only source: their arrays through tensorstore.

The item's metadata becomes a manifest in :mod:`.orbax_metadata`; this module opens what it
names. Each parameter is a zarr array named by its key path joined with ``.`` (``params.w``),
read through tensorstore (with the ``ocdbt`` kvstore driver for an OCDBT item), so a box read
touches only the chunks it overlaps. Python scalars (0-d arrays in Orbax) are read when the
item is opened and become manifest values, as Orbax restores them. Nothing is unpickled and
orbax is never imported; anything else (custom value types) is a :class:`ManifestError`
naming the item, damaged data a :class:`CorruptChunkError`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt
import tensorstore as ts

from jaxckpt._errors import CorruptChunkError, ManifestError
from jaxckpt._format.manifest import Manifest, is_supported_dtype
from jaxckpt._format.manifest_check import MAX_BYTES
from jaxckpt._format.names import SEP
from jaxckpt._format.plan import ReadItem
from jaxckpt._sources.orbax_metadata import (
    ARRAY_METADATAS,
    OrbaxItem,
    Stored,
    bad_metadata,
    manifest_from_orbax,
    parse_metadata,
    with_prng_impls,
)
from jaxckpt._storage import location as _location
from jaxckpt._storage.location import read_small
from jaxckpt._storage.reader import Reader

STRINGS = "_strings.json"
MAX_JSON = 1 << 30
_MAX_ARRAY_METADATAS = 256 << 20  # ~200 bytes per array
_ARRAYS = ("jax.Array", "np.ndarray")
# For the OCDBT database only: without a cache its b-tree nodes would be re-read per array.
# Arrays open in jaxckpt's own context (no chunk cache).
_CONTEXT = ts.Context({"cache_pool": {"total_bytes_limit": 64 << 20}}, _location.CONTEXT)


def read_json(kv: ts.KvStore, loc: _location.Location, name: str, limit: int = MAX_JSON) -> Any:
    """The JSON document ``name`` under ``loc`` (``None`` if absent), at most ``limit`` bytes.

    Raises:
      ManifestError: it is larger, not JSON, or nested too deeply to be Orbax metadata.
    """
    raw = read_small(kv, loc, name, limit)
    if raw is None:
        return None
    try:
        return json.loads(raw)
    except RecursionError:  # nested deeper than the decoder allows: no real metadata is
        raise ManifestError(
            f"{loc}/{name} is nested too deeply to be Orbax metadata. The Orbax checkpoint is "
            f"damaged: restore another step."
        ) from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ManifestError(
            f"{loc}/{name} is not valid JSON ({e}). The Orbax checkpoint is damaged: restore "
            f"another step."
        ) from e


def open_item(loc: _location.Location, kv: ts.KvStore, doc: Any) -> tuple[Manifest, OrbaxReader]:
    """The manifest and reader of the PyTree/Standard item at ``loc`` whose ``_METADATA`` is
    ``doc``: its arrays opened (not read), its scalars and strings read.

    Raises:
      ManifestError, CorruptChunkError: the metadata or the arrays are damaged or unsupported.
    """
    item = parse_metadata(loc, doc)
    item = dataclasses.replace(item, ocdbt=stored_in_ocdbt(loc, kv, item.ocdbt))
    values, opening = _start_opening(loc, kv, item)
    stores: dict[str, Any] = {}
    arrays: dict[str, Stored] = {}
    scalars = {}
    for key, (name, vtype, fut) in opening.items():
        store = _opened(loc, key, name, fut)
        if vtype == "scalar":
            if store.rank != 0:
                raise bad_metadata(loc, f"scalar leaf {key!r} is stored with shape {store.shape}")
            scalars[key] = (name, store.read())
            continue
        dtype = store.dtype.numpy_dtype
        shape = tuple(int(s) for s in store.shape)
        if math.prod(shape) * dtype.itemsize > MAX_BYTES:
            raise bad_metadata(loc, f"array {name} claims an absurd shape {shape}")
        chunks = tuple(int(c) for c in store.chunk_layout.read_chunk.shape or shape)
        _check_chunks(loc, name, shape, chunks, dtype.itemsize)
        arrays[key] = Stored(name, shape, dtype, chunks)
        stores[key] = store
    for key, (name, fut) in scalars.items():
        values[key] = _result(loc, key, name, fut).item()
    if any(a.dtype == np.uint32 for a in arrays.values()):  # what key data is stored as
        arrays = with_prng_impls(
            loc, arrays, read_json(kv, loc, ARRAY_METADATAS, _MAX_ARRAY_METADATAS)
        )
    return manifest_from_orbax(loc, item, arrays, values), OrbaxReader(loc, stores)


def _check_chunks(
    loc: _location.Location,
    name: str,
    shape: tuple[int, ...],
    chunks: tuple[int, ...],
    itemsize: int,
) -> None:
    """Refuse a chunk grid that would make tensorstore allocate what the array cannot hold:
    a chunk larger than the array (Orbax writes chunks of at most a shard) or absurdly large."""
    if len(chunks) != len(shape) or any(c > max(s, 1) for s, c in zip(shape, chunks)):
        raise bad_metadata(loc, f"array {name} has chunks {chunks} larger than its shape {shape}")
    if math.prod(chunks) * itemsize > MAX_BYTES:
        raise bad_metadata(loc, f"array {name} claims an absurd chunk shape {chunks}")


def _start_opening(
    loc: _location.Location, kv: ts.KvStore, item: OrbaxItem
) -> tuple[dict[str, Any], dict[str, tuple[str, str, Any]]]:
    """Read the ``None`` and string leaves; start opening the arrays and scalars.

    Returns ``(values, opening)``: values by key, and key -> (param name, value type, future).
    """
    strings: object = None  # the JSON document, read on first use
    database = None
    opening: dict[str, tuple[str, str, Any]] = {}
    values: dict[str, Any] = {}
    for parts, _, vm in item.leaves:
        key, name, vtype = SEP.join(parts), ".".join(parts), vm.get("value_type")
        if key in item.empty:
            continue
        if vtype == "None":
            values[key] = None
        elif vtype == "string":
            strings = read_json(kv, loc, STRINGS) if strings is None else strings
            v = strings.get(name) if isinstance(strings, dict) else None
            if not isinstance(v, str):
                raise bad_metadata(loc, f"string leaf {key!r} has no string in {STRINGS}")
            values[key] = v
        elif vtype in _ARRAYS or vtype == "scalar":
            spec: dict[str, Any] = {
                "driver": "zarr3" if item.zarr3 else "zarr",
                "fill_missing_data_reads": item.fill_ok,
            }
            if item.ocdbt:  # keys live inside the database: none can name a path outside it
                database = _database(loc) if database is None else database
                fut = ts.open(
                    spec,
                    kvstore=database / (name + "/"),
                    open=True,
                    read=True,
                    context=_location.context(),
                )
            else:
                spec["kvstore"] = _kvstore(loc, name)
                fut = ts.open(spec, open=True, read=True, context=_location.context())
            opening[key] = (name, vtype, fut)
        else:
            raise ManifestError(
                f"{loc}: leaf {key!r} has Orbax value type {vtype!r} (a custom TypeHandler or "
                f"an aggregate value), which jaxckpt does not read. Restore this item with "
                f"orbax-checkpoint, or re-save the leaf as an array."
            )
    return values, opening


def stored_in_ocdbt(loc: _location.Location, kv: ts.KvStore, recorded: bool | None) -> bool:
    """Whether the item's arrays live in an OCDBT database: as ``_METADATA`` records it, or
    where it does not (Orbax < 0.11.31) from the files on disk.

    Raises:
      CorruptChunkError: an OCDBT item without its root ``manifest.ocdbt`` (an unfinished save).
    """
    if recorded is False:
        return False
    if listed(loc, kv, "manifest.ocdbt", "manifest.ocdbt\0"):
        return True
    if recorded or listed(loc, kv, "ocdbt.process_", "ocdbt.process_\x7f"):
        raise CorruptChunkError(
            f"{loc}: an OCDBT item (Orbax's default) without its manifest.ocdbt, the root of "
            f"the database that Orbax writes last: the save did not finish or the file was "
            f"lost. Restore another step."
        )
    return False


def listed(loc: _location.Location, kv: ts.KvStore, start: str, stop: str) -> bool:
    """Whether any name in ``[start, stop)`` exists at the item's top (nothing is read)."""
    if loc.local is not None:  # one directory listing, not a walk of every array's chunks
        return any(start <= n < stop for n in os.listdir(loc.local))
    return bool(_location.wait(kv.list(ts.KvStore.KeyRange(start, stop)), loc, "listing it"))


def _database(loc: _location.Location) -> ts.KvStore:
    """The item's OCDBT key-value store, opened once (its b-tree nodes cached, not chunks)."""
    try:
        opening = ts.KvStore.open({"driver": "ocdbt", "base": loc.kvstore}, context=_CONTEXT)
        return _location.wait(opening, loc, "opening its OCDBT database")
    except ValueError as e:
        raise CorruptChunkError(
            f"{loc}: the OCDBT database (manifest.ocdbt) cannot be opened ({e}). The Orbax "
            f"checkpoint is damaged: restore another step."
        ) from e


def _kvstore(loc: _location.Location, name: str) -> dict[str, Any]:
    if loc.local is not None:
        root = os.path.realpath(loc.local)
        if not os.path.realpath(loc.local / name).startswith(root + os.sep):
            raise ManifestError(
                f"{loc}: parameter {name} is a link outside the checkpoint; refusing to read it. "
                f"Copy the checkpoint without links."
            )
    return loc.child(name)


def _opened(loc: _location.Location, key: str, name: str, fut: Any) -> Any:
    try:
        return _location.wait(fut, loc, f"opening array {name} (leaf {key!r})")
    except ValueError as e:
        raise CorruptChunkError(
            f"{loc}: leaf {key!r} (array {name}) cannot be opened ({e}). The Orbax checkpoint "
            f"is damaged or its array is of a kind jaxckpt does not read: restore another step."
        ) from e


def _result(
    loc: _location.Location, key: str, name: str, fut: Any, nbytes: int = 0
) -> npt.NDArray[Any]:
    try:
        return _location.wait(fut, loc, f"reading array {name} (leaf {key!r})", nbytes)
    except ValueError as e:
        raise CorruptChunkError(
            f"{loc}: leaf {key!r} (array {name}): a chunk is missing or cannot be decoded ({e}). "
            f"The Orbax checkpoint is damaged: restore another step, or the other keys."
        ) from e


class OrbaxReader(Reader):
    """Reads boxes of an Orbax item's arrays through tensorstore (zarr, zarr3, OCDBT)."""

    kind = "orbax"

    def __init__(self, loc: _location.Location, stores: dict[str, Any]) -> None:
        self.loc, self.stores = loc, stores
        if any(not is_supported_dtype(s.dtype.numpy_dtype) for s in stores.values()):
            bad = next(k for k, s in stores.items() if not is_supported_dtype(s.dtype.numpy_dtype))
            raise ManifestError(f"{loc}: leaf {bad!r} has a dtype jaxckpt does not read.")

    def start(self, entry: Any, item: ReadItem) -> Callable[[], npt.NDArray[Any]]:
        """The call that waits for ``item``'s box; tensorstore reads the chunks its box overlaps."""
        store = self.stores[item.key]
        if item.sizes != tuple(store.shape):
            store = store[tuple(slice(o, o + s) for o, s in zip(item.offsets, item.sizes))]
        fut = store.read()
        name = item.key.replace(SEP, ".")  # Orbax's parameter name
        nbytes = math.prod(item.sizes) * store.dtype.numpy_dtype.itemsize
        return lambda: _result(self.loc, item.key, name, fut, nbytes)
