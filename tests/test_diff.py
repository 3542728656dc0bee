"""``jaxckpt.diff`` and ``jaxckpt diff``: keys, shapes, dtypes, values and data of two
checkpoints, across meshes and formats, skipping what digests say is equal."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import mesh, one_array_per_leaf, put  # noqa: F401 (autouse)
from safetensors.numpy import save_file

import jaxckpt
from jaxckpt._cli.main import main
from jaxckpt._sources import diff as diff_mod


def _w(m=None, spec=("x", "y")):
    m = m or mesh((4, 2), ("x", "y"))
    return put(jnp.arange(64.0).reshape(8, 8), m, *spec)


def _state(**changes):
    tree = {"w": _w(), "b": np.ones(4, np.float32), "step": 7}
    tree.update(changes)
    return tree


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_equal_checkpoints_are_equal_and_exit_0(tmp_path, capsys):
    jaxckpt.save(tmp_path / "a", _state())
    jaxckpt.save(tmp_path / "b", _state())
    r = jaxckpt.diff(str(tmp_path / "a"), str(tmp_path / "b"))
    assert r.equal and set(r.arrays) == {"w", "b"} and r.arrays["w"].chunks == 8
    assert repr(r).endswith("equal (2 arrays compared)>") and "\n" not in repr(r)
    code, out, _ = run(capsys, "diff", tmp_path / "a", tmp_path / "b")
    assert code == 0 and out.startswith(f"EQUAL: {tmp_path / 'a'} vs {tmp_path / 'b'}")


def test_one_changed_element_is_one_chunk_with_its_abs_and_rel_difference(tmp_path, capsys):
    jaxckpt.save(tmp_path / "a", _state())
    w = np.arange(64.0).reshape(8, 8)
    w[5, 6] = 45.0  # was 46: abs 1, rel 1/46
    jaxckpt.save(tmp_path / "b", _state(w=put(jnp.asarray(w), mesh((4, 2), ("x", "y")), "x", "y")))
    r = jaxckpt.diff(str(tmp_path / "a"), str(tmp_path / "b"))
    d = r.arrays["w"]
    assert not r.equal and [x.key for x in r.differing] == ["w"]
    assert (d.differing_chunks, d.chunks, d.differing) == (1, 8, 1)
    assert d.max_abs == 1.0 and d.max_rel == pytest.approx(1 / 46)
    code, out, _ = run(capsys, "diff", tmp_path / "a", tmp_path / "b")
    assert code == 1
    assert "differs    w  1 of 8 chunks, 1 element, max abs 1, max rel 0.02174" in out
    assert out.splitlines()[-1].startswith("DIFFERENT:") and "1 of 2 arrays differ" in out


def test_keys_shapes_dtypes_and_values(tmp_path, capsys):
    jaxckpt.save(tmp_path / "a", {**_state(), "gone": np.zeros(2), "s": np.zeros(3)})
    b = _state(b=np.ones(4, jnp.bfloat16), step=8, new=np.zeros(1))
    jaxckpt.save(tmp_path / "b", {**b, "s": np.zeros(4)})
    r = jaxckpt.diff(str(tmp_path / "a"), str(tmp_path / "b"))
    assert r.only_a == ("gone",) and r.only_b == ("new",)
    assert r.changed == {"b": ("float32[4]", "bfloat16[4]"), "s": ("float64[3]", "float64[4]")}
    assert r.values == {"step": (7, 8)} and r.arrays["w"].equal
    code, out, _ = run(capsys, "diff", "--json", tmp_path / "a", tmp_path / "b")
    doc = json.loads(out)
    assert code == 1 and doc["equal"] is False
    assert doc["only_a"] == ["gone"] and doc["only_b"] == ["new"]
    assert doc["changed"]["b"] == {"a": "float32[4]", "b": "bfloat16[4]"}
    assert doc["values"]["step"] == {"a": 7, "b": 8}
    assert doc["arrays"]["w"]["equal"] is True and doc["arrays"]["w"]["chunks"] == 8
    code, out, _ = run(capsys, "diff", tmp_path / "a", tmp_path / "b")
    assert "only in A  gone" in out and "only in B  new" in out
    assert "changed    b  float32[4] -> bfloat16[4]" in out and "value      step  7 -> 8" in out


def test_across_meshes(tmp_path):
    jaxckpt.save(tmp_path / "a", {"w": _w()})
    other = mesh((2, 4), ("x", "y"))
    jaxckpt.save(tmp_path / "b", {"w": _w(other, ("y", None))})
    jaxckpt.save(tmp_path / "c", {"w": jnp.arange(64.0).reshape(8, 8).at[0, 0].set(-1.0)})
    assert jaxckpt.metadata(tmp_path / "b").entries["w"].chunks == (2, 8)
    assert jaxckpt.diff(str(tmp_path / "a"), str(tmp_path / "b")).equal
    d = jaxckpt.diff(str(tmp_path / "b"), str(tmp_path / "c")).arrays["w"]
    assert (d.differing_chunks, d.chunks, d.differing, d.max_abs) == (1, 4, 1, 1.0)


def test_across_formats_safetensors_and_jaxckpt(tmp_path, capsys):
    w = np.arange(64.0, dtype=np.float32).reshape(8, 8)
    save_file({"w": w, "b": np.ones(4, np.float32)}, str(tmp_path / "m.safetensors"))
    jaxckpt.save(tmp_path / "a", {"w": put(jnp.asarray(w), mesh((4, 2), ("x", "y")), "x", "y"),
                                  "b": np.ones(4, np.float32)})  # fmt: skip
    assert jaxckpt.diff(str(tmp_path / "a"), str(tmp_path / "m.safetensors")).equal
    save_file({"w": w * 2, "b": np.ones(4, np.float32)}, str(tmp_path / "n.safetensors"))
    code, out, _ = run(capsys, "diff", tmp_path / "m.safetensors", tmp_path / "n.safetensors")
    assert code == 1 and "differs    w  1 of 1 chunk, 63 elements, max abs 63, max rel 0.5" in out


def test_across_formats_orbax(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    tree = {"w": _w(), "b": jnp.ones(4)}
    with ocp.StandardCheckpointer() as c:
        c.save(tmp_path / "orbax", tree)
    jaxckpt.save(tmp_path / "a", tree)
    assert jaxckpt.diff(str(tmp_path / "orbax"), str(tmp_path / "a")).equal


def test_chunks_larger_than_a_block_are_read_in_row_blocks(tmp_path, monkeypatch):
    monkeypatch.setattr(diff_mod, "BLOCK_BYTES", 64)  # 2 rows of 8 float32: 4 reads a chunk
    monkeypatch.setattr(diff_mod, "BATCH_BYTES", 128)
    a = np.zeros((8, 8), np.float32)
    b = a.copy()
    b[1, 1] = b[7, 7] = 3.0  # two rows of one chunk
    jaxckpt.save(tmp_path / "a", {"w": a})
    jaxckpt.save(tmp_path / "b", {"w": b})
    d = jaxckpt.diff(str(tmp_path / "a"), str(tmp_path / "b")).arrays["w"]
    assert (d.chunks, d.differing_chunks, d.differing, d.max_abs, d.max_rel) == (1, 1, 2, 3, 1)


def test_boxes_with_equal_digests_are_not_read(tmp_path):
    m = mesh((8,), ("x",))
    x = np.arange(64.0).reshape(8, 8)
    jaxckpt.save(tmp_path / "a", {"w": put(jnp.asarray(x), m, "x")}, digests=True)
    y = x.copy()
    y[0, 0] = -1.0  # one of 8 row chunks changes
    jaxckpt.save(tmp_path / "b", {"w": put(jnp.asarray(y), m, "x")}, base=tmp_path / "a")
    # An unchanged chunk (a hard link in both) is damaged: equal digests, so never read.
    chunk = next((tmp_path / "b").glob("arrays/*/c/7/0"))
    chunk.write_bytes(b"garbage")
    r = jaxckpt.diff(str(tmp_path / "a"), str(tmp_path / "b"))
    d = r.arrays["w"]
    assert (d.chunks, d.skipped, d.differing_chunks, d.differing) == (8, 7, 1, 1)
    with pytest.raises(jaxckpt.CorruptChunkError):  # without the digests it would be read
        jaxckpt.restore(tmp_path / "b")


def test_nan_equals_nan_and_a_number_against_nan_is_infinitely_far(tmp_path):
    jaxckpt.save(tmp_path / "a", {"x": np.array([np.nan, 1.0, 2.0])})
    jaxckpt.save(tmp_path / "b", {"x": np.array([np.nan, 1.0, np.nan])})
    jaxckpt.save(tmp_path / "c", {"x": np.array([np.nan, 1.0, 2.0])})
    assert jaxckpt.diff(str(tmp_path / "a"), str(tmp_path / "c")).equal
    d = jaxckpt.diff(str(tmp_path / "a"), str(tmp_path / "b")).arrays["x"]
    assert d.differing == 1 and d.max_abs == np.inf


def test_python_values_holding_nan_are_equal_as_array_elements_are(tmp_path, capsys):
    nan = float("nan")
    values = {"f": nan, "c": complex(nan, 1.0), "d": complex(2.0, nan), "i": float("inf")}
    jaxckpt.save(tmp_path / "a", values)
    jaxckpt.save(tmp_path / "b", values | {"c": complex(nan, 2.0), "i": 1e308})
    assert jaxckpt.diff(str(tmp_path / "a"), str(tmp_path / "a")).equal
    code, out, _ = run(capsys, "diff", tmp_path / "a", tmp_path / "a")
    assert code == 0 and out.startswith("EQUAL:"), out
    r = jaxckpt.diff(str(tmp_path / "a"), str(tmp_path / "b"))
    assert sorted(r.values) == ["c", "i"]  # another part, a number against infinity


def test_infinities_and_big_integers(tmp_path):
    big = 2**60
    jaxckpt.save(tmp_path / "a", {"f": np.array([np.inf, -np.inf, 1.0]), "i": np.array([big, 1])})
    jaxckpt.save(
        tmp_path / "b", {"f": np.array([np.inf, -np.inf, 2.0]), "i": np.array([big + 1, 1])}
    )
    r = jaxckpt.diff(str(tmp_path / "a"), str(tmp_path / "b"))
    assert (r.arrays["f"].differing, r.arrays["f"].max_abs) == (1, 1.0)  # inf == inf
    assert r.arrays["i"].differing == 1  # though float64 rounds both alike


def test_prng_keys_and_ints_and_bools(tmp_path):
    a = {"k": jax.random.key(0), "i": np.array([1, 5], np.int32), "f": np.array([True, False])}
    b = {"k": jax.random.key(1), "i": np.array([1, 9], np.int32), "f": np.array([True, True])}
    jaxckpt.save(tmp_path / "a", a)
    jaxckpt.save(tmp_path / "b", b)
    r = jaxckpt.diff(str(tmp_path / "a"), str(tmp_path / "b"))
    assert not r.arrays["k"].equal and r.arrays["i"].max_abs == 4 and r.arrays["f"].differing == 1


def test_progress_in_the_library_and_on_the_command_line(tmp_path, capsys):
    jaxckpt.save(tmp_path / "a", _state())
    jaxckpt.save(tmp_path / "b", _state())
    seen = []
    jaxckpt.diff(str(tmp_path / "a"), str(tmp_path / "b"), progress=lambda d, t: seen.append(d))
    assert seen[-1] == 64 * 4 + 16  # float32 w, float32 b
    code, _, err = run(capsys, "diff", "--progress", tmp_path / "a", tmp_path / "b")
    assert code == 0 and "diff" in err and "100%" in err


# errors ---------------------------------------------------------------------------------------


def test_a_missing_checkpoint_exits_2_naming_it(tmp_path, capsys):
    jaxckpt.save(tmp_path / "a", _state())
    code, out, err = run(capsys, "diff", tmp_path / "a", tmp_path / "nope")
    assert code == 2 and out == ""
    assert err.startswith("jaxckpt diff: error:") and f"{tmp_path / 'nope'} does not exist" in err
    with pytest.raises(jaxckpt.CheckpointNotFoundError, match="nope does not exist"):
        jaxckpt.diff(str(tmp_path / "nope"), str(tmp_path / "a"))


def test_a_run_directory_is_not_a_checkpoint(tmp_path, capsys):
    jaxckpt.save(tmp_path / "run" / "00000001", _state())
    jaxckpt.save(tmp_path / "a", _state())
    code, _, err = run(capsys, "diff", tmp_path / "run", tmp_path / "a")
    assert code == 2 and "00000001" in err and "Traceback" not in err


def test_damage_met_while_comparing_exits_2_not_1(tmp_path, capsys):
    jaxckpt.save(tmp_path / "a", _state())
    jaxckpt.save(tmp_path / "b", _state())
    next((tmp_path / "b").glob("arrays/w/c/0/0")).write_bytes(b"garbage")
    code, _, err = run(capsys, "diff", tmp_path / "a", tmp_path / "b")
    assert code == 2 and "w" in err and "chunk" in err


def test_bad_arguments_are_named(tmp_path, capsys):
    with pytest.raises(TypeError, match=r"jaxckpt\.diff: progress must be"):
        jaxckpt.diff(str(tmp_path), str(tmp_path), progress="yes")
    code, _, err = run(capsys, "diff", tmp_path)
    assert code == 2 and "the following arguments are required: B" in err
    code, _, err = run(capsys, "diff", "--colour", tmp_path, tmp_path)
    assert code == 2 and "unrecognized arguments: --colour" in err


def test_the_notebook_view_is_a_table_of_what_differs(tmp_path):
    jaxckpt.save(tmp_path / "a", _state())
    jaxckpt.save(tmp_path / "b", _state(step=9, extra=np.zeros(1)))
    html = jaxckpt.diff(str(tmp_path / "a"), str(tmp_path / "b"))._repr_html_()
    assert "<td>extra</td><td>only in B</td>" in html and "9" in html


def test_a_file_that_is_no_checkpoint_and_a_damaged_manifest_exit_2(tmp_path, capsys):
    jaxckpt.save(tmp_path / "a", _state())
    (tmp_path / "notes.txt").write_text("hello")
    code, _, err = run(capsys, "diff", tmp_path / "a", tmp_path / "notes.txt")
    assert code == 2 and str(tmp_path / "notes.txt") in err and "Traceback" not in err
    jaxckpt.save(tmp_path / "b", _state())
    (tmp_path / "b" / "manifest.json").write_text("{not json")
    code, _, err = run(capsys, "diff", tmp_path / "a", tmp_path / "b")
    assert code == 2 and "manifest.json" in err
    with pytest.raises(jaxckpt.ManifestError, match="manifest.json"):
        jaxckpt.diff(str(tmp_path / "a"), str(tmp_path / "b"))
