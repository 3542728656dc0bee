"""Interoperability: zarr-python v3 reads jaxckpt arrays; flax NNX and equinox state round-trip."""

from __future__ import annotations

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_equal, mesh, one_array_per_leaf, put  # noqa: F401 (autouse)
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt import ArrayEntry

zarr = pytest.importorskip("zarr", minversion="3")


def _standard_tree() -> dict:
    m = mesh((4, 2), ("data", "model"))
    return {
        "params": {
            "w": put(jnp.arange(96.0).reshape(8, 12), m, "data", "model"),
            "b": put(jnp.arange(12, dtype=jnp.int32), m, "model"),
            "replicated": put(jnp.linspace(-1, 1, 6, dtype=jnp.float16), m, None),
        },
        "mask": np.array([[True, False], [False, True]]),
        "counts": np.arange(10, dtype=np.uint64).reshape(2, 5),
        "f64": np.array(3.25),
        "c64": (np.arange(4) + 1j).astype(np.complex64),
        "step": 11,
    }


def test_zarr_python_reads_every_array(tmp_path):
    path = tmp_path / "ckpt"
    jaxckpt.save(path, _standard_tree())
    want = jaxckpt.restore(path)
    arrays = [e for e in jaxckpt.metadata(path).entries.values() if isinstance(e, ArrayEntry)]
    assert len(arrays) == 7
    for e in arrays:
        z = zarr.open_array(str(path / e.path), mode="r")
        assert z.shape == e.shape and z.chunks == e.chunks, e.key
        assert [c.to_dict()["name"] for c in z.metadata.codecs] == ["bytes", "crc32c"]
        got = z[...]
        ref = want
        for part in e.key.split("/"):
            ref = ref[part]
        assert got.dtype == np.asarray(ref).dtype, e.key
        np.testing.assert_array_equal(got, ref, err_msg=e.key)


def test_zarr_python_checks_the_crc32c_codec(tmp_path):
    path = tmp_path / "ckpt"
    jaxckpt.save(path, {"w": put(jnp.arange(16.0).reshape(4, 4), mesh((2,), ("x",)), "x")})
    chunk = path / "arrays" / "w" / "c" / "1" / "0"
    data = bytearray(chunk.read_bytes())
    data[0] ^= 1
    chunk.write_bytes(bytes(data))
    z = zarr.open_array(str(path / "arrays" / "w"), mode="r")
    np.testing.assert_array_equal(z[:2], np.arange(8.0).reshape(2, 4))  # the other chunk
    with pytest.raises(ValueError, match="checksum do not match"):
        z[2:]


# flax NNX ---------------------------------------------------------------------------------


def test_flax_nnx_state_roundtrip_onto_an_abstract_sharded_state(tmp_path: Path):
    nnx = pytest.importorskip("flax.nnx")

    class MLP(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.l1 = nnx.Linear(4, 8, rngs=rngs)
            self.bn = nnx.BatchNorm(8, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)
            self.l2 = nnx.Linear(8, 2, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            return self.l2(self.drop(nnx.relu(self.bn(self.l1(x)))))

    model = MLP(nnx.Rngs(0, dropout=1))
    model(jnp.ones((5, 4)))  # update the batch statistics and the dropout key count
    _, state = nnx.split(model)
    jaxckpt.save(tmp_path / "nnx", state)
    assert "l1/kernel/value" in jaxckpt.metadata(tmp_path / "nnx").entries

    abstract = nnx.eval_shape(lambda: MLP(nnx.Rngs(7, dropout=8)))
    graphdef, abstract_state = nnx.split(abstract)
    m = mesh((4, 2), ("data", "model"))

    def place(x: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        spec = P(None, "model") if x.ndim == 2 else P()
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(m, spec))

    target = jax.tree.map(place, abstract_state)
    restored = nnx.merge(graphdef, jaxckpt.restore(tmp_path / "nnx", target))
    _, restored_state = nnx.split(restored)
    assert_tree_equal(restored_state, state)
    assert restored.l1.kernel[...].sharding == NamedSharding(m, P(None, "model"))
    model.eval()
    restored.eval()
    x = jnp.arange(12.0).reshape(3, 4)  # sharded matmuls may round differently
    np.testing.assert_allclose(restored(x), model(x), rtol=1e-5)


# equinox ----------------------------------------------------------------------------------


def test_equinox_module_roundtrip_with_partition(tmp_path: Path):
    eqx = pytest.importorskip("equinox")
    model = eqx.nn.MLP(4, 2, 8, depth=2, key=jax.random.key(0))
    params, _ = eqx.partition(model, eqx.is_array)
    jaxckpt.save(tmp_path / "eqx", params)
    assert "layers/0/weight" in jaxckpt.metadata(tmp_path / "eqx").entries

    fresh = eqx.nn.MLP(4, 2, 8, depth=2, key=jax.random.key(1))  # same structure, other values
    like, static = eqx.partition(fresh, eqx.is_array)
    restored = eqx.combine(jaxckpt.restore(tmp_path / "eqx", like), static)
    assert_tree_equal(eqx.filter(restored, eqx.is_array), eqx.filter(model, eqx.is_array))
    x = jnp.linspace(-1, 1, 4)
    np.testing.assert_array_equal(restored(x), model(x))

    with pytest.raises(jaxckpt.ShapeMismatchError, match="layers/0/weight"):
        wider = eqx.nn.MLP(4, 2, 16, depth=2, key=jax.random.key(2))
        jaxckpt.restore(tmp_path / "eqx", eqx.filter(wider, eqx.is_array))


def _linen_variables():
    import flax.linen as nn

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            init = nn.with_partitioning(nn.initializers.lecun_normal(), (None, "model"))
            return nn.Dense(3, kernel_init=init)(x)

    return nn, lambda: Model().init(jax.random.key(0), jnp.ones((1, 2)))


def test_boxed_against_plain_keys_say_did_you_mean_with_the_mapping(tmp_path):
    # Issue 31.8: nn.Partitioned / nnx.State keep the array at '.../value'; a target of the
    # other kind is told the mapping and the fix, not just strict=False (which restores none).
    from flax import nnx

    nn, init = _linen_variables()
    jaxckpt.save(tmp_path / "linen", init())  # boxed: params/Dense_0/kernel/value
    plain = nn.unbox(jax.eval_shape(init))
    with pytest.raises(
        jaxckpt.KeyMismatchError,
        match=r"Did you mean \(target -> checkpoint\) 'params/Dense_0/kernel' -> "
        r"'params/Dense_0/kernel/value'\?.*suffix '/value'.*nn.Partitioned.*"
        r"Restore into a target wrapped the same way.*nn.unbox",
    ):
        jaxckpt.restore(tmp_path / "linen", plain)
    back = nn.unbox(jaxckpt.restore(tmp_path / "linen", jax.eval_shape(init)))  # the fix
    want = nn.unbox(init())["params"]["Dense_0"]["kernel"]
    np.testing.assert_array_equal(back["params"]["Dense_0"]["kernel"], want)

    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    jaxckpt.save(tmp_path / "pure", nnx.to_pure_dict(nnx.state(model)))  # plain: kernel
    abstract = nnx.state(nnx.eval_shape(lambda: nnx.Linear(2, 3, rngs=nnx.Rngs(0))))
    with pytest.raises(
        jaxckpt.KeyMismatchError,
        match=r"Did you mean \(target -> checkpoint\) 'bias/value' -> 'bias', and 1 more alike\?"
        r".*the target holds wrapped leaves.*nnx.to_pure_dict",
    ):
        jaxckpt.restore(tmp_path / "pure", abstract)
    restored = jaxckpt.restore(tmp_path / "pure", nnx.to_pure_dict(abstract))  # the fix
    nnx.replace_by_pure_dict(abstract, restored)
    np.testing.assert_array_equal(abstract["kernel"][...], model.kernel[...])


def test_strict_false_logs_target_leaves_missing_from_the_checkpoint(tmp_path, caplog):
    jaxckpt.save(tmp_path / "c", {"w": jnp.ones(3)})
    head = jnp.zeros(2)
    sds3, sds4 = jax.ShapeDtypeStruct((3,), jnp.float32), jax.ShapeDtypeStruct((4,), jnp.float32)
    target = {"w": sds3, "head": head, "new": sds4}
    with caplog.at_level("WARNING", logger="jaxckpt"):
        back = jaxckpt.restore(tmp_path / "c", target, strict=False)
    assert isinstance(back["w"], jax.Array) and back["head"] is head
    assert back["new"] is target["new"]  # documented: kept as the target holds it, and logged
    (record,) = [r for r in caplog.records if "strict=False" in r.getMessage()]
    assert record.levelname == "WARNING"
    assert re.search(
        r"2 key\(s\) in `target` are not in the checkpoint.*\['head', 'new'\].*"
        r"1 of them are abstract.*\['new'\]; initialise them",
        record.getMessage(),
    )


# What zarr-python (3.x) makes of each dtype jaxckpt saves (docs/format.md, "Other readers").
ZARR_PYTHON_READS = set(
    "bool int8 int16 int32 int64 uint8 uint16 uint32 uint64 float16 float32 float64 complex64 "
    "complex128".split()
)
# zarr v3 data types of tensorstore's own names: zarr-python refuses the array, tensorstore reads it.
TENSORSTORE_NAMES = set(
    "bfloat16 int4 float8_e4m3fn float8_e5m2 float8_e4m3fnuz float8_e4m3b11fnuz float8_e5m2fnuz".split()
)
# Stored as uint8: zarr-python reads the carrier; .view(ml_dtypes.<name>) gives the values.
CARRIED = set("uint4 uint2 int2 float4_e2m1fn float8_e8m0fnu float8_e3m4 float8_e4m3".split())


def _saved_dtypes() -> set[str]:
    """Every dtype name jaxckpt saves, from numpy's and ml_dtypes' dtypes."""
    import ml_dtypes

    from jaxckpt._format.dtypes import is_supported_dtype

    names = {np.dtype(t).name for t in np.sctypeDict.values()}  # noqa: NPY201
    for n in dir(ml_dtypes):
        try:
            names.add(np.dtype(getattr(ml_dtypes, n)).name)
        except (TypeError, ValueError):  # not a dtype
            pass
    return {n for n in names if is_supported_dtype(n)}


def test_the_documented_dtype_lists_cover_every_dtype_jaxckpt_saves():
    assert ZARR_PYTHON_READS | TENSORSTORE_NAMES | CARRIED == _saved_dtypes()
    assert not (
        ZARR_PYTHON_READS & TENSORSTORE_NAMES or CARRIED & (ZARR_PYTHON_READS | TENSORSTORE_NAMES)
    )
    doc = (Path(__file__).parents[1] / "docs" / "format.md").read_text()
    section = doc.split("### Other readers", 1)[1].split("\n#", 1)[0]
    for names, line in [
        (ZARR_PYTHON_READS, "zarr-python reads"),
        (TENSORSTORE_NAMES, "zarr-python refuses"),
        (CARRIED, "carrier"),
    ]:
        row = next(r for r in section.splitlines() if r.startswith("| ") and line in r)
        assert set(re.findall(r"`([a-z0-9_]+)`", row.split("|")[1])) == names, line


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_zarr_python_reads_exactly_the_documented_dtypes(tmp_path, compression):
    import ml_dtypes
    import tensorstore as ts

    tree = {}
    for name in sorted(_saved_dtypes()):
        dt = np.dtype(getattr(ml_dtypes, name, None) or name)
        values = np.arange(1, 7) % (2 if name in ("bool", "uint2", "int2") else 7)
        tree[name] = values.astype(np.float32).astype(dt).reshape(2, 3)
    path = tmp_path / "ckpt"
    jaxckpt.save(
        path, tree, planner=jaxckpt.DefaultSavePlanner(pack_bytes=0), compression=compression
    )
    entries = jaxckpt.metadata(path).entries
    for name, want in tree.items():
        where = str(path / entries[name].path)
        if name in TENSORSTORE_NAMES:
            with pytest.raises(ValueError, match=name):
                zarr.open_array(where, mode="r")
            spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": where}}
            got = ts.open(spec, open=True).result().read().result()
        else:
            got = zarr.open_array(where, mode="r")[...]
            if name in CARRIED:
                assert got.dtype == np.uint8 and entries[name].storage_dtype == "uint8", name
                got = got.view(want.dtype)
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), name
