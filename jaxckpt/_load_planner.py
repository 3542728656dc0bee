"""The load planner: the protocol, and the default that reads each needed region once per host.

Adapted from PyTorch DCP's ``DefaultLoadPlanner`` (its ``_narrow`` becomes a box read): for each
*distinct* target shard on this host the planner asks storage for exactly that box of the saved
array, and tensorstore reads only the chunks the box overlaps.
"""

from __future__ import annotations

import abc
import collections
from typing import Any

import jax
import numpy as np

from jaxckpt import _manifest, _tree
from jaxckpt._errors import DtypeMismatchError, KeyMismatchError, ShapeMismatchError
from jaxckpt._manifest import ArrayEntry, Manifest
from jaxckpt._plan import LoadPlan, ReadItem, index_to_box

_HOST = "host"
_UNCOMMITTED = "uncommitted"  # a target array not committed to a device: return one like it


class LoadPlanner(abc.ABC):
    """The load protocol. ``jaxckpt.restore`` calls, on every process, in this order:

    1. ``set_up_planner(target, manifest, keys=, strict=)``: match the target to the manifest,
       raising on missing/unexpected keys (``strict``) and shape/dtype mismatches.
    2. ``create_local_plan() -> LoadPlan``: the boxes this host must read, each once.
    3. For each item, storage reads the box and the planner gets
       ``transform_tensor(item, array) -> array`` (the hook to cast or quantise), then
       ``commit_tensor(item, array)``.
    4. ``finish() -> tree``: place the data on devices and rebuild the tree.

    Nothing is gathered across processes: each reads only what its own devices need.
    """

    @abc.abstractmethod
    def set_up_planner(self, target: Any, manifest: Manifest, *, keys: Any = None,
                       strict: bool = True) -> None:  # fmt: skip
        """1. Match ``target`` (or the whole checkpoint, for ``None``) to ``manifest``.

        Raises:
          KeyMismatchError, ShapeMismatchError, DtypeMismatchError: naming the key.
        """

    @abc.abstractmethod
    def create_local_plan(self) -> LoadPlan:
        """2. The boxes this host reads, each distinct box once."""

    def transform_tensor(self, item: ReadItem, array: np.ndarray) -> np.ndarray:
        """3a. Change a box read from storage (cast, quantise) before it is committed."""
        return array

    @abc.abstractmethod
    def commit_tensor(self, item: ReadItem, array: np.ndarray) -> None:
        """3b. Keep a (transformed) box until :meth:`finish`."""

    @abc.abstractmethod
    def finish(self) -> Any:
        """4. Place the boxes on their devices and return the restored tree."""


class DefaultLoadPlanner(LoadPlanner):
    """Restores onto any sharding, onto the host as numpy, or as the saved Python values.

    Args:
      allow_dtype_cast: cast saved arrays to the target's dtype instead of raising
        :class:`DtypeMismatchError` (e.g. restore float32 weights into a bfloat16 model).
    """

    def __init__(self, *, allow_dtype_cast: bool = False) -> None:
        self.allow_dtype_cast = allow_dtype_cast

    # 1.
    def set_up_planner(self, target: Any, manifest: Manifest, *, keys: Any = None,
                       strict: bool = True) -> None:  # fmt: skip
        self.manifest = manifest
        saved = list(manifest.entries)
        if target is None:
            self.treedef = None
            wanted = _tree.select(saved, keys)
            self.targets: dict[str, Any] = {k: None for k in wanted}
        else:
            tkeys, tleaves, self.treedef = _tree.flatten_with_treedef(target)
            self.targets = dict(zip(tkeys, tleaves))
            wanted = _tree.select(saved, keys) if keys is not None else saved
            in_target = set(tkeys) if keys is None else {k for k in tkeys if _tree.matches(k, keys)}
            missing = sorted(in_target - set(saved))
            unexpected = sorted(set(wanted) - set(tkeys))
            if strict and (missing or unexpected):
                raise KeyMismatchError(_key_message(missing, unexpected))
            self.selected = in_target - set(missing)
        self.wants = {}  # key -> (dtype to return, sharding | _HOST)
        order = {k: i for i, k in enumerate(saved)}
        for key in self.targets if target is None else sorted(self.selected, key=order.get):
            self.wants[key] = self._want(key, manifest.entries[key], self.targets[key])
        self.results: dict[str, Any] = {}

    def _want(self, key: str, entry: Any, leaf: Any) -> tuple[Any, Any]:
        if not isinstance(entry, ArrayEntry):
            if leaf is not None and isinstance(leaf, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)):
                raise ShapeMismatchError(
                    f"Key {key!r}: the target holds an array but the checkpoint a Python value "
                    f"({entry.value!r}). Use a Python value or None at this key in `target`."
                )
            return None, _HOST
        dtype = _manifest.dtype_from_name(entry.dtype)
        if leaf is None or isinstance(leaf, (int, float, bool, str)):
            return dtype, _HOST
        if isinstance(leaf, jax.sharding.Sharding):
            return dtype, leaf
        shape, tdtype = tuple(leaf.shape), leaf.dtype
        sharding = getattr(leaf, "sharding", None) if not isinstance(leaf, np.ndarray) else None
        if isinstance(leaf, jax.Array) and not leaf.committed:  # e.g. optax's jnp.zeros count
            sharding = _UNCOMMITTED
        if entry.prng_impl:
            if not jax.dtypes.issubdtype(tdtype, jax.dtypes.prng_key):
                raise DtypeMismatchError(
                    f"Key {key!r}: on disk a PRNG key array ({entry.prng_impl}), in `target` "
                    f"dtype {tdtype}. Use a key array (jax.random.key) or None as the target."
                )
            if shape != entry.shape[: len(shape)] or len(entry.shape) != len(shape) + 1:
                raise _shape_error(key, shape, entry.shape[:-1])
            return dtype, sharding or _HOST
        if shape != entry.shape:
            raise _shape_error(key, shape, entry.shape)
        if np.dtype(tdtype) != dtype:
            if not self.allow_dtype_cast:
                raise DtypeMismatchError(
                    f"Key {key!r}: dtype in `target`: {np.dtype(tdtype).name}, on disk: "
                    f"{entry.dtype}. Pass planner=jaxckpt.DefaultLoadPlanner(allow_dtype_cast=True) "
                    f"to cast, or fix the target's dtype."
                )
            dtype = np.dtype(tdtype)
        return dtype, sharding or _HOST

    # 2.
    def create_local_plan(self) -> LoadPlan:
        items = []
        for key, (_, where) in self.wants.items():
            entry = self.manifest.entries[key]
            if not isinstance(entry, ArrayEntry):
                continue
            if where is _HOST or where is _UNCOMMITTED or entry.prng_impl:
                items.append(ReadItem(key, (0,) * len(entry.shape), entry.shape))
                continue
            by_box = collections.defaultdict(list)
            for dev, index in where.addressable_devices_indices_map(entry.shape).items():
                by_box[index_to_box(index, entry.shape)].append(dev.id)
            for (offsets, sizes), devs in by_box.items():
                items.append(ReadItem(key, offsets, sizes, tuple(devs)))
        self.plan = LoadPlan(tuple(items))
        return self.plan

    # 3.
    def transform_tensor(self, item: ReadItem, array: np.ndarray) -> np.ndarray:
        dtype, _ = self.wants[item.key]
        return array if array.dtype == dtype else array.astype(dtype)

    def commit_tensor(self, item: ReadItem, array: np.ndarray) -> None:
        self.results.setdefault(item.key, []).append((item, array))

    # 4.
    def finish(self) -> Any:
        devices = {d.id: d for d in jax.devices()}
        values: dict[str, Any] = {}
        sharded: dict[str, tuple[int, int]] = {}  # key -> its slice of the batched transfer
        arrays: list[np.ndarray] = []
        targets: list[Any] = []
        whole: list[tuple[str, np.ndarray, Any]] = []
        for key, (_, where) in self.wants.items():
            entry = self.manifest.entries[key]
            if not isinstance(entry, ArrayEntry):
                values[key] = entry.value
                continue
            parts = self.results.get(key, [])
            if entry.prng_impl:
                keys_ = jax.random.wrap_key_data(parts[0][1], impl=entry.prng_impl)
                placed = where is _HOST or where is _UNCOMMITTED
                values[key] = keys_ if placed else jax.device_put(keys_, where)
            elif where is _HOST:
                values[key] = parts[0][1]
            elif where is _UNCOMMITTED:
                values[key] = jax.device_put(parts[0][1])
            elif len(parts) == 1 and parts[0][0].sizes == entry.shape:
                whole.append((key, parts[0][1], where))  # replicated here: one batched put
            else:
                start = len(arrays)
                for item, array in parts:
                    for d in item.devices:
                        arrays.append(array)
                        targets.append(devices[d])
                sharded[key] = (start, len(arrays))
        if whole:
            placed = jax.device_put([a for _, a, _ in whole], [w for _, _, w in whole])
            values.update((k, v) for (k, _, _), v in zip(whole, placed))
        shards = jax.device_put(arrays, targets) if arrays else []  # one batched transfer
        for key, (lo, hi) in sharded.items():
            entry = self.manifest.entries[key]
            values[key] = jax.make_array_from_single_device_arrays(
                entry.shape, self.wants[key][1], shards[lo:hi]
            )
        if self.treedef is None:
            tree = _tree.unflatten(self.manifest.tree, values)
            return None if tree is _tree._MISSING else tree
        leaves = [values.get(k, self.targets[k]) for k in self.targets]
        return jax.tree_util.tree_unflatten(self.treedef, leaves)


def _shape_error(key: str, target: tuple, saved: tuple) -> ShapeMismatchError:
    return ShapeMismatchError(
        f"Key {key!r}: shape in `target`: {target}, on disk: {tuple(saved)}. Restore with a "
        f"target of the saved shape (or a bare Sharding, which takes shape from the checkpoint)."
    )


def _key_message(missing: list[str], unexpected: list[str]) -> str:
    parts = []
    if missing:
        parts.append(
            f"{len(missing)} key(s) in `target` missing from the checkpoint: {missing[:5]!r}"
        )
    if unexpected:
        parts.append(
            f"{len(unexpected)} key(s) in the checkpoint not in `target`: {unexpected[:5]!r}"
        )
    return (
        "; ".join(parts)
        + ". Pass strict=False to restore the keys both have (others keep the target's leaf), "
        "or keys=[...] to pick a subset."
    )
