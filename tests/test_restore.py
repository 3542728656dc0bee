"""Restores onto other meshes, specs, device subsets, numpy; keys=, strict, casting."""

import tempfile
from pathlib import Path

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_equal, mesh, one_array_per_leaf, put, x64  # noqa: F401 (autouse)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt._format.plan import ReadItem

M42 = mesh((4, 2), ("data", "model"))


@pytest.fixture
def saved(tmp_path):
    rng = np.random.default_rng(0)
    state = {
        "params": {
            "w": put(rng.standard_normal((16, 8)).astype(np.float32), M42, "data", "model"),
            "b": put(rng.standard_normal((8,)).astype(np.float32), M42, "model"),
        },
        "opt": [put(rng.standard_normal((16, 8)).astype(np.float32), M42, "data", None), 3],
    }
    jaxckpt.save(tmp_path / "c", state)
    return tmp_path / "c", state


TARGETS = {
    "(2,4)": lambda: mesh((2, 4), ("a", "b")),
    "(8,)": lambda: mesh((8,), ("a",)),
    "(1,)": lambda: mesh((1,), ("a",)),
    "subset(2,)": lambda: mesh((2,), ("a",), jax.devices()[6:8]),
}


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_restore_onto_other_mesh(saved, name):
    path, state = saved
    m = TARGETS[name]()
    a = m.axis_names[0]
    b = m.axis_names[1] if len(m.axis_names) > 1 else None
    target = {
        "params": {"w": NamedSharding(m, P(b, a)), "b": NamedSharding(m, P(a))},
        "opt": [NamedSharding(m, P()), None],
    }
    back = jaxckpt.restore(path, target)
    for got, spec in [(back["params"]["w"], P(b, a)), (back["opt"][0], P())]:
        assert got.sharding == NamedSharding(m, spec)
    assert_tree_equal(jax.device_get(back), jax.device_get(state))


def test_restore_with_shape_dtype_struct_and_numpy(saved):
    path, state = saved
    m = mesh((2, 4), ("a", "b"))
    sds = jax.ShapeDtypeStruct((16, 8), jnp.float32, sharding=NamedSharding(m, P("b")))
    back = jaxckpt.restore(path, {"params": {"w": sds, "b": None}, "opt": [None, None]})
    assert back["params"]["w"].sharding == sds.sharding
    assert isinstance(back["params"]["b"], np.ndarray) and back["opt"][1] == 3
    assert_tree_equal(back["params"]["w"], state["params"]["w"])


def test_keys_selects_subset_by_prefix(saved):
    path, state = saved
    back = jaxckpt.restore(path, keys=["params"])
    assert set(back) == {"params"} and set(back["params"]) == {"w", "b"}
    back = jaxckpt.restore(path, keys=["opt/1"])
    assert back == {"opt": {"1": 3}}  # a partly restored list becomes a dict of its parts
    target = {"params": {"w": state["params"]["w"]}}
    back = jaxckpt.restore(path, target, keys=["params/w"])
    assert_tree_equal(back, target)
    with pytest.raises(jaxckpt.KeyMismatchError, match=r"keys=\['nope'\] match no key.*inspect"):
        jaxckpt.restore(path, keys=["nope"])


def test_strict_names_missing_and_unexpected_keys(saved):
    path, state = saved
    target = {"params": {"w": state["params"]["w"], "extra": jnp.ones(2)}}
    with pytest.raises(jaxckpt.KeyMismatchError, match=r"params/extra.*params/b.*strict=False"):
        jaxckpt.restore(path, target)
    back = jaxckpt.restore(path, target, strict=False)
    assert_tree_equal(back["params"]["w"], state["params"]["w"])
    assert back["params"]["extra"] is target["params"]["extra"]  # kept as given


def test_shape_and_dtype_mismatch_name_the_key(saved):
    path, state = saved
    bad = {"params": {"w": jnp.zeros((8, 8)), "b": None}, "opt": [None, None]}
    with pytest.raises(jaxckpt.ShapeMismatchError, match=r"'params/w'.*\(8, 8\).*\(16, 8\)"):
        jaxckpt.restore(path, bad)
    bf = jax.ShapeDtypeStruct((16, 8), jnp.bfloat16, sharding=state["params"]["w"].sharding)
    bad = {"params": {"w": bf, "b": None}, "opt": [None, None]}
    with pytest.raises(
        jaxckpt.DtypeMismatchError, match=r"'params/w'.*bfloat16.*float32.*allow_dtype_cast"
    ):
        jaxckpt.restore(path, bad)
    back = jaxckpt.restore(path, bad, planner=jaxckpt.DefaultLoadPlanner(allow_dtype_cast=True))
    assert back["params"]["w"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(back["params"]["w"], state["params"]["w"].astype(jnp.bfloat16))


def test_array_target_for_a_saved_value_is_an_error(saved):
    path, _ = saved
    with pytest.raises(jaxckpt.ShapeMismatchError, match=r"'opt/1'.*\(2,\).*Python value"):
        jaxckpt.restore(path, {"opt": [None, jnp.zeros(2)]}, keys=["opt"])
    # A scalar array target takes a saved number of its kind (below); across kinds it names
    # both and the fix, as for arrays.
    with pytest.raises(
        jaxckpt.DtypeMismatchError,
        match=r"'opt/1'.*int 3.*dtype float32.*not an integer.*allow_dtype_cast",
    ):
        jaxckpt.restore(path, {"opt": [None, jnp.zeros(())]}, keys=["opt"])


def _file_bytes_read() -> int:
    from jaxckpt._storage import reader as _reader

    return _reader.file_bytes_read()


def test_restore_reads_only_overlapping_chunks(tmp_path):
    # 8 row-chunks of 2x64 float32 (512 B each); a target shard needs rows 4..5 only.
    x = put(np.arange(16 * 64, dtype=np.float32).reshape(16, 64), mesh((8,), ("x",)), "x")
    jaxckpt.save(tmp_path / "c", {"x": x})
    assert jaxckpt.metadata(tmp_path / "c").entries["x"].chunks == (2, 64)
    dev = jax.devices()[2]
    before = _file_bytes_read()
    part = jaxckpt.restore(tmp_path / "c", {"x": SingleDeviceSharding(dev)})  # whole array
    whole = _file_bytes_read() - before
    assert whole >= 16 * 64 * 4
    m = mesh((8,), ("x",))
    before = _file_bytes_read()
    one = jax.sharding.NamedSharding(m, P("x"))
    # Restore onto a mesh where this host holds all 8 shards: each chunk read exactly once.
    part = jaxckpt.restore(tmp_path / "c", {"x": one})
    assert _file_bytes_read() - before == whole
    np.testing.assert_array_equal(part["x"], x)
    # A one-shard read (a ReadItem of the planner protocol) touches only that shard's chunk.
    from jaxckpt._storage import location as _location
    from jaxckpt._storage import reader as _reader

    item = ReadItem("x", (4, 0), (2, 64), (dev.id,))

    before = _file_bytes_read()
    reader = _reader.CheckpointReader(_location.Location(tmp_path / "c"))
    [(_, data)] = list(reader.read(jaxckpt.metadata(tmp_path / "c").entries, [item]))
    read = _file_bytes_read() - before
    assert read < whole / 4, (read, whole)  # one of eight chunks (plus metadata)
    np.testing.assert_array_equal(data, np.asarray(x)[4:6])


def test_small_arrays_are_read_whole_and_big_ones_per_shard(tmp_path):
    # A small array all on this host is one read and one put (its 8 shards cost more as 8
    # puts); a big one is read per shard box, each box placed as it is.
    m = mesh((8,), ("x",))
    small = put(np.arange(8 * 64, dtype=np.float32).reshape(8, 64), m, "x")
    big = put(np.arange(8 * 65536, dtype=np.float32).reshape(8, 65536), m, "x")  # 2 MiB
    jaxckpt.save(tmp_path / "c", {"small": small, "big": big})
    target = {"small": small.sharding, "big": big.sharding}
    planner = jaxckpt.DefaultLoadPlanner()
    planner.set_up_planner(target, jaxckpt.metadata(tmp_path / "c"))
    items = planner.create_local_plan().items
    assert [(i.offsets, i.sizes) for i in items if i.key == "small"] == [((0, 0), (8, 64))]
    assert sorted(i.offsets for i in items if i.key == "big") == [(r, 0) for r in range(8)]
    out = jaxckpt.restore(tmp_path / "c", target)
    for k, want in (("small", small), ("big", big)):
        assert out[k].sharding == want.sharding
        for a, b in zip(out[k].addressable_shards, want.addressable_shards):
            assert a.device == b.device and a.index == b.index
            np.testing.assert_array_equal(a.data, b.data)


def test_restore_reads_each_distinct_region_once_per_host(tmp_path):
    # Fully replicated target over 8 devices: one read, placed on all 8 devices.
    x = put(np.arange(64, dtype=np.float32).reshape(8, 8), M42, "data", "model")
    jaxckpt.save(tmp_path / "c", {"x": x})
    planner = jaxckpt.DefaultLoadPlanner()
    planner.set_up_planner({"x": NamedSharding(M42, P())}, jaxckpt.metadata(tmp_path / "c"))
    plan = planner.create_local_plan()
    assert len(plan.items) == 1 and len(plan.items[0].devices) == 8


def test_uncommitted_target_leaves_come_back_uncommitted(tmp_path):
    # optax's step count starts as an uncommitted jnp.zeros: restoring it committed to one
    # device would make jit refuse to mix it with arrays on the mesh.
    count = jnp.zeros((), jnp.int32) + 5
    assert not count.committed
    w = put(np.ones((8, 4), np.float32), M42, "data")
    jaxckpt.save(tmp_path / "c", {"count": count, "w": w})
    back = jaxckpt.restore(tmp_path / "c", {"count": count, "w": w})
    assert not back["count"].committed and int(back["count"]) == 5
    assert back["w"].committed
    out = jax.jit(lambda c, x: x * c)(back["count"], back["w"])  # mixes fine with the mesh
    np.testing.assert_array_equal(out, np.full((8, 4), 5.0))


def test_keys_with_a_target_lacking_them_reports_missing_not_a_bad_checkpoint(saved):
    path, state = saved
    target = {"opt": [None, None]}
    with pytest.raises(
        jaxckpt.KeyMismatchError, match=r"not in `target`: \['params/b', 'params/w'\]"
    ):
        jaxckpt.restore(path, target, keys=["params"])
    back = jaxckpt.restore(path, target, keys=["params"], strict=False)
    assert back == target  # nothing selected in the target: returned unchanged


def test_eval_shape_targets_restore_as_jax_arrays_python_step_included(tmp_path):
    # The usual way to build a target: jax.eval_shape of the init. Its ShapeDtypeStructs have
    # no sharding (-> jax.Arrays on the default device, not numpy), and TrainState.step is a
    # Python 0 before the first jitted step, whose eval_shape is a weak int32 scalar (31.6).
    import optax
    from flax.training import train_state

    def init():
        params = {"w": jnp.ones((4, 2)), "b": jnp.zeros(2)}
        return train_state.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-2))

    state = init()
    assert state.step == 0 and isinstance(state.step, int)
    jaxckpt.save(tmp_path / "c", state)
    target = jax.eval_shape(init)
    back = jaxckpt.restore(tmp_path / "c", target)
    for leaf in jax.tree.leaves(back):
        assert isinstance(leaf, jax.Array) and leaf.devices() == {jax.devices()[0]}
    assert back.step.shape == () and back.step.dtype == jnp.int32 and back.step.weak_type
    assert int(back.step) == 0 and type(back.tx) is type(state.tx)
    np.testing.assert_array_equal(back.params["w"], np.ones((4, 2)))
    grads = jax.tree.map(jnp.ones_like, back.params)
    stepped = jax.jit(lambda s, g: s.apply_gradients(grads=g))(back, grads)
    assert int(stepped.step) == 1
    # Onto a sharding, and into other integer dtypes that hold the value.
    s = NamedSharding(M42, P())
    sds = jax.ShapeDtypeStruct((), jnp.int16, sharding=s)
    got = jaxckpt.restore(tmp_path / "c", {"step": sds}, keys=["step"], strict=False)["step"]
    assert got.sharding == s and got.dtype == jnp.int16 and int(got) == 0


def test_multi_process_restore_of_a_saved_value_into_a_sharded_scalar(tmp_path, monkeypatch):
    # With several processes, a restore shares the reads of boxes that devices of several
    # processes need. A saved Python value has no box: restored into a sharded scalar target
    # (an eval_shape'd step with a sharding) it once reached read_sharding, an AttributeError.
    jaxckpt.save(tmp_path / "c", {"step": 7, "w": np.arange(8.0, dtype=np.float32)})
    manifest = jaxckpt.metadata(tmp_path / "c")
    s = SingleDeviceSharding(jax.devices()[0])
    target = {"step": jax.ShapeDtypeStruct((), jnp.int32, sharding=s), "w": s}
    monkeypatch.setattr(jax, "process_count", lambda backend=None: 2)
    planner = jaxckpt.DefaultLoadPlanner()
    planner.set_up_planner(target, manifest)
    assert planner.wants["step"] == (np.dtype(np.int32), s)


def test_saved_scalars_into_scalar_targets_need_a_compatible_dtype(tmp_path):
    jaxckpt.save(tmp_path / "c", {"n": 300, "flag": True, "lr": 0.5})
    i8 = jax.ShapeDtypeStruct((), jnp.int8)
    with pytest.raises(jaxckpt.DtypeMismatchError, match=r"'n'.*300 does not fit in int8"):
        jaxckpt.restore(tmp_path / "c", {"n": i8, "flag": None, "lr": None})
    f32 = jax.ShapeDtypeStruct((), jnp.float32)
    with pytest.raises(jaxckpt.DtypeMismatchError, match=r"'flag'.*float32 is not bool.*cast"):
        jaxckpt.restore(tmp_path / "c", {"n": None, "flag": f32, "lr": f32})
    cast = jaxckpt.DefaultLoadPlanner(allow_dtype_cast=True)
    back = jaxckpt.restore(
        tmp_path / "c", {"n": f32, "flag": f32, "lr": np.zeros((), np.float16)}, planner=cast
    )
    assert float(back["n"]) == 300.0 and float(back["flag"]) == 1.0
    assert isinstance(back["lr"], np.ndarray) and back["lr"].dtype == np.float16  # numpy target


BIG = {"a": np.array([1099511627783, -3], np.int64), "f": np.array([1e300, 2.0])}
X64_FIX = r"jax_enable_x64.*jax\.config\.update.*allow_dtype_cast=True"


def test_64_bit_arrays_onto_devices_without_x64_are_an_error_not_truncated(tmp_path):
    # With x64 off (jax's default) jax has no 64-bit arrays: placing these would give int32
    # [7, -3] and float32 [inf, 2.] with no word. The targets that take the saved dtype (a bare
    # Sharding) or ask for a 64-bit one (a ShapeDtypeStruct) are refused, naming the fix.
    jaxckpt.save(tmp_path / "c", BIG)
    s = SingleDeviceSharding(jax.devices()[1])
    with pytest.raises(jaxckpt.DtypeMismatchError, match=rf"'a'.*int64.*int32.*{X64_FIX}"):
        jaxckpt.restore(tmp_path / "c", {"a": s, "f": None})
    with pytest.raises(jaxckpt.DtypeMismatchError, match=rf"'f'.*float64.*float32.*{X64_FIX}"):
        jaxckpt.restore(tmp_path / "c", {"a": None, "f": s})
    for sharding in (s, None):  # None: a plain jax.eval_shape leaf, put on the default device
        sds = jax.ShapeDtypeStruct((2,), np.int64, sharding=sharding)
        with pytest.raises(jaxckpt.DtypeMismatchError, match=rf"'a'.*int64.*int32.*{X64_FIX}"):
            jaxckpt.restore(tmp_path / "c", {"a": sds, "f": None})
    # Host targets keep the saved dtype: None, a numpy array, a Python scalar.
    for target in (None, {"a": np.zeros(2, np.int64), "f": 0.0}):
        back = jaxckpt.restore(tmp_path / "c", target)
        for k in BIG:
            assert isinstance(back[k], np.ndarray) and back[k].dtype == BIG[k].dtype
            np.testing.assert_array_equal(back[k], BIG[k])


def test_32_bit_array_target_for_64_bit_data_names_jax_enable_x64(tmp_path):
    # jnp.zeros(2, jnp.int64) is int32 when x64 is off: an ordinary dtype mismatch, whose
    # usual cause is that flag.
    jaxckpt.save(tmp_path / "c", BIG)
    target = {"a": jnp.zeros(2, jnp.int32), "f": None}
    with pytest.raises(
        jaxckpt.DtypeMismatchError, match=r"'a'.*int32.*int64.*allow_dtype_cast.*jax_enable_x64"
    ):
        jaxckpt.restore(tmp_path / "c", target)


def test_64_bit_arrays_cast_when_asked_and_exact_with_x64(tmp_path):
    jaxckpt.save(tmp_path / "c", {"a": BIG["a"], "f": np.array([1.5, -2.0])})
    s = SingleDeviceSharding(jax.devices()[0])
    cast = jaxckpt.DefaultLoadPlanner(allow_dtype_cast=True)
    back = jaxckpt.restore(tmp_path / "c", {"a": s, "f": s}, planner=cast)
    assert back["a"].dtype == jnp.int32 and back["f"].dtype == jnp.float32
    assert back["a"].tolist() == [7, -3] and back["f"].tolist() == [1.5, -2.0]  # as asked
    with x64():
        sds = jax.ShapeDtypeStruct((2,), np.int64, sharding=s)
        back = jaxckpt.restore(tmp_path / "c", {"a": sds, "f": s})
        assert back["a"].dtype == jnp.int64 and back["f"].dtype == jnp.float64
        assert back["a"].tolist() == BIG["a"].tolist() and back["f"].tolist() == [1.5, -2.0]


def test_saved_python_numbers_into_64_bit_scalar_targets_follow_the_same_rule(tmp_path):
    jaxckpt.save(tmp_path / "c", {"n": 2**40 + 7, "lr": 0.1})
    i64 = jax.ShapeDtypeStruct((), np.int64, sharding=SingleDeviceSharding(jax.devices()[0]))
    f64 = jax.ShapeDtypeStruct((), np.float64)
    with pytest.raises(jaxckpt.DtypeMismatchError, match=rf"'n'.*int64.*int32.*{X64_FIX}"):
        jaxckpt.restore(tmp_path / "c", {"n": i64, "lr": None})
    with pytest.raises(jaxckpt.DtypeMismatchError, match=rf"'lr'.*float64.*float32.*{X64_FIX}"):
        jaxckpt.restore(tmp_path / "c", {"n": None, "lr": f64})
    cast = jaxckpt.DefaultLoadPlanner(allow_dtype_cast=True)
    with pytest.raises(jaxckpt.DtypeMismatchError, match=r"'n'.*does not fit in int32"):
        jaxckpt.restore(tmp_path / "c", {"n": i64, "lr": f64}, planner=cast)
    back = jaxckpt.restore(tmp_path / "c", {"n": None, "lr": f64}, planner=cast)
    assert back["lr"].dtype == jnp.float32 and float(back["lr"]) == np.float32(0.1)
    with x64():
        back = jaxckpt.restore(tmp_path / "c", {"n": i64, "lr": f64})
        assert back["n"].dtype == jnp.int64 and int(back["n"]) == 2**40 + 7
        assert back["lr"].dtype == jnp.float64 and float(back["lr"]) == 0.1


WIDE = ["int64", "uint64", "float64", "complex128"]


@settings(
    max_examples=24, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    values=hnp.arrays(st.sampled_from(WIDE).map(np.dtype), st.integers(1, 5)),  # NaN, inf too
    kind=st.sampled_from(["sharding", "sds", "eval_shape"]),
)
def test_64_bit_dtypes_raise_cast_or_restore_exactly(tmp_path, values, kind):
    # Whenever x64 canonicalisation would change the dtype jax places: an error by default, a
    # numpy cast when asked, and the exact values with x64 on.
    path = Path(tempfile.mkdtemp(dir=tmp_path)) / "c"  # hypothesis reuses tmp_path
    jaxckpt.save(path, {"x": values})
    s = NamedSharding(M42, P())

    def target():
        if kind == "sharding":
            return {"x": s}
        sharding = s if kind == "sds" else None  # None: as jax.eval_shape makes them
        return {"x": jax.ShapeDtypeStruct(values.shape, values.dtype, sharding=sharding)}

    placed = np.dtype(jax.dtypes.canonicalize_dtype(values.dtype))
    name = values.dtype.name
    with pytest.raises(jaxckpt.DtypeMismatchError, match=rf"'x'.*{name}.*{placed.name}.*{X64_FIX}"):
        jaxckpt.restore(path, target())
    cast = jaxckpt.DefaultLoadPlanner(allow_dtype_cast=True)
    with np.errstate(over="ignore", invalid="ignore"):  # 1e300 -> inf: the cast asked for
        back = jaxckpt.restore(path, target(), planner=cast)["x"]
        want = values.astype(placed)
    assert back.dtype == placed and np.asarray(back).tobytes() == want.tobytes()
    with x64():
        back = jaxckpt.restore(path, target())["x"]
        assert back.dtype == values.dtype and np.asarray(back).tobytes() == values.tobytes()
