"""Pod-scale figures of a save and a restore on an object store, from a model of the layout.

    .venv/bin/python benchmarks/pod_scale.py [--devices 512,4096,32768] [--per-process 4]
        [--layout objects|chunks]

Pure arithmetic over the plan jaxckpt makes (no devices, no store): for a 7B-style
transformer (LLaMA-7B shapes: 32 layers, d_model 4,096, MLP 11,008, vocab 32,000; float32
parameters with Adam's two moments, so 3 x 291 arrays and ~81 GB), every matrix sharded on
its first dimension over all devices (FSDP; where a dimension has fewer rows than devices,
its rows are replicated over the rest), the 65 norm vectors replicated (packed), it prints
per save and restore:

- objects per save (what the layout writes: :func:`objects_per_save`; the default layout on
  object stores, :class:`DataObjects`, or ``--layout chunks``, :class:`Layout`), and their
  typical size;
- requests per process: the most any process sends (process 0, which also writes the lease
  and the commit, and with ``--layout chunks`` every ``zarr.json``) and the mean;
- listing pages per process (1,000 keys a page, GCS's and S3's), for a save, a restore and a
  ``CheckpointManager`` step;
- coordination-service operations per process (``jax.distributed``'s key-value store).

``tests/test_pod_scale_groups.py`` measures the same counts with real groups of 2, 4 and 8
processes against fake-gcs-server and checks them against :func:`model` (the default layout)
for its toy state, so the table's model is the one the code follows. docs/object_storage.md ("Pod scale") has the
table and how each count grows.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
from collections.abc import Callable, Sequence

PAGE = 1000  # keys per listing page (GCS and S3)
PACK_BYTES = 256 << 10  # jaxckpt._planning.packing.DEFAULT_PACK_BYTES
MAX_CHUNK = 64 << 20  # the save planner's max_chunk_bytes
# jaxckpt._format.objects: DEFAULT_TARGET, SPREAD, MIN_OBJECT; a record's CRC-32C
OBJECT_TARGET, SPREAD, MIN_OBJECT, CRC = 128 << 20, 16, 4 << 20, 4


@dataclasses.dataclass(frozen=True)
class Array:
    """One leaf: its shape, bytes per element, and whether its first dimension is sharded
    over all devices (else it is replicated)."""

    shape: tuple[int, ...]
    itemsize: int = 4
    sharded: bool = True

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


def transformer_7b() -> list[Array]:
    """LLaMA-7B's parameters with Adam's two moments (float32): 873 arrays."""
    d, ffn, vocab, layers = 4096, 11008, 32000, 32
    params = [Array((vocab, d)), Array((d, vocab)), Array((d,), sharded=False)]
    for _ in range(layers):
        params += [Array((d, d))] * 4 + [Array((d, ffn)), Array((ffn, d)), Array((d, ffn))]
        params += [Array((d,), sharded=False)] * 2
    return params * 3  # the parameters, mu, nu


def toy_transformer() -> dict[str, Array]:
    """The groups test's state (tests/test_pod_scale_groups.py), by key: the 7B's structure at
    2 layers, d_model 576, MLP 1,152, vocab 1,024 (each matrix above 4 x ``PACK_BYTES``, so
    unpacked, as the 7B's are): 63 arrays, 93 MB."""
    d, ffn, vocab = 576, 1152, 1024
    params = {"embed": Array((vocab, d)), "head": Array((d, vocab))}
    params["final_norm"] = Array((d,), sharded=False)
    for i in range(2):
        for w in ("q", "k", "v", "o"):
            params[f"l{i}/attn_{w}"] = Array((d, d))
        params |= {f"l{i}/mlp_up": Array((d, ffn)), f"l{i}/mlp_down": Array((ffn, d))}
        params |= {f"l{i}/mlp_gate": Array((d, ffn))}
        params |= {f"l{i}/norm1": Array((d,), sharded=False)}
        params |= {f"l{i}/norm2": Array((d,), sharded=False)}
    return {f"{part}/{k}": a for part in ("params", "mu", "nu") for k, a in params.items()}


@dataclasses.dataclass(frozen=True)
class Counts:
    """What one save and one restore send, per the model (see the module's docstring)."""

    devices: int
    processes: int
    objects: int  # per save
    object_bytes: int  # the median chunk's bytes
    save_requests_max: int  # per process: process 0
    save_requests_mean: float
    restore_requests_max: int
    restore_requests_mean: float
    save_pages: int  # listing pages per process: process 0 (the others: 0)
    restore_pages: int  # per process
    step_pages: int  # process 0 (the others: 0), a CheckpointManager step besides its save
    retention_pages: int  # process 0, in the background: the run, then the deleted step
    coordination_ops: tuple[int, int]  # per save: process 0's, each other process's


@dataclasses.dataclass(frozen=True)
class Layout:
    """A file per chunk (formats 1-4, ``DefaultSavePlanner(layout="chunks")``): a zarr array
    per leaf, a ``zarr.json`` and an object per chunk (a chunk per shard box, split above
    ``MAX_CHUNK``), small leaves in packs of one chunk each. :class:`DataObjects` (the
    default on object stores) overrides :meth:`objects` and :meth:`writes`."""

    restore_fixed = {"manifest read": 1, "manifest unchanged check": 1}

    def chunks(self, a: Array, devices: int) -> int:
        """Chunks of an unpacked array: one per distinct shard box (rows that cannot be split
        further are replicated), a box above ``MAX_CHUNK`` cut in several."""
        boxes = min(devices, a.shape[0]) if a.sharded else 1
        return boxes * max(1, math.ceil(a.nbytes / boxes / MAX_CHUNK))

    def packs(self, small: Sequence[Array], processes: int) -> int:
        """Packs of the replicated small leaves (``jaxckpt._planning.packing.plan_packs``):
        spread over up to one per process, each at least ``PACK_BYTES``."""
        total = sum(a.nbytes for a in small)
        if not total:
            return 0
        spread = max(1, min(processes, total // PACK_BYTES))
        cap = max(min(MAX_CHUNK, math.ceil(total / spread)), max(a.nbytes for a in small))
        count, filled = 1, 0
        for a in small:
            if filled and filled + a.nbytes > cap:
                count, filled = count + 1, 0
            filled += a.nbytes
        return count

    def objects(self, state: Sequence[Array], devices: int, processes: int) -> dict[str, int]:
        """Objects a save writes: chunks and ``zarr.json`` of each stored array, the manifest
        (the lease, ``writer.json``, is written and deleted)."""
        small = [a for a in state if _packed(a, devices)]
        big = [a for a in state if not _packed(a, devices)]
        packs = self.packs(small, processes)
        return {
            "chunks": sum(self.chunks(a, devices) for a in big) + packs,  # a pack: one chunk
            "zarr.json": len(big) + packs,
            "manifest.json": 1,
        }

    def typical_object(self, state: Sequence[Array], devices: int, processes: int) -> int:
        """The median chunk's bytes (of the unpacked arrays)."""
        big = [a for a in state if not _packed(a, devices)]
        sizes = sorted(a.nbytes // max(1, self.chunks(a, devices)) for a in big)
        return sizes[len(sizes) // 2] if sizes else 0

    def writes(self, state: Sequence[Array], devices: int, processes: int) -> tuple[int, int]:
        """Data writes of one save besides the protocol's: process 0's and all processes'
        (every chunk once, balanced; process 0 adds every ``zarr.json``)."""
        parts = self.objects(state, devices, processes)
        chunks, arrays = parts["chunks"], parts["zarr.json"]
        return math.ceil(chunks / processes) + arrays, chunks + arrays


@dataclasses.dataclass(frozen=True)
class DataObjects(Layout):
    """Format v5, the default on object stores: each process's chunks as records (the chunk's
    bytes and its CRC-32C) in a few data objects ``data/P.K`` of at most
    ``OBJECT_TARGET`` bytes, or of a 16th of the busiest process's bytes where that is less
    (but at least ``MIN_OBJECT``); a new object starts where the next record would pass the
    size. No ``zarr.json``; a restore reads byte ranges (one request per box here, each box
    one record) and does not check the manifest again (data object names are unique to
    their save)."""

    restore_fixed = {"manifest read": 1}

    def records(self, state: Sequence[Array], devices: int, processes: int) -> list[list[int]]:
        """Each process's record lengths in write order: its boxes of each unpacked array
        (box ``i`` of ``n``: process ``i * processes // n``), then the packs (pack ``j``:
        process ``j``)."""
        out: list[list[int]] = [[] for _ in range(processes)]
        for a in state:
            if _packed(a, devices):
                continue
            n = self.chunks(a, devices)
            for i in range(n):
                out[i * processes // n].append(math.ceil(a.nbytes / n) + CRC)
        small = [a for a in state if _packed(a, devices)]
        total = sum(a.nbytes for a in small)
        packs = self.packs(small, processes)
        for j in range(packs):
            out[j % processes].append(math.ceil(total / packs) + CRC)
        return out

    def per_process(self, state: Sequence[Array], devices: int, processes: int) -> list[int]:
        """Data objects each process writes (the greedy split of its records)."""
        records = self.records(state, devices, processes)
        busiest = max(sum(r) for r in records)
        size = min(OBJECT_TARGET, max(MIN_OBJECT, math.ceil(busiest / SPREAD)))
        return [_split(tuple(r), size) for r in records]

    def objects(self, state: Sequence[Array], devices: int, processes: int) -> dict[str, int]:
        return {
            "data objects": sum(self.per_process(state, devices, processes)),
            "manifest.json": 1,
        }

    def writes(self, state: Sequence[Array], devices: int, processes: int) -> tuple[int, int]:
        mine = self.per_process(state, devices, processes)
        return mine[0], sum(mine)

    def typical_object(self, state: Sequence[Array], devices: int, processes: int) -> int:
        """A data object's mean bytes."""
        records = self.records(state, devices, processes)
        return sum(map(sum, records)) // max(1, sum(self.per_process(state, devices, processes)))


@functools.lru_cache(maxsize=64)
def _split(records: tuple[int, ...], size: int) -> int:
    """Objects of at most ``size`` bytes that ``records`` fill in order (a record never spans
    two; one bigger than ``size`` has an object of its own): ``jaxckpt._format.objects.table``."""
    count, filled = 0, 0
    for n in records:
        if not count or (filled and filled + n > size):
            count, filled = count + 1, 0
        filled += n
    return count


def _packed(a: Array, devices: int) -> bool:
    box = a.nbytes / (min(devices, a.shape[0]) if a.sharded else 1)
    return a.nbytes <= PACK_BYTES or (a.nbytes <= 4 * PACK_BYTES and box <= PACK_BYTES)


def objects_per_save(
    state: Sequence[Array], devices: int, processes: int, layout: Layout | None = None
) -> int:
    """The hook: objects one save writes under ``layout`` (default: the default layout on
    object stores, :class:`DataObjects`)."""
    return sum((layout or DataObjects()).objects(state, devices, processes).values())


# The fixed requests of the protocol, each named (docs/object_storage.md, "Round trips").
SAVE_FIXED_COORDINATOR = {
    "manifest read": 1,
    "listing of the step's prefix": 1,
    "lease (writer.json) create": 1,
    "lease delete": 1,
    "manifest write (the commit)": 1,
}
# (and, once per process and store, a write that checks the store honours preconditions)
# jax.distributed key-value operations (sets, gets, directory reads, deletes) of one save,
# per process: process 0 and the others. Counted by the groups test at
# 2 and 4 processes: independent of processes, leaves and bytes (process 0 reads all the
# arrivals of a sync point in one directory read). A process that waits longer at a sync
# point polls again (every jaxckpt._runtime.distributed._POLL_S), so these are typical
# counts, and the test allows twice as many.
COORDINATION_PER_SAVE = (11, 9)
# One restore onto arrays of several processes: one agreement (every process's read error
# shared; jaxckpt._runtime.shared_restore): process 0 makes this many plus one answer per
# other process, each other process the second figure. Typical, as above. Each includes the
# watch for another process's failure: one blocking get, whatever the time spent reading (and
# on process 0 two more: waking the watchers, deleting their key).
COORDINATION_PER_RESTORE = (7, 7)


def model(
    state: Sequence[Array],
    devices: int,
    per_process: int,
    layout: Layout | None = None,
    coordination: tuple[int, int] = COORDINATION_PER_SAVE,
    kept: int = 2,
) -> Counts:
    """The counts of one save and one restore (to the same sharding) of ``state``; a manager
    keeping ``kept`` steps for the retention's figure."""
    layout = layout or DataObjects()
    processes = devices // per_process
    objects = sum(layout.objects(state, devices, processes).values())
    big = [a for a in state if not _packed(a, devices)]
    packs = layout.packs([a for a in state if _packed(a, devices)], processes)
    # Writes: the layout's data, balanced; process 0 adds the protocol's.
    fixed = sum(SAVE_FIXED_COORDINATOR.values())
    first, every = layout.writes(state, devices, processes)
    save_max = first + fixed
    save_mean = (every + fixed) / processes
    # Reads: each process its own boxes (a replicated row read once per host that needs it)
    # and every pack (a replicated leaf is wanted whole everywhere).
    own = sum(
        math.ceil(layout.chunks(a, devices) / min(processes, layout.chunks(a, devices)))
        for a in big
    )
    restore = own + packs + sum(layout.restore_fixed.values())
    return Counts(
        devices=devices,
        processes=processes,
        objects=objects,
        object_bytes=layout.typical_object(state, devices, processes),
        save_requests_max=save_max,
        save_requests_mean=save_mean,
        restore_requests_max=restore,
        restore_requests_mean=restore,
        save_pages=1,
        restore_pages=0,
        step_pages=1,
        # The run's index (kept + 1 markers), then the deleted step's objects.
        retention_pages=math.ceil((kept + 1) / PAGE) + math.ceil(objects / PAGE),
        coordination_ops=coordination,
    )


def _row(c: Counts) -> str:
    return (
        f"| {c.devices:,} | {c.processes:,} | {c.objects:,} | {c.object_bytes / 1024:,.0f} KiB | "
        f"{c.save_requests_max:,} / {c.save_requests_mean:,.0f} | "
        f"{c.restore_requests_max:,} | {c.save_pages} / {c.restore_pages} / {c.step_pages} | "
        f"{c.retention_pages:,} | {c.coordination_ops[0]} / {c.coordination_ops[1]} |"
    )


HEADER = (
    "| devices | processes | objects per save | typical object | save requests per process "
    "(process 0 / mean) | restore requests per process | listing pages per process (save, "
    "process 0 / restore / manager step) | retention pages (max_to_keep=2; process 0, "
    "background) | "
    "coordination ops per save (process 0 / others) |\n|" + " --- |" * 9
)


def main(argv: Sequence[str] | None = None, out: Callable[[str], object] = print) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--devices", default="512,4096,32768")
    p.add_argument("--per-process", type=int, default=4, help="devices per host (TPU VM: 4)")
    p.add_argument(
        "--layout",
        choices=("objects", "chunks"),
        default="objects",
        help="objects: format v5's data objects (the default on object stores); chunks: an "
        'object per chunk (DefaultSavePlanner(layout="chunks"))',
    )
    args = p.parse_args(argv)
    layout = DataObjects() if args.layout == "objects" else Layout()
    state = transformer_7b()
    gb = sum(a.nbytes for a in state) / 1e9
    out(f"7B-style transformer + Adam: {len(state)} arrays, {gb:.1f} GB (float32)")
    out(HEADER)
    for n in (int(x) for x in args.devices.split(",")):
        out(_row(model(state, n, args.per_process, layout)))


if __name__ == "__main__":
    main()
