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


class FakeClient:
    """What ``jax.sharding`` asks a device's client: which process this one is (the process
    being simulated, so that its devices are the addressable ones)."""

    me = 0

    def process_index(self) -> int:
        return FakeClient.me


FakeDevice.client = FakeClient()  # type: ignore[attr-defined]


def run_restore(processes: int, per_process: int = 8, arrays: int = 1000) -> dict:
    """Restore planning on the simulated job, ``arrays`` arrays saved by ``processes`` x
    ``per_process`` devices (the save plan's manifest, as :func:`run` makes it):

    * the load plan (``DefaultLoadPlanner.set_up_planner`` and ``create_local_plan``, the
      shared reads of a multi-process restore included) of process 0 and of the last
      process, onto the same layout: every process makes its own, none waits for another;
    * the elastic agreement (``benchmarks/_tiers_bench.simulate_plan``: ``processes`` ->
      half as many, 1,000 leaves in 10 layouts): process 0's plan of everyone's share, and
      the last process's description of a part and its share expanded.

    Each with its time and peak RSS growth (VmHWM reset before it)."""
    import _tiers_bench
    from _procfs import reset_peak, vm

    from jaxckpt._planning import load_planner as _load_planner
    from jaxckpt._planning import plan_cache as _plan_cache
    from jaxckpt._planning import save_planner as _save_planner

    _plan_cache.clear_plan_cache()
    planner = _save_planner.DefaultSavePlanner()
    state = simulated_state(processes, per_process, arrays)
    planner.set_up_planner(state, process_index=0, process_count=processes)
    manifest = planner.create_global_plan().manifest
    del planner, state
    out: dict = {"processes": processes, "arrays": arrays}
    count = jax.process_count
    for name, me in (("load_0", 0), ("load_last", processes - 1)):
        FakeClient.me = me
        tree = simulated_state(processes, per_process, arrays)
        target = {
            k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in tree.items()
        }
        gc.collect()
        reset_peak()
        base = vm("VmRSS")
        jax.process_count = lambda: processes  # the shared reads are planned as on a pod
        try:
            t0 = time.perf_counter()
            load = _load_planner.DefaultLoadPlanner()
            load.set_up_planner(target, manifest)
            items = len(load.create_local_plan().items)
            out[name] = {"s": time.perf_counter() - t0, "items": items}
        finally:
            jax.process_count = count
        out[name]["growth_mb"] = max(vm("VmHWM") - base, 0) / 2**20
        del load, tree, target
    FakeClient.me = 0
    new = max(processes // 2, 1)
    got = _tiers_bench.simulate_plan(processes, new, arrays, per_process)
    out["elastic"] = {"new": new, **got}
    return out
