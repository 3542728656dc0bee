"""Where each shard of an array lives, and who writes it — vectorized over devices.

A :class:`Layout` lists, for every device holding an array (all processes, not only this
one), the box it holds, as numpy arrays. For a ``NamedSharding`` it is computed from the mesh
and the ``PartitionSpec`` directly (no per-device Python objects), so a 32,768-device job plans
in milliseconds per array; other shardings go through ``devices_indices_map``.

Assignment is the greedy dedup of PyTorch DCP's default planner ("give each replicated box to its least-loaded holder,
largest first"), done one array at a time: within one array every device holds exactly one box,
so the replica groups are disjoint and the greedy choice for all boxes is one ``argmin``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from jaxckpt._errors import InvalidArgumentError
from jaxckpt._format.grid import ceil_div
from jaxckpt._format.plan import Box, IntArray, index_to_box


@dataclasses.dataclass(frozen=True, eq=False)
class Layout:
    """Every shard box of one array and its holders.

    ``groups[b, r]`` is the position (into ``device_ids``/``processes``) of the ``r``-th
    replica of box ``b``; ``offsets[b]`` is the box's offset and every box has size
    ``box`` (clipped at the array's end).
    """

    shape: tuple[int, ...]
    box: tuple[int, ...]
    offsets: IntArray  # [n_boxes, ndim]
    groups: IntArray  # [n_boxes, n_replicas]
    device_ids: IntArray  # [n_devices]; -1 for a host (numpy) array
    processes: IntArray  # [n_devices]


def named_layout(
    shape: Sequence[int],
    mesh_shape: Sequence[int],
    axis_names: Sequence[str],
    spec: Iterable[str | tuple[str, ...] | None],
    device_ids: IntArray,
    processes: IntArray,
) -> Layout:
    """The layout of a ``NamedSharding``, from the mesh's device ids and the partition spec.

    ``device_ids``/``processes`` have the mesh's shape. Matches ``devices_indices_map`` (a test
    checks it over many specs): dimension ``d`` is split over the mesh axes named in
    ``spec[d]``, major to minor; the mesh axes no dimension names are replicas.
    """
    shape = tuple(int(s) for s in shape)
    mesh_shape = tuple(int(m) for m in mesh_shape)
    coords = _coords(mesh_shape)
    axis = {n: i for i, n in enumerate(axis_names)}
    spec = tuple(spec)
    spec += (None,) * (len(shape) - len(spec))
    used: set[int] = set()
    box, offsets, parts, box_id = [], [], [], np.zeros(coords.shape[1], np.int64)
    for dim, entry in zip(shape, spec):
        names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        c = np.zeros(coords.shape[1], np.int64)
        n = 1
        for name in names:
            a = axis[name]
            used.add(a)
            c = c * mesh_shape[a] + coords[a]
            n *= mesh_shape[a]
        size = ceil_div(dim, n) if dim else 0
        box.append(size)
        offsets.append(c * size)
        parts.append(n)
        box_id = box_id * n + c
    rank = np.zeros(coords.shape[1], np.int64)
    for a in range(len(mesh_shape)):
        if a not in used:
            rank = rank * mesh_shape[a] + coords[a]
    n_boxes = math.prod(parts)
    n_rep = coords.shape[1] // n_boxes
    groups = np.empty((n_boxes, n_rep), np.int64)
    groups[box_id, rank] = np.arange(coords.shape[1])  # (box, replica) <-> device: a bijection
    first = groups[:, 0]
    offs = np.stack(offsets, 1)[first] if shape else np.zeros((n_boxes, 0), np.int64)
    return Layout(shape, tuple(box), offs, groups, device_ids.reshape(-1), processes.reshape(-1))


@functools.lru_cache(maxsize=16)
def _coords(mesh_shape: tuple[int, ...]) -> npt.NDArray[np.intp]:
    return np.indices(mesh_shape).reshape(len(mesh_shape), -1)


def layout(shape: Sequence[int], sharding: Any) -> Layout:
    """The layout of ``sharding`` for an array of ``shape`` (any JAX sharding).

    Cached: the arrays of a model share a few (shape, sharding) pairs, and share one layout.
    """
    try:
        return _cached_layout(tuple(shape), sharding)
    except TypeError:  # an unhashable sharding
        return _layout(tuple(shape), sharding)


@functools.lru_cache(maxsize=256)
def _cached_layout(shape: tuple[int, ...], sharding: Any) -> Layout:
    return _layout(shape, sharding)


def _layout(shape: tuple[int, ...], sharding: Any) -> Layout:
    import jax

    if isinstance(sharding, jax.sharding.NamedSharding) and _plain_spec(sharding.spec):
        ids, procs = _mesh_ids(sharding.mesh)
        return named_layout(
            shape, sharding.mesh.devices.shape, sharding.mesh.axis_names, sharding.spec, ids, procs
        )
    return _generic_layout(shape, sharding)


def _plain_spec(spec: Any) -> bool:
    entries = tuple(spec)
    ok = all(e is None or isinstance(e, str) or isinstance(e, tuple) for e in entries)
    return ok and not getattr(spec, "unreduced", None) and not getattr(spec, "reduced", None)


@functools.lru_cache(maxsize=64)
def _mesh_ids(mesh: Any) -> tuple[IntArray, IntArray]:
    flat = mesh.devices.reshape(-1)
    ids = np.fromiter((d.id for d in flat), np.int64, len(flat)).reshape(mesh.devices.shape)
    procs = np.fromiter((d.process_index for d in flat), np.int64, len(flat))
    return ids, procs.reshape(mesh.devices.shape)


def _generic_layout(shape: tuple[int, ...], sharding: Any) -> Layout:
    by_box: dict[Box, list[int]] = {}
    devices = sorted(sharding.devices_indices_map(shape).items(), key=lambda kv: kv[0].id)
    for pos, (_, index) in enumerate(devices):
        by_box.setdefault(index_to_box(index, shape), []).append(pos)
    boxes = sorted(by_box)
    if len({len(v) for v in by_box.values()}) != 1:
        raise InvalidArgumentError(
            f"sharding {sharding} replicates its shards unevenly (some boxes are held by more "
            f"devices than others); jaxckpt saves arrays whose every box is held by as many "
            f"devices: put the array on a NamedSharding (jax.device_put) before saving."
        )
    box = tuple(max(b[1][d] for b in boxes) for d in range(len(shape)))
    return Layout(
        shape=shape,
        box=box,
        offsets=np.array([b[0] for b in boxes], np.int64).reshape(len(boxes), len(shape)),
        groups=np.array([by_box[b] for b in boxes], np.int64),
        device_ids=np.array([d.id for d, _ in devices], np.int64),
        processes=np.array([d.process_index for d, _ in devices], np.int64),
    )


def host_layout(shape: Sequence[int], process_count: int) -> Layout:
    """A numpy array that every process holds whole."""
    shape = tuple(shape)
    return Layout(
        shape=shape,
        box=shape,
        offsets=np.zeros((1, len(shape)), np.int64),
        groups=np.arange(process_count, dtype=np.int64)[None, :],
        device_ids=np.full(process_count, -1, np.int64),
        processes=np.arange(process_count, dtype=np.int64),
    )


class Balancer:
    """Greedy writer choice across arrays: each box to its least-loaded holder.

    Loads are bytes planned per device id (per process for host arrays). Call :meth:`assign`
    for the arrays largest box first (LPT order); ties rotate with the box index so equal loads
    still spread. ``lowest=True`` gives every box to its lowest holder instead.
    """

    def __init__(self, lowest: bool = False) -> None:
        self.lowest = lowest
        self.loads = {False: np.zeros(0, np.int64), True: np.zeros(0, np.int64)}
        self.proc_loads = np.zeros(0, np.int64)

    def assign(self, lay: Layout, box_bytes: int) -> IntArray:
        """Position (into ``lay.device_ids``) of the writer of each box."""
        groups = lay.groups
        n_boxes, n_rep = groups.shape
        host = bool(lay.device_ids[0] == -1) if len(lay.device_ids) else False
        ids = lay.processes if host else lay.device_ids
        holder = ids[groups]  # [n_boxes, n_rep]: who holds each replica
        if self.lowest:
            lowest: IntArray = groups[np.arange(n_boxes), np.argmin(holder, axis=1)]
            return lowest
        # Unreplicated boxes have one choice, but their bytes still count towards the loads.
        table = self.loads[host]
        if len(table) <= ids.max():
            table = self.loads[host] = np.concatenate(
                [table, np.zeros(ids.max() + 1 - len(table), np.int64)]
            )
        procs = self.proc_loads
        if len(procs) <= lay.processes.max():
            procs = self.proc_loads = np.concatenate(
                [procs, np.zeros(lay.processes.max() + 1 - len(procs), np.int64)]
            )
        cand = table[holder]
        best = cand == cand.min(axis=1, keepdims=True)
        # Among the least-loaded devices, the least-loaded process: spreads replicas over hosts.
        pcand = np.where(best, procs[lay.processes[groups]], np.iinfo(np.int64).max)
        best = pcand == pcand.min(axis=1, keepdims=True)
        tie = (np.arange(n_rep)[None, :] - np.arange(n_boxes)[:, None]) % n_rep
        choice = np.argmin(np.where(best, tie, n_rep), axis=1)
        writers: IntArray = groups[np.arange(n_boxes), choice]
        table[ids[writers]] += box_bytes  # a device holds one box per array: no repeats
        np.add.at(procs, lay.processes[writers], box_bytes)
        return writers
