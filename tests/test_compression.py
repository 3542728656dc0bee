"""Optional compression of chunks (issue 52.4): what save accepts, restore reads, bit for bit,
on every store and onto other meshes; the format says so (version 4, per array); uncompressed
arrays keep their in-place reads; a crafted or damaged compressed checkpoint is a typed error
naming the key."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorstore as ts
from helpers import assert_tree_equal, mesh, put
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_hostile_manifest import _edit, _every_reader_refuses

import jaxckpt
from jaxckpt._cli.main import main
from jaxckpt._storage import chunkfile

UNPACKED = jaxckpt.DefaultSavePlanner(pack_bytes=0)


def _state(m):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 32)).astype(np.float32) * 0.02
    return {
        "w": put(jnp.asarray(w), m, "a", "b"),
        "w16": put(jnp.asarray(w, jnp.bfloat16), m, "a", None),
        "zeros": put(jnp.zeros((256, 64)), m, None, "b"),
        "ids": jnp.arange(1000, dtype=jnp.int32),
        "mask": jnp.asarray(rng.random(77) > 0.5),
        "key": jax.random.key(3),
        "small": {"b": jnp.ones(5, jnp.float16), "c": np.arange(3, dtype=np.uint8)},
        "step": 7,
        "name": "run",
    }


def _codecs(m) -> set[str | None]:
    return {e.codec for e in m.entries.values() if isinstance(e, jaxckpt.ArrayEntry)}


def _chunk_bytes(d: Path) -> int:
    return sum(f.stat().st_size for f in d.rglob("*") if f.is_file() and "/c/" in str(f) + "/")


@pytest.mark.parametrize("codec", ["zstd", "lz4"])
def test_each_codec_round_trips_onto_another_mesh(tmp_path, codec):
    src = _state(mesh((4, 2), ("a", "b")))
    jaxckpt.save(tmp_path / "c", src, compression=codec)
    other = mesh((2, 4), ("a", "b"))
    target = jax.tree.map(lambda x: x, src)
    target["w"] = jax.ShapeDtypeStruct(
        (64, 32),
        jnp.float32,
        sharding=jax.NamedSharding(other, jax.sharding.PartitionSpec("b", "a")),
    )
    got = jaxckpt.restore(tmp_path / "c", target)
    assert_tree_equal(got, src)
    assert got["w"].sharding.mesh.devices.shape == (2, 4)
    assert_tree_equal(jaxckpt.restore(tmp_path / "c"), jax.device_get(src))


def test_the_manifest_says_how_each_array_is_stored(tmp_path):
    src = _state(mesh((4, 2), ("a", "b")))
    jaxckpt.save(tmp_path / "raw", src)
    jaxckpt.save(tmp_path / "z", src, compression="zstd")
    raw = json.loads((tmp_path / "raw/manifest.json").read_text())
    z = json.loads((tmp_path / "z/manifest.json").read_text())
    assert raw["version"] == 2 and z["version"] == 4  # 4 only when a chunk is compressed
    assert all("compression" not in e for e in raw["entries"].values())
    assert all(p["compression"] == "zstd" for p in z["packs"].values())
    for key, e in z["entries"].items():  # packed arrays take their pack's
        if e["kind"] == "array":
            assert ("compression" in e) == ("offset" not in e), key
    assert _codecs(jaxckpt.metadata(tmp_path / "z")) == {"zstd"}
    assert _chunk_bytes(tmp_path / "z") < _chunk_bytes(tmp_path / "raw")


def test_inspect_and_verify_show_the_codec(tmp_path, capsys):
    jaxckpt.save(tmp_path / "z", {"w": jnp.zeros((1024, 512)), "b": jnp.ones(3)}, compression="lz4")
    assert main(["inspect", str(tmp_path / "z")]) == 0
    out = capsys.readouterr().out
    assert "format v4, lz4" in out and "chunks 1x1 of [1024,512] lz4" in out and "packed lz4" in out
    assert main(["inspect", "--json", str(tmp_path / "z")]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {e["compression"] for e in doc["entries"]} == {"lz4"}
    assert main(["verify", str(tmp_path / "z")]) == 0


def test_a_compressed_array_is_a_plain_zarr_v3_array(tmp_path):
    """zarr v3 readers open it from its own zarr.json (blosc, then crc32c)."""
    w = np.random.default_rng(1).standard_normal((300, 40)).astype(np.float32)
    jaxckpt.save(tmp_path / "z", {"w": w}, compression="zstd", planner=UNPACKED)
    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(tmp_path / "z/arrays/w")}}
    arr = ts.open(spec).result()
    assert [c["name"] for c in arr.spec().to_json()["metadata"]["codecs"]] == [
        "bytes",
        "blosc",
        "crc32c",
    ]
    np.testing.assert_array_equal(arr.read().result(), w)


def test_uncompressed_chunks_are_still_read_in_place(tmp_path, monkeypatch):
    w = np.arange(1 << 20, dtype=np.float32).reshape(1024, 1024)
    jaxckpt.save(tmp_path / "raw", {"w": w})
    jaxckpt.save(tmp_path / "z", {"w": w}, compression="zstd")
    before = chunkfile.bytes_read()
    np.testing.assert_array_equal(jaxckpt.restore(tmp_path / "raw")["w"], w)
    assert chunkfile.bytes_read() - before >= w.nbytes  # read in place
    before = chunkfile.bytes_read()
    np.testing.assert_array_equal(jaxckpt.restore(tmp_path / "z")["w"], w)
    assert chunkfile.bytes_read() == before  # decoded by tensorstore


@pytest.mark.parametrize("url", ["memory://compressed", "file"])
def test_a_manager_compresses_every_step_and_an_incremental_step_rewrites_a_raw_base(tmp_path, url):
    run = f"{url}-{tmp_path.name}" if url.startswith("memory") else str(tmp_path / "run")
    frozen = np.arange(1 << 16, dtype=np.float32)
    with jaxckpt.CheckpointManager(run, incremental=True) as mgr:
        mgr.save(1, {"frozen": frozen, "v": 1})
    with jaxckpt.CheckpointManager(run, incremental=True, compression="zstd") as mgr:
        mgr.save(2, {"frozen": frozen, "v": 2})
        mgr.wait()
        assert mgr.last_save.reused_bytes == 0  # the base's raw chunks are not this codec's
        mgr.save(3, {"frozen": frozen, "v": 3})
        mgr.wait()
        assert mgr.last_save.reused_bytes >= frozen.nbytes  # same codec: taken from step 2
        for step in (1, 2, 3):
            got = mgr.restore(step)
            assert got["v"] == step
            np.testing.assert_array_equal(got["frozen"], frozen)
        codecs = {s: _codecs(mgr.metadata(s)) for s in (1, 2, 3)}
        assert codecs == {1: {None}, 2: {"zstd"}, 3: {"zstd"}}


@pytest.mark.parametrize(
    "bad, match",
    [
        ("gzip", "compression='gzip' is not supported; use one of 'zstd', 'lz4' or None"),
        (1, "compression=1 is not supported"),
        ("", "compression='' is not supported"),
    ],
)
def test_an_unknown_compression_is_refused_before_anything_is_written(tmp_path, bad, match):
    for call in (jaxckpt.save, jaxckpt.save_async):
        with pytest.raises(jaxckpt.InvalidArgumentError, match=match):
            call(tmp_path / "c", {"w": jnp.ones(3)}, compression=bad)
    assert not (tmp_path / "c").exists()
    with pytest.raises(jaxckpt.InvalidArgumentError, match=f"CheckpointManager: {match}"):
        jaxckpt.CheckpointManager(tmp_path / "run", compression=bad)


# -- hostile and damaged checkpoints ----------------------------------------------------------


def _saved(tmp_path, codec="zstd") -> Path:
    d = tmp_path / "c"
    jaxckpt.save(d, {"w": jnp.arange(4096.0)}, compression=codec, planner=UNPACKED)
    return d


def test_compression_in_an_older_version_is_refused_not_read_as_raw(tmp_path, capsys):
    d = tmp_path / "c"
    jaxckpt.save(d, {"w": jnp.arange(4096.0)}, planner=UNPACKED)

    def older(m):
        m["entries"]["w"]["compression"] = "zstd"  # a version-1 manifest that claims it

    _edit(d, older)
    _every_reader_refuses(d, capsys, r"entry 'w' says its chunks are compressed .* version 4")


def test_an_unknown_codec_asks_for_a_newer_jaxckpt(tmp_path, capsys):
    d = _saved(tmp_path)
    _edit(d, lambda m: m["entries"]["w"].update(compression="brotli"))
    _every_reader_refuses(d, capsys, r"entry 'w' has compression 'brotli'.*upgrade jaxckpt")


@pytest.mark.parametrize("bad", ["brotli", 3, None])
def test_a_pack_with_an_unknown_codec_is_refused(tmp_path, bad):
    d = tmp_path / "c"
    jaxckpt.save(d, {"a": jnp.ones(3), "b": jnp.zeros(2)}, compression="zstd")
    m = json.loads((d / "manifest.json").read_text())
    (pack,) = m["packs"]
    if bad is None:  # a packed array that says it is compressed on its own
        m["entries"]["a"]["compression"] = "zstd"
        match = "entry 'a' is packed and compressed"
    else:
        m["packs"][pack]["compression"] = bad
        match = f"pack '{pack}' has compression {bad!r}"
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(jaxckpt.ManifestError, match=match):
        jaxckpt.restore(d)


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty"])
def test_a_damaged_compressed_chunk_is_a_corrupt_chunk_error(tmp_path, capsys, damage):
    d = _saved(tmp_path)
    (chunk,) = (d / "arrays/w/c").iterdir()
    data = bytearray(chunk.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
    chunk.write_bytes(
        b""
        if damage == "empty"
        else bytes(data[: len(data) // 2])
        if damage == "truncate"
        else bytes(data)
    )
    with pytest.raises(jaxckpt.CorruptChunkError, match="Key 'w'"):
        jaxckpt.restore(d)
    capsys.readouterr()
    assert main(["verify", str(d)]) == 1
    assert "DAMAGED w chunk (0) at arrays/w/c/0" in capsys.readouterr().out


def test_a_compressed_chunk_that_decodes_to_the_wrong_size_is_refused(tmp_path):
    """A crafted chunk (valid blosc and CRC, of another array's size) never fills the target
    with what the checkpoint does not hold."""
    d = _saved(tmp_path)
    jaxckpt.save(tmp_path / "other", {"w": jnp.arange(16.0)}, compression="zstd", planner=UNPACKED)
    (chunk,) = (d / "arrays/w/c").iterdir()
    (small,) = (tmp_path / "other/arrays/w/c").iterdir()
    chunk.write_bytes(small.read_bytes())
    with pytest.raises(jaxckpt.CorruptChunkError, match="Key 'w'"):
        jaxckpt.restore(d)


# -- what save accepts, restore reads ----------------------------------------------------------

DTYPES = ["float32", "bfloat16", "float16", "int8", "int32", "uint16", "bool", "float64"]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    dtype=st.sampled_from(DTYPES),
    shape=hnp.array_shapes(min_dims=0, max_dims=3, max_side=40),
    codec=st.sampled_from(["zstd", "lz4"]),
    packed=st.booleans(),
)
def test_any_array_round_trips_compressed(data, dtype, shape, codec, packed):
    np_dtype = jnp.dtype(dtype)
    if dtype == "bfloat16":
        values = data.draw(hnp.arrays(np.float32, shape)).astype(np_dtype)
    else:
        values = data.draw(hnp.arrays(np_dtype, shape))
    if dtype == "float64":
        values = np.asarray(values)  # numpy keeps float64 without x64
    url = f"memory://prop-{uuid.uuid4().hex}"  # a fresh store per example
    planner = jaxckpt.DefaultSavePlanner(pack_bytes=None if packed else 0)
    jaxckpt.save(url, {"x": values}, compression=codec, planner=planner)
    got = jaxckpt.restore(url)["x"]
    assert got.dtype == values.dtype and got.shape == values.shape
    assert np.asarray(got).tobytes() == np.asarray(values).tobytes()  # NaNs and -0.0 too


def test_the_v4_fixture_written_when_compression_was_added_still_restores():
    """tests/data/v4_zstd (tests/data/make_v4_zstd.py): compressed bytes this code did not
    write, of the state of tests/data/v2_packed, whose values tests/test_pack.py checks."""
    data = Path(__file__).parent / "data"
    assert json.loads((data / "v4_zstd/manifest.json").read_text())["version"] == 4
    assert _codecs(jaxckpt.metadata(data / "v4_zstd")) == {"zstd"}
    got, want = jaxckpt.restore(data / "v4_zstd"), jaxckpt.restore(data / "v2_packed")
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert type(a) is type(b)
        if isinstance(a, np.ndarray):
            assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
        else:
            assert a == b or jax.random.key_data(a).tolist() == jax.random.key_data(b).tolist()
    assert main(["verify", str(data / "v4_zstd")]) == 0
