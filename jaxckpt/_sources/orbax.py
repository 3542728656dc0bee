"""Orbax checkpoints as a read-only source, from Orbax's JSON metadata only.

What orbax-checkpoint (0.12) writes for a PyTree / Standard item::

    ITEM/_METADATA              JSON: per leaf its key path, value type; use_zarr3, and
                                use_ocdbt since 0.11.31 (older: OCDBT is told by manifest.ocdbt)
    ITEM/_CHECKPOINT_METADATA   JSON: the handler's name, timestamps
    ITEM/_strings.json          JSON: string leaves, by parameter name
    ITEM/manifest.ocdbt, d/, ocdbt.process_N/   OCDBT: one key-value database for all arrays
    ITEM/<param.name>/          without OCDBT: one zarr (v2, ``.zarray``) or zarr3 array each
    ITEM/array_metadatas/process_N              JSON: per array, a PRNG key's implementation
    ITEM/_sharding                              not needed here

A ``CheckpointManager`` step is ``STEP/_CHECKPOINT_METADATA`` naming its items
(``{"default": ...}`` or ``{"state": ..., "extra": ...}``) and one folder per item. A step
with exactly one item is read as that item; with several, pass ``STEP/ITEM``.

Each parameter is a zarr array named by its key path joined with ``.`` (``params.w``), read
through tensorstore (with the ``ocdbt`` kvstore driver for an OCDBT item), so a box read
touches only the chunks it overlaps. A PRNG key array is stored as its uint32 key data; the
implementation that ``array_metadatas/process_0`` records for it (``random_key_impl``) makes
it a key again, as jaxckpt's own ``prng_impl``. Python scalars (0-d arrays in Orbax) are read when the
checkpoint is opened and become manifest values, as Orbax restores them. Nothing is
unpickled and orbax is never imported; anything else (custom handlers or value types) is a
:class:`ManifestError` naming the item.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import numpy as np
import tensorstore as ts

from jaxckpt._errors import CorruptChunkError, ManifestError
from jaxckpt._format.manifest import ArrayEntry, Manifest, ValueEntry, is_supported_dtype
from jaxckpt._format.names import SEP
from jaxckpt._format.plan import ReadItem
from jaxckpt._storage import location as _location
from jaxckpt._storage.location import read_small
from jaxckpt._storage.reader import pipelined
from jaxckpt._storage.writer import MAX_INFLIGHT_BYTES

METADATA = "_METADATA"
CHECKPOINT_METADATA = "_CHECKPOINT_METADATA"
STRINGS = "_strings.json"
ARRAY_METADATAS = "array_metadatas/process_0"  # every process records every jax.Array
_MAX_JSON = 1 << 30
_MAX_ARRAY_METADATAS = 256 << 20  # ~200 bytes per array
# uint32 words of one key, by the implementation names jax.random.key_impl gives.
KEY_WORDS = {"threefry2x32": 2, "rbg": 4, "unsafe_rbg": 4}
_MAX_BYTES = 1 << 50
_ARRAYS = ("jax.Array", "np.ndarray")
_EMPTY = {"Dict": "dict", "List": "list", "Tuple": "list", "NamedTuple": "dict"}
# For the OCDBT database only: without a cache its b-tree nodes would be re-read per array.
# Arrays open in jaxckpt's own context (no chunk cache).
_CONTEXT = ts.Context({"cache_pool": {"total_bytes_limit": 64 << 20}}, _location.CONTEXT)


def open_source(loc: _location.Location) -> tuple[Manifest, OrbaxReader] | None:
    """The manifest and reader for an Orbax item or step at ``loc``, or ``None``."""
    if loc.local is not None and loc.local.is_file():
        return None
    kv = _location.kvstore(loc.kvstore)
    raw = _read_json(kv, loc, METADATA)
    if raw is not None:
        return _open_item(loc, kv, raw)
    step = _read_json(kv, loc, CHECKPOINT_METADATA)
    if step is None:
        return None
    handlers = step.get("item_handlers") if isinstance(step, dict) else None
    if isinstance(handlers, dict) and len(handlers) == 1:
        ((name, handler),) = handlers.items()
        if isinstance(name, str) and name and "/" not in name and name not in (".", ".."):
            item = loc.join(name)
            raw = _read_json(_location.kvstore(item.kvstore), item, METADATA)
            if raw is not None:
                return _open_item(item, _location.kvstore(item.kvstore), raw)
            raise _unsupported(f"{loc}: item {name!r}", handler)
    if isinstance(handlers, dict) and len(handlers) > 1:
        names = sorted(str(n) for n in handlers)
        raise ManifestError(
            f"{loc} is an Orbax CheckpointManager step with items {names}: restore one of them "
            f"by its folder, e.g. jaxckpt.restore('{loc}/{names[0]}')."
        )
    raise _unsupported(f"{loc}", handlers)


def _unsupported(where: str, handler: Any) -> ManifestError:
    name = str(handler).rsplit(".", 1)[-1] if handler else "an unknown handler"
    return ManifestError(
        f"{where} was written by Orbax's {name}, which jaxckpt does not read (it reads "
        f"PyTree/Standard items: a folder with {METADATA}). Restore it with orbax-checkpoint, "
        f"or restore the other items by their folders."
    )


def _read_json(kv: ts.KvStore, loc: _location.Location, name: str, limit: int = _MAX_JSON) -> Any:
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


def _bad(loc: _location.Location, what: str) -> ManifestError:
    return ManifestError(
        f"{loc}/{METADATA}: {what}. The Orbax metadata is damaged or of a layout jaxckpt does "
        f"not know; nothing was read. Restore it with orbax-checkpoint, or another step."
    )


def _leaves(loc: _location.Location, doc: Any) -> list[tuple[list[str], list[int], dict]]:
    meta = doc.get("tree_metadata") if isinstance(doc, dict) else None
    if not isinstance(meta, dict):
        raise _bad(loc, 'no "tree_metadata" object')
    out = []
    for raw_key, leaf in meta.items():
        kms = leaf.get("key_metadata") if isinstance(leaf, dict) else None
        vm = leaf.get("value_metadata") if isinstance(leaf, dict) else None
        if not isinstance(kms, list) or not kms or not isinstance(vm, dict) or len(kms) > 1000:
            raise _bad(loc, f"leaf {raw_key!r} has no key_metadata/value_metadata")
        parts, kinds = [], []
        for km in kms:
            k, t = (km.get("key"), km.get("key_type")) if isinstance(km, dict) else (None, None)
            if not isinstance(k, (str, int)) or isinstance(k, bool) or t not in (1, 2):
                raise _bad(loc, f"leaf {raw_key!r} has a malformed key entry {km!r}")
            if t == 1 and not str(k).isdigit():
                raise _bad(loc, f"leaf {raw_key!r} has sequence index {k!r}")
            if SEP in str(k) or "\0" in str(k) or str(k) in (".", ".."):
                raise _bad(loc, f"leaf {raw_key!r} has key {k!r}, which jaxckpt cannot name")
            parts.append(str(k))
            kinds.append(t)
        out.append((parts, kinds, vm))
    return out


def _tree(loc: _location.Location, leaves: list, empty: dict[str, str]) -> dict:
    """jaxckpt's JSON tree from Orbax key paths (key_type 2: dict key, 1: sequence index)."""
    root: dict = {"kind": "dict", "kids": {}}
    for parts, kinds, _ in leaves:
        node = root
        for i, (part, kind) in enumerate(zip(parts, kinds)):
            want = "dict" if kind == 2 else "list"
            if node.get("kind") != want:
                raise _bad(loc, f"{SEP.join(parts)!r} mixes dict keys and sequence indices")
            last = i == len(parts) - 1
            key = SEP.join(parts)
            child = node["kids"].get(part)
            if child is None:
                nxt = kinds[i + 1] if not last else 0
                child = (
                    {"leaf": key}
                    if last and key not in empty
                    else {
                        "kind": empty.get(key) if last else ("dict" if nxt == 2 else "list"),
                        "kids": {},
                    }
                )
                node["kids"][part] = child
            elif last or "leaf" in child:
                raise _bad(loc, f"{key!r} is both a leaf and a subtree")
            node = child

    def to_json(n: dict) -> dict:
        if "leaf" in n:
            return {"type": "leaf", "key": n["leaf"]}
        items = list(n["kids"].items())
        if n["kind"] == "list":
            items.sort(key=lambda kv: int(kv[0]))
            return {"type": "list", "children": [to_json(c) for _, c in items]}
        return {
            "type": "dict",
            "keys": [k for k, _ in items],
            "children": [to_json(c) for _, c in items],
        }

    return to_json(root)


class Stored(NamedTuple):
    """An opened Orbax array, as the manifest describes it."""

    name: str  # the parameter name: the array's folder (or OCDBT prefix)
    shape: tuple[int, ...]
    dtype: np.dtype
    chunks: tuple[int, ...]  # the read chunk shape
    prng_impl: str | None = None  # a PRNG key array's implementation (shape ends in its words)


@dataclasses.dataclass(frozen=True)
class OrbaxItem:
    """An item's ``_METADATA``, checked: its leaves, the tree they form, how arrays are stored."""

    leaves: list[tuple[list[str], list[int], dict]]  # (key path, key types, value metadata)
    empty: dict[str, str]  # key -> "dict" or "list": an empty container, not a leaf
    tree: dict  # jaxckpt's JSON tree
    ocdbt: bool | None  # None: _METADATA does not say (Orbax < 0.11.31); see stored_in_ocdbt
    zarr3: bool
    fill_ok: bool  # chunks equal to the fill value may be missing


def parse_metadata(loc: _location.Location, doc: Any) -> OrbaxItem:
    """Check an item's ``_METADATA`` document; nothing is read.

    Raises:
      ManifestError: the document is not the PyTree metadata jaxckpt knows.
    """
    leaves = _leaves(loc, doc)
    ocdbt, zarr3 = doc.get("use_ocdbt"), bool(doc.get("use_zarr3"))
    if ocdbt is not None and not isinstance(ocdbt, bool):
        raise _bad(loc, f'"use_ocdbt" is {ocdbt!r}, not true or false')
    fill_ok = doc.get("store_array_data_equal_to_fill_value") is False
    empty = {
        SEP.join(p): _EMPTY[vm.get("value_type")]
        for p, _, vm in leaves
        if vm.get("value_type") in _EMPTY
    }
    return OrbaxItem(leaves, empty, _tree(loc, leaves, empty), ocdbt, zarr3, fill_ok)


def manifest_from_orbax(
    loc: _location.Location, item: OrbaxItem, arrays: dict[str, Stored], values: dict[str, Any]
) -> Manifest:
    """The manifest of an Orbax item from its metadata, its opened ``arrays`` and the Python
    ``values`` of its other leaves (by key); pure, so it needs no tensorstore.

    Raises:
      ManifestError: a value leaf holds something other than a Python scalar or string.
    """
    entries: dict[str, ArrayEntry | ValueEntry] = {
        key: ArrayEntry(
            key=key,
            shape=a.shape,
            dtype=a.dtype.name,
            storage_dtype=a.dtype.name,
            chunks=tuple(max(1, c) for c in a.chunks),
            path=a.name,
            checksum="none",
            prng_impl=a.prng_impl,
        )
        for key, a in arrays.items()
    }
    order = [SEP.join(p) for p, _, _ in item.leaves if SEP.join(p) not in item.empty]
    for key in order:
        if key in values:
            v = values[key]
            if not isinstance(v, (int, float, bool, str, type(None))):
                raise _bad(loc, f"leaf {key!r} holds a {type(v).__name__}")
            entries[key] = ValueEntry(key, v)
    entries = {k: entries[k] for k in order}
    created = {"source": "orbax", "use_ocdbt": item.ocdbt, "use_zarr3": item.zarr3}
    return Manifest(tree=item.tree, entries=entries, created=created)


def _open_item(loc: _location.Location, kv: ts.KvStore, doc: Any) -> tuple[Manifest, OrbaxReader]:
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
                raise _bad(loc, f"scalar leaf {key!r} is stored with shape {store.shape}")
            scalars[key] = (name, store.read())
            continue
        dtype = store.dtype.numpy_dtype
        shape = tuple(int(s) for s in store.shape)
        if math.prod(shape) * dtype.itemsize > _MAX_BYTES:
            raise _bad(loc, f"array {name} claims an absurd shape {shape}")
        chunks = tuple(int(c) for c in store.chunk_layout.read_chunk.shape or shape)
        arrays[key] = Stored(name, shape, dtype, chunks)
        stores[key] = store
    for key, (name, fut) in scalars.items():
        values[key] = _result(loc, key, name, fut).item()
    if any(a.dtype == np.uint32 for a in arrays.values()):  # what key data is stored as
        arrays = with_prng_impls(
            loc, arrays, _read_json(kv, loc, ARRAY_METADATAS, _MAX_ARRAY_METADATAS)
        )
    return manifest_from_orbax(loc, item, arrays, values), OrbaxReader(loc, stores)


def with_prng_impls(
    loc: _location.Location, arrays: dict[str, Stored], doc: Any
) -> dict[str, Stored]:
    """``arrays`` with the PRNG key implementations that Orbax's array metadata file (``doc``,
    ``None`` where there is none) records; pure.

    Raises:
      ManifestError: naming the file: it is not the layout Orbax writes, names an implementation
        jax lacks, or records a key for an array that is not uint32 key data of that kind.
    """
    if doc is None:
        return arrays
    where = f"{loc}/{ARRAY_METADATAS}"
    impls = _prng_impls(where, doc)
    out = dict(arrays)
    for key, a in arrays.items():
        impl = impls.get(a.name)
        if impl is None:
            continue
        words = KEY_WORDS[impl]
        if a.dtype != np.uint32 or not a.shape or a.shape[-1] != words:
            raise _bad_array_metadata(
                where,
                f"array {a.name} (leaf {key!r}) is recorded as a {impl} PRNG key but is stored "
                f"as {a.dtype.name}{list(a.shape)}, not the key data uint32[..., {words}]",
            )
        out[key] = a._replace(prng_impl=impl)
    return out


def _prng_impls(where: str, doc: Any) -> dict[str, str]:
    """Parameter name -> PRNG key implementation, from an array metadata document."""
    entries = doc.get("array_metadatas") if isinstance(doc, dict) else None
    if not isinstance(entries, list):
        raise _bad_array_metadata(where, 'no "array_metadatas" list')
    found = {}
    for i, entry in enumerate(entries):
        meta = entry.get("array_metadata") if isinstance(entry, dict) else None
        name = meta.get("param_name") if isinstance(meta, dict) else None
        ext = meta.get("ext_metadata") if isinstance(meta, dict) else None
        impl = ext.get("random_key_impl") if isinstance(ext, dict) else None
        if not isinstance(name, str) or not isinstance(ext, (dict, type(None))):
            raise _bad_array_metadata(
                where,
                f"entry {i} is not {{'array_metadata': {{'param_name': ..., 'ext_metadata': ...}}}}",
            )
        if impl is not None and impl not in KEY_WORDS:
            raise _bad_array_metadata(
                where,
                f"array {name[:200]} is recorded as a PRNG key of implementation "
                f"{str(impl)[:100]!r}, which jaxckpt does not know (it knows "
                f"{', '.join(KEY_WORDS)})",
            )
        if impl is not None:
            found[name] = impl
    return found


def _bad_array_metadata(where: str, what: str) -> ManifestError:
    return ManifestError(
        f"{where}: {what}. The Orbax array metadata is damaged or of a layout jaxckpt does not "
        f"know; nothing was read. Restore the item with orbax-checkpoint, or another step."
    )


def _start_opening(
    loc: _location.Location, kv: ts.KvStore, item: OrbaxItem
) -> tuple[dict[str, Any], dict[str, tuple[str, str, Any]]]:
    """Read the ``None`` and string leaves; start opening the arrays and scalars.

    Returns ``(values, opening)``: values by key, and key -> (param name, value type, future).
    """
    strings: dict | None = None
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
            strings = _read_json(kv, loc, STRINGS) if strings is None else strings
            v = strings.get(name) if isinstance(strings, dict) else None
            if not isinstance(v, str):
                raise _bad(loc, f"string leaf {key!r} has no string in {STRINGS}")
            values[key] = v
        elif vtype in _ARRAYS or vtype == "scalar":
            spec = {
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
                    context=_location.CONTEXT,
                )
            else:
                spec["kvstore"] = _kvstore(loc, name)
                fut = ts.open(spec, open=True, read=True, context=_location.CONTEXT)
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
    if _listed(loc, kv, "manifest.ocdbt", "manifest.ocdbt\0"):
        return True
    if recorded or _listed(loc, kv, "ocdbt.process_", "ocdbt.process_\x7f"):
        raise CorruptChunkError(
            f"{loc}: an OCDBT item (Orbax's default) without its manifest.ocdbt, the root of "
            f"the database that Orbax writes last: the save did not finish or the file was "
            f"lost. Restore another step."
        )
    return False


def _listed(loc: _location.Location, kv: ts.KvStore, start: str, stop: str) -> bool:
    """Whether any name in ``[start, stop)`` exists at the item's top (nothing is read)."""
    if loc.local is not None:  # one directory listing, not a walk of every array's chunks
        return any(start <= n < stop for n in os.listdir(loc.local))
    return bool(kv.list(ts.KvStore.KeyRange(start, stop)).result())


def _database(loc: _location.Location) -> ts.KvStore:
    """The item's OCDBT key-value store, opened once (its b-tree nodes cached, not chunks)."""
    try:
        return ts.KvStore.open({"driver": "ocdbt", "base": loc.kvstore}, context=_CONTEXT).result()
    except ValueError as e:
        raise CorruptChunkError(
            f"{loc}: the OCDBT database (manifest.ocdbt) cannot be opened ({e}). The Orbax "
            f"checkpoint is damaged: restore another step."
        ) from e


def _kvstore(loc: _location.Location, name: str) -> dict:
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
        return fut.result()
    except ValueError as e:
        raise CorruptChunkError(
            f"{loc}: leaf {key!r} (array {name}) cannot be opened ({e}). The Orbax checkpoint "
            f"is damaged or its array is of a kind jaxckpt does not read: restore another step."
        ) from e


def _result(loc: _location.Location, key: str, name: str, fut: Any) -> np.ndarray:
    try:
        return fut.result()
    except ValueError as e:
        raise CorruptChunkError(
            f"{loc}: leaf {key!r} (array {name}): a chunk is missing or cannot be decoded ({e}). "
            f"The Orbax checkpoint is damaged: restore another step, or the other keys."
        ) from e


class OrbaxReader:
    """Reads boxes of an Orbax item's arrays through tensorstore (zarr, zarr3, OCDBT)."""

    kind = "orbax"

    def __init__(self, loc: _location.Location, stores: dict[str, Any]) -> None:
        self.loc, self.stores = loc, stores
        if any(not is_supported_dtype(s.dtype.numpy_dtype) for s in stores.values()):
            bad = next(k for k, s in stores.items() if not is_supported_dtype(s.dtype.numpy_dtype))
            raise ManifestError(f"{loc}: leaf {bad!r} has a dtype jaxckpt does not read.")

    def read(
        self,
        entries: dict[str, Any],
        items: Iterable[ReadItem],
        *,
        max_inflight_bytes: int = MAX_INFLIGHT_BYTES,
    ) -> Iterator[tuple[ReadItem, np.ndarray]]:
        """Yield ``(item, data)`` for each item; tensorstore reads the chunks its box overlaps."""
        return pipelined(entries, items, self._start, max_inflight_bytes=max_inflight_bytes)

    def _start(self, item: ReadItem) -> Callable[[], np.ndarray]:
        store = self.stores[item.key]
        if item.sizes != tuple(store.shape):
            store = store[tuple(slice(o, o + s) for o, s in zip(item.offsets, item.sizes))]
        fut = store.read()
        name = item.key.replace(SEP, ".")  # Orbax's parameter name
        return lambda: _result(self.loc, item.key, name, fut)
