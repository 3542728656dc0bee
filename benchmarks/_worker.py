"""One measurement in a fresh process: ``python compare.py --worker JSON`` runs ``run(spec)``.

Every task times the first call in the process separately ("cold": imports, tensorstore
contexts, plan-cache misses, first compilations) from the ``runs`` calls after it ("warm").
"""

from __future__ import annotations

import gc
import os
import resource
import shutil
import sys
import time

import _evict
import _libs
import _limits
import _procfs
import _state
import jax
import numpy as np


def _du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _file_bytes_read() -> int:
    import tensorstore as ts

    found = ts.experimental_collect_matching_metrics("/tensorstore/kvstore/file/bytes_read")
    direct = sys.modules.get("jaxckpt._storage.chunkfile")  # jaxckpt reads its own chunks in place
    return sum(v.get("value", 0) for m in found for v in m["values"]) + (
        direct.bytes_read() if direct else 0
    )


def _needed_bytes(target) -> int:
    """Bytes of the distinct target shards this process holds (what it must read at least)."""
    total = 0
    for leaf in jax.tree_util.tree_leaves(target):
        boxes = {
            tuple((s.indices(n)[0], s.indices(n)[1]) for s, n in zip(idx, leaf.shape))
            for idx in leaf.sharding.addressable_devices_indices_map(leaf.shape).values()
        }
        for box in boxes:
            size = leaf.dtype.itemsize
            for a, b in box:
                size *= b - a
            total += size
    return total


def _calls(spec: dict, cold: bool = True):
    """Call numbers: 0 (the cold one) if ``cold``, then up to ``runs`` warm ones; warm calls
    stop early (after at least one) once they took ``budget_s`` together."""
    start = None
    for r in range(int(not cold), spec["runs"] + 1):
        if start is None and r >= 1:
            start = time.perf_counter()
        elif start is not None and time.perf_counter() - start > spec.get("budget_s", 1e9):
            return
        yield r


def _save(spec: dict) -> dict:
    lib = _libs.LIBS[spec["lib"]]()
    state = _state.build(spec["workload"])
    times = []
    for r in _calls(spec):
        path = spec["keep"] if r == 0 else f"{spec['keep']}.run{r}"
        t = time.perf_counter()
        lib.save(path, state)
        times.append(time.perf_counter() - t)
        if path != spec["keep"]:
            shutil.rmtree(path)
    return {
        "cold": times[0],
        "warm": times[1:],
        "disk_bytes": _du(spec["keep"]),
        "state_bytes": _state.nbytes(state),
    }


def _check_shardings(out, target) -> None:
    for got, want in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(target)):
        if not got.sharding.is_equivalent_to(want.sharding, len(want.shape)):
            raise AssertionError(f"restored sharding {got.sharding}, wanted {want.sharding}")


def _restore_onto(lib, spec: dict, mesh: list[int], cold: bool) -> dict:
    """Restore ``spec["path"]`` onto ``mesh``; with ``spec["evict"]``, each call after the
    checkpoint's files were dropped from the page cache (not timed; pages left counted)."""
    target = _state.abstract(spec["workload"], tuple(mesh))
    times, reads, left = [], [], 0
    for r, _ in enumerate(_calls(spec, cold)):
        if spec.get("evict"):
            left = max(left, _evict.evict(spec["path"])["resident_pages"])
        before, lib.bytes_read = _file_bytes_read(), 0
        t = time.perf_counter()
        out = jax.block_until_ready(lib.restore(spec["path"], target))
        times.append(time.perf_counter() - t)
        reads.append(_file_bytes_read() - before + lib.bytes_read)
        if r == 0:  # the bytes and the layout are right (not timed)
            _state.check(spec["workload"], out)
            _check_shardings(out, target)
        del out
    needed = _needed_bytes(target)
    return {"times": times, "bytes_read": reads, "bytes_needed": needed, "resident_pages": left}


def _restore(spec: dict) -> dict:
    """Restore onto the saving mesh (first call: cold), then, if asked, onto another mesh."""
    lib = _libs.LIBS[spec["lib"]]()
    same = _restore_onto(lib, spec, [4, 2], cold=True)
    out = {
        "cold": same["times"][0],
        "warm": same["times"][1:],
        "bytes_read": same["bytes_read"],
        "bytes_needed": same["bytes_needed"],
        "resident_pages": same["resident_pages"],
    }
    if spec.get("reshard"):  # after the cold call above: only warm calls here
        at_least_one = {**spec, "runs": max(spec["runs"], 1)}
        out["reshard"] = _restore_onto(lib, at_least_one, list(spec["reshard"]), cold=False)
    return out


def _async(spec: dict) -> dict:
    """Time until ``save_async`` returns and until the save is done; then ``jax.device_get``."""
    state = _state.build("big")
    lib = _libs.LIBS[spec["lib"]]()
    os.makedirs(spec["root"], exist_ok=True)
    blocking, total = [], []
    for r in _calls(spec):
        path = f"{spec['root']}/async-{r}"
        t = time.perf_counter()
        wait = lib.save_async(path, state)
        blocking.append(time.perf_counter() - t)
        wait()
        total.append(time.perf_counter() - t)
        shutil.rmtree(path)
    out = {"cold": blocking[0], "warm": blocking[1:], "total_warm": total[1:]}
    if spec.get("device_get"):  # the floor for any copy to the host, warm only
        times = []
        for _ in range(spec["runs"] + 1):
            # A fresh copy each time: an Array caches its host value after one device_get.
            fresh = jax.block_until_ready(jax.tree_util.tree_map(lambda a: a.copy(), state))
            t = time.perf_counter()
            jax.device_get(fresh)
            times.append(time.perf_counter() - t)
            del fresh
        out["device_get"] = times[1:]
    return out


def _memory(spec: dict) -> dict:
    """Peak RSS growth of one save of ``big`` per mode, after a tiny warm-up save per mode."""
    lib = _libs.LIBS[spec["lib"]]()
    os.makedirs(spec["root"], exist_ok=True)
    ways = {"blocking": lib.save, "async": lambda p, s: lib.save_async(p, s)()}
    tiny = {"w": jax.device_put(np.ones((64, 64), np.float32))}
    for mode in spec["modes"]:  # imports, contexts and caches: not measured
        ways[mode](f"{spec['root']}/warmup-{mode}", tiny)
    state = _state.build("big")
    growth = {}
    for mode in spec["modes"]:
        gc.collect()
        base = _procfs.vm("VmRSS")
        if not _procfs.reset_peak():  # fall back to the peak since start, which may hide the growth
            base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        ways[mode](f"{spec['root']}/mem-{mode}", state)
        growth[mode] = max(_procfs.vm("VmHWM") - base, 0)
    return {"growth": growth, "state_bytes": _state.nbytes(state)}


def _memory_restore(spec: dict) -> dict:
    """Peak RSS growth of one restore of ``spec["path"]`` (``big``) in a fresh process.

    The restored arrays themselves count (on CPU devices they live in host memory): 1.0x is
    the floor, the rest is what the library holds on the host on the way.
    """
    lib = _libs.LIBS[spec["lib"]]()
    os.makedirs(spec["root"], exist_ok=True)
    tiny = {"w": jax.device_put(np.ones((64, 64), np.float32))}
    lib.save(f"{spec['root']}/warmup-restore", tiny)  # imports, contexts: not measured
    jax.block_until_ready(lib.restore(f"{spec['root']}/warmup-restore", tiny))
    target = _state.abstract("big")
    gc.collect()
    base = _procfs.vm("VmRSS")
    if not _procfs.reset_peak():
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out = jax.block_until_ready(lib.restore(spec["path"], target))
    growth = max(_procfs.vm("VmHWM") - base, 0)
    _state.check("big", out)
    return {"growth": growth, "state_bytes": _state.nbytes(out)}


def _files(path: str) -> int:
    return sum(len(files) for _, _, files in os.walk(path))


def _scaling(spec: dict) -> dict:
    """One point of ``scaling`` in one process: saves (first = cold), then restores of the
    last save onto the same shardings (the first one checked, not timed apart from the rest)."""
    lib = _libs.LIBS[spec["lib"]]()
    state = _state.build(spec["workload"])
    size = _state.nbytes(state)
    saves = []
    for r in _calls(spec):
        path = f"{spec['root']}/run{r}"
        shutil.rmtree(path, ignore_errors=True)
        t = time.perf_counter()
        lib.save(path, state)
        saves.append(time.perf_counter() - t)
        if r:
            shutil.rmtree(f"{spec['root']}/run{r - 1}")
    del state
    gc.collect()
    files = _files(path)
    target = _state.abstract(spec["workload"])
    restores, host = [], None
    for r in _calls(spec):
        t = time.perf_counter()
        out = jax.block_until_ready(lib.restore(path, target))
        restores.append(time.perf_counter() - t)
        if r == 0:
            _state.check(spec["workload"], out)
            _check_shardings(out, target)
            host = [np.asarray(x) for x in jax.tree_util.tree_leaves(out)]  # already read
        del out
    shutil.rmtree(path)
    # JAX's placement floor at this point: a batched device_put of the host arrays the
    # restore had to build, onto the same shardings (what any reader must do after reading).
    shardings = [x.sharding for x in jax.tree_util.tree_leaves(target)]
    place = _limits.placement(host, shardings, max(1, len(restores) - 1))
    out = {"save": saves, "restore": restores, "state_bytes": size, "files": files}
    return {**out, "place": place}


def _plan(spec: dict) -> dict:
    import _plan_bench

    points = [_plan_bench.run(p, 8, spec["arrays"]) for p in spec["processes"]]
    restore = [_plan_bench.run_restore(p, 8, spec["arrays"]) for p in spec["processes"]]
    return {"points": points, "restore": restore}


TASKS = {
    "save": _save,
    "restore": _restore,
    "async": _async,
    "memory": _memory,
    "memory_restore": _memory_restore,
    "plan": _plan,
    "scaling": _scaling,
    "limits": _limits.run,
}


def run(spec: dict) -> dict:
    return TASKS[spec["task"]](spec)
