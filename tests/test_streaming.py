"""Streaming restore: boxes go to their devices as they are read, inside a host budget."""

import jax
import jax.numpy as jnp
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


def _saved(path, name: str, n: int, shape: tuple[int, int], seed: int):
    """``n`` random float32 arrays of ``shape`` on M42 (8 boxes each), saved at ``path``."""
    rng = np.random.default_rng(seed)
    state = {
        f"{name}{i}": put(rng.standard_normal(shape).astype(np.float32), M42, "data", "model")
        for i in range(n)
    }
    jaxckpt.save(path, state)
    return path, state


@pytest.fixture
def big(tmp_path):
    return _saved(tmp_path / "c", "w", 8, (256, 256), 0)  # 256 KiB arrays, boxes of 32 KiB


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
    assert not planner.placement.whole  # above half its budget: each box placed alone


M24 = mesh((2, 4), ("data", "model"))


@pytest.fixture
def mid(tmp_path):
    # 2 MiB arrays: above the size read whole and put in one call (1 MiB).
    return _saved(tmp_path / "c", "m", 4, (1024, 512), 1)


@pytest.mark.parametrize("budget", [None, 16 << 20])
def test_an_array_within_half_the_budget_is_made_in_one_call(mid, budget):
    # 16 MiB: 4 MiB for placement in groups of 1 MiB, so each array's 8 boxes of 256 KiB
    # span two groups; the first group waits for the rest.
    path, state = mid
    planner = Watching() if budget is None else Watching(max_host_bytes=budget)
    target = {k: NamedSharding(M24, P("model", "data")) for k in state}  # resharded too
    back = jaxckpt.restore(path, target, planner=planner)
    assert_tree_equal(jax.device_get(back), jax.device_get(state))
    assert all(b.sharding == target[k] for k, b in back.items())
    assert planner.placement.whole == set(state)
    if budget is not None:
        assert max(planner.held) <= budget // 4
        assert planner.placement.groups >= 4  # one per array: placed along the way


def test_a_cast_array_is_made_in_one_call_too(mid):
    path, state = mid
    planner = jaxckpt.DefaultLoadPlanner(allow_dtype_cast=True)
    target = {
        k: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16, sharding=x.sharding)
        for k, x in state.items()
    }
    back = jaxckpt.restore(path, target, planner=planner)
    assert planner.placement.whole == set(state)
    for k, b in back.items():
        assert b.dtype == jnp.bfloat16 and b.sharding == state[k].sharding
        np.testing.assert_array_equal(np.asarray(b), np.asarray(state[k]).astype(jnp.bfloat16))


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
