"""Moving and placing the boxes of an elastic restore (its step 3, see ``elastic_restore``).

Each process gets its share of the plan (``jaxckpt._tiers.elastic.Plan``) and:

* reads each saved box its plan lists from a part on its own disk, once, slab by slab (runs of
  at most one transfer chunk, ``elastic.slabs``), through the part's reader (the checks of any
  checkpoint read: checksums, sizes, confinement) with a read-ahead of two slabs;
* keeps its own pieces and writes the others' into one stream per receiver
  (``jaxckpt._runtime.streams``: peer to peer through the transfer servers, as replicas go,
  or relayed by process 0), in the plan's order, which both ends know;
* receives its pieces on one thread per sender (``pools.stream_pool``: a receiver waits only
  on its sender, so no cycle of waits can form);
* fills its target boxes (host buffers aligned for the CPU backend to alias them) and puts
  each leaf on its devices as soon as every byte of its boxes has arrived, dropping the host
  copy. A piece that overflows its box, or a box not filled, is an error.

So a sender holds a slab being cut, two read ahead and a window of chunks per stream; a
receiver the chunk being read and the boxes of the leaves still arriving.
"""

from __future__ import annotations

import dataclasses
import json
import math
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import jax
import numpy as np
import numpy.typing as npt

from jaxckpt._errors import CheckpointError
from jaxckpt._format.dtypes import dtype_from_name
from jaxckpt._format.entries import ArrayEntry
from jaxckpt._format.grid import aligned_empty
from jaxckpt._format.plan import Box, ReadItem, index_to_box
from jaxckpt._planning import tree as _tree
from jaxckpt._runtime import collector as _collector
from jaxckpt._runtime import heartbeat as _heartbeat
from jaxckpt._runtime import pools
from jaxckpt._runtime import streams as _streams
from jaxckpt._sources.detect import open_source
from jaxckpt._storage import location as _location
from jaxckpt._tiers import elastic as _elastic
from jaxckpt._tiers import local_part as _part


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One leaf of the local step, as every process needs to know it.

    ``kind``: ``"array"``, ``"prng"`` (key data stored), ``"host"`` (a numpy value, moved as
    an array and returned as numpy) or ``"value"`` (a Python value, ``value``). ``data`` and
    ``trailing``: the stored dtype and the key data's trailing dimensions.
    """

    key: str
    kind: str
    shape: tuple[int, ...] = ()
    dtype: str = ""
    prng: str = ""
    data: str = ""
    trailing: tuple[int, ...] = ()
    value: Any = None

    @property
    def itemsize(self) -> int:
        """Bytes per element of the leaf (a key's data included)."""
        return dtype_from_name(self.data).itemsize * math.prod(self.trailing)

    def to_json(self) -> list[Any]:
        return [*dataclasses.astuple(self)]

    @staticmethod
    def from_json(raw: list[Any]) -> Leaf:
        key, kind, shape, dtype, prng, data, trailing, value = raw
        return Leaf(key, kind, tuple(shape), dtype, prng, data, tuple(trailing), value)

    def data_box(self, box: Box) -> Box:
        """``box`` of the leaf in the stored data's coordinates (the key data's appended)."""
        return (*box[0], *(0,) * len(self.trailing)), (*box[1], *self.trailing)


@dataclasses.dataclass
class Stats:
    """What one process did in an elastic restore (logged; read by tests and benchmarks)."""

    read: list[tuple[str, Box, int]] = dataclasses.field(default_factory=list)  # key, box, part
    read_bytes: int = 0  # of pieces read from its own disk, its own and others'
    sent_bytes: int = 0
    received_bytes: int = 0

    def __str__(self) -> str:
        mib = 1 << 20
        return (
            f"resharded: {len(self.read)} boxes read here, {self.read_bytes / mib:.1f} MiB of "
            f"pieces, {self.sent_bytes / mib:.1f} MiB sent, {self.received_bytes / mib:.1f} "
            f"MiB received"
        )


def sharding_of(t: Any) -> Any:
    """The sharding a target leaf (a ``jax.Array``, a ``ShapeDtypeStruct`` or a bare
    ``Sharding``) restores onto."""
    return t if isinstance(t, jax.sharding.Sharding) else t.sharding


def carry_out(
    common: Mapping[str, Any],
    own: str,
    target: Any,
    paths: Mapping[int, Path],
    prefix: str,
    process: int,
) -> tuple[Any, Stats]:
    """Read, send, receive and place this process's share (3.): the restored tree.

    Raises:
      CheckpointError, DistributedError: a read, a stream or a box failed here.
    """
    with _collector.paused():
        leaves, plan, needs = share_of(common, own)
    _, targets, treedef = _tree.flatten_with_treedef(target)
    stats, slab = Stats(), int(common["slab"])
    assembly = _Assembly(leaves, needs, targets)
    jobs: list[Future[int]] = [
        pools.stream_pool().submit(_receive, prefix, h, process, reads, leaves, assembly, slab)
        for h, reads in sorted(plan.incoming.items())
    ]
    try:
        _serve(plan.reads, leaves, paths, process, prefix, assembly, slab, stats)
    finally:
        errors = []
        for job in jobs:
            try:
                stats.received_bytes += job.result()
            except Exception as e:  # noqa: BLE001 - the first one is raised below
                errors.append(e)
    if errors:
        raise errors[0]
    return jax.tree_util.tree_unflatten(treedef, assembly.finish()), stats


def share_of(
    common: Mapping[str, Any], own: str
) -> tuple[list[Leaf], _elastic.Plan, dict[int, list[Box]]]:
    """The leaves, this process's plan per leaf and its target boxes per leaf, from the
    verdict (``common``) and its share (``own``, per layout): what a process other than 0
    computes of the plan (benchmarks/_plan_bench.py times it)."""
    leaves = [Leaf.from_json(raw) for raw in common["leaves"]]
    mine = json.loads(own)
    layouts = [[int(i) for i in members] for members in common["layouts"]]
    plan = _elastic.plan_from_json(mine["plan"]).expand(layouts)
    needs: dict[int, list[Box]] = {}
    for n, boxes in mine["needs"].items():
        needs.update(dict.fromkeys(layouts[int(n)], [_elastic.box_of(b) for b in boxes]))
    return leaves, plan, needs


def _totals(reads: Sequence[_elastic.Read], leaves: list[Leaf]) -> dict[int, int]:
    """The bytes of the pieces of ``reads`` per process."""
    out: dict[int, int] = {}
    for r in reads:
        for c in r.pieces:
            out[c.process] = (
                out.get(c.process, 0) + _elastic.volume(c.region) * leaves[r.leaf].itemsize
            )
    return out


def _cuts(
    read: _elastic.Read, leaf: Leaf, slab: int
) -> list[tuple[Box, list[tuple[_elastic.Piece, Box]]]]:
    """Per slab of the saved box (stored coordinates) that some piece needs, the piece's part
    of it: the order both ends of a stream agree on."""
    box = leaf.data_box(read.box)
    regions = [(c, leaf.data_box(c.region)) for c in read.pieces]
    out = []
    for s in _elastic.slabs(box, dtype_from_name(leaf.data).itemsize, slab):
        cut = [(c, sub) for c, r in regions if (sub := _elastic.intersect(s, r)) is not None]
        if cut:
            out.append((s, cut))
    return out


def _serve(
    reads: Sequence[_elastic.Read],
    leaves: list[Leaf],
    paths: Mapping[int, Path],
    process: int,
    prefix: str,
    assembly: _Assembly,
    slab: int,
    stats: Stats,
) -> None:
    """Read each box of ``reads`` once, slab by slab; keep this process's pieces, stream the
    others' to them (one stream per receiver, opened first so its receiver can start)."""
    outs = {
        p: _streams.Outgoing(f"{prefix}/{process}-{p}/", n, watch=_heartbeat.Watch(prefix, p))
        for p, n in sorted(_totals(reads, leaves).items())
        if p != process and n
    }
    sources: dict[int, tuple[Mapping[str, Any], Any]] = {}
    try:
        for read in reads:
            leaf = leaves[read.leaf]
            if read.part not in sources:
                manifest, reader = open_source(_location.Location(paths[read.part]))
                sources[read.part] = (manifest.entries, reader)
            entries, reader = sources[read.part]
            try:
                _read_box(read, leaf, entries, reader, process, outs, assembly, slab, stats)
            except CheckpointError as e:
                raise _part.user_error(e, paths[read.part], [f.key for f in leaves]) from e
        for out in outs.values():
            stats.sent_bytes += out.close()
    except BaseException:
        for out in outs.values():
            out.abort()
        raise


def _read_box(
    read: _elastic.Read,
    leaf: Leaf,
    entries: Mapping[str, Any],
    reader: Any,
    process: int,
    outs: Mapping[int, _streams.Outgoing],
    assembly: _Assembly,
    slab: int,
    stats: Stats,
) -> None:
    key = f"values/{read.leaf}" if leaf.kind == "host" else f"boxes/{read.leaf}/{read.index}"
    box = leaf.data_box(read.box)
    entry = entries.get(key)
    if not isinstance(entry, ArrayEntry) or tuple(entry.shape) != box[1]:
        raise CheckpointError(f"{key!r} of the part is not box {read.box} of its description")
    cuts = _cuts(read, leaf, slab)
    items = []
    for _, cut in cuts:
        lo = [min(sub[0][d] for _, sub in cut) for d in range(len(box[1]))]
        hi = [max(sub[0][d] + sub[1][d] for _, sub in cut) for d in range(len(box[1]))]
        offsets = tuple(a - o for a, o in zip(lo, box[0]))
        items.append(ReadItem(key, offsets, tuple(b - a for a, b in zip(lo, hi))))
    got = reader.read(dict(entries), items, max_inflight_bytes=2 * slab)
    for (item, data), (_, cut) in zip(got, cuts):
        corner = [o + a for o, a in zip(box[0], item.offsets)]
        for c, sub in cut:
            piece = data[tuple(slice(o - k, o - k + s) for o, s, k in zip(*sub, corner))]
            stats.read_bytes += piece.nbytes
            if c.process == process:
                assembly.put(read.leaf, c.target, sub, piece)
            else:
                outs[c.process].write(np.ascontiguousarray(piece).reshape(-1).view(np.uint8).data)
    stats.read.append((leaf.key, read.box, read.part))


def _receive(
    prefix: str,
    sender: int,
    process: int,
    reads: Sequence[_elastic.Read],
    leaves: list[Leaf],
    assembly: _Assembly,
    slab: int,
) -> int:
    """Receive the pieces of ``reads`` from ``sender``, in its order; the bytes. A sender
    that dies or gives up ends the wait within its I/O deadline (its heartbeat)."""
    total = sum(_totals(reads, leaves).values())
    if not total:
        return 0
    name = f"{prefix}/{sender}-{process}/"
    watch = _heartbeat.Watch(prefix, sender)
    stream = _streams.Incoming(name, total=total, what=f"the boxes of {name}", watch=watch)
    try:
        for read in reads:
            leaf = leaves[read.leaf]
            dtype = dtype_from_name(leaf.data)
            for _, cut in _cuts(read, leaf, slab):
                for c, sub in cut:
                    raw = stream.read(_elastic.volume(sub) * dtype.itemsize)
                    assembly.put(
                        read.leaf, c.target, sub, np.frombuffer(raw, dtype).reshape(sub[1])
                    )
    except Exception as e:
        stream.fail(e)
        raise
    stream.close()
    return total


class _Assembly:
    """This process's target boxes, filled piece by piece (from any thread); each leaf is put
    on its devices as soon as every byte of its boxes has arrived, and its host copy dropped."""

    def __init__(self, leaves: list[Leaf], needs: Mapping[int, list[Box]], targets: list[Any]):
        self.leaves, self.needs, self.targets = leaves, needs, targets
        self.left = {
            i: sum(_elastic.volume(b) for b in boxes) * leaves[i].itemsize
            for i, boxes in needs.items()
        }
        self.buffers: dict[tuple[int, int], npt.NDArray[Any]] = {}
        self.done: dict[int, Any] = {}
        self._lock = threading.Lock()

    def _buffer(self, i: int, k: int) -> npt.NDArray[Any]:
        with self._lock:
            buf = self.buffers.get((i, k))
            if buf is None:
                leaf = self.leaves[i]
                shape = leaf.data_box(self.needs[i][k])[1]
                buf = self.buffers[(i, k)] = aligned_empty(shape, dtype_from_name(leaf.data))
            return buf

    def put(self, i: int, k: int, sub: Box, data: npt.NDArray[Any]) -> None:
        """Copy ``data``, the box ``sub`` (stored coordinates), into target box ``k`` of leaf
        ``i``."""
        if i not in self.needs or k >= len(self.needs[i]):
            raise CheckpointError(f"a piece for target box {k} of leaf {i}, which is not needed")
        corner = self.leaves[i].data_box(self.needs[i][k])[0]
        self._buffer(i, k)[tuple(slice(o - c, o - c + s) for o, s, c in zip(*sub, corner))] = data
        with self._lock:
            self.left[i] -= data.nbytes
            whole = self.left[i] == 0
            if self.left[i] < 0:
                raise CheckpointError(f"key {self.leaves[i].key!r}: more bytes than its boxes hold")
        if whole:
            self.done[i] = self._place(i)

    def _place(self, i: int) -> Any:
        leaf = self.leaves[i]
        if leaf.kind == "host":
            return self._buffer(i, 0)
        sharding = sharding_of(self.targets[i])
        index = {b: k for k, b in enumerate(self.needs.get(i, ()))}
        arrays = []
        for device, idx in sharding.addressable_devices_indices_map(leaf.shape).items():
            a = jax.device_put(self._buffer(i, index[index_to_box(idx, leaf.shape)]), device)
            arrays.append(jax.random.wrap_key_data(a, impl=leaf.prng) if leaf.prng else a)
        with self._lock:
            for k in range(len(index)):
                self.buffers.pop((i, k), None)
        return jax.make_array_from_single_device_arrays(leaf.shape, sharding, arrays)

    def finish(self) -> list[Any]:
        """Every leaf, in order (those without bytes to wait for are placed now)."""
        out = []
        for i, leaf in enumerate(self.leaves):
            if leaf.kind == "value":
                out.append(leaf.value)
                continue
            if i not in self.done:
                if self.left.get(i, 0):
                    raise CheckpointError(f"key {leaf.key!r}: some of its boxes never arrived")
                self.done[i] = self._place(i)
            out.append(self.done[i])
        return out
