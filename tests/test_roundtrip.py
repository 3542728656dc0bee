"""Save -> restore is bit-exact for every sharding pattern, dtype and leaf kind."""

import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import assert_tree_equal, mesh, put
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt._runtime.pools import settle

M42 = mesh((4, 2), ("data", "model"))


def _x(shape, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) * 100).astype(dtype)


SHARDINGS = {
    "replicated": lambda: put(_x((8, 6)), M42),
    "1d": lambda: put(_x((16,)), mesh((8,), ("x",)), "x"),
    "2d": lambda: put(_x((8, 6)), M42, "data", "model"),
    "partially_replicated": lambda: put(_x((8, 6)), M42, "data", None),
    "transposed": lambda: put(_x((6, 8)), M42, "model", "data"),
    "both_axes_one_dim": lambda: put(_x((16, 3)), M42, ("data", "model"), None),
    "single_device": lambda: jax.device_put(_x((5, 7)), SingleDeviceSharding(jax.devices()[3])),
    "uneven_unsharded_dim": lambda: put(_x((12, 7)), M42, "data", None),
    "subset_of_devices": lambda: put(_x((4, 4)), mesh((2,), ("x",), jax.devices()[5:7]), "x"),
    "zero_d": lambda: put(np.float32(3.5), M42),
    "zero_size": lambda: put(np.zeros((0, 4), np.float32), M42, None, "model"),
}


@pytest.mark.parametrize("name", sorted(SHARDINGS))
def test_round_trip_every_sharding(tmp_path, name):
    x = SHARDINGS[name]()
    jaxckpt.save(tmp_path / "c", {"x": x})
    back = jaxckpt.restore(tmp_path / "c", {"x": x})["x"]
    assert back.sharding == x.sharding
    assert_tree_equal(back, x)
    host = jaxckpt.restore(tmp_path / "c")["x"]
    assert isinstance(host, np.ndarray)
    assert_tree_equal(host, np.asarray(x))


DTYPES = (
    "float32 float64 float16 bfloat16 float8_e4m3fn float8_e5m2 float8_e4m3fnuz float8_e5m2fnuz "
    "float8_e4m3b11fnuz int4 uint4 int8 int16 int32 int64 uint8 uint16 uint32 uint64 bool "
    "complex64 complex128"
).split()


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype_bit_exact(tmp_path, dtype):
    jax.config.update("jax_enable_x64", True)
    try:
        np_dtype = np.dtype(getattr(ml_dtypes, dtype, None) or dtype)
        raw = np.random.default_rng(1).integers(
            0, 256, size=8 * 4 * np_dtype.itemsize, dtype=np.uint8
        )
        if dtype == "bool":
            host = raw[: 8 * 4].astype(bool).reshape(8, 4)
        elif dtype in ("int4", "uint4"):
            lo, hi = (-8, 8) if dtype == "int4" else (0, 16)
            host = np.random.default_rng(2).integers(lo, hi, size=(8, 4)).astype(np_dtype)
        else:  # random bit patterns, NaNs included
            host = raw.view(np_dtype).reshape(8, 4)
        x = put(host, M42, "data", "model")
        jaxckpt.save(tmp_path / "c", {"x": x, "n": host})
        back = jaxckpt.restore(tmp_path / "c", {"x": x, "n": None})
        assert back["x"].dtype == x.dtype
        assert np.asarray(back["x"]).tobytes() == np.asarray(x).tobytes()
        assert back["n"].dtype == host.dtype and back["n"].tobytes() == host.tobytes()
        assert jaxckpt.metadata(tmp_path / "c").entries["x"].dtype == dtype
    finally:
        jax.config.update("jax_enable_x64", False)


def test_python_values_none_and_containers(tmp_path):
    tree = {
        "step": 12,
        "lr": 0.1,
        "nan": float("nan"),
        "inf": float("-inf"),
        "flag": True,
        "name": "run-7",
        "nothing": None,
        "seq": [1, (2.5, "x"), []],
        "empty": {},
        "np": np.arange(5, dtype=np.int16),
        "np_scalar": np.float32(2.0),
    }
    jaxckpt.save(tmp_path / "c", tree)
    back = jaxckpt.restore(tmp_path / "c")
    assert back["seq"] == [1, (2.5, "x"), []] and back["empty"] == {}
    assert back["nothing"] is None and back["flag"] is True and back["step"] == 12
    assert np.isnan(back["nan"]) and back["inf"] == float("-inf")
    assert_tree_equal(back["np"], tree["np"])
    assert back["np_scalar"].shape == () and back["np_scalar"] == 2.0


def test_prng_keys_round_trip(tmp_path):
    k = jax.random.key(42)
    ks = jax.random.split(jax.random.key(1), 8)
    ks = jax.device_put(ks, NamedSharding(M42, P("data")))
    jaxckpt.save(tmp_path / "c", {"k": k, "ks": ks})
    back = jaxckpt.restore(tmp_path / "c", {"k": k, "ks": ks})
    assert back["ks"].sharding == ks.sharding
    assert_tree_equal(back, {"k": k, "ks": ks})
    host = jaxckpt.restore(tmp_path / "c")
    assert jax.random.key_impl(host["k"]) == jax.random.key_impl(k)
    assert np.array_equal(jax.random.key_data(host["ks"]), jax.random.key_data(ks))
    # The restored key draws the same numbers.
    assert np.array_equal(jax.random.normal(host["k"], (3,)), jax.random.normal(k, (3,)))


def test_namedtuples_and_custom_nodes_need_target_for_their_class(tmp_path):
    from typing import NamedTuple

    class State(NamedTuple):
        count: jax.Array
        mu: dict

    tree = State(jnp.int32(3), {"w": jnp.ones(4)})
    jaxckpt.save(tmp_path / "c", tree)
    back = jaxckpt.restore(tmp_path / "c", tree)
    assert isinstance(back, State)
    assert_tree_equal(back, tree)
    host = jaxckpt.restore(tmp_path / "c")  # no target: fields come back as a dict
    assert set(host) == {"count", "mu"} and host["count"] == 3


def test_overwrite_replaces_and_refuses_without_flag(tmp_path):
    jaxckpt.save(tmp_path / "c", {"a": jnp.ones(3)})
    with pytest.raises(jaxckpt.CheckpointExistsError, match="overwrite=True"):
        jaxckpt.save(tmp_path / "c", {"a": jnp.zeros(3)})
    assert np.array_equal(jaxckpt.restore(tmp_path / "c")["a"], np.ones(3))
    jaxckpt.save(tmp_path / "c", {"b": jnp.zeros(2)}, overwrite=True)
    settle()  # the replaced checkpoint goes in the background
    assert set(jaxckpt.restore(tmp_path / "c")) == {"b"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]  # no temporaries left


def test_failed_overwrite_leaves_old_checkpoint_intact(tmp_path):
    jaxckpt.save(tmp_path / "c", {"a": jnp.arange(4.0)})
    with pytest.raises(jaxckpt.UnsupportedLeafError):
        jaxckpt.save(tmp_path / "c", {"a": jnp.zeros(4), "bad": object()}, overwrite=True)

    class Boom(jaxckpt.DefaultSavePlanner):
        def resolve_data(self, item):
            raise RuntimeError("device lost")

    with pytest.raises(RuntimeError, match="device lost"):
        jaxckpt.save(tmp_path / "c", {"a": jnp.zeros(4)}, overwrite=True, planner=Boom())
    assert np.array_equal(jaxckpt.restore(tmp_path / "c")["a"], np.arange(4.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


def test_memory_and_file_urls(tmp_path):
    tree = {"w": put(_x((8, 2)), M42, "data")}
    jaxckpt.save("memory://ckpt/a", tree)
    assert_tree_equal(jaxckpt.restore("memory://ckpt/a", tree), tree)
    jaxckpt.save(f"file://{tmp_path}/c", tree)
    assert_tree_equal(jaxckpt.restore(tmp_path / "c", tree), tree)


def test_blocking_save_to_memory_does_not_alias_the_callers_arrays():
    # memory:// keeps what it is given; a later change to the caller's array must not reach it.
    x = np.arange(4.0)
    jaxckpt.save("memory://alias/c", {"x": x})
    x[:] = -1
    np.testing.assert_array_equal(jaxckpt.restore("memory://alias/c")["x"], np.arange(4.0))


def test_enum_values_are_stored_as_their_base_type(tmp_path):
    import enum

    class Mode(enum.IntEnum):
        TRAIN = 2

    class Name(str, enum.Enum):  # noqa: UP042 -- the str mix-in, not StrEnum, is the case here
        A = "alpha"

    jaxckpt.save(tmp_path / "c", {"mode": Mode.TRAIN, "name": Name.A})
    back = jaxckpt.restore(tmp_path / "c")
    assert back == {"mode": 2, "name": "alpha"}
    assert type(back["mode"]) is int and type(back["name"]) is str


BYTE_ORDER_DTYPES = (
    "int8 uint8 bool int16 uint16 int32 uint32 int64 uint64 float16 float32 float64 complex64 "
    "complex128"
).split()


def _layout(base: np.ndarray, layout: str) -> np.ndarray:
    """``base``'s values laid out in memory as ``layout`` says (values unchanged)."""
    if layout == "fortran":
        return np.asfortranarray(base)
    if layout == "strided":  # every other element of a buffer twice as long
        wide = np.empty((base.shape[0] * 2, *base.shape[1:]), base.dtype)
        wide[::2] = base
        return wide[::2]
    if layout == "reversed":
        return base[::-1].copy()[::-1]
    if layout == "zero_stride":  # one stored row broadcast to every row
        return np.broadcast_to(base[:1], base.shape)
    return base


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    dtype=st.sampled_from(BYTE_ORDER_DTYPES),
    order=st.sampled_from(["<", ">", "="]),
    layout=st.sampled_from(["c", "fortran", "strided", "reversed", "zero_stride"]),
    shape=st.sampled_from([(6,), (3, 4), (2, 3, 2)]),
    packed=st.booleans(),
)
def test_every_byte_order_and_layout_round_trips(tmp_path, dtype, order, layout, shape, packed):
    rng = np.random.default_rng(0)
    values = rng.integers(0, 100, size=shape).astype(dtype)
    x = _layout(values.astype(np.dtype(dtype).newbyteorder(order)), layout)
    expect = np.array(x)  # the values, whatever the bytes' order and layout
    path = Path(tempfile.mkdtemp(dir=tmp_path)) / "c"  # hypothesis reuses tmp_path
    planner = jaxckpt.DefaultSavePlanner(pack_bytes=None if packed else 0)
    jaxckpt.save(path, {"x": x}, planner=planner)
    packs = jaxckpt.metadata(path).packs
    assert bool(packs) == packed
    back = jaxckpt.restore(path)["x"]
    assert back.dtype == np.dtype(dtype) and back.shape == shape
    np.testing.assert_array_equal(back, expect)
    assert back.tobytes() == expect.astype(dtype).tobytes()  # bit-exact, in native order
