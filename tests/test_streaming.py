"""Streaming restore: boxes go to their devices as they are read, inside a host budget."""

import jax
import numpy as np
import pytest
from helpers import assert_tree_equal, mesh, put
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt

M42 = mesh((4, 2), ("data", "model"))


class Watching(jaxckpt.DefaultLoadPlanner):
    """Records the host bytes it holds after each box it is given."""

    def set_up_planner(self, *args, **kwargs):
        super().set_up_planner(*args, **kwargs)
        self.held = []

    def commit_tensor(self, item, array):
        super().commit_tensor(item, array)
        self.held.append(self.host_bytes)


@pytest.fixture
def big(tmp_path):
    # 8 arrays of 256 KiB, each sharded into 8 boxes of 32 KiB.
    rng = np.random.default_rng(0)
    state = {f"w{i}": put(rng.standard_normal((256, 256)).astype(np.float32), M42, "data", "model")
             for i in range(8)}  # fmt: skip
    jaxckpt.save(tmp_path / "c", state)
    return tmp_path / "c", state


def test_restore_holds_at_most_its_budget_and_places_as_it_reads(big):
    path, state = big
    budget = 256 << 10  # a eighth of the state
    planner = Watching(max_host_bytes=budget)
    target = jax.tree_util.tree_map(lambda x: x.sharding, state)
    back = jaxckpt.restore(path, target, planner=planner)
    assert_tree_equal(jax.device_get(back), jax.device_get(state))
    assert len(planner.held) == 64
    assert planner.read_ahead_bytes == budget // 4  # storage's share (its reads in flight)
    assert max(planner.held) <= budget // 4  # boxes queued for or in transfer to devices
    assert planner.placement.peak_bytes <= budget // 4
    assert planner.placement.groups >= 8  # placed along the way, not all at the end
    assert all(b.sharding == target[k] for k, b in back.items())


def test_small_replicated_leaves_go_in_one_batched_put(tmp_path):
    state = {f"p{i}": put(np.full(64, i, np.float32), M42) for i in range(300)}
    jaxckpt.save(tmp_path / "c", state)
    planner = Watching()
    back = jaxckpt.restore(tmp_path / "c", state, planner=planner)
    assert planner.placement.groups == 1
    assert_tree_equal(jax.device_get(back), jax.device_get(state))


def test_a_box_larger_than_the_budget_is_still_restored(big):
    path, state = big
    planner = Watching(max_host_bytes=1024)  # smaller than any box
    target = {k: NamedSharding(M42, P()) for k in state}  # whole 256 KiB arrays
    back = jaxckpt.restore(path, target, planner=planner)
    assert_tree_equal(jax.device_get(back), jax.device_get(state))
    assert max(planner.held) <= 256 * 256 * 4  # one box at a time


def test_budget_must_be_positive():
    with pytest.raises(ValueError, match=r"max_host_bytes must be a positive number of bytes"):
        jaxckpt.DefaultLoadPlanner(max_host_bytes=0)


class KeepAll(jaxckpt.LoadPlanner):
    """A planner written against the protocol alone: keeps every box for finish()."""

    def set_up_planner(self, target, manifest, *, keys=None, strict=True):
        self.inner = jaxckpt.DefaultLoadPlanner()
        self.inner.set_up_planner(target, manifest, keys=keys, strict=strict)
        self.boxes = []

    def create_local_plan(self):
        return self.inner.create_local_plan()

    def commit_tensor(self, item, array):
        self.boxes.append((item, array))

    def finish(self):
        for item, array in self.boxes:
            self.inner.commit_tensor(item, self.inner.transform_tensor(item, array))
        return self.inner.finish()


def test_a_planner_that_keeps_boxes_until_finish_still_works(big):
    path, state = big
    back = jaxckpt.restore(
        path, jax.tree_util.tree_map(lambda x: x.sharding, state), planner=KeepAll()
    )
    assert_tree_equal(jax.device_get(back), jax.device_get(state))
