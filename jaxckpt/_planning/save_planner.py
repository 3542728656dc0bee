"""The save planner: the protocol, and the default that dedups and balances writes.

Adapted from PyTorch DCP's ``DefaultSavePlanner``, with one change that matters at scale:
every process can compute every shard's index from the sharding itself, so the global plan is
computed **on every process without gathering local plans**; processes only compare a short
digest of it (see ``jaxckpt._runtime.distributed``).
"""

from __future__ import annotations

import abc
import collections
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import numpy.typing as npt

from jaxckpt._errors import InvalidArgumentError, UnsupportedLeafError
from jaxckpt._format import dtypes, manifest_check
from jaxckpt._format import manifest as _manifest
from jaxckpt._format import objects as _objects
from jaxckpt._format.manifest import ArrayEntry, Manifest, ValueEntry
from jaxckpt._format.plan import (
    SavePlan,
    WriteItem,
    index_to_box,
)
from jaxckpt._planning import packing as _pack
from jaxckpt._planning import plan_cache
from jaxckpt._planning import tree as _tree
from jaxckpt._planning.global_plan import (
    GlobalSavePlan,
    create_global_save_plan,
    is_array,
    validate_global_plan,
)
from jaxckpt._runtime import pools, staging


class SavePlanner(abc.ABC):
    """The save protocol. ``jaxckpt.save`` calls, on every process, in this order:

    1. ``set_up_planner(tree, process_index, process_count)``: flatten the tree.
    2. ``create_global_plan() -> GlobalSavePlan``: every array box, who writes it, and the
       manifest. Computed identically on every process from the shardings alone, so nothing is
       gathered; the processes only agree on ``GlobalSavePlan.digest``.
       ``check_global_plan(global_plan)`` then refuses a plan that does not tile its arrays.
    3. ``finish_plan(global_plan) -> SavePlan``: this process's share of the writes.
    4. ``resolve_data(item) -> np.ndarray``: the bytes of one item, asked for by storage
       (storage never sees the tree).

    ``save_async`` calls ``detach(items)`` between 3 and 4: a planner may take its own copy of
    some items there (returning how to read each later); the others ``save_async`` copies into
    host staging before it returns, so the caller may donate or overwrite its arrays.

    ``save_async(..., max_host_bytes=N)`` sets :attr:`max_host_bytes` to N before step 1 (every
    save sets it: ``None`` without a budget) and calls ``detach`` only where this process's
    whole share fits in N: instead of 4 it calls ``resolve_into(item, out)`` for one item
    after the other, ``out`` a slot of a host buffer of at most N bytes (less what was
    detached) that is reused once the item is written. A planner keeps no host copy
    of its own beyond the item being resolved then (the default starts no device-to-host
    copies in 3).

    Invariants the global plan must keep (``jaxckpt._format.plan.validate_plan`` checks them): the
    items of each array tile it exactly once, along its chunk grid, in its dtype.
    """

    @abc.abstractmethod
    def set_up_planner(self, tree: Any, *, process_index: int, process_count: int) -> None:
        """1. Take the tree to save (flatten it) and this process's place in the job.

        Raises:
          UnsupportedLeafError: a leaf cannot be stored (names its key path).
        """

    @abc.abstractmethod
    def create_global_plan(self) -> GlobalSavePlan:
        """2. Every process's writes and the manifest; identical on every process.

        Returns:
          The plan; ``save`` checks that its boxes tile every array (``PlanValidationError``).
        """

    def check_global_plan(self, global_plan: GlobalSavePlan) -> None:
        """2b. Refuse a plan whose boxes do not tile every array exactly once along its chunk
        grid, before anything is written.

        Raises:
          PlanValidationError: naming the bad keys.
        """
        validate_global_plan(global_plan)

    @abc.abstractmethod
    def finish_plan(self, global_plan: GlobalSavePlan) -> SavePlan:
        """3. This process's share of ``global_plan`` (the items it writes)."""

    @abc.abstractmethod
    def resolve_data(self, item: WriteItem) -> npt.NDArray[Any]:
        """4. The bytes of ``item`` as a numpy array of its box's shape and logical dtype."""

    max_host_bytes: int | None = None
    """The host-memory budget of the save in progress (``save_async``'s ``max_host_bytes``)."""

    def detach(self, items: Sequence[WriteItem]) -> dict[int, Callable[[], npt.NDArray[Any]]]:
        """(``save_async`` only) Copies of ``items[i]`` that the caller's later donation or
        writes cannot change, for the ``i`` this planner can copy more cheaply than a host
        copy: ``i -> thunk`` returning the item's data (called later, in the writer's thread).
        The default detaches nothing."""
        return {}

    def resolve_into(self, item: WriteItem, out: npt.NDArray[Any]) -> None:
        """(``save_async`` with ``max_host_bytes`` only) 4. Copy the bytes of ``item`` into
        ``out``: host memory of the item's box shape and logical dtype, in the save's staging
        buffer. The default copies :meth:`resolve_data`'s array, which may be a copy of its
        own meanwhile (on the host: counted beyond the budget)."""
        staging.copy_into(out, self.resolve_data(item))


DEFAULT_LAYOUT = "auto"  # DefaultSavePlanner(layout=None): data objects on object stores


class DefaultSavePlanner(SavePlanner):
    """Dedups replicated shards, balances writes by bytes, validates, and caches the plan.

    Args:
      dedup: ``"balanced"`` (default) gives each replicated box to the holder with the fewest
        planned bytes; ``"lowest"`` to the lowest process/device.
      max_chunk_bytes: shards larger than this are written as several chunks (split along
        their outer dimension), which bounds memory per write and lets restores onto another
        mesh read less. A shard that several processes hold (replicated across hosts) is cut
        into a chunk per process too (at least 1 MiB each), so that they can share its reads
        on restore (docs/multihost.md).
      enable_plan_caching: reuse the plan for the same structure, shapes, dtypes, shardings
        and options.
      pack_bytes: arrays of at most this many bytes (or of at most 4x as many, in shards of
        at most this many) are stored together in a few shared 1-D arrays ("packs", one file
        or a few per dtype) instead of one zarr array each; ``0``
        stores every array on its own (and writes format version 1). ``None``:
        ``jaxckpt._planning.packing.DEFAULT_PACK_BYTES`` (256 KiB).
      layout: ``"auto"`` (``None``: ``jaxckpt._planning.save_planner.DEFAULT_LAYOUT``, which
        is ``"auto"``): on ``gs://``, ``s3://`` and ``memory://``, each process's chunks as
        records in a few data objects of about ``object_bytes`` each
        (format version 5; docs/format.md), where the save is plain: compressed and
        incremental saves (``base=``, ``digests=True``) keep an object per chunk; local disks
        keep a file per chunk (in-place reads and ``O_DIRECT`` writes, measured faster there).
        ``"objects"``: the same. ``"chunks"``: an object or file per chunk everywhere
        (format 1-4), as before this release.
      object_bytes: the data objects' largest size (default 128 MiB);
        a process with less than 16 such objects' worth writes 16 smaller ones (at least
        4 MiB), so that its requests still run side by side.
    """

    def __init__(
        self,
        *,
        dedup: str = "balanced",
        max_chunk_bytes: int = 64 << 20,
        enable_plan_caching: bool = True,
        pack_bytes: int | None = None,
        layout: str | None = None,
        object_bytes: int = _objects.DEFAULT_TARGET,
    ) -> None:
        if dedup not in ("balanced", "lowest"):
            raise InvalidArgumentError(f"dedup must be 'balanced' or 'lowest', got {dedup!r}")
        layout = DEFAULT_LAYOUT if layout is None else layout
        if (
            layout not in ("auto", "chunks", "objects")
            or not 0 < object_bytes <= _objects.MAX_TARGET
        ):
            raise InvalidArgumentError(
                f"layout must be 'auto', 'chunks' or 'objects' and object_bytes in 1..2**40, got "
                f"{layout!r} and {object_bytes!r}"
            )
        # "auto" and "objects": on object stores, uncompressed and not incremental, format v5's
        # few data objects per process (docs/format.md, "Version 5"); elsewhere a file per chunk.
        self.layout = layout
        self.object_bytes = object_bytes
        self.dedup = dedup
        self.max_chunk_bytes = max_chunk_bytes
        self.pack_bytes = _pack.DEFAULT_PACK_BYTES if pack_bytes is None else pack_bytes
        self.enable_plan_caching = enable_plan_caching
        self._built: GlobalSavePlan | None = None  # the last plan built: checked already

    # 1.
    def set_up_planner(self, tree: Any, *, process_index: int, process_count: int) -> None:
        self.process_index = process_index
        self.process_count = process_count
        keys, leaves, self.treedef = _tree.flatten_with_treedef(tree)
        self.tree = tree
        self.leaves: dict[str, Any] = {}
        self.prng: dict[str, str] = {}
        self.scalars: set[str] = set()
        for key, leaf in zip(keys, leaves):
            self.leaves[key] = self._classify(key, leaf)
        self._shards: dict[tuple[str, int | None], Any] = {}

    def _classify(self, key: str, leaf: Any) -> Any:
        if isinstance(leaf, jax.core.Tracer):  # a jax.Array to isinstance, but has no data
            raise UnsupportedLeafError(
                f"Leaf {key!r} is a JAX tracer ({type(leaf).__name__}): jaxckpt.save was called "
                f"inside a traced function (jax.jit, grad, vmap, scan). Save outside it, on the "
                f"arrays the jitted function returns."
            )
        if isinstance(leaf, jax.Array) and leaf.is_deleted():
            raise UnsupportedLeafError(
                f"Leaf {key!r} is a deleted jax.Array (its buffer was donated, e.g. by "
                f"jax.jit(..., donate_argnums=...), or freed with .delete()). Save the arrays "
                f"the step returned instead of the ones it consumed."
            )
        if isinstance(leaf, jax.Array):
            if jax.numpy.issubdtype(leaf.dtype, jax.dtypes.prng_key):
                self.prng[key] = str(jax.random.key_impl(leaf))
                leaf = jax.random.key_data(leaf)
            if not dtypes.is_supported_dtype(leaf.dtype):
                raise _unsupported(key, leaf, f"dtype {leaf.dtype}")
            return leaf
        if isinstance(leaf, (np.ndarray, np.generic)):
            if not dtypes.is_supported_dtype(leaf.dtype):
                raise _unsupported(key, leaf, f"dtype {leaf.dtype}")
            if isinstance(leaf, np.generic):
                self.scalars.add(key)  # the tree says so: restored as a numpy scalar
            return np.asarray(leaf)
        return python_value(key, leaf)

    def _signature(self) -> tuple[object, ...]:
        sig: list[object] = []
        for key, leaf in self.leaves.items():
            if isinstance(leaf, jax.Array):
                sig.append((leaf.shape, leaf.dtype, leaf.sharding, self.prng.get(key)))
            elif isinstance(leaf, np.ndarray):
                sig.append((leaf.shape, leaf.dtype))
            else:
                sig.append(type(leaf))
        return (
            type(self),
            self.treedef,
            tuple(sig),
            frozenset(self.scalars),
            self.dedup,
            self.max_chunk_bytes,
            self.pack_bytes,
            self.process_count,
            _manifest.VERSION,
        )

    # 2.
    def create_global_plan(self) -> GlobalSavePlan:
        cache_key = plan_cache.key(self._signature()) if self.enable_plan_caching else None
        plan = plan_cache.lookup(cache_key)
        if plan is not None:
            fresh = dataclasses.replace(plan, manifest=self._with_values(plan.manifest))
            object.__setattr__(fresh, "_local", plan._local)  # same arrays: same items
            self._built = fresh
            return fresh
        plan = create_global_save_plan(
            self.leaves,
            _tree.structure(self.tree),
            prng=self.prng,
            lowest=self.dedup == "lowest",
            max_chunk_bytes=self.max_chunk_bytes,
            process_count=self.process_count,
            pack_bytes=self.pack_bytes,
        )
        plan_cache.store(cache_key, plan)
        self._built = plan
        return plan

    def check_global_plan(self, global_plan: GlobalSavePlan) -> None:
        """Plans this planner built were checked when built (then cached); others are checked."""
        if global_plan is not self._built:
            super().check_global_plan(global_plan)

    def _with_values(self, manifest: Manifest) -> Manifest:
        """A cached manifest with this tree's Python values, which are not part of the key."""
        values = {k: ValueEntry(k, v) for k, v in self.leaves.items() if not is_array(v)}
        if not values:
            return manifest
        return dataclasses.replace(manifest, entries={**manifest.entries, **values})

    # 3.
    def finish_plan(self, global_plan: GlobalSavePlan) -> SavePlan:
        self.global_plan = global_plan
        plan = global_plan.for_process(self.process_index)
        # Start every device-to-host copy now so they overlap (GPU/TPU); on CPU devices the
        # host already holds the bytes and a copy would only cost memory. Not within a host
        # budget: jax keeps each copy on the array until the array goes (resolve_into). The
        # shards are looked up either way: their boxes are needed after a donation too.
        prefetch = self.max_host_bytes is None
        for item in plan.items:
            if item.key in global_plan.packs:  # written whole from the host: copy them all now
                for k in global_plan.packs[item.key] if prefetch else ():
                    leaf = self.leaves[k]
                    if isinstance(leaf, jax.Array) and _platform(leaf) != "cpu":
                        leaf.copy_to_host_async()
                continue
            leaf = self.leaves[item.key]
            if isinstance(leaf, jax.Array) and item.device is not None:
                shard = self._shard(item.key, leaf, item.device)
                if prefetch and shard.device.platform != "cpu":
                    shard.data.copy_to_host_async()
        return plan

    def detach(self, items: Sequence[WriteItem]) -> dict[int, Callable[[], npt.NDArray[Any]]]:
        """Items of arrays on CPU devices: one batched ``jax.device_put(..., may_alias=False)``,
        which XLA runs asynchronously and orders before any later donation, so ``save_async``
        returns once it is dispatched instead of after a host copy. A single-process array
        whose every shard this process writes is copied whole (one transfer instead of one per
        shard); otherwise only the shards it writes are. (On accelerators a device copy would cost
        device memory: their items go to host staging.) Nothing is detached where a subclass
        overrides ``resolve_data``."""
        if type(self).resolve_data is not DefaultSavePlanner.resolve_data:
            return {}  # a subclass that changes the bytes sees every item, as in save()
        picked: dict[int, WriteItem] = {}
        devices: dict[str, set[int]] = collections.defaultdict(set)
        for i, item in enumerate(items):
            leaf = self.leaves.get(item.key)
            if isinstance(leaf, jax.Array) and item.device is not None and _platform(leaf) == "cpu":
                picked[i] = item
                devices[item.key].add(item.device)
        if not picked:
            return {}
        sources: dict[tuple[str, int | None], jax.Array] = {}
        for key, devs in devices.items():
            leaf = self.leaves[key]
            # (device_put copies a multi-process array only shard by shard)
            if leaf.is_fully_addressable and len(devs) == len(leaf.sharding.addressable_devices):
                sources[(key, None)] = leaf
            else:
                sources.update({(key, d): self._shard(key, leaf, d).data for d in devs})
        # Dispatched from a pool thread: XLA's CPU client then runs the copies on its own
        # threads, after the call returns. Called from the main thread it runs them inline, one
        # at a time, and the first save_async of a process returns later (docs/benchmarks.md).
        put = functools.partial(jax.device_put, list(sources.values()), may_alias=False)
        copies = dict(zip(sources, pools.stage_pool().submit(put).result()))

        def read(item: WriteItem) -> npt.NDArray[Any]:  # in the writer's thread
            copy = copies.get((item.key, item.device))
            if copy is None:  # a whole-array copy: split it into its shards once, on first use
                whole = copies.pop((item.key, None))
                copies.update({(item.key, s.device.id): s.data for s in whole.addressable_shards})
                copy = copies[(item.key, item.device)]
            return self._box(item, copy)

        return {i: functools.partial(read, item) for i, item in picked.items()}

    # 4.
    def resolve_data(self, item: WriteItem) -> npt.NDArray[Any]:
        members = self.global_plan.packs.get(item.key) if hasattr(self, "global_plan") else None
        if members is not None:  # a pack: its members' bytes end to end, built on the host
            manifest = self.global_plan.manifest
            arrays = [e for k in members if isinstance(e := manifest.entries[k], ArrayEntry)]
            pack = manifest.packs[arrays[0].path]  # a member's path is its pack's
            return _pack.assemble(pack, ((e, self._pieces(e.key)) for e in arrays))
        leaf = self.leaves[item.key]
        if isinstance(leaf, jax.Array):
            return self._box(item, self._shard(item.key, leaf, item.device).data)
        box: npt.NDArray[Any] = leaf[
            tuple(slice(o, o + s) for o, s in zip(item.offsets, item.sizes))
        ]
        return box

    def resolve_into(self, item: WriteItem, out: npt.NDArray[Any]) -> None:
        """Straight from the state into ``out``, holding no other host copy on CPU devices
        (views of the shards) nor of packs (assembled in ``out``). On accelerators each
        chunk is sliced on its device and copied to the host alone (one chunk of host memory
        beyond the budget while it is copied, and of device memory), never a whole shard: jax
        would keep that copy on the caller's array."""
        if type(self).resolve_data is not DefaultSavePlanner.resolve_data:
            return super().resolve_into(item, out)  # a subclass's bytes, as in save()
        members = self.global_plan.packs.get(item.key)
        if members is not None:
            manifest = self.global_plan.manifest
            arrays = [e for k in members if isinstance(e := manifest.entries[k], ArrayEntry)]
            pieces = ((e, self._pieces(e.key, _uncached)) for e in arrays)
            _pack.assemble(manifest.packs[arrays[0].path], pieces, out=out.reshape(-1))
            return
        leaf = self.leaves[item.key]
        if isinstance(leaf, jax.Array) and _platform(leaf) != "cpu":
            shard = self._shard(item.key, leaf, item.device)
            offsets, _ = index_to_box(shard.index, leaf.shape)
            local = tuple(
                slice(o - so, o - so + s) for o, so, s in zip(item.offsets, offsets, item.sizes)
            )
            piece = shard.data[local]  # a new array, unless the chunk is the whole shard
            staging.copy_into(out, _uncached(piece) if piece is shard.data else np.asarray(piece))
            return
        staging.copy_into(out, self.resolve_data(item))

    def _box(self, item: WriteItem, shard_data: jax.Array) -> npt.NDArray[Any]:
        """``item``'s box out of the shard (or its detached copy) that holds it."""
        leaf = self.leaves[item.key]
        offsets, _ = index_to_box(self._shard(item.key, leaf, item.device).index, leaf.shape)
        local = tuple(
            slice(o - so, o - so + s) for o, so, s in zip(item.offsets, offsets, item.sizes)
        )
        return np.asarray(shard_data)[local]

    def _pieces(
        self, key: str, host: Callable[[Any], npt.NDArray[Any]] = np.asarray
    ) -> list[tuple[Any, Any]]:
        """The whole array of ``key`` as ``(index, data)`` pieces on the host (this process
        holds every box of it): its shards, each box once, not an assembled copy (which jax
        would also keep on the array). ``host`` brings a shard to the host."""
        leaf = self.leaves[key]
        if not isinstance(leaf, jax.Array):
            return [((), leaf)]
        if leaf.is_fully_replicated:
            return [((), host(leaf.addressable_data(0)))]
        # The first shard of each box: its replicas here are not copied again.
        boxes: dict[tuple[tuple[int | None, int | None], ...], Any] = {}
        for shard in leaf.addressable_shards:
            boxes.setdefault(tuple((s.start, s.stop) for s in shard.index), shard)
        return [(shard.index, host(shard.data)) for shard in boxes.values()]

    def _shard(self, key: str, leaf: jax.Array, device: int | None) -> Any:
        found = self._shards.get((key, device))
        if found is None:
            for shard in leaf.addressable_shards:
                self._shards[(key, shard.device.id)] = shard
            found = self._shards[(key, device)]
        return found


def _uncached(x: jax.Array) -> npt.NDArray[Any]:
    """``x`` on the host without a copy kept on ``x``: on CPU devices a view; elsewhere the
    host copy of a fresh device copy, which goes with it (``np.asarray`` of an accelerator's
    array keeps its host copy on the array, here the caller's)."""
    if _platform(x) == "cpu":
        return np.asarray(x)
    return np.asarray(jax.device_put(x, may_alias=False))


def _platform(leaf: jax.Array) -> str:
    """The platform of ``leaf``'s devices ("cpu", "gpu", "tpu")."""
    device: jax.Device = next(iter(leaf.sharding.device_set))  # jax cannot resolve its type
    platform: str = device.platform
    return platform


def python_value(key: str, leaf: Any) -> Any:
    """The Python value leaf ``leaf`` of ``key`` as a checkpoint stores it: ``None``, a
    ``bool``, ``int``, ``float``, ``complex`` or ``str`` (subclasses such as ``IntEnum`` as
    their base value). The one rule of what a value leaf may be, for every tier.

    Raises:
      UnsupportedLeafError: any other leaf, or an int JSON cannot spell; names ``key``.
    """
    if leaf is None or type(leaf) in (bool, float, complex, str):
        return leaf
    for base in (bool, int, float, str):  # IntEnum, str-Enum, ...: stored as the base value
        if isinstance(leaf, base):
            leaf = base.__str__(leaf) if base is str else base(leaf)
            if base is int and manifest_check.int_digits_over(leaf):  # json could not spell it
                raise _unsupported(
                    key, leaf, f"an int of more than {manifest_check.int_digits_over(leaf)} digits"
                )
            return leaf
    raise _unsupported(key, leaf, f"type {type(leaf).__name__}")


def _unsupported(key: str, leaf: Any, what: str) -> UnsupportedLeafError:
    return UnsupportedLeafError(
        f"Leaf {key!r} has {what}, which jaxckpt cannot store. Supported leaves: jax.Array and "
        f"numpy arrays of numeric/bool/PRNG-key dtypes, and Python int, float, complex, bool, str, "
        f"None. "
        f"Convert the leaf (e.g. to a numpy array or a string) or drop it from the tree."
    )
