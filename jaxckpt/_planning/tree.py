"""Pytrees <-> flat ``{key path: leaf}`` dicts, and the JSON structure that maps back.

PyTorch DCP's ``flatten_state_dict`` adapted to JAX: a key path is the pytree path of a leaf
written as ``"/"``-joined parts (``"opt_state/0/mu/dense/kernel"``). ``None`` counts as a leaf
here (JAX drops it), so a saved ``None`` comes back as ``None``.

The structure is a small JSON document (no pickle, no class names that get imported) that
rebuilds dicts, lists and tuples without a target. NamedTuples and other registered nodes
(flax/equinox modules, dataclasses) come back as dicts of their fields without a target; pass a
``target`` to get the original classes back.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Sequence
from typing import Any, TypeAlias

import jax
import numpy as np

from jaxckpt._errors import KeyMismatchError, UnsupportedLeafError
from jaxckpt._format.manifest_check import MAX_DEPTH, int_digits_over
from jaxckpt._format.names import SEP

_KeyPath: TypeAlias = tuple[Any, ...]  # a jax.tree_util key path: its entries (DictKey, ...)
_Trail: TypeAlias = tuple[()] | tuple["_Trail", Hashable]  # (parent's trail, name)


def _entry_str(entry: Any) -> str:
    tu = jax.tree_util
    if isinstance(entry, tu.DictKey):
        if type(entry.key) is int and int_digits_over(entry.key):
            raise UnsupportedLeafError(
                f"A dict key is an int of more than {int_digits_over(entry.key)} digits, which "
                f"a key path cannot spell. Use shorter (or str) keys."
            )
        return str(entry.key)
    if isinstance(entry, tu.SequenceKey):
        return str(entry.idx)
    if isinstance(entry, tu.GetAttrKey):
        return str(entry.name)
    if isinstance(entry, tu.FlattenedIndexKey):
        return str(entry.key)
    return str(entry)


def path_to_key(path: _KeyPath) -> str:
    """The key path string of a ``jax.tree_util`` path (``""`` for a bare leaf)."""
    return SEP.join(_entry_str(e) for e in path)


def _is_none(x: Any) -> bool:
    return x is None


def flatten_with_treedef(tree: Any) -> tuple[list[str], list[Any], Any]:
    """Flatten ``tree`` (``None`` kept as a leaf) into key paths, leaves and the treedef.

    Raises:
      UnsupportedLeafError: the tree nests deeper than a manifest holds (``MAX_DEPTH``), or
        has dict keys JAX cannot sort.
    """
    _check_depth(tree)  # first: JAX's own flatten overflows the stack on a deep enough tree
    try:
        with_path, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_none)
    except (TypeError, ValueError) as e:  # JAX sorts dict keys: mixed int/str cannot sort
        where = _unsortable(tree, "")
        if where is None:
            raise
        raise UnsupportedLeafError(
            f"The dict at {where or '(the root)'!r} has keys JAX cannot sort "
            f"({sorted(map(repr, _dict_at(tree, where)))[:5]}, {e}). Use keys of one type "
            f"(e.g. all str: {{str(k): v ...}})."
        ) from e
    keys = _keys_for(treedef, with_path)
    return keys, [leaf for _, leaf in with_path], treedef


_LEAVES = (jax.Array, np.ndarray, np.generic, int, float, complex, str, bytes)


def _check_depth(tree: Any) -> None:
    """Refuse a tree nested deeper than ``MAX_DEPTH`` (what restore refuses), walking it with a
    stack of its own: one step per node, no recursion."""
    stack: list[tuple[Any, int, _Trail]] = [(tree, 0, ())]
    while stack:
        x, depth, trail = stack.pop()
        if x is None or isinstance(x, _LEAVES):
            continue
        if isinstance(x, dict):
            kids = list(x.items())
        elif isinstance(x, (list, tuple)):
            kids = list(enumerate(x))
        else:  # a registered node (or a leaf JAX knows): one level of it
            leaves, treedef = jax.tree_util.tree_flatten(x, is_leaf=_all_but(x))
            if jax.tree_util.treedef_is_leaf(treedef) and leaves and leaves[0] is x:
                continue
            kids = list(enumerate(leaves))
        if kids and depth >= MAX_DEPTH:  # its children would lie below the limit
            names = []
            while trail:
                trail, name = trail
                names.append(str(name))
            raise _too_deep(SEP.join(reversed(names)))
        stack.extend((v, depth + 1, (trail, k)) for k, v in kids)


def _all_but(node: Any) -> Callable[[Any], bool]:
    """An ``is_leaf`` that flattens one level of ``node``: all but ``node`` is a leaf."""
    return lambda y: y is not node


def _too_deep(key: str) -> UnsupportedLeafError:
    return UnsupportedLeafError(
        f"The tree nests deeper than {MAX_DEPTH} levels (below {key[:100]!r}...), more than a "
        f"checkpoint holds. "
        f"Flatten the structure (e.g. a list instead of nested pairs), or save the deep part "
        f"as an array."
    )


def _unsortable(node: Any, path: str) -> str | None:
    """The key path of the first dict (through dicts, lists, tuples) whose keys cannot sort."""
    if isinstance(node, dict):
        try:
            sorted(node)
        except TypeError:
            return path
        children = list(node.items())
    elif isinstance(node, (list, tuple)):
        children = list(enumerate(node))
    else:
        return None
    for k, v in children:
        found = _unsortable(v, f"{path}{SEP}{k}" if path else str(k))
        if found is not None:
            return found
    return None


def _dict_at(tree: Any, path: str) -> Any:
    node = tree
    for part in path.split(SEP) if path else []:
        node = node[int(part)] if isinstance(node, (list, tuple)) else _child(node, part)
    return node


def _child(d: dict[Any, Any], name: str) -> Any:
    return next(v for k, v in d.items() if str(k) == name)


def _keys_for(treedef: Any, with_path: list[tuple[_KeyPath, Any]]) -> list[str]:
    try:
        return list(_cached_keys(treedef, tuple(p for p, _ in with_path)))
    except TypeError:  # a custom node whose aux data is unhashable: compute without cache
        return _compute_keys([p for p, _ in with_path])


@functools.lru_cache(maxsize=64)
def _cached_keys(treedef: Any, paths: tuple[_KeyPath, ...]) -> tuple[str, ...]:
    del treedef  # part of the cache key only
    return tuple(_compute_keys(list(paths)))


def _compute_keys(paths: list[_KeyPath]) -> list[str]:
    keys = [path_to_key(p) for p in paths]
    if len(set(keys)) != len(keys):
        seen: dict[str, int] = {}
        for k in keys:
            seen[k] = seen.get(k, 0) + 1
        dup = sorted(k for k, n in seen.items() if n > 1)
        raise UnsupportedLeafError(
            f"Two leaves map to the same key path {dup[:5]!r}: a dict key contains '{SEP}' "
            f"or two nodes name their children alike. Rename the keys so each leaf's path "
            f"is unique."
        )
    return keys


def structure(tree: Any) -> dict[str, Any]:
    """The JSON structure of ``tree``, with leaves as ``{"type": "leaf", "key": ...}``.

    Raises:
      UnsupportedLeafError: the tree nests deeper than a manifest holds (``MAX_DEPTH``).
    """
    return _node(tree, (), 0)


def _json_key(key: Any) -> Any:
    return key if isinstance(key, (str, int)) and not isinstance(key, bool) else str(key)


def _node(x: Any, path: _KeyPath, depth: int) -> dict[str, Any]:
    if depth > MAX_DEPTH:  # what restore refuses (jaxckpt._format.manifest), before recursing on
        raise _too_deep(path_to_key(path))
    if x is None:
        return {"type": "leaf", "key": path_to_key(path)}
    if isinstance(x, np.generic):  # a numpy scalar comes back as one, not as a 0-d array
        return {"type": "leaf", "key": path_to_key(path), "scalar": True}
    children, treedef = jax.tree_util.tree_flatten_with_path(x, is_leaf=lambda y: y is not x)
    if jax.tree_util.treedef_is_leaf(treedef) and children and children[0][1] is x:
        return {"type": "leaf", "key": path_to_key(path)}
    kids = [_node(child, path + p, depth + 1) for p, child in children]
    if isinstance(x, dict):
        keys = [_json_key(p[0].key) for p, _ in children]
        return {"type": "dict", "keys": keys, "children": kids}
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        fields = [p[0].name for p, _ in children]
        return {"type": "namedtuple", "name": type(x).__name__, "keys": fields, "children": kids}
    if isinstance(x, list):
        return {"type": "list", "children": kids}
    if isinstance(x, tuple):
        return {"type": "tuple", "children": kids}
    keys = [_entry_str(p[0]) for p, _ in children]
    return {"type": "node", "name": type(x).__qualname__, "keys": keys, "children": kids}


def unflatten(
    node: dict[str, Any],
    values: dict[str, Any],
    selected: str | Sequence[str] | None = None,
    path: str = "",
) -> Any:
    """Rebuild a tree from its JSON structure, taking leaves from ``values``.

    Leaves whose key is not in ``values`` are dropped; a container that loses children becomes
    a dict of the children that remain (keyed as in the key path), and one that loses all of
    them is dropped. ``MISSING`` is returned for a dropped subtree. With ``selected`` (the
    ``keys=`` of a restore: key paths or prefixes), an empty container (e.g. optax's ``EmptyState()``)
    outside them is dropped too: it was not asked for.
    """
    kind = node["type"]
    if kind == "leaf":
        value = values.get(node["key"], MISSING)
        if node.get("scalar") is True and isinstance(value, np.ndarray) and value.ndim == 0:
            return value[()]  # saved as a numpy scalar
        return value
    keys = node.get("keys") or [str(i) for i in range(len(node["children"]))]
    kids = [
        unflatten(c, values, selected, f"{path}{SEP}{k}" if path else str(k))
        for k, c in zip(keys, node["children"])
    ]
    kept = [(k, v) for k, v in zip(keys, kids) if v is not MISSING]
    if not kept and (kids or (selected is not None and not matches(path, selected))):
        return MISSING
    if len(kept) < len(kids) or kind in ("namedtuple", "node"):
        return {k if kind == "dict" else str(k): v for k, v in kept}
    if kind == "dict":
        return dict(kept)
    if kind == "list":
        return [v for _, v in kept]
    return tuple(v for _, v in kept)


def empty_paths(node: dict[str, Any], path: str = "", found: set[str] | None = None) -> set[str]:
    """The key paths of the containers in a JSON structure that hold nothing (``{}``, an
    ``EmptyState()``), as a leaf there would be named."""
    found = set() if found is None else found
    if node["type"] != "leaf" and not node["children"]:
        found.add(path)
    elif node["type"] != "leaf":
        keys = node.get("keys") or [str(i) for i in range(len(node["children"]))]
        for k, child in zip(keys, node["children"]):
            empty_paths(child, f"{path}{SEP}{k}" if path else str(k), found)
    return found


def is_empty_at(tree: Any, key: str) -> bool:
    """Whether ``tree`` holds, at key path ``key``, a node with no leaves (``None`` counts as a
    leaf here, as in :func:`flatten_with_treedef`)."""
    node = tree
    for part in key.split(SEP) if key else []:
        if node is None:
            return False
        children = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda y, n=node: y is not n)[
            0
        ]
        found = [child for p, child in children if len(p) == 1 and _entry_str(p[0]) == part]
        if not found or found[0] is node:
            return False
        node = found[0]
    return node is not None and not jax.tree_util.tree_leaves(node, is_leaf=_is_none)


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


MISSING = _Missing()


def select(keys: list[str], wanted: str | Sequence[str] | None) -> list[str]:
    """The keys matching ``wanted`` (exact key paths or ``/``-prefixes); all if ``None``.

    Raises:
        KeyMismatchError: a requested key or prefix matches nothing.
    """
    if wanted is None:
        return list(keys)
    if isinstance(wanted, str):
        wanted = [wanted]
    hit = {w: [k for k in keys if _matches(k, w)] for w in wanted}
    unmatched = [w for w, ks in hit.items() if not ks]
    if unmatched:
        raise KeyMismatchError(
            f"keys={unmatched!r} match no key in the checkpoint. Saved keys start with: "
            f"{sorted({k.split(SEP)[0] for k in keys})[:10]!r}. Use `jaxckpt inspect PATH` to "
            f"list them."
        )
    chosen = {k for ks in hit.values() for k in ks}
    return [k for k in keys if k in chosen]


def wrapper_suffix(missing: list[str], unexpected: list[str]) -> tuple[str, bool] | None:
    """The suffix (e.g. ``"/value"``) that every mismatched key differs by, if there is one.

    ``(suffix, True)``: each key in ``unexpected`` (the checkpoint's) is one in ``missing`` (the
    target's) plus ``suffix``; ``(suffix, False)``: the other way round; ``None``: the keys
    differ otherwise. Flax's boxed ``nn.Partitioned`` and nnx ``Variable``s hold their array at
    ``.../value``, so the boxed and the plain tree of one model differ exactly so.
    """
    if not missing or len(missing) != len(unexpected):
        return None
    for short, long, saved_longer in ((missing, unexpected, True), (unexpected, missing, False)):
        for base in (k for k in short if long[0].startswith(k + SEP)):
            suffix = long[0][len(base) :]
            if {k + suffix for k in short} == set(long):
                return suffix, saved_longer
    return None


def matches(key: str, wanted: str | Sequence[str]) -> bool:
    """Whether ``key`` is one of ``wanted`` (key paths or ``/``-prefixes)."""
    if isinstance(wanted, str):
        wanted = [wanted]
    return any(_matches(key, w) for w in wanted)


def _matches(key: str, wanted: str) -> bool:
    prefix = wanted.rstrip(SEP)
    return key == wanted or not prefix or key.startswith(prefix + SEP)
