"""One process's part of a local step: what its own devices hold, as a plain checkpoint.

A part is a single-process jaxckpt checkpoint, so it has the commit protocol, the checksums
and the checks on read of any checkpoint (``jaxckpt.restore(PART)`` reads it). Its tree::

    {"description": "<JSON>",                        # a string leaf: nothing executable
     "boxes": {"<leaf #>": {"<box #>": ndarray}},    # this process's distinct shards
     "values": {"<leaf #>": value}}                  # numpy and Python leaves, whole

The description (:class:`PartInfo`) names the step, the process and the process count, the
save that wrote it (parts of one step combine only when they come from its newest save), the
state's global layout digest (keys, shapes, dtypes and every device's box: the same on every
process, so comparing it with a restore target's tells whether the target has the layout the
part was cut for), and per leaf its key, kind (``array``, ``prng`` or ``value``), shape, dtype
and boxes. A restore with the same layout rebuilds each ``jax.Array`` from this process's own
part with ``jax.make_array_from_single_device_arrays``: nothing is read from other hosts.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import re
from pathlib import Path
from typing import Any

import jax
import numpy as np
import numpy.typing as npt

from jaxckpt._api.restoring import metadata, restore
from jaxckpt._errors import CheckpointError, UnsupportedLeafError
from jaxckpt._format.iterators import IteratorState, SavedIterator
from jaxckpt._format.manifest import ValueEntry, storage_entries
from jaxckpt._format.names import parse_part as parse_part  # the rule lives with the names
from jaxckpt._format.names import part_name as part_name
from jaxckpt._format.plan import Box, index_to_box
from jaxckpt._planning import tree as _tree
from jaxckpt._planning.save_planner import DefaultSavePlanner, python_value
from jaxckpt._runtime import pools
from jaxckpt._storage import location as _location
from jaxckpt._storage import writer as _storage

logger = logging.getLogger("jaxckpt")
FORMAT = 1
DESCRIPTION = "description"


# What layout_digest digests of a leaf: (key, kind, shape, dtype, sharding), sharding None for
# a value.
LayoutLeaf = tuple[str, str, tuple[int, ...], str, jax.sharding.Sharding | None]


@dataclasses.dataclass(frozen=True)
class LeafInfo:
    key: str
    kind: str  # "array", "prng" (stored as its key data) or "value"
    shape: tuple[int, ...] = ()
    dtype: str = ""
    prng: str = ""  # the PRNG implementation of a "prng" leaf
    boxes: tuple[Box, ...] = ()  # in the leaf's own coordinates (not the key data's)


@dataclasses.dataclass(frozen=True)
class PartInfo:
    step: int
    process: int
    process_count: int
    save: str  # the save that wrote it: "<manager's start time, hex>-<random>-<save #>"
    layout: str
    leaves: tuple[LeafInfo, ...]

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, **dataclasses.asdict(self)}, sort_keys=True)


@dataclasses.dataclass
class Snapshot:
    """A state copied off the caller's buffers (device copies on CPU, host copies elsewhere)."""

    info: PartInfo
    copies: dict[tuple[int, int], jax.Array | npt.NDArray[Any]]  # (leaf #, box #) -> its copy
    values: dict[int, Any]
    nbytes: int
    iterators: dict[str, SavedIterator] = dataclasses.field(default_factory=dict)


# -- layouts ------------------------------------------------------------------------------------


def layout_digest(process_count: int, leaves: list[LayoutLeaf]) -> str:
    """The digest of ``(key, kind, shape, dtype, sharding)`` per leaf (``sharding`` ``None``
    for values): equal exactly when the keys, shapes, dtypes and every device's box are."""
    h = hashlib.sha256(str(process_count).encode())
    for key, kind, shape, dtype, sharding in leaves:
        h.update(json.dumps([key, kind, list(shape), dtype]).encode())
        if sharding is not None:
            try:
                h.update(_sharding_digest(sharding, tuple(shape)))
            except TypeError:  # an unhashable sharding: not cached
                h.update(_sharding_digest.__wrapped__(sharding, tuple(shape)))
    return h.hexdigest()[:32]


@functools.lru_cache(maxsize=256)
def _sharding_digest(sharding: Any, shape: tuple[int, ...]) -> bytes:
    boxes = sorted(
        (d.id, index_to_box(i, shape)) for d, i in sharding.devices_indices_map(shape).items()
    )
    return hashlib.sha256(repr(boxes).encode()).digest()


def target_layout(target: Any, process_count: int, saved: PartInfo | None = None) -> str | None:
    """The layout digest of a restore ``target``, or ``None`` if it cannot be rebuilt from
    parts: every array leaf must carry shape, dtype and sharding (a ``jax.Array`` or a
    ``ShapeDtypeStruct`` with a sharding, or a bare ``Sharding`` whose shape and dtype the
    ``saved`` part's description gives), every other leaf be ``None``."""
    if target is None:
        return None
    keys, leaves, _ = _tree.flatten_with_treedef(target)
    known = {li.key: li for li in saved.leaves} if saved is not None else {}
    entries: list[LayoutLeaf] = []
    for key, leaf in zip(keys, leaves):
        li = known.get(key)
        if leaf is None:
            entries.append((key, "value", (), "", None))
        elif isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)) and leaf.sharding is not None:
            kind = "prng" if jax.numpy.issubdtype(leaf.dtype, jax.dtypes.prng_key) else "array"
            entries.append((key, kind, tuple(leaf.shape), str(leaf.dtype), leaf.sharding))
        elif isinstance(leaf, jax.sharding.Sharding) and li is not None and li.kind != "value":
            entries.append((key, li.kind, li.shape, li.dtype, leaf))
        else:
            return None
    return layout_digest(process_count, entries)


# -- saving -------------------------------------------------------------------------------------


def snapshot(
    tree: Any,
    *,
    step: int,
    save: str,
    process: int,
    count: int,
    records: dict[str, IteratorState] | None = None,
) -> Snapshot:
    """Copy this process's distinct addressable shards (and values) of ``tree`` off its buffers;
    ``records``: this process's iterator states, committed with the part.

    Returns once the copies are dispatched (CPU devices) or done (elsewhere): the caller may
    then donate or overwrite ``tree``.
    """
    keys, leaves, _ = _tree.flatten_with_treedef(tree)
    infos: list[LeafInfo] = []
    layout: list[LayoutLeaf] = []
    sources: dict[tuple[int, int], jax.Array] = {}
    values: dict[int, Any] = {}
    for i, (key, leaf) in enumerate(zip(keys, leaves)):
        if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
            if leaf.is_deleted():
                raise UnsupportedLeafError(
                    f"Leaf {key!r} is a deleted jax.Array; save live arrays."
                )
            info, shards = _array_leaf(key, leaf)
            infos.append(info)
            layout.append((key, info.kind, info.shape, info.dtype, leaf.sharding))
            sources.update(((i, j), s) for j, s in enumerate(shards))
        else:
            values[i] = _value(key, leaf)
            infos.append(LeafInfo(key, "value"))
            layout.append((key, "value", (), "", None))
    part = PartInfo(step, process, count, save, layout_digest(count, layout), tuple(infos))
    copies = dict(zip(sources, _copy(list(sources.values()))))
    nbytes = sum(int(np.prod(c.shape)) * c.dtype.itemsize for c in copies.values())
    iterators = {n: SavedIterator(count, {process: r}) for n, r in (records or {}).items()}
    return Snapshot(part, copies, values, nbytes, iterators)


def _array_leaf(key: str, leaf: jax.Array) -> tuple[LeafInfo, list[jax.Array]]:
    kind, prng, data = "array", "", leaf
    if jax.numpy.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        kind, prng, data = "prng", str(jax.random.key_impl(leaf)), jax.random.key_data(leaf)
    nd = leaf.ndim
    boxes: dict[Box, jax.Array] = {}
    for shard in data.addressable_shards:
        box = index_to_box(shard.index[:nd], leaf.shape)
        boxes.setdefault(box, shard.data)
    info = LeafInfo(key, kind, tuple(leaf.shape), str(leaf.dtype), prng, tuple(boxes))
    return info, list(boxes.values())


def _value(key: str, leaf: Any) -> Any:
    """A numpy or Python leaf as the part holds it: what the persistent tier takes, alike."""
    if isinstance(leaf, (np.ndarray, np.generic)):
        return np.array(leaf)  # the caller may change its array once save() returns
    return python_value(key, leaf)


def _copy(shards: list[jax.Array]) -> list[jax.Array | npt.NDArray[Any]]:
    """Copies of ``shards`` that survive donation: device copies on CPU devices (dispatched,
    as ``DefaultSavePlanner.detach`` does), host copies on accelerators (device memory is
    scarce there)."""
    if not shards:
        return []
    if all(next(iter(s.devices())).platform == "cpu" for s in shards):
        put = functools.partial(jax.device_put, shards, may_alias=False)
        copies: list[jax.Array | npt.NDArray[Any]] = pools.stage_pool().submit(put).result()
        return copies
    for s in shards:
        s.copy_to_host_async()
    return [np.array(s) for s in shards]


def write_part(path: Path, snap: Snapshot, *, overwrite: bool) -> int:
    """Write ``snap`` as the single-process checkpoint ``path``; the bytes written.

    This process is the only writer, so the save needs no agreement with the others: one
    ``Writer`` with the same commit protocol as ``jaxckpt.save``.
    """
    tree: dict[str, Any] = {
        DESCRIPTION: snap.info.to_json(),
        "boxes": {},
        "values": {str(i): v for i, v in snap.values.items()},
    }
    for (i, j), copy in snap.copies.items():
        tree["boxes"].setdefault(str(i), {})[str(j)] = np.asarray(copy)
    planner = DefaultSavePlanner()
    planner.set_up_planner(tree, process_index=0, process_count=1)
    plan = planner.create_global_plan()
    planner.check_global_plan(plan)
    items = planner.finish_plan(plan).items
    entries = storage_entries(plan.manifest)
    writer = _storage.Writer(_location.Location(path), overwrite=overwrite)
    try:
        writer.open_arrays(entries.values(), create=True)
        nbytes = writer.write(entries, ((i, planner.resolve_data(i)) for i in items))
        writer.flush()
        writer.commit(dataclasses.replace(plan.manifest, iterators=snap.iterators))
    except BaseException:
        writer.abort()
        raise
    return nbytes


# -- reading ------------------------------------------------------------------------------------


def read_info(path: Path) -> PartInfo | None:
    """The description of the committed part at ``path``; ``None`` if it is none (absent,
    uncommitted, foreign or malformed: a hostile part is never used)."""
    try:
        entry = metadata(str(path)).entries.get(DESCRIPTION)
        text = entry.value if isinstance(entry, ValueEntry) else None
        raw = json.loads(text) if isinstance(text, str) else None
        return _parse(raw) if isinstance(raw, dict) and raw.get("format") == FORMAT else None
    except (CheckpointError, ValueError, TypeError, KeyError, OSError):
        return None


def _parse(raw: dict[str, Any]) -> PartInfo | None:
    def ints(xs: Any) -> tuple[int, ...]:
        if not isinstance(xs, list) or not all(type(x) is int and x >= 0 for x in xs):
            raise ValueError("not a list of non-negative ints")
        return tuple(xs)

    leaves = []
    for leaf in raw["leaves"]:
        shape = ints(leaf["shape"])
        boxes = tuple((ints(o), ints(s)) for o, s in leaf["boxes"])
        if leaf["kind"] not in ("array", "prng", "value") or any(
            len(o) != len(shape)
            or len(s) != len(shape)
            or any(a + b > d for a, b, d in zip(o, s, shape))
            for o, s in boxes
        ):
            raise ValueError("a box outside its array")
        leaves.append(
            LeafInfo(
                str(leaf["key"]), leaf["kind"], shape, str(leaf["dtype"]), str(leaf["prng"]), boxes
            )
        )
    count, process, step = (int(raw[k]) for k in ("process_count", "process", "step"))
    if not 0 <= process < count or step < 0:
        raise ValueError("process or step out of range")
    return PartInfo(step, process, count, str(raw["save"]), str(raw["layout"]), tuple(leaves))


def rebuild(path: Path, info: PartInfo, target: Any) -> Any:
    """``target``'s tree from the part at ``path`` (its layout digest must be ``info.layout``).

    Each distinct box is read once onto one device that needs it (through ``jaxckpt.restore``,
    so with its checks and bounded host memory) and copied to the others on this process.
    """
    _, leaves, treedef = _tree.flatten_with_treedef(target)
    where: dict[tuple[int, int], Any] = {}  # (leaf #, box #) -> the device it is read onto
    needs: dict[int, list[tuple[Any, int]]] = {}  # leaf # -> (device, box #) per local device
    for i, (li, t) in enumerate(zip(info.leaves, leaves)):
        if li.kind == "value":
            continue
        index = {box: j for j, box in enumerate(li.boxes)}
        needs[i] = []
        sharding: Any = t if isinstance(t, jax.sharding.Sharding) else t.sharding
        for device, idx in sharding.addressable_devices_indices_map(li.shape).items():
            j = index.get(index_to_box(idx, li.shape))
            if j is None:
                raise CheckpointError(f"{path}: key {li.key!r} has no box for device {device}")
            needs[i].append((device, j))
            where.setdefault((i, j), device)
    shardings: dict[str, Any] = {DESCRIPTION: None, "boxes": {}, "values": {}}
    for i, li in enumerate(info.leaves):
        if li.kind == "value":
            shardings["values"][str(i)] = None
        for j in range(len(li.boxes)):
            device = where.get((i, j), jax.local_devices()[0])
            shardings["boxes"].setdefault(str(i), {})[str(j)] = jax.sharding.SingleDeviceSharding(
                device
            )
    try:
        got = restore(str(path), shardings)
    except CheckpointError as e:
        raise user_error(e, path, [li.key for li in info.leaves]) from e
    out = []
    for i, (li, t) in enumerate(zip(info.leaves, leaves)):
        if li.kind == "value":
            out.append(got["values"][str(i)])
            continue
        arrays = []
        for device, j in needs[i]:
            box = got["boxes"][str(i)][str(j)]
            box = box if where[(i, j)] == device else jax.device_put(box, device)
            arrays.append(jax.random.wrap_key_data(box, impl=li.prng) if li.prng else box)
        sharding = t if isinstance(t, jax.sharding.Sharding) else t.sharding
        out.append(jax.make_array_from_single_device_arrays(li.shape, sharding, arrays))
    return jax.tree_util.tree_unflatten(treedef, out)


_INTERNAL = re.compile(r"""(['"])(?:boxes/([0-9]+)/([0-9]+)|values/([0-9]+))\1""")


def user_error(e: CheckpointError, path: Path, keys: list[str]) -> CheckpointError:
    """``e``, an error reading the part at ``path``, naming the user's key paths (``keys``,
    per leaf) instead of the part's own (``'boxes/3/0'`` is box 0 of the fourth leaf).

    Example:
      >>> user_error(CheckpointError("Key 'boxes/1/0': chunk 0 is damaged."), Path("p"), ["a", "b"])
      CheckpointError("Local part p: Key 'b' (box 0 of it in the part): chunk 0 is damaged.")
    """

    def name(m: re.Match[str]) -> str:
        i = int(m[2] or m[4])
        if i >= len(keys):
            return m[0]
        return f"{m[1]}{keys[i]}{m[1]}" + (f" (box {m[3]} of it in the part)" if m[3] else "")

    err = type(e)(f"Local part {path}: {_INTERNAL.sub(name, str(e))}")
    err.__cause__ = e
    return err
