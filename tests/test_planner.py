"""The save planner: dedup, balance, validation and the plan cache."""

import dataclasses
import math

import hypothesis
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import mesh, one_array_per_leaf, put  # noqa: F401 (autouse)
from hypothesis import strategies as st

import jaxckpt
from jaxckpt._format import plan as _plan
from jaxckpt._format.plan import WriteItem

M42 = mesh((4, 2), ("data", "model"))


def _state():
    rng = np.random.default_rng(0)
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    return {
        "replicated": put(f(64, 32), M42),
        "rows": put(f(64, 32), M42, "data", None),
        "cols": put(f(64, 32), M42, None, "model"),
        "grid": put(f(64, 32), M42, "data", "model"),
        "host": f(10, 3),
        "step": 5,
    }


def _chunk_payload_bytes(root) -> tuple[int, int]:
    """(bytes of chunk data under arrays/, number of chunk files) — checksums excluded."""
    arrays = root / "arrays"
    files = [p for p in arrays.rglob("*") if p.is_file() and "/c/" in f"/{p.relative_to(arrays)}"]
    return sum(p.stat().st_size for p in files) - 4 * len(files), len(files)


def test_replicated_data_is_written_once(tmp_path):
    state = _state()
    unique = sum(x.nbytes for x in state.values() if hasattr(x, "nbytes"))
    jaxckpt.save(tmp_path / "c", state)
    payload, nfiles = _chunk_payload_bytes(tmp_path / "c")
    assert payload == unique
    assert nfiles == 1 + 4 + 2 + 8 + 1  # one chunk per distinct shard


def _plan_for(tree, **kw):
    planner = jaxckpt.DefaultSavePlanner(enable_plan_caching=False, **kw)
    planner.set_up_planner(tree, process_index=0, process_count=1)
    return planner.create_global_plan()


def test_replicated_writes_are_balanced_across_devices():
    tree = {f"r{i}": put(np.zeros((32, 32), np.float32), M42) for i in range(16)}
    plan = _plan_for(tree)
    per_device: dict = {}
    for it in plan.items:
        per_device[it.device] = per_device.get(it.device, 0) + it.nbytes
    assert len(per_device) == 8 and len(set(per_device.values())) == 1  # 2 arrays each
    lowest = _plan_for(tree, dedup="lowest")
    assert {it.device for it in lowest.items} == {0}


def test_partially_replicated_boxes_go_to_distinct_replicas():
    tree = {"a": put(np.zeros((8, 4), np.float32), M42, "data", None)}
    plan = _plan_for(tree)
    assert len(plan.items) == 4
    # Each row is held by the 2 devices of one "data" index; the 4 rows go to 4 distinct
    # devices, 2 from each "model" column (balanced, not all to the first replica).
    writers = [it.device for it in plan.items]
    assert len(set(writers)) == 4
    columns = {int(d.id): c for c in range(2) for d in M42.devices[:, c]}
    assert sorted(columns[w] for w in writers) == [0, 0, 1, 1]


def _arrays(shape=(4, 4), chunks=(2, 2)):
    return {"w": (shape, "float32", chunks)}


def _grid_items():
    return [WriteItem("w", (i, j), (2, 2), "float32", 0, 0) for i in (0, 2) for j in (0, 2)]


def test_validation_accepts_an_exact_tiling():
    _plan.validate_plan(_grid_items(), _arrays())


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda items: items + [items[0]], "same chunk"),
        (lambda items: items[:-1], "gap"),
        (
            lambda items: [dataclasses.replace(items[0], offsets=(4, 0))] + items[1:],
            "out of bounds",
        ),
        (lambda items: [dataclasses.replace(items[0], dtype="int32")] + items[1:], "dtype int32"),
        (lambda items: [dataclasses.replace(items[0], offsets=(1, 0))] + items[1:], "not aligned"),
        (lambda items: items + [WriteItem("v", (0,), (1,), "float32", 0)], "not in the manifest"),
    ],
)
def test_validation_rejects_bad_plans_naming_the_key(mutate, message):
    with pytest.raises(jaxckpt.PlanValidationError, match=rf"key '[wv]'.*{message}"):
        _plan.validate_plan(mutate(_grid_items()), _arrays())


def test_validation_sweep_finds_overlap_of_multi_chunk_boxes():
    big = WriteItem("w", (0, 0), (4, 2), "float32", 0)
    items = [big, WriteItem("w", (2, 0), (2, 4), "float32", 0)]
    with pytest.raises(jaxckpt.PlanValidationError, match="overlap"):
        _plan.validate_plan(items, _arrays())
    ok = [big, WriteItem("w", (0, 2), (4, 2), "float32", 0)]
    _plan.validate_plan(ok, _arrays())


def test_validation_error_is_truncated():
    items = [WriteItem(f"k{i}", (0,), (9,), "float32", 0) for i in range(20)]
    arrays = {f"k{i}": ((4,), "float32", (4,)) for i in range(20)}
    with pytest.raises(jaxckpt.PlanValidationError, match=r"and 12 more") as e:
        _plan.validate_plan(items, arrays)
    assert len(str(e.value)) < 1200


def test_custom_planner_with_bad_global_plan_is_rejected_before_writing(tmp_path):
    class DropOne(jaxckpt.DefaultSavePlanner):
        def create_global_plan(self):
            plan = super().create_global_plan()
            a = plan.arrays[0]
            short = dataclasses.replace(
                a, offsets=a.offsets[1:], process=a.process[1:], device=a.device[1:]
            )
            return dataclasses.replace(plan, arrays=(short,))  # save() must catch it

    with pytest.raises(jaxckpt.PlanValidationError, match="key 'grid'.*gap"):
        jaxckpt.save(
            tmp_path / "c",
            {"grid": put(np.zeros((8, 4)), M42, "data", "model")},
            planner=DropOne(enable_plan_caching=False),
        )
    assert not (tmp_path / "c").exists()


def test_second_save_of_same_state_skips_planning(tmp_path):
    state = _state()
    jaxckpt.save(tmp_path / "a", state)
    before = jaxckpt.plan_cache_info()
    state["step"] = 6  # Python values change between saves; they are not part of the key
    state["grid"] = state["grid"] + 1
    jaxckpt.save(tmp_path / "b", state)
    after = jaxckpt.plan_cache_info()
    assert after.hits == before.hits + 1 and after.misses == before.misses
    back = jaxckpt.restore(tmp_path / "b")
    assert back["step"] == 6
    np.testing.assert_array_equal(back["grid"], state["grid"])
    # A different sharding is a different plan.
    state["grid"] = put(np.zeros((64, 32), np.float32), M42, "model", None)
    jaxckpt.save(tmp_path / "c", state)
    assert jaxckpt.plan_cache_info().misses == after.misses + 1


def test_large_shards_are_split_into_bounded_chunks(tmp_path):
    x = put(jnp.arange(64 * 1024, dtype=jnp.float32).reshape(64, 1024), M42, "data")
    planner = jaxckpt.DefaultSavePlanner(max_chunk_bytes=16 * 1024)
    jaxckpt.save(tmp_path / "c", {"x": x}, planner=planner)
    entry = jaxckpt.metadata(tmp_path / "c").entries["x"]
    assert entry.chunks == (4, 1024)  # 16 KiB chunks, 4 per shard
    np.testing.assert_array_equal(jaxckpt.restore(tmp_path / "c")["x"], x)


def test_chunk_shape_is_the_shard_halved_to_the_limit():
    assert _plan.chunk_shape((3, 5), 4, 1 << 20) == (3, 5)
    assert _plan.chunk_shape((64, 1024), 4, 16 * 1024) == (4, 1024)
    assert _plan.chunk_shape((0, 5), 4, 1 << 20) == (1, 5)
    assert _plan.chunk_boxes((4, 0), (4, 5), (2, 5)) == [((4, 0), (2, 5)), ((6, 0), (2, 5))]


def test_unreplicated_bytes_count_towards_the_balance():
    # A big array on device 0 alone: replicated arrays should then avoid device 0.
    import jax
    from jax.sharding import SingleDeviceSharding

    tree = {
        "big": jax.device_put(
            np.zeros((1024, 1024), np.float32), SingleDeviceSharding(jax.devices()[0])
        )
    }
    tree.update({f"r{i}": put(np.zeros((16, 16), np.float32), M42) for i in range(7)})
    plan = _plan_for(tree)
    replicated_writers = {it.device for it in plan.items if it.key != "big"}
    assert replicated_writers == {1, 2, 3, 4, 5, 6, 7}


def test_boxes_held_by_several_processes_get_a_chunk_per_process():
    # A chunk is the unit of a read; a box that h processes hold is restored by h processes
    # that share its reads, so it is cut into h chunks (down to SHARED_CHUNK_MIN_BYTES).
    from jax.sharding import PartitionSpec as P

    from jaxckpt._planning import global_plan as _global_plan
    from jaxckpt._planning import layout as _layout

    ids = np.arange(8).reshape(4, 2)  # 4 processes x 2 devices: mesh axis "a" is the process
    procs = ids // 2
    lay = lambda shape, spec: _layout.named_layout(shape, (4, 2), ("a", "b"), spec, ids, procs)  # noqa: E731
    limit = _global_plan.chunk_limit
    big = 64 << 20
    rep = lay((2048, 4096), P())  # 32 MiB, on every process
    assert limit(rep, 4, big) == 8 << 20
    assert _plan.chunk_shape(rep.box, 4, limit(rep, 4, big)) == (512, 4096)
    assert limit(rep, 4, 4 << 20) == 4 << 20  # max_chunk_bytes still bounds it
    fsdp = lay((2048, 4096), P("a"))  # a row block per process, replicated within one
    assert limit(fsdp, 4, big) == big
    tp = lay((2048, 4096), P(None, "b"))  # columns within a process, replicated across
    assert limit(tp, 4, big) == 4 << 20
    small = lay((512, 1024), P())  # 2 MiB over 4 processes: not below 1 MiB a chunk
    assert limit(small, 4, big) == _global_plan.SHARED_CHUNK_MIN_BYTES == 1 << 20
    one = _layout.named_layout((2048, 4096), (4, 2), ("a", "b"), P(), ids, np.zeros_like(ids))
    assert limit(one, 4, big) == big  # one process: nothing to share


def test_arrays_cut_for_shared_reads_stay_unpacked():
    # A packed array is read whole by every process that needs it, so the pack rule counts
    # shards: a replicated 4 MiB array cut into 1 MiB chunks for 4 processes' shared reads
    # stays unpacked under pack_bytes=1 MiB, while the same array in 512 KiB shards that one
    # process holds is packed (and a replicated one of at most pack_bytes still is).
    from jax.sharding import PartitionSpec as P

    from jaxckpt._format.manifest import ArrayEntry
    from jaxckpt._planning import global_plan as _global_plan
    from jaxckpt._planning import layout as _layout
    from jaxckpt._planning import packing as _pack

    ids = np.arange(8).reshape(4, 2)
    shape = (1024, 1024)  # 4 MiB of float32
    layouts = {
        "replicated": _layout.named_layout(shape, (4, 2), ("a", "b"), P(), ids, ids // 2),
        "sharded": _layout.named_layout(shape, (4, 2), ("a", "b"), P("a", "b"), ids, 0 * ids),
        "small": _layout.named_layout((512, 512), (4, 2), ("a", "b"), P(), ids, ids // 2),
    }
    entries = {}
    for key, lay in layouts.items():
        limit = _global_plan.chunk_limit(lay, 4, 64 << 20)
        chunks = _plan.chunk_shape(lay.box, 4, limit)
        entries[key] = ArrayEntry(key, lay.shape, "float32", "float32", chunks, f"arrays/{key}")
    assert entries["replicated"].chunks == (256, 1024)  # 1 MiB: a chunk per process
    packed, _ = _pack.plan_packs(
        entries, layouts, pack_bytes=1 << 20, max_chunk_bytes=64 << 20, taken=set()
    )
    assert sorted(packed) == ["sharded", "small"]


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(
    shape=st.lists(st.sampled_from([1, 3, 6, 64, 96, 1001, 1024, 4096]), min_size=1, max_size=4),
    procs=st.sampled_from([2, 3, 4, 8]),
    per=st.sampled_from([1, 2, 4]),
    max_chunk=st.sampled_from([1 << 20, 4 << 20, 64 << 20]),
)
def test_shared_reads_fall_on_the_chunks_the_save_cut(shape, procs, per, max_chunk):
    # Save and restore together: a replicated array saved on `procs` processes and restored
    # replicated on as many. Each process reads the chunks its share of the split dimension
    # overlaps (a chunk is read whole): about its share, and the array about once in all.
    from jax.sharding import PartitionSpec as P

    from jaxckpt._planning import global_plan as _global_plan
    from jaxckpt._planning import layout as _layout
    from jaxckpt._planning import shared_read as _shared_read

    shape = tuple(shape)
    ids = np.arange(procs * per).reshape(procs, per)
    lay = _layout.named_layout(shape, ids.shape, ("a", "b"), P(), ids, ids // per)
    total = math.prod(shape) * 4
    limit = _global_plan.chunk_limit(lay, 4, max_chunk)
    assert limit == min(max_chunk, max(total // procs, _global_plan.SHARED_CHUNK_MIN_BYTES))
    chunks = _plan.chunk_shape(lay.box, 4, limit)
    assert math.prod(chunks) * 4 <= limit or all(c % 2 for c in chunks)  # halved to the limit
    dim = _shared_read.shared_read_dim(shape, chunks, procs * per)
    if dim is None:  # not shared: each process reads what it needs (the table test below)
        return
    across = total // shape[dim]  # bytes of one index along dim (the slab spans the others)
    c, share, read = chunks[dim], shape[dim] // procs, []
    for p in range(procs):
        lo, hi = p * share // c * c, min(-(-(p + 1) * share // c) * c, shape[dim])
        read.append((hi - lo) * across)  # the whole chunks the share overlaps
    chunk = c * across
    assert sum(read) <= total + (procs - 1) * chunk, (read, total, chunks)
    assert max(read) <= total // procs + 2 * chunk, (read, total, chunks)
    if procs != 3 and c * procs <= shape[dim]:  # chunks no larger than a share: exactly once
        assert sum(read) == total and len(set(read)) == 1, (read, total, chunks)


@pytest.mark.parametrize(
    "shape, chunks, n, dim",
    [
        ((64, 64), (16, 64), 8, 0),
        ((64, 64), (64, 16), 8, 1),  # cut along columns: read along columns
        ((3, 3, 256, 512), (3, 3, 64, 512), 16, 2),  # a conv kernel
        ((1001, 1024), (1001, 256), 16, 1),  # a vocabulary the devices do not divide
        ((64, 64), (64, 64), 8, None),  # one chunk: every process reads it whole anyway
        ((1001, 64), (143, 64), 8, None),  # no dimension of several chunks divides
        ((0, 64), (1, 64), 8, None),
    ],
)
def test_shared_reads_split_a_dimension_of_several_chunks(shape, chunks, n, dim):
    from jaxckpt._planning import shared_read as _shared_read

    assert _shared_read.shared_read_dim(shape, chunks, n) == dim


def test_the_simulated_job_benchmark_still_plans():
    # benchmarks/_plan_bench.py drives the real planner with stand-in devices and arrays; it
    # broke once unnoticed when the planner began asking leaves is_deleted(). 16 processes x 8
    # devices, 30 arrays (this module saves without packs: one_array_per_leaf).
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "benchmarks"))
    try:
        import _plan_bench
    finally:
        sys.path.pop(0)
    got = _plan_bench.run(processes=16, arrays=30)
    assert got["boxes"] == 20 * 16 * 8 + 10  # 128 shards of each sharded array, 10 replicated
    # process 0 writes its 8 shards of each sharded array, and its few of the replicated ones
    assert 20 * 8 <= got["local_items"] <= 20 * 8 + 2, got
