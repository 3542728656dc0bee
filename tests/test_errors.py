"""Bad input: each a typed error whose message names the path/key and says what to do."""

import json
import os
import re

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import mesh, one_array_per_leaf, put  # noqa: F401 (autouse)

import jaxckpt

M42 = mesh((4, 2), ("data", "model"))


@pytest.fixture
def ckpt(tmp_path):
    state = {"w": put(np.arange(64, dtype=np.float32).reshape(8, 8), M42, "data", "model"), "s": 1}
    jaxckpt.save(tmp_path / "c", state)
    return tmp_path / "c"


def _edit_manifest(path, fn):
    m = json.loads((path / "manifest.json").read_text())
    fn(m)
    (path / "manifest.json").write_text(json.dumps(m))


def test_missing_path(tmp_path):
    with pytest.raises(jaxckpt.CheckpointNotFoundError, match=r"nope does not exist\. Check the"):
        jaxckpt.restore(tmp_path / "nope")
    with pytest.raises(FileNotFoundError):  # also a FileNotFoundError for generic handlers
        jaxckpt.metadata(tmp_path / "nope")


def test_directory_without_manifest_is_not_a_checkpoint(ckpt):
    (ckpt / "manifest.json").unlink()
    with pytest.raises(jaxckpt.CheckpointNotFoundError, match="unfinished or failed save"):
        jaxckpt.restore(ckpt)


def test_a_run_directory_says_so_and_how_to_restore_its_latest_step(tmp_path):
    run = tmp_path / "run"
    with jaxckpt.CheckpointManager(run) as mgr:
        for step in (10, 20, 30):
            mgr.save(step, {"w": jnp.full(2, step)})
    (run / "00000040" / "arrays").mkdir(parents=True)  # unfinished: not a committed step
    latest, here = re.escape(repr(str(run / "00000030"))), re.escape(repr(str(run)))
    expected = (
        rf"{re.escape(str(run))} is a run directory .*CheckpointManager.* committed step\(s\): "
        rf"\[10, 20, 30\]\. Use one step, e.g. the latest: jaxckpt.restore\({latest}\)"
        rf".*CheckpointManager\({here}\).restore\(\)"
    )
    with pytest.raises(jaxckpt.CheckpointNotFoundError, match=expected):
        jaxckpt.restore(run)
    with pytest.raises(jaxckpt.CheckpointNotFoundError, match="is a run directory"):
        jaxckpt.metadata(run)  # and so `jaxckpt inspect RUN_DIR`
    assert int(jaxckpt.restore(run / "00000030")["w"][0]) == 30  # the suggestion works


def test_corrupted_manifest_json(ckpt):
    (ckpt / "manifest.json").write_text('{"format": "jaxckpt", "vers')
    with pytest.raises(
        jaxckpt.ManifestError, match=r"manifest.json is not valid JSON.*restore an earlier"
    ):
        jaxckpt.restore(ckpt)


def test_unknown_format_version(ckpt):
    _edit_manifest(ckpt, lambda m: m.update(version=99))
    with pytest.raises(jaxckpt.ManifestError, match=r"version 99.*reads version 1.*Upgrade"):
        jaxckpt.metadata(ckpt)


def test_not_a_jaxckpt_manifest(ckpt):
    (ckpt / "manifest.json").write_text("[1, 2]")
    with pytest.raises(jaxckpt.ManifestError, match="not a jaxckpt manifest"):
        jaxckpt.restore(ckpt)


def _chunk_files(ckpt, name="w"):
    return sorted(p for p in (ckpt / "arrays" / name / "c").rglob("*") if p.is_file())


def test_flipped_byte_in_a_chunk_names_key_and_chunk(ckpt):
    chunk = _chunk_files(ckpt)[3]
    data = bytearray(chunk.read_bytes())
    data[5] ^= 0x40
    chunk.write_bytes(bytes(data))
    cell = ",".join(chunk.relative_to(ckpt / "arrays" / "w" / "c").parts)
    with pytest.raises(
        jaxckpt.CorruptChunkError, match=rf"Key 'w': chunk \({cell}\).*checksum.*verify"
    ):
        jaxckpt.restore(ckpt)
    # Keys whose chunks are intact still restore.
    assert jaxckpt.restore(ckpt, keys=["s"]) == {"s": 1}


def test_missing_chunk_is_an_error_not_zeros(ckpt):
    _chunk_files(ckpt)[0].unlink()
    with pytest.raises(jaxckpt.CorruptChunkError, match=r"Key 'w': chunk \(0,0\).*missing"):
        jaxckpt.restore(ckpt)


def test_all_zero_arrays_are_still_stored(tmp_path):
    jaxckpt.save(tmp_path / "c", {"z": put(np.zeros((8, 8), np.float32), M42, "data")})
    assert len(_chunk_files(tmp_path / "c", "z")) == 4
    np.testing.assert_array_equal(jaxckpt.restore(tmp_path / "c")["z"], np.zeros((8, 8)))


def test_unsupported_leaf_names_key_path(tmp_path):
    with pytest.raises(
        jaxckpt.UnsupportedLeafError, match=r"Leaf 'a/1/f' has type function.*Convert"
    ):
        jaxckpt.save(tmp_path / "c", {"a": [1, {"f": lambda: 0}]})
    with pytest.raises(jaxckpt.UnsupportedLeafError, match=r"Leaf 'o' has dtype object"):
        jaxckpt.save(tmp_path / "c", {"o": np.array([None, 1], dtype=object)})
    assert not (tmp_path / "c").exists()


def test_colliding_key_paths_are_refused(tmp_path):
    with pytest.raises(jaxckpt.UnsupportedLeafError, match=r"same key path \['a/b'\]"):
        jaxckpt.save(tmp_path / "c", {"a/b": 1, "a": {"b": 2}})


def test_existing_non_checkpoint_directory_is_not_replaced(tmp_path):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "notes.txt").write_text("mine")
    with pytest.raises(jaxckpt.CheckpointExistsError, match="holds no checkpoint.*'notes.txt'"):
        jaxckpt.save(tmp_path / "c", {"a": jnp.ones(2)})
    assert (tmp_path / "c" / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize(
    "path",
    [
        "../../etc",
        "/etc/passwd",
        "arrays/../../x",
        "arrays/../arrays/w",
        "s3://bucket/x",
        "file:///etc",
        "arrays/.hidden",
        "arrays/a/b",
        "arrays/",
    ],
)
def test_manifest_paths_cannot_escape_the_checkpoint(ckpt, path):
    _edit_manifest(ckpt, lambda m: m["entries"]["w"].update(path=path))
    with pytest.raises(jaxckpt.ManifestError, match=r"entry 'w' has storage path .* outside"):
        jaxckpt.restore(ckpt)


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("shape", [1 << 40, 1 << 40], "absurd size"),
        ("shape", [-1, 8], "invalid shape"),
        ("shape", "8", "invalid shape"),
        ("chunks", [0, 8], "invalid chunk shape"),
        ("chunks", [8], "invalid chunk shape"),
        ("dtype", "object", "unknown dtype"),
        ("storage_dtype", "uint8", "expected float32"),
        ("kind", "pickle", "unknown kind"),
        ("checksum", "sha1", "unknown checksum"),
        ("prng_impl", "../x", "invalid prng_impl"),
    ],
)
def test_manifest_fields_are_validated_before_any_read(ckpt, field, value, message):
    _edit_manifest(ckpt, lambda m: m["entries"]["w"].update({field: value}))
    with pytest.raises(jaxckpt.ManifestError, match=rf"entry 'w' .*{message}.*nothing was read"):
        jaxckpt.metadata(ckpt)


def test_tree_naming_unknown_key_is_rejected(ckpt):
    def add_ghost(m):
        m["tree"]["keys"].append("ghost")
        m["tree"]["children"].append({"type": "leaf", "key": "ghost"})

    _edit_manifest(ckpt, add_ghost)
    with pytest.raises(jaxckpt.ManifestError, match="ghost"):
        jaxckpt.restore(ckpt)


def test_symlinked_array_outside_checkpoint_is_refused(ckpt, tmp_path):
    outside = tmp_path / "elsewhere"
    os.rename(ckpt / "arrays" / "w", outside)
    os.symlink(outside, ckpt / "arrays" / "w")
    with pytest.raises(jaxckpt.ManifestError, match=r"'w'.*outside the checkpoint"):
        jaxckpt.restore(ckpt)


def test_zarr_metadata_cannot_change_how_bytes_decode(ckpt):
    # The manifest is the source of truth: a tampered zarr.json is not read on restore.
    meta = ckpt / "arrays" / "w" / "zarr.json"
    doc = json.loads(meta.read_text())
    doc["codecs"] = [{"name": "bytes", "configuration": {"endian": "big"}}]
    doc["data_type"] = "int32"
    meta.write_text(json.dumps(doc))
    back = jaxckpt.restore(ckpt)["w"]
    assert back.dtype == np.float32
    np.testing.assert_array_equal(back, np.arange(64, dtype=np.float32).reshape(8, 8))


def test_value_entries_accept_only_json_scalar_types(ckpt):
    # A manifest is JSON; a value entry cannot smuggle in an object.
    _edit_manifest(ckpt, lambda m: m["entries"]["s"].update(type="object", value={"__reduce__": 1}))
    with pytest.raises(jaxckpt.ManifestError, match="entry 's' has an invalid value"):
        jaxckpt.restore(ckpt)


def test_symlinked_arrays_folder_outside_checkpoint_is_refused(ckpt, tmp_path):
    outside = tmp_path / "elsewhere"
    os.rename(ckpt / "arrays", outside)
    os.symlink(outside, ckpt / "arrays")
    with pytest.raises(jaxckpt.ManifestError, match=r"'w'.*outside the checkpoint"):
        jaxckpt.restore(ckpt)


def test_symlink_that_stays_inside_the_checkpoint_is_read(ckpt):
    os.rename(ckpt / "arrays" / "w", ckpt / "arrays" / "w_real")
    os.symlink("w_real", ckpt / "arrays" / "w")
    np.testing.assert_array_equal(jaxckpt.restore(ckpt)["w"], np.arange(64.0).reshape(8, 8))
