"""save_async: staged copies are independent of the caller's buffers, host memory stays flat,
one save in flight per manager, and the handle reports timings, bytes and GB/s."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
from helpers import assert_tree_equal, mesh, put

import jaxckpt
from jaxckpt._runtime import staging as _staging


def _sharded_state(m, scale: float = 1.0) -> dict:
    a = np.arange(512 * 1024, dtype=np.float32).reshape(512, 1024) * scale
    return {
        "w": put(a, m, "data", "model"),  # 2 MiB, 8 shards
        "b": put(a[:64] + 1, m),  # replicated on 8 devices, written once
        "host": np.arange(4096, dtype=np.int64),  # a numpy leaf, mutable in place
        "step": 3,
    }


def test_overwriting_buffers_after_save_async_does_not_change_the_checkpoint(tmp_path):
    m = mesh((4, 2), ("data", "model"))
    state = _sharded_state(m)
    state["big"] = put(np.ones((4096, 2048), np.float32), m, "data")  # 32 MiB: writes take a while
    expected = jax.tree.map(lambda x: np.array(x) if hasattr(x, "shape") else x, state)
    clobber = jax.jit(lambda s: jax.tree.map(lambda x: x * 0 - 7, s), donate_argnums=0)
    keys = ("w", "b", "big")
    clobber({k: state[k] + 0 for k in keys})  # compiled now, so it runs while the save writes

    h = jaxckpt.save_async(tmp_path / "c", state)
    arrays = {k: state[k] for k in keys}
    for _ in range(3):  # donated: XLA writes the results into the very same buffers
        arrays = clobber(arrays)
    state["host"][:] = -1  # and the numpy leaf is changed in place
    assert state["w"].is_deleted()
    h.wait()
    assert_tree_equal(jaxckpt.restore(tmp_path / "c"), expected)

    # The same through a manager whose saves reuse one staging buffer.
    state = _sharded_state(m, 2.0)
    expected2 = jax.tree.map(lambda x: np.array(x) if hasattr(x, "shape") else x, state)
    with jaxckpt.CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(1, state)
        state = {**state, **clobber({"w": state["w"], "b": state["b"]})}
        mgr.save(2, state)  # stages into the buffer step 1 was written from
    assert_tree_equal(mgr.restore(1), expected2)
    assert float(mgr.restore(2)["w"][0, 0]) == -7.0


def _planned(state) -> tuple[jaxckpt.DefaultSavePlanner, list]:
    planner = jaxckpt.DefaultSavePlanner(pack_bytes=0)
    planner.set_up_planner(state, process_index=0, process_count=1)
    return planner, planner.finish_plan(planner.create_global_plan()).items


def test_cpu_device_items_are_detached_as_device_copies_not_views():
    m = mesh((4, 2), ("data", "model"))
    state = _sharded_state(m)
    state["half"] = put(np.arange(64 * 8, dtype=np.int32).reshape(64, 8), m, "data")
    planner, items = _planned(state)
    detached = planner.detach(items)
    # every jax.Array item (whole leaves, replicated "b", half-replicated "half"); not "host"
    assert {items[i].key for i in detached} == {"w", "b", "half"}
    assert all(items[i].key != "host" for i in detached)
    originals = {
        (k, s.device.id): s.data.unsafe_buffer_pointer()
        for k in ("w", "b", "half")
        for s in state[k].addressable_shards
    }
    for i, read in detached.items():
        item, got = items[i], read()
        assert np.array_equal(got, planner.resolve_data(item)), item.key
        # a copy of its own, never a view of the caller's (donatable) device buffer
        assert got.ctypes.data != originals[(item.key, item.device)], item.key


def test_a_planner_that_overrides_resolve_data_sees_every_item_of_save_async(tmp_path):
    seen = []

    class Counting(jaxckpt.DefaultSavePlanner):
        def resolve_data(self, item):
            seen.append(item.key)
            return super().resolve_data(item)

    m = mesh((4, 2), ("data", "model"))
    state = _sharded_state(m)
    planner, items = _planned(state)
    jaxckpt.save_async(tmp_path / "c", state, planner=Counting(pack_bytes=0)).wait()
    assert sorted(seen) == sorted(i.key for i in items)


def test_a_planner_that_detaches_nothing_stages_everything_on_the_host(tmp_path):
    class NoDetach(jaxckpt.DefaultSavePlanner):
        def detach(self, items):
            return jaxckpt.SavePlanner.detach(self, items)  # the protocol's default: {}

    m = mesh((4, 2), ("data", "model"))
    state = _sharded_state(m)
    expected = jax.tree.map(lambda x: np.array(x) if hasattr(x, "shape") else x, state)
    h = jaxckpt.save_async(tmp_path / "c", state, planner=NoDetach())
    clobber = jax.jit(lambda x: x * 0 - 7, donate_argnums=0)
    state["w"] = clobber(state["w"])
    h.wait()
    assert_tree_equal(jaxckpt.restore(tmp_path / "c"), expected)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_host_memory_stays_flat_over_50_async_saves(tmp_path):
    m = mesh((4, 2), ("data", "model"))
    big = np.random.default_rng(0).standard_normal((2048, 1024), dtype=np.float32)  # 8 MiB
    state = {"w": put(big, m, "data", "model"), "v": put(big[:1024], m, "data")}
    nbytes = big.nbytes * 3 // 2
    with jaxckpt.CheckpointManager(tmp_path, max_to_keep=1) as mgr:
        for s in range(5):  # warm up: plans cached, the staging buffer allocated
            mgr.save(s, state)
        mgr.wait()
        before = _rss()
        for s in range(5, 55):
            mgr.save(s, state)
        mgr.wait()
        after = _rss()
        assert _staging.POOL.free_bytes < 2 * nbytes  # one buffer, reused
    # Without reuse (or with a leak) 50 saves would add 50 x 12 MiB = 600 MiB.
    assert after - before < 4 * nbytes, (before >> 20, after >> 20)
    assert mgr.all_steps() == [54]
    assert_tree_equal(mgr.restore()["w"], big)


def test_one_save_in_flight_per_manager(tmp_path):
    m = mesh((4, 2), ("data", "model"))
    state = _sharded_state(m)
    mgr = jaxckpt.CheckpointManager(tmp_path)
    mgr.save(1, state)
    first = mgr.last_save
    mgr.save(2, state)
    assert first.done() and 1 in mgr.all_steps()  # save(2) waited for step 1's commit
    mgr.wait()
    assert mgr.all_steps() == [1, 2] and mgr.last_save.done()


def test_handle_reports_timings_bytes_and_throughput(tmp_path, caplog):
    m = mesh((4, 2), ("data", "model"))
    state = _sharded_state(m)
    caplog.set_level(logging.INFO, logger="jaxckpt")
    h = jaxckpt.save_async(tmp_path / "c", state)
    h.wait()
    assert h.done()
    assert set(h.timings) == {"plan", "stage", "write", "commit", "wait", "blocking", "total"}
    assert all(t >= 0 for t in h.timings.values())
    # 2 MiB sharded + the replicated array once (not 8 times) + the numpy leaf.
    assert h.nbytes == 512 * 1024 * 4 + 64 * 1024 * 4 + 4096 * 8
    assert h.gbps > 0
    assert any("saved" in r.getMessage() and "write" in r.getMessage() for r in caplog.records)

    with jaxckpt.CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(7, {"x": jnp.ones(1024)})
    assert any(
        "step 7 committed" in r.getMessage() and "GB/s" in r.getMessage() for r in caplog.records
    )


def test_a_program_that_exits_right_after_saving_still_commits(tmp_path):
    script = """
import sys, numpy as np, jaxckpt
mgr = jaxckpt.CheckpointManager(sys.argv[1])
mgr.save(1, {"w": np.arange(1 << 20, dtype=np.float32)})
h = jaxckpt.save_async(sys.argv[1] + "/plain", {"w": np.ones(1 << 20, np.float32)})
"""  # and returns at once: no wait(), no close()
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "JAX_PLATFORMS": "cpu",
    }
    subprocess.run([sys.executable, "-c", script, str(tmp_path)], env=env, check=True, timeout=120)
    assert jaxckpt.CheckpointManager(tmp_path).all_steps() == [1]
    assert jaxckpt.restore(tmp_path / "00000001")["w"][-1] == (1 << 20) - 1
    assert jaxckpt.restore(tmp_path / "plain")["w"].sum() == 1 << 20


def test_save_async_from_an_atexit_hook_commits_before_the_interpreter_ends(tmp_path):
    # By then Python has joined the save threads and takes no new work: the save runs at once.
    script = """
import atexit, sys, numpy as np, jaxckpt
def at_exit():
    jaxckpt.save_async(sys.argv[1] + "/c", {"w": np.ones(1 << 20, np.float32)})
    jaxckpt.CheckpointManager(sys.argv[1] + "/run").save(1, {"w": np.full(8, 2.0)})
atexit.register(at_exit)
"""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    subprocess.run([sys.executable, "-c", script, str(tmp_path)], env=env, check=True, timeout=120)
    assert jaxckpt.restore(tmp_path / "c")["w"].sum() == 1 << 20
    assert jaxckpt.CheckpointManager(tmp_path / "run").restore(1)["w"].sum() == 16
