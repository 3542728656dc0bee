"""jaxckpt.convert / `jaxckpt convert`: Orbax, safetensors and jaxckpt sources -> jaxckpt."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import assert_tree_equal, mesh, put

import jaxckpt
from jaxckpt._cli.main import main
from jaxckpt._sources import convert as _convert

ocp = pytest.importorskip("orbax.checkpoint")
st = pytest.importorskip("safetensors.numpy")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


def test_convert_orbax_keeps_tree_values_and_bytes(tmp_path):
    m = mesh((4, 2), ("data", "model"))
    tree = {
        "w": put(jnp.arange(64.0).reshape(8, 8), m, "data", "model"),
        "b": [np.arange(3, dtype=np.int8), "name"],
        "step": 3,
        "none": None,
    }
    with ocp.PyTreeCheckpointer() as c:  # Standard refuses strings and None
        c.save(tmp_path / "orbax", tree)
    manifest = jaxckpt.convert(str(tmp_path / "orbax"), str(tmp_path / "ckpt"))
    assert manifest.created["converted_from"] == "orbax"
    assert_tree_equal(jaxckpt.restore(tmp_path / "ckpt"), jaxckpt.restore(tmp_path / "orbax"))
    assert jaxckpt.restore(tmp_path / "ckpt")["b"][1] == "name"
    assert main(["verify", str(tmp_path / "ckpt")]) == 0  # a real jaxckpt checkpoint, checksummed
    with pytest.raises(jaxckpt.CheckpointExistsError, match="overwrite=True"):
        jaxckpt.convert(str(tmp_path / "orbax"), str(tmp_path / "ckpt"))
    jaxckpt.convert(str(tmp_path / "orbax"), str(tmp_path / "ckpt"), overwrite=True)


def test_convert_streams_large_arrays_in_row_blocks(tmp_path, monkeypatch):
    monkeypatch.setattr(_convert, "BLOCK_BYTES", 1024)
    w = {
        "a.weight": np.arange(40 * 33, dtype=np.float32).reshape(40, 33),
        "wide": np.arange(2 * 600, dtype=np.float32).reshape(2, 600),
        "bf": np.arange(10).astype(ml_dtypes.bfloat16),
        "s": np.array(1, np.int16),
    }
    st.save_file(w, tmp_path / "m.safetensors")
    m = jaxckpt.convert(str(tmp_path / "m.safetensors"), str(tmp_path / "ckpt"))
    assert m.entries["a.weight"].chunks == (7, 33)  # 7 rows of 132 bytes fit 1 KiB
    assert m.entries["wide"].chunks == (1, 256)
    got = jaxckpt.restore(tmp_path / "ckpt")
    for k, v in w.items():
        assert got[k].dtype == v.dtype and got[k].tobytes() == v.tobytes(), k


def test_cli_convert_with_progress_and_errors(tmp_path, capsys):
    st.save_file({"x": np.ones((4, 4), np.float32)}, tmp_path / "m.safetensors")
    rc = main(["convert", str(tmp_path / "m.safetensors"), str(tmp_path / "c"), "--progress"])
    out, err = capsys.readouterr()
    assert (
        rc == 0
        and "wrote" in out
        and "from safetensors" in out
        and "convert:" in err
        and "100%" in err
    )
    assert main(["convert", str(tmp_path / "m.safetensors"), str(tmp_path / "c")]) == 2
    assert "overwrite" in capsys.readouterr().err
    assert main(["convert", str(tmp_path / "nothing"), str(tmp_path / "d")]) == 2
    assert "nothing does not exist" in capsys.readouterr().err
    # export reads foreign sources too
    assert main(["export", str(tmp_path / "m.safetensors"), str(tmp_path / "o.npz")]) == 0
    np.testing.assert_array_equal(np.load(tmp_path / "o.npz")["x"], 1.0)


def test_convert_a_jaxckpt_checkpoint_rechunks_it(tmp_path):
    tree = {"w": put(jnp.arange(16.0).reshape(4, 4), mesh((2, 2), ("a", "b")), "a", "b")}
    jaxckpt.save(tmp_path / "a", tree)
    jaxckpt.convert(str(tmp_path / "a"), str(tmp_path / "b"))
    assert jaxckpt.metadata(tmp_path / "b").entries["w"].chunks == (4, 4)
    assert_tree_equal(jaxckpt.restore(tmp_path / "a"), jaxckpt.restore(tmp_path / "b"))


def test_convert_writes_chunks_of_at_most_max_chunk_bytes(tmp_path, capsys):
    # Finer chunks for checkpoints that many hosts restore in parts: a chunk is read whole.
    w = {"embed": np.arange(1000 * 64, dtype=np.float32).reshape(1000, 64)}  # 250 KiB
    st.save_file(w, tmp_path / "m.safetensors")
    m = jaxckpt.convert(
        str(tmp_path / "m.safetensors"), str(tmp_path / "a"), max_chunk_bytes=16 << 10
    )
    assert m.entries["embed"].chunks == (64, 64)  # 64 rows of 256 bytes: 16 KiB
    assert jaxckpt.metadata(tmp_path / "a").entries["embed"].grid == (16, 1)
    assert jaxckpt.restore(tmp_path / "a")["embed"].tobytes() == w["embed"].tobytes()
    rc = main(
        [
            "convert",
            str(tmp_path / "m.safetensors"),
            str(tmp_path / "b"),
            "--max-chunk-bytes",
            "4096",
        ]
    )
    assert rc == 0 and jaxckpt.metadata(tmp_path / "b").entries["embed"].chunks == (16, 64)
    m = jaxckpt.convert(
        str(tmp_path / "m.safetensors"), str(tmp_path / "n"), max_chunk_bytes=np.int64(4096)
    )
    assert m.entries["embed"].chunks == (16, 64)  # numpy integers are byte counts too
    capsys.readouterr()
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=r"max_chunk_bytes must be a positive number"):
            jaxckpt.convert(
                str(tmp_path / "m.safetensors"), str(tmp_path / "c"), max_chunk_bytes=bad
            )
    assert not (tmp_path / "c").exists()  # refused before anything was written
    rc = main(
        ["convert", str(tmp_path / "m.safetensors"), str(tmp_path / "c"), "--max-chunk-bytes", "0"]
    )
    assert rc == 2 and "'0' is not a positive number of bytes" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()
