"""What a manifest on disk may hold: the checks that turn untrusted JSON into entries.

Reading a manifest never runs code. ``manifest.Manifest.from_json`` decodes the JSON and checks
its header (format, version); ``fields_from_json`` here type-checks every other field: the
entries, packs, digests, references and the tree. Storage paths are confined to the
checkpoint's own ``arrays/`` folder, and sizes, nesting (``MAX_DEPTH``) and the digits of an int
(``MAX_INT_DIGITS``) are bounded; save refuses trees beyond the last two. A field that fails is
a ``ManifestError`` that names it (and an entry's key) and says the manifest is damaged.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import sys
from collections.abc import Sequence
from typing import Any, TypeGuard

import numpy as np

from jaxckpt._errors import ManifestError
from jaxckpt._format import codecs
from jaxckpt._format.dtypes import NATIVE, dtype_from_name, storage_dtype_name
from jaxckpt._format.entries import ArrayEntry, Entry, PackEntry, ValueEntry
from jaxckpt._format.names import is_reference, is_storage_path

# The deepest tree nesting (a leaf at depth MAX_DEPTH, the root at 0) and the longest int value
# (decimal digits) a manifest holds. Save refuses more (UnsupportedLeafError) and restore reads
# up to them: _check_tree and unflatten recurse once per level, well inside Python's recursion
# limit, and Python's int <-> str conversion (json) refuses longer ints by default.
MAX_DEPTH = 400
MAX_INT_DIGITS = 4300  # sys.int_info.default_max_str_digits
_MAX_NDIM = 64  # dimensions of an array
MAX_BYTES = 1 << 50  # 1 PiB: larger sizes in a manifest are treated as corruption


def int_digits_over(value: int) -> int | None:
    """The digit limit ``value`` exceeds (``MAX_INT_DIGITS``, or this interpreter's lower
    ``sys.get_int_max_str_digits()``), or ``None`` if it fits. No str conversion: O(1) mostly."""
    limit = min(MAX_INT_DIGITS, sys.get_int_max_str_digits() or MAX_INT_DIGITS)
    return limit if abs(value) >= _power_of_ten(limit) else None


@functools.cache
def _power_of_ten(n: int) -> int:
    return int(10**n)  # int ** int is Any to mypy: a negative exponent makes a float


@dataclasses.dataclass(frozen=True)
class Fields:
    """A manifest's fields after its header, checked: those of ``Manifest`` but ``version``."""

    tree: dict[str, Any]
    entries: dict[str, Entry]
    created: dict[str, Any]
    packs: dict[str, PackEntry]
    digests: dict[str, dict[str, str]]
    probes: dict[str, dict[str, str]]
    refs: dict[str, str]


def fields_from_json(
    doc: dict[str, Any],
    where: str,
    *,
    with_packs: bool,
    with_refs: bool,
    with_compression: bool = False,
) -> Fields:
    """Check every field of a decoded ``manifest.json`` but its header (format, version).

    Args:
      doc: the decoded JSON object, untrusted.
      where: what errors call the manifest (its path).
      with_packs: whether the manifest's version has ``packs`` (else they are ignored).
      with_refs: whether the manifest's version has ``refs`` (else they are ignored).
      with_compression: whether the manifest's version has compressed arrays (else an array
        or pack that says it is compressed is an error, not read as raw bytes).

    Returns:
      The checked fields, for ``Manifest``.

    Raises:
      ManifestError: a field a manifest jaxckpt wrote cannot hold, named (with an entry's key).
    """
    raw = doc.get("entries")
    if not isinstance(raw, dict):
        raise ManifestError(f'{where}: "entries" must be an object.')
    packs = _packs_from_json(doc.get("packs", {}) if with_packs else {}, where, with_compression)
    entries = {k: _entry_from_json(k, v, where, packs, with_compression) for k, v in raw.items()}
    paths = [e.path for e in entries.values() if isinstance(e, ArrayEntry) and not e.pack]
    paths += packs
    if len(set(paths)) != len(paths):
        raise ManifestError(f"{where}: two keys share one storage path.")
    tree = _check_tree(doc.get("tree"), entries, where)
    created = c if isinstance(c := doc.get("created"), dict) else {}
    raise_if_bad_packs(entries, packs, where)
    stored = set(paths)
    refs = _refs_from_json(doc.get("refs", {}) if with_refs else {}, stored, where)
    digests = _digests_from_json(doc.get("digests", {}), stored, where)
    probes = _digests_from_json(doc.get("probes", {}), stored, where, "probes")
    return Fields(tree, entries, created, packs, digests, probes, refs)


def _bad(where: str, key: str, what: str) -> ManifestError:
    return ManifestError(
        f"{where}: entry {key!r} {what}. The manifest is damaged or was not written by "
        f"jaxckpt; nothing was read."
    )


def _ints(x: object) -> TypeGuard[list[int]]:
    if not isinstance(x, list):
        return False
    for i in x:  # a loop, not all(...): called twice per entry of manifests of 100k entries
        if type(i) is not int or i < 0:
            return False
    return True


def _compression(d: dict[str, Any], allowed: bool) -> tuple[str | None, str | None]:
    """An array's or a pack's ``compression``, and what is wrong with it (``None``: nothing)."""
    name = d.get("compression")
    if name is None:
        return None, None
    if not allowed:
        return None, (
            f"says its chunks are compressed ({name!r}), which its format version cannot: "
            f"compressed checkpoints are version {codecs.VERSION}"
        )
    if not isinstance(name, str) or name not in codecs.CODECS:
        return None, (
            f"has compression {name!r}, which this jaxckpt cannot decode (it reads "
            f"{', '.join(codecs.CODECS)}); upgrade jaxckpt to read it"
        )
    return name, None


def _entry_from_json(
    key: str, d: Any, where: str, packs: dict[str, PackEntry], with_compression: bool = False
) -> Entry:
    if not isinstance(d, dict):
        raise _bad(where, key, "is not an object")
    if d.get("kind") == "value":
        return ValueEntry(key, _value_from_json(key, d, where))
    if d.get("kind") != "array":
        raise _bad(where, key, f"has unknown kind {d.get('kind')!r}")
    shape, chunks = _check_grid(key, d.get("shape"), d.get("chunks"), where)
    path = d.get("path")
    if not (type(path) is str and _storage_path_ok(path)):
        raise _bad(where, key, f"has storage path {path!r} outside the checkpoint's arrays/")
    dtype, sdtype = d.get("dtype"), d.get("storage_dtype")
    if type(dtype) is not str or type(sdtype) is not str:
        raise _bad(where, key, f"has an unknown dtype {dtype!r}/{sdtype!r}")
    logical = _dtype_pair(dtype, sdtype)
    if logical is None:
        raise _bad(where, key, f"has an unknown dtype {dtype!r}/{sdtype!r}")
    if isinstance(logical, str):
        raise _bad(where, key, logical)
    if math.prod(shape) * logical.itemsize > MAX_BYTES:
        raise _bad(where, key, f"claims an absurd size {shape!r}")
    if math.prod(chunks) * logical.itemsize > MAX_BYTES:  # a zero-size array's chunks too
        raise _bad(where, key, f"claims an absurd chunk size {chunks!r}")
    if d.get("checksum", "crc32c") not in ("crc32c", "none"):
        raise _bad(where, key, f"has unknown checksum {d.get('checksum')!r}")
    compression, problem = _compression(d, with_compression)
    if problem:
        raise _bad(where, key, problem)
    impl = d.get("prng_impl")
    if impl is not None and not (isinstance(impl, str) and re.fullmatch(r"[a-z0-9_]+", impl)):
        raise _bad(where, key, f"has an invalid prng_impl {impl!r}")
    if impl is not None:
        problem = prng_problem(impl, tuple(shape), dtype)
        if problem:
            raise _bad(where, key, problem)
    sharding = d.get("sharding")
    offset = d.get("offset")
    pack = None if offset is None else _pack_of(key, path, offset, sdtype, shape, packs, where)
    if pack is not None and compression is not None:
        raise _bad(where, key, "is packed and compressed: a packed array takes its pack's codec")
    return ArrayEntry(
        key=key,
        shape=tuple(shape),
        dtype=dtype,
        storage_dtype=sdtype,
        chunks=tuple(chunks),
        path=path,
        checksum=d.get("checksum", "crc32c"),
        compression=compression,
        prng_impl=impl,
        sharding=sharding if isinstance(sharding, str) else None,
        pack=pack,
        offset=offset or 0,
    )


@functools.lru_cache(maxsize=4096)  # bounded: the paths come from a manifest on disk
def _storage_path_ok(path: str) -> bool:  # cached: the members of a pack share one path
    return is_storage_path(path)


@functools.lru_cache(maxsize=256)  # bounded: a hostile manifest may name any string
def _dtype_pair(dtype: str, sdtype: str) -> np.dtype[Any] | str | None:
    """The logical dtype of an entry; ``None`` for an unknown name, or why the pair is wrong.
    Cached: a manifest names a handful of dtypes over thousands of entries."""
    try:
        logical = dtype_from_name(dtype)
        dtype_from_name(sdtype)
    except ManifestError:
        return None
    if sdtype != storage_dtype_name(logical):
        return f"stores {dtype} as {sdtype}, expected {storage_dtype_name(logical)}"
    return logical


def _check_grid(key: str, shape: Any, chunks: Any, where: str) -> tuple[list[int], list[int]]:
    """``shape`` and ``chunks``, checked."""
    if not _ints(shape) or len(shape) > _MAX_NDIM:
        raise _bad(where, key, f"has an invalid shape {shape!r}")
    if not _ints(chunks) or len(chunks) != len(shape):
        raise _bad(where, key, f"has an invalid chunk shape {chunks!r} for shape {shape!r}")
    for s, c in zip(shape, chunks):
        if c < 1:
            raise _bad(where, key, f"has an invalid chunk shape {chunks!r} for shape {shape!r}")
        if c > s and c > 1:  # larger than its shape: tensorstore allocates whole chunks
            raise _bad(where, key, f"has a chunk shape {chunks!r} larger than its shape {shape!r}")
    return shape, chunks


def _value_from_json(key: str, d: dict[str, Any], where: str) -> Any:
    kind, v = d.get("type"), d.get("value")
    if kind == "none":
        return None
    if kind == "float" and isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            pass
    if kind in ("int", "bool", "str") and type(v).__name__ == kind:
        return v
    if kind == "complex" and isinstance(v, list) and len(v) == 2:
        try:
            return complex(float(v[0]), float(v[1]))  # each part as a float's repr
        except (TypeError, ValueError):
            pass
    raise _bad(where, key, f"has an invalid value of type {kind!r}")


def _pack_of(
    key: str,
    path: str,
    offset: Any,
    sdtype: str,
    shape: list[int],
    packs: dict[str, PackEntry],
    where: str,
) -> PackEntry:
    """A packed entry's pack: ``path`` names it, and it holds [offset, offset + size)."""
    pack = packs.get(path)
    if type(offset) is not int or offset < 0 or pack is None:
        raise _bad(where, key, f"has offset {offset!r} into {path!r}, which is not a pack")
    if pack.storage_dtype != sdtype:
        raise _bad(where, key, f"is {sdtype} but its pack {path} holds {pack.storage_dtype}")
    if offset + math.prod(shape) > pack.size:
        raise _bad(
            where,
            key,
            f"lies at [{offset}, {offset + math.prod(shape)}) outside its "
            f"pack {path} of {pack.size} elements",
        )
    return pack


# Key data of the PRNG implementations jax ships: uint32 words per key. Others (registered with
# jax.extend.random.define_prng_impl) are checked against jax by the load planner.
PRNG_KEY_SHAPES = {"threefry2x32": (2,), "rbg": (4,), "unsafe_rbg": (4,)}


def prng_problem(
    impl: str, shape: tuple[int, ...], dtype: str, key_shape: tuple[int, ...] | None = None
) -> str | None:
    """Why key data of ``shape``/``dtype`` cannot be keys of ``impl`` (``None`` if it can).

    ``key_shape``: the impl's key data shape if known (else :data:`PRNG_KEY_SHAPES`'s).
    """
    key_shape = key_shape or PRNG_KEY_SHAPES.get(impl)
    if dtype != "uint32":
        return f"is a PRNG key array ({impl}) stored as {dtype}; key data is uint32"
    if key_shape is not None and (len(shape) < 1 or shape[-len(key_shape) :] != key_shape):
        return (
            f"is a PRNG key array ({impl}) of key data shape {list(shape)}, which must end "
            f"in {list(key_shape)} for {impl}"
        )
    if len(shape) < 1:
        return f"is a PRNG key array ({impl}) with scalar key data; it needs a trailing dimension"
    return None


def _packs_from_json(raw: Any, where: str, with_compression: bool = False) -> dict[str, PackEntry]:
    if not isinstance(raw, dict):
        raise ManifestError(f'{where}: "packs" must be an object.')
    packs: dict[str, PackEntry] = {}
    for path, d in raw.items():
        if not isinstance(d, dict):
            raise ManifestError(f"{where}: pack {path!r} is not an object.")
        shape, chunks, sdtype = d.get("shape"), d.get("chunks"), d.get("storage_dtype")
        what = None
        if not is_storage_path(path):
            what = "has a storage path outside the checkpoint's arrays/"
        elif not _ints(shape) or len(shape) != 1 or not _ints(chunks) or len(chunks) != 1:
            what = f"has an invalid shape {shape!r} or chunk shape {chunks!r} (1-D expected)"
        elif chunks[0] < 1 or not isinstance(sdtype, str) or sdtype not in NATIVE:
            what = f"has an invalid chunk size {chunks!r} or data type {sdtype!r}"
        elif chunks[0] > max(shape[0], 1):  # tensorstore allocates whole chunks
            what = f"has a chunk size {chunks!r} larger than its shape {shape!r}"
        elif shape[0] * dtype_from_name(sdtype).itemsize > MAX_BYTES:
            what = f"claims an absurd size {shape!r}"
        elif d.get("checksum", "crc32c") not in ("crc32c", "none"):
            what = f"has unknown checksum {d.get('checksum')!r}"
        else:
            compression, what = _compression(d, with_compression)
            checksum = d.get("checksum", "crc32c")
            if not what:  # every check passed
                packs[path] = PackEntry(path, shape[0], sdtype, chunks[0], checksum, compression)
        if what:
            raise ManifestError(
                f"{where}: pack {path!r} {what}. The manifest is damaged or was not written by "
                f"jaxckpt; nothing was read."
            )
    return packs


def pack_problems(entries: dict[str, Entry], packs: dict[str, PackEntry]) -> list[str]:
    """Members outside their pack or overlapping another member, in O(n log n)."""
    members: dict[str, list[tuple[int, int, str]]] = {}
    for e in entries.values():
        if isinstance(e, ArrayEntry) and e.pack is not None and e.size:
            members.setdefault(e.path, []).append((e.offset, e.offset + e.size, e.key))
    errors = []
    for path, spans in members.items():
        pack, first = packs.get(path), entries[spans[0][2]]
        if pack is None or not isinstance(first, ArrayEntry) or pack != first.pack:
            errors.append(f"key {spans[0][2]!r} names pack {path!r}, which the manifest lacks")
            continue
        spans.sort()
        if max(s[1] for s in spans) > pack.size:
            errors.append(f"a member of pack {path!r} lies outside its {pack.size} elements")
        for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
            if start < end:
                errors.append(f"keys {a!r} and {b!r} overlap in pack {path!r}")
                break
    return errors


def raise_if_bad_packs(entries: dict[str, Entry], packs: dict[str, PackEntry], where: str) -> None:
    """Raise ``ManifestError`` naming the first few of ``pack_problems``, if any."""
    errors = pack_problems(entries, packs)
    if errors:
        raise ManifestError(
            f"{where}: {'; '.join(errors[:5])}. The manifest is damaged or was not written by "
            f"jaxckpt; nothing was read."
        )


def box_key(offsets: Sequence[int], sizes: Sequence[int]) -> str:
    """How a box is named in ``Manifest.digests``: ``"0,8+4,8"`` (offsets, then sizes).

    >>> box_key((0, 8), (4, 8)), box_key((), ())
    ('0,8+4,8', '+')
    """
    return ",".join(map(str, offsets)) + "+" + ",".join(map(str, sizes))


_BOX = re.compile(r"[0-9,]{0,1300}\+[0-9,]{0,1300}")
_HEX = re.compile(r"[0-9a-f]{32}")


def _digests_from_json(
    raw: Any, stored: set[str], where: str, field: str = "digests"
) -> dict[str, dict[str, str]]:
    if not isinstance(raw, dict):
        raise ManifestError(f'{where}: "{field}" must be an object.')
    for path, boxes in raw.items():
        ok = path in stored and isinstance(boxes, dict)
        if not ok or not all(
            isinstance(b, str) and _BOX.fullmatch(b) and isinstance(h, str) and _HEX.fullmatch(h)
            for b, h in boxes.items()
        ):
            raise ManifestError(
                f"{where}: the {field} of {path!r} are malformed or name no stored array. The "
                f"manifest is damaged or was not written by jaxckpt; nothing was read."
            )
    return raw


def _refs_from_json(raw: Any, stored: set[str], where: str) -> dict[str, str]:
    if not isinstance(raw, dict):
        raise ManifestError(f'{where}: "refs" must be an object.')
    for path, target in raw.items():
        if path not in stored or not is_reference(target):
            raise ManifestError(
                f"{where}: reference {path!r} -> {target!r} is not a sibling step's array "
                f"(../STEP/arrays/NAME). The manifest is damaged or was not written by jaxckpt; "
                f"nothing was read."
            )
    return raw


def _check_tree(node: Any, entries: dict[str, Entry], where: str, depth: int = 0) -> dict[str, Any]:
    """``node``, a tree of the manifest, checked."""
    if depth > MAX_DEPTH or not isinstance(node, dict):  # well inside Python's recursion limit
        raise ManifestError(f"{where}: the tree structure is malformed.")
    kind = node.get("type")
    if kind == "leaf":
        if not isinstance(node.get("key"), str) or node.get("key") not in entries:
            raise ManifestError(f"{where}: the tree names key {node.get('key')!r} with no entry.")
        if node.get("scalar", True) is not True:  # optional: a numpy scalar leaf
            raise ManifestError(f"{where}: leaf {node['key']!r} has a malformed 'scalar' flag.")
        return node
    if kind not in ("dict", "list", "tuple", "namedtuple", "node"):
        raise ManifestError(f"{where}: unknown tree node type {kind!r}.")
    kids = node.get("children")
    keys = node.get("keys", [])
    if not isinstance(kids, list) or not isinstance(keys, list):
        raise ManifestError(f"{where}: the tree structure is malformed.")
    if not all(type(k) in (str, int) for k in keys):  # dict keys: what JSON and a tree allow
        bad = next(k for k in keys if type(k) not in (str, int))
        raise ManifestError(f"{where}: a {kind} node has key {bad!r}; keys must be str or int.")
    if kind != "list" and kind != "tuple" and len(keys) != len(kids):
        raise ManifestError(f"{where}: a {kind} node has {len(keys)} keys, {len(kids)} children.")
    for child in kids:
        _check_tree(child, entries, where, depth + 1)
    return node
