"""Hostile manifests (issue 29.5-29.7): every field tensorstore or jax would act on is checked
first, so a crafted manifest is a ManifestError naming the key, never an abort or a raw error."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxckpt
from jaxckpt._cli.main import main
from jaxckpt._format.names import is_storage_path

UNPACKED = jaxckpt.DefaultSavePlanner(pack_bytes=0)


def _edit(d: Path, fn) -> None:
    m = json.loads((d / "manifest.json").read_bytes())
    fn(m)
    (d / "manifest.json").write_text(json.dumps(m))


def _every_reader_refuses(d: Path, capsys, match: str) -> None:
    """restore, metadata, `jaxckpt verify` and `jaxckpt export` all refuse, naming the problem."""
    with pytest.raises(jaxckpt.ManifestError, match=match):
        jaxckpt.restore(d)
    with pytest.raises(jaxckpt.ManifestError, match=match):
        jaxckpt.metadata(d)
    capsys.readouterr()
    assert main(["verify", str(d)]) == 1
    assert main(["export", str(d), str(d.parent / "out.npz")]) == 1
    err = capsys.readouterr().err
    assert err.count("entry 'w'") == 2, err
    assert not (d.parent / "out.npz").exists()


# 29.5: a chunk larger than its array made tensorstore allocate it (std::bad_alloc, SIGABRT) ---

_CHUNKS = """
import json, sys, numpy as np, jaxckpt
from jaxckpt._cli.main import main
d, chunks, what = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
m = json.load(open(d + "/manifest.json"))
m["entries"]["w"]["chunks"] = chunks
open(d + "/manifest.json", "w").write(json.dumps(m))
if what == "restore":
    try:
        jaxckpt.restore(d)
    except jaxckpt.ManifestError as e:
        print("ManifestError:", e)
else:
    sys.exit(main([what, d] + ([d + ".npz"] if what == "export" else [])))
"""


@pytest.mark.parametrize("what", ["restore", "verify", "export"])
@pytest.mark.parametrize("chunks", [[1 << 40, 8], [9, 8], [8, 1 << 62]])
def test_a_chunk_larger_than_its_array_is_a_manifest_error(tmp_path, what, chunks):
    d = tmp_path / "c"
    jaxckpt.save(d, {"w": np.ones((8, 8), np.float32)}, planner=UNPACKED)
    # in a subprocess: before the fix tensorstore's std::bad_alloc aborted the process
    r = subprocess.run(
        [sys.executable, "-c", _CHUNKS, str(d), json.dumps(chunks), what],
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = r.stdout + r.stderr
    assert r.returncode in (0, 1), out  # not -6 (SIGABRT)
    assert "entry 'w' has a chunk shape" in out and "larger than its shape [8, 8]" in out, out


def test_a_pack_chunk_larger_than_the_pack_is_a_manifest_error(tmp_path):
    d = tmp_path / "c"
    jaxckpt.save(
        d,
        {"w": np.ones(4, np.float32), "v": np.ones(4, np.float32)},
        planner=jaxckpt.DefaultSavePlanner(pack_bytes=1 << 10),
    )
    _edit(d, lambda m: next(iter(m["packs"].values())).update(chunks=[1 << 40]))
    with pytest.raises(jaxckpt.ManifestError, match=r"pack 'arrays/.*chunk size \[1099511627776\]"):
        jaxckpt.metadata(d)


def test_chunks_as_large_as_the_shape_still_read(tmp_path):
    d = tmp_path / "c"  # the largest legal chunks: one chunk per array, zero-size dims as 1
    tree = {"w": np.arange(12.0).reshape(3, 4), "e": np.zeros((0, 5)), "s": np.float32(2)}
    jaxckpt.save(d, tree, planner=UNPACKED)
    assert jaxckpt.metadata(d).entries["e"].chunks == (1, 5)
    got = jaxckpt.restore(d)
    np.testing.assert_array_equal(got["w"], tree["w"])
    assert got["e"].shape == (0, 5)


# 29.6: prng_impl is checked against jax: a known impl, uint32 key data of its trailing shape ---


@pytest.mark.parametrize(
    "change, match",
    [
        (
            {"prng_impl": "nosuch"},
            r"entry 'w' names prng_impl 'nosuch', which this jax does not know",
        ),
        ({"prng_impl": "rbg"}, r"entry 'w' is a PRNG key array \(rbg\) of key data shape \[3, 2\]"),
        (
            {"dtype": "float32", "storage_dtype": "float32"},
            r"entry 'w' is a PRNG key array \(threefry2x32\) stored as float32",
        ),
    ],
    ids=["unknown", "wrong-trailing-dim", "not-uint32"],
)
def test_a_bad_prng_impl_is_a_manifest_error(tmp_path, capsys, change, match):
    d = tmp_path / "c"
    jaxckpt.save(d, {"w": jax.random.split(jax.random.key(0), 3)}, planner=UNPACKED)
    _edit(d, lambda m: m["entries"]["w"].update(change))
    _every_reader_refuses(d, capsys, match)


def test_rbg_on_float_data_is_a_manifest_error(tmp_path, capsys):
    d = tmp_path / "c"  # the case: "rbg" on float32[8, 8]
    jaxckpt.save(d, {"w": jnp.ones((8, 8))}, planner=UNPACKED)
    _edit(d, lambda m: m["entries"]["w"].update(prng_impl="rbg"))
    _every_reader_refuses(d, capsys, r"entry 'w' is a PRNG key array \(rbg\) stored as float32")


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg", "unsafe_rbg"])
def test_every_prng_impl_jax_ships_round_trips(tmp_path, impl):
    d = tmp_path / "c"
    keys = jax.random.split(jax.random.key(1, impl=impl), 4)
    jaxckpt.save(d, {"k": keys})
    got = jaxckpt.restore(d, {"k": keys})["k"]
    assert jax.random.key_impl(got) == jax.random.key_impl(keys)
    np.testing.assert_array_equal(jax.random.key_data(got), jax.random.key_data(keys))


# 29.7: storage paths are matched whole ("$" also matched before a trailing newline) ----------


@pytest.mark.parametrize("path", ["arrays/w\n", "g0a1b2c3d/arrays/w\n", "arrays/w\n\n"])
def test_a_storage_path_with_a_trailing_newline_is_refused(tmp_path, capsys, path):
    assert not is_storage_path(path)
    d = tmp_path / "c"
    jaxckpt.save(d, {"w": np.ones((8, 8), np.float32)}, planner=UNPACKED)
    _edit(d, lambda m: m["entries"]["w"].update(path=path))
    _every_reader_refuses(d, capsys, r"entry 'w' has storage path .* outside the checkpoint")


def test_a_pack_path_with_a_trailing_newline_is_refused(tmp_path):
    d = tmp_path / "c"
    jaxckpt.save(
        d,
        {"w": np.ones(4, np.float32), "v": np.ones(4, np.float32)},
        planner=jaxckpt.DefaultSavePlanner(pack_bytes=1 << 10),
    )

    def newline(m: dict) -> None:
        (path,) = m["packs"]
        m["packs"] = {path + "\n": m["packs"][path]}
        for e in m["entries"].values():
            e["path"] += "\n"

    _edit(d, newline)
    with pytest.raises(jaxckpt.ManifestError, match=r"outside the checkpoint's arrays/"):
        jaxckpt.restore(d)


def test_a_foreign_name_ending_in_a_newline_is_not_taken_for_jaxckpts_own(tmp_path):
    d = tmp_path / "c"  # the target check used "$" too: a user's "manifest.json\n" is foreign
    jaxckpt.save(d, {"w": np.ones(2)})
    (d / ".x.tmp-0a\n").write_text("mine")  # looks like a temporary of jaxckpt's but for "\n"
    with pytest.raises(jaxckpt.CheckpointExistsError, match=r"'.x.tmp-0a\\n', which jaxckpt"):
        jaxckpt.save(d, {"w": np.zeros(2)}, overwrite=True)
    assert (d / ".x.tmp-0a\n").read_text() == "mine"


# 29.11: restore reads by the manifest alone; only verify checks zarr.json (as documented) ----


def test_a_zarr_json_that_disagrees_is_ignored_by_restore_and_reported_by_verify(tmp_path, capsys):
    d = tmp_path / "c"
    jaxckpt.save(d, {"w": np.arange(8.0)}, planner=UNPACKED)
    meta = d / "arrays" / "w" / "zarr.json"
    meta.write_text(meta.read_text().replace('"float64"', '"int16"'))
    np.testing.assert_array_equal(jaxckpt.restore(d)["w"], np.arange(8.0))
    assert main(["verify", str(d)]) == 1
    assert "DAMAGED w metadata at arrays/w/zarr.json" in capsys.readouterr().out
    doc = (Path(__file__).resolve().parent.parent / "docs" / "format.md").read_text()
    assert "or the read fails with `CorruptChunkError`" not in doc  # what it used to claim
    assert "does not affect a\nrestore" in doc and "`jaxckpt verify` checks" in doc
