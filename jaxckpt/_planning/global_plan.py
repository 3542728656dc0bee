"""The global save plan: every array box, who writes it, and the manifest they commit.

Computed identically on every process from the shardings alone (``create_global_save_plan``),
so nothing is gathered; the processes only compare its ``digest``. The planner that builds it
from a tree, and the protocol around it, are in ``jaxckpt._planning.save_planner``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import Any

import jax
import numpy as np

from jaxckpt._format import dtypes, manifest_check
from jaxckpt._format import manifest as _manifest
from jaxckpt._format.manifest import ArrayEntry, Manifest, ValueEntry
from jaxckpt._format.names import storage_name
from jaxckpt._format.plan import (
    IntArray,
    SavePlan,
    WriteItem,
    check_boxes,
    chunk_boxes,
    chunk_shape,
    raise_if,
)
from jaxckpt._planning import layout as _layout
from jaxckpt._planning import packing as _pack
from jaxckpt._version import __version__

# Boxes held by several processes are cut into a chunk per process, down to this size: smaller
# chunks would cost a file each for a share of a read that is small anyway (chunk_limit).
SHARED_CHUNK_MIN_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True, eq=False)
class ArrayPlan:
    """Who writes which box of one array: one row per shard box (compact at any scale).

    ``offsets[b]`` is box ``b``'s corner (every box has ``entry``'s shard shape ``box``, clipped
    at the array's end); ``process[b]``/``device[b]`` its writer (device ``-1``: a host array).
    Each box is written as the chunks it covers.
    """

    entry: ArrayEntry
    box: tuple[int, ...]
    offsets: IntArray
    process: IntArray
    device: IntArray

    def sizes(self) -> IntArray:
        sizes: IntArray = np.minimum(
            np.array(self.box, np.int64), np.array(self.entry.shape, np.int64) - self.offsets
        )
        return sizes

    def items(self, process: int | None = None) -> list[WriteItem]:
        """The write items (one per chunk) of ``process``, or of every process."""
        rows = (
            range(len(self.offsets)) if process is None else np.flatnonzero(self.process == process)
        )
        sizes = self.sizes()
        e = self.entry
        out = []
        for b in rows:
            dev = int(self.device[b])
            for offsets, size in chunk_boxes(self.offsets[b].tolist(), sizes[b].tolist(), e.chunks):
                out.append(
                    WriteItem(
                        e.key,
                        offsets,
                        size,
                        e.dtype,
                        int(self.process[b]),
                        None if dev < 0 else dev,
                    )
                )
        return out


@dataclasses.dataclass(frozen=True, eq=False)
class GlobalSavePlan:
    """Every process's writes plus the manifest they commit; identical on every process."""

    manifest: Manifest
    arrays: tuple[ArrayPlan, ...]
    digest: str
    # pack storage key (``PackEntry.key``) -> the key paths it holds; its ArrayPlan is in arrays
    packs: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    # Per-process items, built once per plan; a replace()d plan starts afresh (its arrays may
    # differ), except the plan cache's own copy, which shares them explicitly.
    _local: dict[int, SavePlan] = dataclasses.field(default_factory=dict, init=False, repr=False)

    @property
    def items(self) -> tuple[WriteItem, ...]:
        """Every write item of every process (materialised; for inspection and tests)."""
        return tuple(i for a in self.arrays for i in a.items())

    def for_process(self, process: int) -> SavePlan:
        """The write items of ``process``, one per chunk."""
        found = self._local.get(process)
        if found is None:
            found = self._local[process] = SavePlan(
                tuple(i for a in self.arrays for i in a.items(process))
            )
        return found


def validate_global_plan(plan: GlobalSavePlan) -> None:
    """Check every array plan tiles its array exactly once along its chunk grid.

    Raises:
        PlanValidationError: naming the bad keys.
    """
    errors: list[str] = []
    # Arrays sharing one (cached) layout are checked once: by (its offsets, shape, chunks, box).
    checked: dict[tuple[int, tuple[int, ...], tuple[int, ...], tuple[int, ...]], bool] = {}
    for a in plan.arrays:
        e = a.entry
        seen = (id(a.offsets), e.shape, e.chunks, a.box)
        if checked.get(seen):
            continue
        found = check_boxes(e.key, e.shape, e.chunks, a.offsets, a.sizes())
        checked[seen] = not found
        errors += found
    m = plan.manifest
    missing = {k for k, v in m.entries.items() if isinstance(v, ArrayEntry) and v.pack is None}
    missing |= {p.key for p in m.packs.values()}
    missing -= {a.entry.key for a in plan.arrays}
    errors += manifest_check.pack_problems(m.entries, m.packs)
    errors += [f"key {k!r}: no boxes planned (a gap)" for k in sorted(missing)]
    raise_if(errors)


def is_array(leaf: Any) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray))


def create_global_save_plan(
    leaves: dict[str, Any],
    tree: dict[str, Any],
    *,
    prng: dict[str, str] | None = None,
    lowest: bool = False,
    max_chunk_bytes: int = 64 << 20,
    process_count: int = 1,
    pack_bytes: int = 0,
) -> GlobalSavePlan:
    """The default global plan: chunk grids, packs, deduplicated balanced writers, the manifest.

    Arrays are assigned largest shard first (the greedy of PyTorch DCP's default planner, by
    bytes); see :class:`jaxckpt._planning.layout.Balancer`. Arrays of at most ``pack_bytes``
    share packs (:func:`jaxckpt._planning.packing.plan_packs`), each written whole by the
    least-loaded process that holds all its members.
    """
    taken: set[str] = set()
    entries, layouts = _entries(leaves, prng or {}, max_chunk_bytes, process_count, taken)
    packed, packs = _pack.plan_packs(
        {k: entries[k] for k in layouts},
        layouts,
        pack_bytes=pack_bytes,
        max_chunk_bytes=max_chunk_bytes,
        taken=taken,
    )
    entries.update(packed)
    plain = [k for k in layouts if k not in packed]
    balancer = _layout.Balancer(lowest=lowest)
    arrays = _assign_writers(plain, layouts, entries, balancer)
    pack_plans = _pack.assign(packs, balancer.proc_loads, lowest=lowest)
    for p in pack_plans:
        arrays[p.entry.key] = ArrayPlan(
            p.entry.as_array(),
            (p.entry.size,),
            np.zeros((1, 1), np.int64),
            np.array([p.process]),
            np.array([-1]),
        )
    created = {"jax": jax.__version__, "jaxckpt": __version__, "process_count": process_count}
    manifest = Manifest(
        tree=tree,
        entries=entries,
        created=created,
        version=_manifest.VERSION if packs else 1,
        packs={p.entry.path: p.entry for p in pack_plans},
    )
    ordered = tuple(arrays[k] for k in [*plain, *(p.entry.key for p in pack_plans)])
    digest = _digest(manifest, layouts.values(), lowest)
    plan = GlobalSavePlan(
        manifest=manifest,
        arrays=ordered,
        digest=digest,
        packs={p.entry.key: p.members for p in pack_plans},
    )
    validate_global_plan(plan)
    return plan


def _entries(
    leaves: dict[str, Any],
    prng: dict[str, str],
    max_chunk_bytes: int,
    process_count: int,
    taken: set[str],
) -> tuple[dict[str, Any], dict[str, _layout.Layout]]:
    """Each leaf's manifest entry, and each array's layout (storage names join ``taken``)."""
    entries: dict[str, Any] = {}
    layouts = {}
    holders: dict[int, int] = {}  # id(layout) -> processes holding each box: one pass per layout
    for key, leaf in leaves.items():
        if not is_array(leaf):
            entries[key] = ValueEntry(key, leaf)
            continue
        shape, dtype = tuple(leaf.shape), np.dtype(leaf.dtype)
        if isinstance(leaf, jax.Array):
            lay = _layout.layout(shape, leaf.sharding)
            sharding = str(leaf.sharding)
        else:
            lay, sharding = _layout.host_layout(shape, process_count), None
        layouts[key] = lay
        limit = chunk_limit(lay, dtype.itemsize, max_chunk_bytes, holders)
        entries[key] = ArrayEntry(
            key=key,
            shape=shape,
            dtype=dtype.name,
            storage_dtype=dtypes.storage_dtype_name(dtype),
            chunks=chunk_shape(lay.box, dtype.itemsize, limit),
            path=storage_name(key, taken),
            prng_impl=prng.get(key),
            sharding=sharding,
        )
    return entries, layouts


def _assign_writers(
    plain: list[str],
    layouts: dict[str, _layout.Layout],
    entries: dict[str, Any],
    balancer: _layout.Balancer,
) -> dict[str, ArrayPlan]:
    """The plan of each unpacked array: its boxes' writers, largest shard first."""
    arrays = {}
    by_size = sorted(
        plain,
        key=lambda k: (
            -math.prod(layouts[k].box) * entries[k].nbytes // max(math.prod(entries[k].shape), 1)
        ),
    )
    for key in by_size:
        lay = layouts[key]
        e = entries[key]
        writers = balancer.assign(
            lay, math.prod(lay.box) * dtypes.dtype_from_name(e.dtype).itemsize
        )
        arrays[key] = ArrayPlan(
            e, lay.box, lay.offsets, lay.processes[writers], lay.device_ids[writers]
        )
    return arrays


def chunk_limit(
    lay: _layout.Layout, itemsize: int, max_chunk_bytes: int, seen: dict[int, int] | None = None
) -> int:
    """The largest chunk for ``lay``'s boxes: ``max_chunk_bytes``, or less for shared boxes.

    A box that ``h`` processes hold (a replicated array, a data-parallel axis across hosts) is
    restored by ``h`` processes that share its reads, each reading ``1/h`` of it
    (``jaxckpt._planning.shared_read``). A chunk is the unit of a read (it is checksummed whole), so
    such a box is cut into chunks of at most ``1/h`` of it, though not below
    ``SHARED_CHUNK_MIN_BYTES``: then a restore on as many processes reads each byte once.
    """
    h = seen.get(id(lay)) if seen is not None else None
    if h is None:
        h = len(np.unique(lay.processes[lay.groups[0]])) if lay.groups.size else 1
        if seen is not None:
            seen[id(lay)] = h
    if h <= 1:
        return max_chunk_bytes
    share = math.prod(lay.box) * itemsize // h
    return min(max_chunk_bytes, max(share, SHARED_CHUNK_MIN_BYTES))


def _digest(manifest: Manifest, layouts: Any, lowest: bool) -> str:
    """A short hash of the plan, cheap at any scale.

    The writers are a deterministic function of the manifest (keys, shapes, dtypes, chunk
    grids, shardings), the dedup policy and the devices' ids and processes in each layout, so
    those are hashed instead of every box: one pass per distinct layout.
    """
    h = hashlib.sha256(manifest.to_json())
    h.update(b"lowest" if lowest else b"balanced")
    seen: set[int] = set()
    for lay in layouts:
        if id(lay) not in seen:
            seen.add(id(lay))
            for part in (lay.offsets, lay.groups, lay.device_ids, lay.processes):
                h.update(np.ascontiguousarray(part).tobytes())
    return h.hexdigest()[:16]
