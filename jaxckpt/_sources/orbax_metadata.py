"""An Orbax PyTree/Standard item's JSON metadata, checked, as a jaxckpt manifest; pure.

What orbax-checkpoint writes for a PyTree / Standard item::

    ITEM/_METADATA              JSON: per leaf its key path, value type; use_zarr3, and
                                use_ocdbt since 0.11.31 (older: OCDBT is told by manifest.ocdbt)
    ITEM/_CHECKPOINT_METADATA   JSON: the handler's name, timestamps
    ITEM/_strings.json          JSON: string leaves, by parameter name
    ITEM/manifest.ocdbt, d/, ocdbt.process_N/   OCDBT: one key-value database for all arrays
    ITEM/<param.name>/          without OCDBT: one zarr (v2, ``.zarray``) or zarr3 array each
    ITEM/array_metadatas/process_N              JSON: per array, a PRNG key's implementation
    ITEM/_sharding                              not needed here

Each leaf becomes a manifest entry keyed by its tree path joined with ``/``; an empty node is
a ``None`` placeholder (``value_type`` "None") or an empty container ("Dict", "List", ...).
A PRNG key array is stored as its uint32 key data; the implementation that
``array_metadatas/process_0`` records for it (``random_key_impl``) becomes the entry's
``prng_impl``, as for jaxckpt's own keys. Nothing here reads files (:mod:`.orbax` does), so
it is tested without orbax or tensorstore; every document is hostile input, checked field by
field, and anything unexpected is a :class:`ManifestError` naming the file.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import numpy as np

from jaxckpt._errors import ManifestError
from jaxckpt._format.manifest import ArrayEntry, Manifest, ValueEntry
from jaxckpt._format.names import SEP
from jaxckpt._storage import location as _location

METADATA = "_METADATA"
CHECKPOINT_METADATA = "_CHECKPOINT_METADATA"
ARRAY_METADATAS = "array_metadatas/process_0"  # every process records every jax.Array
# uint32 words of one key, by the implementation names jax.random.key_impl gives.
KEY_WORDS = {"threefry2x32": 2, "rbg": 4, "unsafe_rbg": 4}
_EMPTY = {"Dict": "dict", "List": "list", "Tuple": "list", "NamedTuple": "dict"}


# A leaf of ``_METADATA``: (key path, key types, value metadata)
_Leaf = tuple[list[str], list[int], dict[str, Any]]


def bad_metadata(loc: _location.Location, what: str) -> ManifestError:
    return ManifestError(
        f"{loc}/{METADATA}: {what}. The Orbax metadata is damaged or of a layout jaxckpt does "
        f"not know; nothing was read. Restore it with orbax-checkpoint, or another step."
    )


def _leaves(loc: _location.Location, doc: Any) -> list[_Leaf]:
    meta = doc.get("tree_metadata") if isinstance(doc, dict) else None
    if not isinstance(meta, dict):
        raise bad_metadata(loc, 'no "tree_metadata" object')
    out: list[_Leaf] = []
    for raw_key, leaf in meta.items():
        kms = leaf.get("key_metadata") if isinstance(leaf, dict) else None
        vm = leaf.get("value_metadata") if isinstance(leaf, dict) else None
        if not isinstance(kms, list) or not kms or not isinstance(vm, dict) or len(kms) > 1000:
            raise bad_metadata(loc, f"leaf {raw_key!r} has no key_metadata/value_metadata")
        parts, kinds = [], []
        for km in kms:
            k, t = (km.get("key"), km.get("key_type")) if isinstance(km, dict) else (None, None)
            if not isinstance(k, (str, int)) or isinstance(k, bool) or t not in (1, 2):
                raise bad_metadata(loc, f"leaf {raw_key!r} has a malformed key entry {km!r}")
            if t == 1 and not str(k).isdigit():
                raise bad_metadata(loc, f"leaf {raw_key!r} has sequence index {k!r}")
            if SEP in str(k) or "\0" in str(k) or str(k) in (".", ".."):
                raise bad_metadata(
                    loc, f"leaf {raw_key!r} has key {k!r}, which jaxckpt cannot name"
                )
            parts.append(str(k))
            kinds.append(t)
        out.append((parts, kinds, vm))
    return out


def _tree(loc: _location.Location, leaves: list[_Leaf], empty: dict[str, str]) -> dict[str, Any]:
    """jaxckpt's JSON tree from Orbax key paths (key_type 2: dict key, 1: sequence index).
    The root is a list where every path starts with an index (Orbax saved a list or tuple:
    it does not record which), otherwise a dict."""
    top = {kinds[0] for _, kinds, _ in leaves}
    root: dict[str, Any] = {"kind": "list" if top == {1} else "dict", "kids": {}}
    for parts, kinds, _ in leaves:
        node = root
        for i, (part, kind) in enumerate(zip(parts, kinds)):
            want = "dict" if kind == 2 else "list"
            if node.get("kind") != want:
                raise bad_metadata(loc, f"{SEP.join(parts)!r} mixes dict keys and sequence indices")
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
                raise bad_metadata(loc, f"{key!r} is both a leaf and a subtree")
            node = child

    def to_json(n: dict[str, Any]) -> dict[str, Any]:
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
    dtype: np.dtype[Any]
    chunks: tuple[int, ...]  # the read chunk shape
    prng_impl: str | None = None  # a PRNG key array's implementation (shape ends in its words)


@dataclasses.dataclass(frozen=True)
class OrbaxItem:
    """An item's ``_METADATA``, checked: its leaves, the tree they form, how arrays are stored."""

    leaves: list[_Leaf]
    empty: dict[str, str]  # key -> "dict" or "list": an empty container, not a leaf
    tree: dict[str, Any]  # jaxckpt's JSON tree
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
        raise bad_metadata(loc, f'"use_ocdbt" is {ocdbt!r}, not true or false')
    fill_ok = doc.get("store_array_data_equal_to_fill_value") is False
    empty = {
        SEP.join(p): _EMPTY[kind] for p, _, vm in leaves if (kind := vm.get("value_type")) in _EMPTY
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
                raise bad_metadata(loc, f"leaf {key!r} holds a {type(v).__name__}")
            entries[key] = ValueEntry(key, v)
    entries = {k: entries[k] for k in order}
    created = {"source": "orbax", "use_ocdbt": item.ocdbt, "use_zarr3": item.zarr3}
    return Manifest(tree=item.tree, entries=entries, created=created)


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
