"""The load planner: the protocol, and the default that reads each needed region once per host.

Adapted from PyTorch DCP's ``DefaultLoadPlanner`` (its ``_narrow`` becomes a box read): for each
*distinct* target shard on this host the planner asks storage for exactly that box of the saved
array, and tensorstore reads only the chunks the box overlaps.

The checks that refuse a target which does not fit the checkpoint, with their messages, live in
``jaxckpt._planning.mismatch``; the sharding under which several processes share the read of a
box, in ``jaxckpt._planning.shared_read``.
"""

from __future__ import annotations

import abc
import collections
import functools
import logging
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import numpy.typing as npt

from jaxckpt._errors import (
    CheckpointError,
    DtypeMismatchError,
    InvalidArgumentError,
    KeyMismatchError,
    ShapeMismatchError,
)
from jaxckpt._format import manifest as _manifest
from jaxckpt._format.manifest import ArrayEntry, Manifest
from jaxckpt._format.plan import Box, LoadPlan, ReadItem, index_to_box
from jaxckpt._planning import mismatch as _mismatch
from jaxckpt._planning import shared_read as _shared_read
from jaxckpt._planning import tree as _tree
from jaxckpt._runtime import placement as _placement

logger = logging.getLogger("jaxckpt")
_HOST = "host"
_UNCOMMITTED = "uncommitted"  # a target array not committed to a device: return one like it
DEFAULT_MAX_HOST_BYTES = 128 << 20
_WHOLE = "whole"  # placement slot of an array put whole with its target sharding
# Arrays up to this size whose target is all on this host are read and put whole: below it a
# device_put per shard costs more than the copy the batched put makes (docs/benchmarks.md).
_WHOLE_BYTES = 1 << 20


class LoadPlanner(abc.ABC):
    """The load protocol. ``jaxckpt.restore`` calls, on every process, in this order:

    1. ``set_up_planner(target, manifest, keys=, strict=)``: match the target to the manifest,
       raising on missing/unexpected keys (``strict``) and shape/dtype mismatches.
    2. ``create_local_plan() -> LoadPlan``: the boxes this host must read, each once.
    3. For each item, as storage reads it (in plan order, at most ``read_ahead_bytes`` read
       ahead of the planner), ``transform_tensor(item, array) -> array`` (the hook to cast or
       quantise), then ``commit_tensor(item, array)``. ``commit_tensor`` may keep the box for
       :meth:`finish` or place it on its devices right away (the default streams: boxes go to
       their devices in batches while the next ones are read, and the host copy is dropped).
    4. ``finish() -> tree``: place whatever is still on the host, assemble each ``jax.Array``
       from its placed single-device buffers, and rebuild the tree.

    Invariants: every array passed to ``commit_tensor`` is owned by the planner (storage keeps
    no reference), so a planner that drops it frees it; nothing is gathered across processes
    unless the planner shares reads (see :class:`DefaultLoadPlanner`). Steps 1 to 3 run no
    jax collective across processes (no ``device_put`` onto a sharding of several processes):
    where the target spans processes, they all agree that every one has read its share
    between 3. and 4. (``jaxckpt._runtime.shared_restore``), and only ``finish`` may gather.
    """

    #: Bytes storage may read ahead of ``commit_tensor`` (what it holds in flight).
    read_ahead_bytes: int = 1 << 30

    @abc.abstractmethod
    def set_up_planner(
        self,
        target: Any,
        manifest: Manifest,
        *,
        keys: str | Sequence[str] | None = None,
        strict: bool = True,
    ) -> None:
        """1. Match ``target`` (or the whole checkpoint, for ``None``) to ``manifest``.

        Raises:
          KeyMismatchError, ShapeMismatchError, DtypeMismatchError: naming the key.
        """

    @abc.abstractmethod
    def create_local_plan(self) -> LoadPlan:
        """2. The boxes this host reads, each distinct box once."""

    def transform_tensor(self, item: ReadItem, array: npt.NDArray[Any]) -> npt.NDArray[Any]:
        """3a. Change a box read from storage (cast, quantise) before it is committed."""
        return array

    @abc.abstractmethod
    def commit_tensor(self, item: ReadItem, array: npt.NDArray[Any]) -> None:
        """3b. Take a (transformed) box: keep it for :meth:`finish`, or place it now."""

    @abc.abstractmethod
    def finish(self) -> Any:
        """4. Place what is left on the host, assemble the arrays and return the tree."""


class DefaultLoadPlanner(LoadPlanner):
    """Restores onto any sharding, onto the host as numpy, or as the saved Python values.

    Boxes stream onto their devices as they are read: at most ``max_host_bytes`` of boxes are
    on the host at once (a quarter read ahead by storage, with tensorstore's decode buffers for
    those reads, or three quarters of format 5's data objects, whose reads in flight hold only
    their bytes; and a quarter queued for or in transfer to their devices), or the largest
    single box where that is larger. Host (numpy) results are the
    restored values themselves and are not counted.

    Args:
      allow_dtype_cast: cast saved arrays to the target's dtype instead of raising
        :class:`DtypeMismatchError` (e.g. restore float32 weights into a bfloat16 model).
      max_host_bytes: the host-memory budget of a restore, in bytes (default 128 MiB). Lower it
        on hosts short of memory; a larger one lets more reads and transfers overlap.
      share_reads: in a multi-process job, read a box that the target puts on devices of
        several processes once in all (each process reads a part, JAX's collectives gather
        them; every process must then call ``restore``). ``False``: each process reads every
        box its own devices need and nothing is exchanged.

    Example:
      >>> import jax, jax.numpy as jnp, jaxckpt, tempfile
      >>> d = tempfile.mkdtemp() + "/c"
      >>> jaxckpt.save(d, {"w": jnp.arange(4.0)})
      >>> s = jax.sharding.SingleDeviceSharding(jax.devices()[0])
      >>> p = jaxckpt.DefaultLoadPlanner(max_host_bytes=64 << 20)
      >>> float(jaxckpt.restore(d, {"w": s}, planner=p)["w"].sum())
      6.0
    """

    def __init__(
        self,
        *,
        allow_dtype_cast: bool = False,
        max_host_bytes: int = DEFAULT_MAX_HOST_BYTES,
        share_reads: bool = True,
    ) -> None:
        if max_host_bytes < 1:
            raise InvalidArgumentError(
                f"max_host_bytes must be a positive number of bytes, not {max_host_bytes}"
            )
        self.allow_dtype_cast = allow_dtype_cast
        self.max_host_bytes = int(max_host_bytes)
        # A read in flight holds its box and, inside tensorstore, up to two decode buffers of
        # its chunks: a quarter of the budget read ahead costs up to three quarters.
        self.read_ahead_bytes = max(self.max_host_bytes // 4, 1)
        self.share_reads = share_reads

    @property
    def host_bytes(self) -> int:
        """Bytes of device-bound boxes this planner holds on the host now (queued or in transfer)."""
        placement = getattr(self, "placement", None)
        return 0 if placement is None else placement.host_bytes

    # 1.
    def set_up_planner(
        self,
        target: Any,
        manifest: Manifest,
        *,
        keys: str | Sequence[str] | None = None,
        strict: bool = True,
    ) -> None:
        self.manifest = manifest
        self.keys = keys
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
            if missing or unexpected:  # None against an empty node is no mismatch
                missing, unexpected = _mismatch.empty_alike(
                    missing, unexpected, manifest, target, self.targets
                )
            if strict and (missing or unexpected):
                raise KeyMismatchError(_mismatch.key_message(missing, unexpected))
            self.selected = in_target & set(saved)
            if not strict:  # a saved None holds no leaf: the target's stays, as for a missing key
                nones = _mismatch.saved_none(self.selected, manifest, self.targets)
                self.selected -= set(nones)
                missing = sorted([*missing, *nones])
            if missing:  # strict=False: they come back as the target holds them; say so
                logger.warning(_mismatch.kept_message(missing, unexpected, self.targets))
        self.wants = {}  # key -> (dtype to return, sharding | _HOST)
        order = {k: i for i, k in enumerate(saved)}
        errors: list[CheckpointError] = []
        for key in self.targets if target is None else sorted(self.selected, key=order.__getitem__):
            try:
                self.wants[key] = self._want(key, manifest.entries[key], self.targets[key])
            except (ShapeMismatchError, DtypeMismatchError) as e:
                errors.append(e)  # every leaf's, in one error
        if errors:
            raise _mismatch.one_error(errors)
        self._via = {}  # key -> the sharding it is read under, when reads are shared
        if self.share_reads and jax.process_count() > 1:
            for key, (_, where) in self.wants.items():
                entry = manifest.entries[key]  # a saved value has no box to share
                if isinstance(entry, ArrayEntry) and isinstance(where, jax.sharding.Sharding):
                    via = _shared_read.read_sharding(entry, where)
                    if via is not None:
                        self._via[key] = via
        self.results: dict[str, Any] = {}  # key -> [(item, array)] kept for finish
        self.placement = _placement.Placement(self.max_host_bytes - 3 * self.read_ahead_bytes)

    def _want(self, key: str, entry: Any, leaf: Any) -> tuple[Any, Any]:
        if not isinstance(entry, ArrayEntry):
            return self._value_want(key, entry, leaf)
        dtype = _manifest.dtype_from_name(entry.dtype)
        if leaf is None or isinstance(leaf, (int, float, bool, str)):
            return dtype, _HOST
        if isinstance(leaf, jax.sharding.Sharding):
            if not entry.prng_impl:  # key data is laid out by the key array's shape
                _mismatch.check_divides(key, leaf, entry.shape)
            found = f"on disk: {entry.dtype}"
            return _mismatch.device_dtype(key, dtype, found, self.allow_dtype_cast), leaf
        shape, tdtype = tuple(leaf.shape), leaf.dtype
        sharding = getattr(leaf, "sharding", None) if not isinstance(leaf, np.ndarray) else None
        if isinstance(leaf, jax.Array) and not leaf.committed:  # e.g. optax's jnp.zeros count
            sharding = _UNCOMMITTED
        if isinstance(leaf, jax.ShapeDtypeStruct) and sharding is None:  # plain jax.eval_shape
            sharding = _UNCOMMITTED  # a jax.Array on the default device, as jnp would make it
        _mismatch.check_prng_target(key, entry, shape, tdtype)
        if entry.prng_impl:
            return dtype, sharding or _HOST
        if shape != entry.shape:
            raise _mismatch.shape_error(key, shape, entry.shape)
        if np.dtype(tdtype) != dtype:
            if not self.allow_dtype_cast:
                raise _mismatch.dtype_error(key, np.dtype(tdtype), dtype)
            dtype = np.dtype(tdtype)
        if sharding is None:  # a numpy target: the host keeps every dtype
            return dtype, _HOST
        if isinstance(sharding, jax.sharding.Sharding):
            _mismatch.check_divides(key, sharding, entry.shape)
        # Without a cast ``dtype`` is the saved one here (a mismatch raised above).
        found = f"on disk: {entry.dtype}"
        return _mismatch.device_dtype(key, dtype, found, self.allow_dtype_cast), sharding

    def _value_want(self, key: str, entry: Any, leaf: Any) -> tuple[Any, Any]:
        """A saved Python value: returned as it is, or into a scalar array target (e.g. the
        ``ShapeDtypeStruct`` that ``jax.eval_shape`` makes of a ``TrainState.step`` of 0) as a
        0-d array of the target's dtype, when the value is of that dtype's kind."""
        if leaf is None or not isinstance(leaf, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)):
            return None, _HOST
        value, dtype = entry.value, np.dtype(leaf.dtype)
        asked = dtype
        if tuple(leaf.shape) != () or value is None or isinstance(value, str):
            raise _mismatch.value_shape_error(key, tuple(leaf.shape), value)
        sharding = None if isinstance(leaf, np.ndarray) else getattr(leaf, "sharding", None)
        if sharding is None or (isinstance(leaf, jax.Array) and not leaf.committed):
            sharding = _HOST if isinstance(leaf, np.ndarray) else _UNCOMMITTED
        if sharding is not _HOST:
            found = f"in `target`: {dtype.name} (a scalar array, for the Python {value!r})"
            dtype = _mismatch.device_dtype(key, dtype, found, self.allow_dtype_cast)
        _mismatch.check_scalar(key, value, asked, dtype, self.allow_dtype_cast)
        return dtype, sharding

    # 2.
    def create_local_plan(self) -> LoadPlan:
        items = []
        self._whole: set[str] = set()
        small = min(_WHOLE_BYTES, self.placement.group_bytes)  # and inside a tight budget
        for key, (_, where) in self.wants.items():
            entry = self.manifest.entries[key]
            if not isinstance(entry, ArrayEntry):
                continue
            if where is _HOST or where is _UNCOMMITTED or entry.prng_impl:
                items.append(ReadItem(key, (0,) * len(entry.shape), entry.shape))
                continue
            if key not in self._via and entry.nbytes <= small and where.is_fully_addressable:
                # Small and all on this host: read it whole and let one batched put slice it
                # (a put per shard costs more than copying a small array's bytes).
                devs = tuple(sorted(d.id for d in where.addressable_devices))
                items.append(ReadItem(key, (0,) * len(entry.shape), entry.shape, devs))
                self._whole.add(key)
                continue
            by_box: dict[Box, list[int]] = collections.defaultdict(list)
            where = self._via.get(key, where)
            for dev, index in where.addressable_devices_indices_map(entry.shape).items():
                by_box[index_to_box(index, entry.shape)].append(dev.id)
            for (offsets, sizes), ids in by_box.items():
                items.append(ReadItem(key, offsets, sizes, tuple(ids)))
            if len(by_box) == 1 and next(iter(by_box))[1] == entry.shape:
                self._whole.add(key)  # replicated on this host: placed by one batched put too
            elif _even(where, entry.shape, by_box) and _shared_read.default_memory(where):
                nbytes = sum(math.prod(sizes) for _, sizes in by_box) * self.wants[key][0].itemsize
                self.placement.expect_array(key, entry.shape, where, len(by_box), nbytes)
        self.plan = LoadPlan(tuple(items))
        return self.plan

    # 3.
    def transform_tensor(self, item: ReadItem, array: npt.NDArray[Any]) -> npt.NDArray[Any]:
        dtype, _ = self.wants[item.key]
        return array if array.dtype == dtype else array.astype(dtype)

    def commit_tensor(self, item: ReadItem, array: npt.NDArray[Any]) -> None:
        entry = self.manifest.entries[item.key]
        where = self.wants[item.key][1]
        prng = isinstance(entry, ArrayEntry) and entry.prng_impl  # the plan reads arrays only
        if where is _HOST or where is _UNCOMMITTED or prng:
            self.results.setdefault(item.key, []).append((item, array))  # the result, or small
        elif item.key in self._whole and where.is_fully_addressable:  # every local device
            self.placement.add((item.key, _WHOLE), array, [where])  # one put
        else:
            # A put onto a sharding of several processes would be a jax collective (jax
            # checks the value is alike on each): none runs before finish (see its comment).
            self.placement.add(item.key, array, _on_devices(item.devices, where.memory_kind))

    # 4.
    def finish(self) -> Any:
        # The first jax collectives of a restore run here, never in commit_tensor: a restore
        # across processes agrees that every process has read its share before this
        # (jaxckpt._runtime.shared_restore), so no process waits in a collective for one
        # that failed, nor in the agreement for one that waits in a collective.
        self.placement.flush()
        placed = self.placement.placed
        values: dict[str, Any] = {}
        for key, (_, where) in self.wants.items():
            entry = self.manifest.entries[key]
            if not isinstance(entry, ArrayEntry):
                dtype = self.wants[key][0]
                values[key] = entry.value
                if dtype is not None:  # into a scalar array target (see _value_want)
                    weak = getattr(self.targets[key], "weak_type", False)
                    values[key] = _scalar(entry.value, dtype, where, weak)
                continue
            parts = self.results.get(key, [])
            if entry.prng_impl:
                keys_ = jax.random.wrap_key_data(parts[0][1], impl=entry.prng_impl)
                kept = where is _HOST or where is _UNCOMMITTED
                values[key] = keys_ if kept else jax.device_put(keys_, where)
            elif where is _HOST:
                values[key] = parts[0][1]
            elif where is _UNCOMMITTED:
                values[key] = jax.device_put(parts[0][1])
            elif key in self._whole and where.is_fully_addressable:
                values[key] = placed[(key, _WHOLE)][0]  # put with the target sharding itself
            elif key in self.placement.whole:
                values[key] = placed[key][0]  # its boxes went in one call (Placement)
            else:
                shards = placed.get(key, [])
                via = self._via.get(key, where)
                values[key] = jax.make_array_from_single_device_arrays(entry.shape, via, shards)
        if self._via:  # read split across processes: JAX's collectives bring every part home
            keys = list(self._via)
            out = jax.jit(_identity, out_shardings=[self.wants[k][1] for k in keys])(
                [values[k] for k in keys]
            )
            values.update(zip(keys, out))
        self.results, self.placement.placed = {}, {}
        if self.treedef is None:
            tree = _tree.unflatten(self.manifest.tree, values, self.keys)
            return None if tree is _tree.MISSING else tree
        leaves = [values.get(k, self.targets[k]) for k in self.targets]
        return jax.tree_util.tree_unflatten(self.treedef, leaves)


def _scalar(value: Any, dtype: np.dtype[Any], where: Any, weak: bool) -> Any:
    """A saved Python scalar as a 0-d array of ``dtype`` where the target wants it; weakly typed
    when the target is (``jax.eval_shape`` of a Python int) and JAX gives the value ``dtype``."""
    host = np.asarray(value, dtype)
    if where is _HOST:
        return host
    src = value if weak and jax.dtypes.canonicalize_dtype(np.result_type(value)) == dtype else host
    if where is _UNCOMMITTED:
        return jax.device_put(src)
    if where.is_fully_addressable:
        return jax.device_put(src, where)
    return jax.make_array_from_callback((), where, lambda _: host)


def _identity(x: Any) -> Any:
    return x


def _even(sharding: Any, shape: tuple[int, ...], boxes: Any) -> bool:
    """Whether every box is ``sharding``'s shard shape (what ``make_array_from_callback``
    takes), rather than an uneven edge."""
    try:
        want = tuple(sharding.shard_shape(shape))
    except ValueError:
        return False
    return all(tuple(sizes) == want for _, sizes in boxes)


@functools.cache
def _devices() -> dict[int, Any]:
    return {d.id: d for d in jax.devices()}


def _on_devices(ids: Sequence[int], kind: str | None) -> list[Any]:
    """A single-device sharding of memory ``kind`` on each device of ``ids``."""
    devices = _devices()
    return [jax.sharding.SingleDeviceSharding(devices[d], memory_kind=kind) for d in ids]
