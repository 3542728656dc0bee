"""jaxckpt.restore reads checkpoints written by the real orbax-checkpoint, onto any mesh."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_equal, mesh, put
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt._cli.main import main

ocp = pytest.importorskip("orbax.checkpoint")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


def _state():
    m = mesh((4, 2), ("data", "model"))
    return {
        "params": {
            "w": put(jnp.arange(96.0).reshape(8, 12), m, "data", "model"),
            "b": put(jnp.arange(12, dtype=jnp.bfloat16), m, "model"),
            "r": put(jnp.linspace(-1, 1, 6, dtype=jnp.float16), m, None),
        },
        "opt": [put(jnp.ones((8, 4), jnp.int32), m, "data"), np.arange(5, dtype=np.uint8)],
        "step": 7,
        "lr": 0.5,
    }


def _save(path, tree, *, ocdbt: bool, zarr3: bool):
    c = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=ocdbt, use_zarr3=zarr3))
    c.save(path, args=ocp.args.PyTreeSave(tree))
    c.close()


def _orbax_restore(path, tree):
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
    with ocp.StandardCheckpointer() as c:
        return c.restore(path, abstract)


@pytest.mark.parametrize(
    "ocdbt,zarr3",
    [(True, True), (True, False), (False, True), (False, False)],
)
def test_restore_onto_other_mesh_one_device_and_host(tmp_path, ocdbt, zarr3):
    tree = _state()
    path = tmp_path / "orbax"
    _save(path, tree, ocdbt=ocdbt, zarr3=zarr3)
    want = _orbax_restore(path, tree)
    other = mesh((2, 4), ("data", "model"))
    target = jax.tree.map(
        lambda x: (
            NamedSharding(other, P("model", "data") if np.ndim(x) == 2 else P())
            if np.ndim(x)
            else x
        ),
        want,
    )
    got = jaxckpt.restore(path, target)
    assert got["params"]["w"].sharding == target["params"]["w"]
    assert_tree_equal(jax.tree.map(np.asarray, got), jax.tree.map(np.asarray, want))
    one = jax.sharding.SingleDeviceSharding(jax.devices()[3])
    got1 = jaxckpt.restore(path, jax.tree.map(lambda x: one if np.ndim(x) else x, want))
    assert got1["params"]["b"].sharding == one
    assert_tree_equal(jax.tree.map(np.asarray, got1), jax.tree.map(np.asarray, want))
    host = jaxckpt.restore(path)
    assert host["step"] == 7 and host["lr"] == 0.5 and isinstance(host["params"]["w"], np.ndarray)
    assert_tree_equal(host, jax.tree.map(np.asarray, want) | {"step": 7, "lr": 0.5})
    assert host["params"]["b"].dtype == jnp.bfloat16


@pytest.mark.parametrize("zarr3", [True, False])
def test_ocdbt_is_told_from_the_files_when_metadata_does_not_say(tmp_path, zarr3):
    """Orbax <= 0.11.30 wrote no use_ocdbt (data/orbax_old holds such checkpoints); this
    orbax's OCDBT items read the same without it, and its non-OCDBT items too."""
    tree = _state()
    for ocdbt in (True, False):
        path = tmp_path / f"o{ocdbt}"
        _save(path, tree, ocdbt=ocdbt, zarr3=zarr3)
        _edit_metadata(path, lambda doc: doc.pop("use_ocdbt", None))
        got = jaxckpt.restore(path)
        assert_tree_equal(
            got, jax.tree.map(np.asarray, _orbax_restore(path, tree)) | {"step": 7, "lr": 0.5}
        )
        assert jaxckpt.metadata(path).created["use_ocdbt"] is ocdbt


def test_reads_only_the_keys_asked_for(tmp_path):
    path = tmp_path / "orbax"
    _save(path, _state(), ocdbt=True, zarr3=False)
    got = jaxckpt.restore(path, keys=["params/w"])
    np.testing.assert_array_equal(got["params"]["w"], np.arange(96.0).reshape(8, 12))
    assert list(got) == ["params"] and list(got["params"]) == ["w"]


def test_standard_checkpointer_and_manager_step(tmp_path, capsys):
    tree = _state()
    with ocp.StandardCheckpointer() as c:
        c.save(tmp_path / "std", tree)
    with ocp.CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(3, args=ocp.args.StandardSave(tree))
    for p in (tmp_path / "std", tmp_path / "run" / "3", tmp_path / "run" / "3" / "default"):
        got = jaxckpt.restore(p)
        np.testing.assert_array_equal(got["opt"][0], np.ones((8, 4), np.int32))
    info = jaxckpt.metadata(tmp_path / "run" / "3")
    assert info.entries["params/w"].shape == (8, 12) and info.entries["step"].value == 7
    assert main(["inspect", str(tmp_path / "std")]) == 0
    out = capsys.readouterr().out
    assert "float32[8,12]" in out and "= 7" in out
    assert main(["verify", str(tmp_path / "std")]) == 0
    assert "stores no checksums" in capsys.readouterr().out


def test_multi_item_step_points_to_its_arrays_and_json_items_restore_as_values(tmp_path, capsys):
    with ocp.CheckpointManager(tmp_path / "run", item_names=("state", "metadata")) as mgr:
        for step in (5, 6):
            mgr.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave({"a": jnp.ones(3)}),
                    metadata=ocp.args.JsonSave({"x": step, "l": [1.5, None, "s", True]}),
                ),
            )
    step = tmp_path / "run" / "5"
    with pytest.raises(
        jaxckpt.ManifestError,
        match=r"items \['metadata', 'state'\]; the arrays are in 'state'.*restore\('.*5/state'\)"
        r".*JSON value.*5/metadata",
    ):
        jaxckpt.restore(step)
    np.testing.assert_array_equal(jaxckpt.restore(step / "state")["a"], 1.0)
    assert jaxckpt.restore(step / "metadata") == {"x": 5, "l": [1.5, None, "s", True]}
    assert jaxckpt.restore(step / "metadata", {"x": 0, "l": [0.0, None, "", False]})["x"] == 5
    jaxckpt.convert(str(step / "metadata"), str(tmp_path / "meta"))
    assert jaxckpt.restore(tmp_path / "meta") == {"x": 5, "l": [1.5, None, "s", True]}
    (tmp_path / "run" / "7.orbax-checkpoint-tmp-123").mkdir()  # a save Orbax did not finish
    assert main(["ls", str(tmp_path / "run")]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[:-1]]
    assert rows[0] == ["NAME", "STATUS", "SIZE", "ADDED", "SAVED", "TIERS", "FORMAT"]
    assert [(r[0], r[1], r[-1]) for r in rows[1:]] == [
        ("5", "committed", "orbax"),
        ("6", "committed", "orbax"),
        ("7.orbax-checkpoint-tmp-123", "incomplete", "-"),
    ]
    with pytest.raises(jaxckpt.CheckpointNotFoundError, match=r"run directory.*\(s\): \[5, 6\]"):
        jaxckpt.restore(tmp_path / "run")


def test_single_json_item_restores_and_other_handlers_are_typed_errors(tmp_path):
    with ocp.CheckpointManager(tmp_path / "run", item_names=("extra",)) as mgr:
        mgr.save(1, args=ocp.args.Composite(extra=ocp.args.JsonSave({"x": 1})))
    assert jaxckpt.restore(tmp_path / "run" / "1") == {"x": 1}
    meta = tmp_path / "run" / "1" / "_CHECKPOINT_METADATA"
    doc = json.loads(meta.read_text())
    doc["item_handlers"]["extra"] = "my.pkg.CustomHandler"
    meta.write_text(json.dumps(doc))
    for path in (tmp_path / "run" / "1", tmp_path / "run" / "1" / "extra"):
        with pytest.raises(
            jaxckpt.ManifestError, match=r"1/extra is an Orbax item of CustomHandler"
        ):
            jaxckpt.restore(path)


def _edit_metadata(path, edit):
    doc = json.loads((path / "_METADATA").read_text())
    edit(doc)
    (path / "_METADATA").write_text(json.dumps(doc))


def test_damaged_orbax_checkpoints_are_typed_errors(tmp_path):
    path = tmp_path / "o"
    _save(path, {"a": {"b": np.arange(4.0)}}, ocdbt=False, zarr3=False)
    (path / "_METADATA").write_text("{not json")
    with pytest.raises(jaxckpt.ManifestError, match=r"_METADATA is not valid JSON"):
        jaxckpt.restore(path)
    _save(tmp_path / "o2", {"a": {"b": np.arange(4.0)}}, ocdbt=False, zarr3=False)
    path = tmp_path / "o2"

    def custom(doc):
        doc["tree_metadata"]["('a', 'b')"]["value_metadata"]["value_type"] = "my.Custom"

    _edit_metadata(path, custom)
    with pytest.raises(jaxckpt.ManifestError, match=r"leaf 'a/b' has Orbax value type 'my.Custom'"):
        jaxckpt.restore(path)
    _save(tmp_path / "o3", {"a": {"b": np.arange(4.0)}}, ocdbt=False, zarr3=False)
    path = tmp_path / "o3"

    def escape(doc):
        doc["tree_metadata"]["('a', 'b')"]["key_metadata"][1]["key"] = "../../etc"

    _edit_metadata(path, escape)
    with pytest.raises(jaxckpt.ManifestError, match=r"key '\.\./\.\./etc'"):
        jaxckpt.restore(path)
    _save(tmp_path / "o4", {"a": {"b": np.arange(4.0)}}, ocdbt=False, zarr3=False)
    (tmp_path / "o4" / "a.b" / "0").unlink()
    with pytest.raises(jaxckpt.CorruptChunkError, match=r"leaf 'a/b' \(array a.b\)"):
        jaxckpt.restore(tmp_path / "o4")


@pytest.mark.parametrize("chunks", [[1 << 20], [1 << 40]], ids=["larger", "absurd"])
def test_orbax_chunks_larger_than_the_array_are_refused(tmp_path, chunks):
    """A zarr chunk grid that would make tensorstore allocate what the array cannot hold (one
    chunk of 8 MiB or 8 TiB for 4 elements) is refused from the metadata, before any read."""
    path = tmp_path / "o"
    _save(path, {"a": {"b": np.arange(4.0)}}, ocdbt=False, zarr3=False)
    zarray = path / "a.b" / ".zarray"
    meta = json.loads(zarray.read_text())
    meta["chunks"] = chunks
    zarray.write_text(json.dumps(meta))
    with pytest.raises(jaxckpt.ManifestError, match=r"array a\.b .*chunk.*Restore it with orbax"):
        jaxckpt.restore(path)


def test_link_outside_the_checkpoint_is_refused(tmp_path):
    _save(tmp_path / "other", {"a": np.arange(3.0)}, ocdbt=False, zarr3=True)
    _save(tmp_path / "o", {"a": np.arange(3.0)}, ocdbt=False, zarr3=True)
    import shutil

    shutil.rmtree(tmp_path / "o" / "a")
    (tmp_path / "o" / "a").symlink_to(tmp_path / "other" / "a")
    with pytest.raises(jaxckpt.ManifestError, match=r"parameter a is a link outside"):
        jaxckpt.restore(tmp_path / "o")


def test_damaged_ocdbt_database_is_a_typed_error(tmp_path):
    path = tmp_path / "o"
    _save(path, {"a": np.arange(4.0)}, ocdbt=True, zarr3=True)
    (path / "manifest.ocdbt").write_bytes(b"\0" * 10)
    with pytest.raises(jaxckpt.CorruptChunkError, match=r"leaf 'a'|OCDBT database"):
        jaxckpt.restore(path)
