"""jaxckpt.restore reads safetensors written by the `safetensors` package, by byte ranges."""

from __future__ import annotations

import json
import struct

import jax
import ml_dtypes
import numpy as np
import pytest
from helpers import mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt._cli.main import main
from jaxckpt._sources import detect as _sources
from jaxckpt._storage import location as _location

st = pytest.importorskip("safetensors.numpy")


def _weights() -> dict:
    rng = np.random.default_rng(0)
    return {
        "model.embed.weight": rng.standard_normal((16, 8)).astype(ml_dtypes.bfloat16),
        "model.layers.0.q_proj.weight": rng.standard_normal((8, 8)).astype(np.float32),
        "model.layers.0.f8": rng.standard_normal((4, 4)).astype(ml_dtypes.float8_e4m3fn),
        "model.layers.0.f8b": rng.standard_normal(4).astype(ml_dtypes.float8_e5m2),
        "mask": np.array([True, False, True]),
        "ids": np.arange(32, dtype=np.int32).reshape(8, 4),
        "scalar": np.array(2.5, np.float16),
    }


def _same(a, b):
    assert np.asarray(a).dtype == b.dtype and np.asarray(a).tobytes() == b.tobytes()


def test_single_file_onto_a_mesh_and_host(tmp_path):
    w = _weights()
    st.save_file(w, tmp_path / "model.safetensors")
    m = mesh((4, 2), ("data", "model"))
    target = {k: NamedSharding(m, P("data", "model") if v.ndim == 2 else P()) for k, v in w.items()}
    got = jaxckpt.restore(tmp_path / "model.safetensors", target)
    assert got["model.embed.weight"].sharding == target["model.embed.weight"]
    for k, v in w.items():
        _same(got[k], v)
    host = jaxckpt.restore(tmp_path / "model.safetensors")
    assert list(host) == list(jaxckpt.metadata(tmp_path / "model.safetensors").entries)
    for k, v in w.items():
        _same(host[k], v)
    part = jaxckpt.restore(tmp_path, keys=["ids"])  # the folder works too
    assert list(part) == ["ids"]


def test_sharded_set_with_an_index(tmp_path):
    w = _weights()
    names = list(w)
    files = {
        "model-00001-of-00002.safetensors": names[:3],
        "model-00002-of-00002.safetensors": names[3:],
    }
    for f, keys in files.items():
        st.save_file({k: w[k] for k in keys}, tmp_path / f)
    index = {
        "metadata": {"total_size": 0},
        "weight_map": {k: f for f, ks in files.items() for k in ks},
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    for p in (tmp_path, tmp_path / "model.safetensors.index.json"):
        got = jaxckpt.restore(p)
        for k, v in w.items():
            _same(got[k], v)
    # a flat target keyed by the file's names; then nest as the model wants
    s = jax.sharding.SingleDeviceSharding(jax.devices()[1])
    got = jaxckpt.restore(tmp_path, {"ids": s, "mask": None}, strict=False)
    assert got["ids"].sharding == s and isinstance(got["mask"], np.ndarray)


def _bytes_read(path, target):
    loc = _location.Location(path)
    manifest, reader = _sources.open_source(loc)
    planner = jaxckpt.DefaultLoadPlanner()
    planner.set_up_planner(target, manifest)
    items = planner.create_local_plan().items
    needed = sum(int(np.prod(i.sizes)) * 4 for i in items)
    for _ in reader.read(manifest.entries, items):
        pass
    return reader.bytes_read, needed, len(items)


def test_mesh_restore_reads_at_most_the_needed_bytes(tmp_path):
    # 2 MiB: arrays of 1 MiB or less all on this host are read whole (one box)
    st.save_file({"w": np.ones((1024, 512), np.float32)}, tmp_path / "m.safetensors")
    m = mesh((4, 2), ("data", "model"))
    # row-sharded: one read per box; column-sharded: one read per row of a box, exact bytes
    for spec, distinct in ((P("data", None), 4), (P(None, "model"), 2), (P("data", "model"), 8)):
        n, needed, boxes = _bytes_read(tmp_path / "m.safetensors", {"w": NamedSharding(m, spec)})
        assert boxes == distinct and n <= 1.1 * needed, (spec, n, needed)


def _file(tmp_path, header: dict, data: bytes, *, length: int | None = None):
    raw = json.dumps(header).encode()
    p = tmp_path / "bad.safetensors"
    p.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return p


def test_damaged_files_are_typed_errors_naming_file_and_tensor(tmp_path):
    st.save_file({"a": np.arange(8, dtype=np.float32)}, tmp_path / "t.safetensors")
    raw = (tmp_path / "t.safetensors").read_bytes()
    (tmp_path / "t.safetensors").write_bytes(raw[:-4])
    with pytest.raises(jaxckpt.CorruptChunkError, match=r"tensor 'a' in t.safetensors.*truncated"):
        jaxckpt.restore(tmp_path / "t.safetensors")
    cases = [
        (
            {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}},
            b"\0" * 8,
            1 << 40,
            r"bad.safetensors: the header claims",
        ),
        (
            {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}},
            b"\0" * 8,
            None,
            r"tensor 'a' has 8 bytes in data_offsets \[0, 8\], but F32\[4\] needs 16",
        ),
        (
            {
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
            },
            b"\0" * 12,
            None,
            r"tensors 'a' and 'b' share bytes",
        ),
        (
            {"a": {"dtype": "Q9", "shape": [2], "data_offsets": [0, 8]}},
            b"\0" * 8,
            None,
            r"tensor 'a' has dtype 'Q9'",
        ),
        (
            {"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 4]}},
            b"\0" * 8,
            None,
            r"tensor 'a' has invalid data_offsets",
        ),
    ]
    for header, data, length, match in cases:
        p = _file(tmp_path, header, data, length=length)
        with pytest.raises(jaxckpt.ManifestError, match=match):
            jaxckpt.restore(p)
    p = _file(tmp_path, {"a": {"dtype": "F32", "shape": [2], "data_offsets": [100, 108]}}, b"")
    with pytest.raises(jaxckpt.CorruptChunkError, match=r"tensor 'a' in bad.safetensors"):
        jaxckpt.restore(p)
    assert main(["verify", str(p)]) == 1
    (tmp_path / "bad.safetensors").write_bytes(b"\1\0")
    with pytest.raises(jaxckpt.ManifestError, match=r"bad.safetensors is truncated"):
        jaxckpt.restore(tmp_path / "bad.safetensors")


def test_index_naming_files_outside_is_refused(tmp_path):
    index = {"weight_map": {"a": "../secret.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(jaxckpt.ManifestError, match=r"names file '\.\./secret.safetensors'"):
        jaxckpt.restore(tmp_path)
    st.save_file({"a": np.zeros(2, np.float32)}, tmp_path / "x.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"b": "x.safetensors"}})
    )
    with pytest.raises(jaxckpt.ManifestError, match=r"maps tensor 'b' to x.safetensors"):
        jaxckpt.restore(tmp_path)
