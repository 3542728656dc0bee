"""Planner micro-benchmark: jaxckpt's real save planner on a simulated multi-process job.

One process cannot hold 32,768 devices, so the devices and arrays are stand-ins: a real
``jax.sharding.Mesh`` of ``(processes, 8)`` ``FakeDevice``s (each with an ``id`` and a
``process_index``, all the planner reads), real ``NamedSharding``s over it, and ``FakeArray``
leaves (a ``jax.Array`` subclass with ``shape``, ``dtype`` and ``sharding`` and no buffers).
Everything else is the real ``DefaultSavePlanner`` run as process 0: flatten, shard layouts,
chunk grids, dedup/balance, validation, manifest and digest, then this process's write items
(``finish_plan``). No bytes are resolved or written.

Arrays: two of every three are ``(processes*64, 512)`` matrices with spec ``("fsdp", "tp")``
(every device holds a unique 64x64 shard: the most boxes); the third is a ``(1024,)`` vector
replicated on every device (the most replicas to dedup).
"""

from __future__ import annotations

import gc
import resource
import time

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


class FakeDevice:
    """A device as the planner sees it: an ``id``, a ``process_index`` and a ``platform``."""

    __slots__ = ("id", "process_index")
    platform = "cpu"  # so finish_plan starts no device-to-host copies

    def __init__(self, id: int, process_index: int) -> None:
        self.id, self.process_index = id, process_index

    def __repr__(self) -> str:
        return f"FakeDevice({self.id})"


class FakeShard:
    """An addressable shard without data: only its ``device`` (data is never resolved here)."""

    __slots__ = ("device",)

    def __init__(self, device: FakeDevice) -> None:
        self.device = device


class FakeArray(jax.Array):
    """A stand-in leaf: ``shape``, ``dtype``, ``sharding`` and process 0's shards (no buffers)."""

    def __init__(self, shape: tuple[int, ...], sharding: NamedSharding, local: list) -> None:
        self._shape, self._sharding, self._local = shape, sharding, local

    shape = property(lambda self: self._shape)
    sharding = property(lambda self: self._sharding)
    dtype = np.dtype("float32")

    @property
    def addressable_shards(self) -> list[FakeShard]:
        return [FakeShard(d) for d in self._local]

    def is_deleted(self) -> bool:  # the planner refuses donated (deleted) arrays
        return False


def simulated_state(processes: int, per_process: int, arrays: int) -> dict:
    n = processes * per_process
    devices = np.array([FakeDevice(i, i // per_process) for i in range(n)], dtype=object)
    mesh = Mesh(devices.reshape(processes, per_process), ("fsdp", "tp"))
    sharded, replicated = NamedSharding(mesh, P("fsdp", "tp")), NamedSharding(mesh, P())
    local = list(devices[:per_process])  # process 0's devices
    tree = {}
    for a in range(arrays):
        if a % 3 == 2:
            tree[f"a{a:04d}"] = FakeArray((1024,), replicated, local)
        else:
            tree[f"a{a:04d}"] = FakeArray((processes * 64, per_process * 64), sharded, local)
    return tree


def run(processes: int, per_process: int = 8, arrays: int = 1000) -> dict:
    """Plan a save of ``arrays`` arrays as process 0 of ``processes`` x ``per_process``."""
    from jaxckpt._planning import plan_cache as _plan_cache
    from jaxckpt._planning import save_planner as _save_planner

    tree = simulated_state(processes, per_process, arrays)
    gc.collect()
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    _plan_cache.clear_plan_cache()
    planner = _save_planner.DefaultSavePlanner()
    t0 = time.perf_counter()
    planner.set_up_planner(tree, process_index=0, process_count=processes)
    plan = planner.create_global_plan()
    local = planner.finish_plan(plan)
    t_miss = time.perf_counter() - t0
    t1 = time.perf_counter()
    planner.set_up_planner(tree, process_index=0, process_count=processes)
    planner.finish_plan(planner.create_global_plan())
    t_hit = time.perf_counter() - t1
    return {
        "processes": processes,
        "devices": processes * per_process,
        "arrays": arrays,
        "boxes": sum(len(a.offsets) for a in plan.arrays),
        "local_items": len(local.items),
        "plan_s": t_miss,
        "cached_s": t_hit,
        "manifest_bytes": len(plan.manifest.to_json()),
        "peak_rss_growth_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024,
    }
