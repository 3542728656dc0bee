"""The first slips of a new user, and the calls a user from Orbax reaches for (issue 43).

Each slip gets an answer that says what is at the path (or in the call) and the next step, in
one line, from the Python API and from the command line alike.
"""

from __future__ import annotations

import logging
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_equal, mesh, one_array_per_leaf, put  # noqa: F401 (autouse)
from test_cli import assert_one_line_error, run
from test_s3 import s3  # noqa: F401 (fixture)

import jaxckpt

# -- what is at the path ---------------------------------------------------------------------


@pytest.mark.parametrize("name", ["train.py", "notes.txt", "config.json"])
def test_a_file_that_is_no_checkpoint_says_what_was_looked_for(tmp_path, capsys, name):
    f = tmp_path / name
    f.write_text('{"lr": 0.1}\n' if name.endswith(".json") else "import os\nprint(os.getcwd())\n")
    with pytest.raises(jaxckpt.CheckpointNotFoundError, match="is a file, not a checkpoint") as e:
        jaxckpt.restore(f)
    msg = str(e.value)
    assert str(f) in msg and "manifest.json" in msg and "Orbax" in msg and "safetensors" in msg
    assert "re-download" not in msg.lower()
    for command in ("inspect", "verify"):
        code, _, err = run(capsys, command, f)
        assert code == 2  # docs/cli.md: a path without a checkpoint
        assert_one_line_error(err, str(f), "is a file, not a checkpoint")


def test_an_npz_that_export_wrote_is_no_checkpoint(tmp_path, capsys):
    jaxckpt.save(tmp_path / "c", {"w": np.arange(4.0)})
    assert run(capsys, "export", tmp_path / "c", tmp_path / "w.npz")[0] == 0
    code, _, err = run(capsys, "convert", tmp_path / "w.npz", tmp_path / "d")
    assert code == 2
    assert_one_line_error(err, "w.npz is an .npz archive", "numpy.load", "exported from")


def test_a_damaged_safetensors_file_is_still_reported_as_damaged(tmp_path):
    f = tmp_path / "model.safetensors"
    f.write_bytes((10**12).to_bytes(8, "little") + b"{}")
    with pytest.raises(jaxckpt.ManifestError, match="header claims"):
        jaxckpt.restore(f)


def test_the_manifest_file_as_the_path_means_its_folder(tmp_path, capsys):
    tree = {"w": np.arange(6.0), "step": 3}
    jaxckpt.save(tmp_path / "c", tree)
    assert_tree_equal(jaxckpt.restore(tmp_path / "c" / "manifest.json"), tree)
    assert jaxckpt.metadata(tmp_path / "c" / "manifest.json").entries["w"].shape == (6,)
    assert run(capsys, "verify", tmp_path / "c" / "manifest.json")[0] == 0
    jaxckpt.save("memory://first-day/c", tree)
    assert_tree_equal(jaxckpt.restore("memory://first-day/c/manifest.json"), tree)


def test_a_path_that_does_not_exist_says_so(tmp_path, capsys):
    missing = tmp_path / "nope"
    with pytest.raises(jaxckpt.CheckpointNotFoundError, match=r"nope does not exist\. Check"):
        jaxckpt.restore(missing)
    code, _, err = run(capsys, "inspect", missing)
    assert code == 2
    assert_one_line_error(err, str(missing), "does not exist")
    assert "latest_step" not in err and "unfinished" not in err
    with pytest.raises(jaxckpt.CheckpointNotFoundError, match=r"nothing is there"):
        jaxckpt.restore("memory://first-day/never-saved")


def test_a_missing_bucket_says_so(s3, capsys):  # noqa: F811
    url = "s3://no-such-bucket-here/ckpt"
    with pytest.raises(jaxckpt.CheckpointNotFoundError, match="no-such-bucket-here.*bucket"):
        jaxckpt.restore(url)
    code, _, err = run(capsys, "inspect", url)
    assert code == 2
    assert_one_line_error(err, "no-such-bucket-here", "bucket exists")


def test_a_missing_base_is_named_as_the_base(tmp_path):
    with pytest.raises(jaxckpt.CheckpointNotFoundError, match=r"The base of this incremental.*nob"):
        jaxckpt.save(tmp_path / "c", {"w": np.ones(3)}, base=tmp_path / "nob")
    assert not (tmp_path / "c").exists()


# -- manager slips ---------------------------------------------------------------------------


def test_manager_restore_with_the_target_first_says_step_comes_first(tmp_path):
    with jaxckpt.CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(1, {"w": np.ones(3)})
        mgr.wait()
        with pytest.raises(TypeError, match=r"step comes first.*got a dict.*restore\(target="):
            mgr.restore({"w": None})
        with pytest.raises(TypeError, match=r"save\(step, tree\): the step comes first"):
            mgr.save({"w": np.ones(3)}, 2)
        assert_tree_equal(mgr.restore(target={"w": None}), {"w": np.ones(3)})


@pytest.mark.parametrize("read_only", [False, True])
def test_a_manager_refuses_a_checkpoint_folder(tmp_path, read_only):
    jaxckpt.save(tmp_path / "c", {"w": np.ones(3)})
    with pytest.raises(jaxckpt.CheckpointError, match=r"c is a checkpoint .*not a run directory"):
        jaxckpt.CheckpointManager(tmp_path / "c", read_only=read_only)
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["arrays", "manifest.json"]


def test_saving_a_step_retention_would_delete_at_once_is_refused(tmp_path):
    with jaxckpt.CheckpointManager(tmp_path / "run", max_to_keep=2, async_save=False) as mgr:
        mgr.save(6, {"w": np.ones(3)})
        mgr.save(9, {"w": np.ones(3)})
        with pytest.raises(jaxckpt.CheckpointError, match=r"Step 5 is older.*\[6, 9\].*delete"):
            mgr.save(5, {"w": np.ones(3)})
        assert mgr.all_steps() == [6, 9]


# -- mismatches ------------------------------------------------------------------------------


def test_every_mismatched_leaf_is_reported_at_once(tmp_path):
    jaxckpt.save(tmp_path / "c", {"w": np.ones((4, 4), np.float32), "b": np.ones(3, np.float32)})
    target = {"w": np.zeros((4, 5), np.float32), "b": np.zeros(3, np.float64)}
    with pytest.raises(jaxckpt.DtypeMismatchError) as e:
        jaxckpt.restore(tmp_path / "c", target)
    msg = str(e.value)
    assert msg.startswith("2 leaves of `target` do not fit the checkpoint")
    assert "Key 'b': dtype in `target`: float64, on disk: float32" in msg
    assert "Key 'w': shape in `target`: (4, 5), on disk: (4, 4)" in msg
    many = {f"x{i:02d}": np.ones(2) for i in range(15)}
    jaxckpt.save(tmp_path / "m", many)
    with pytest.raises(jaxckpt.ShapeMismatchError, match=r"^15 leaves .*\(10\) .*and 5 more\.$"):
        jaxckpt.restore(tmp_path / "m", {k: np.zeros(3) for k in many})


def test_a_sharding_that_does_not_divide_the_shape_names_the_key(tmp_path):
    jaxckpt.save(tmp_path / "c", {"w": np.ones((4, 4), np.float32)})
    three = mesh((3,), ("a",))
    sharding = jax.sharding.NamedSharding(three, jax.sharding.PartitionSpec("a"))
    for leaf in (sharding, jax.ShapeDtypeStruct((4, 4), np.float32, sharding=sharding)):
        with pytest.raises(jaxckpt.ShapeMismatchError, match=r"Key 'w': the target's sharding"):
            jaxckpt.restore(tmp_path / "c", {"w": leaf})


# -- the command line ------------------------------------------------------------------------


def test_cli_version_and_help_list_every_command(capsys):
    code, out, _ = run(capsys, "--version")
    assert code == 0 and out.strip() == f"jaxckpt {jaxckpt.__version__}"
    out = subprocess.run(
        [sys.executable, "-m", "jaxckpt", "--version"], capture_output=True, text=True
    ).stdout
    assert out.strip() == f"jaxckpt {jaxckpt.__version__}"
    code, out, _ = run(capsys, "--help")
    assert code == 0
    for command in ("inspect", "verify", "ls", "export", "convert"):
        assert f"    {command}" in out
    assert "Orbax" in out and "safetensors" in out


def test_cli_messages_name_flags_and_commands(tmp_path, capsys):
    jaxckpt.save(tmp_path / "src", {"w": np.ones(3)})
    jaxckpt.save(tmp_path / "dst", {"w": np.ones(3)})
    code, _, err = run(capsys, "convert", tmp_path / "src", tmp_path / "dst")
    assert code == 2
    assert_one_line_error(err, "--overwrite")
    assert "overwrite=True" not in err
    with jaxckpt.CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(100, {"w": np.ones(3)})
    code, _, err = run(capsys, "inspect", tmp_path / "run")
    assert code == 2
    assert_one_line_error(err, f"`jaxckpt inspect {tmp_path / 'run' / '00000100'}`")
    assert "jaxckpt.restore" not in err and "CheckpointManager(" not in err


# -- what metadata shows is what restore returns -----------------------------------------------


def test_numpy_scalars_and_complex_values_come_back_as_saved(tmp_path):
    tree = {
        "f": np.float32(1.5),
        "i": np.int64(-7),
        "b": np.bool_(True),
        "z": np.zeros((), np.float32),  # a 0-d array stays an array
        "c": 1.5 - 2j,
        "nan": complex(float("nan"), float("inf")),
    }
    jaxckpt.save(tmp_path / "c", tree)
    got = jaxckpt.restore(tmp_path / "c")
    for k in ("f", "i", "b"):
        assert type(got[k]) is type(tree[k]) and got[k] == tree[k], k
    assert type(got["z"]) is np.ndarray and got["z"].shape == ()
    assert got["c"] == 1.5 - 2j and type(got["c"]) is complex
    assert np.isnan(got["nan"].real) and got["nan"].imag == float("inf")
    jaxckpt.save(tmp_path / "d", {"f": np.float32(2.5)})  # the plan cache keeps them apart
    jaxckpt.save(tmp_path / "e", {"f": np.zeros((), np.float32)})
    assert type(jaxckpt.restore(tmp_path / "e")["f"]) is np.ndarray


def test_abstract_is_the_saved_tree_as_restore_returns_it(tmp_path):
    m = mesh((4, 2), ("data", "model"))
    state = {
        "params": {"w": put(jnp.arange(64.0).reshape(8, 8), m, "data", "model")},
        "rng": jax.random.key(7),
        "opt": (jnp.zeros(3, jnp.bfloat16), [np.int32(4)]),
        "step": 12,
    }
    jaxckpt.save(tmp_path / "c", state)
    meta = jaxckpt.metadata(tmp_path / "c")
    assert isinstance(meta, jaxckpt.Manifest)
    abstract = meta.abstract()
    restored = jaxckpt.restore(tmp_path / "c")
    leaves = jax.tree.leaves(restored)
    structs = jax.tree.leaves(abstract)
    assert jax.tree.structure(abstract) == jax.tree.structure(restored)
    for s, r in zip(structs, leaves):
        if isinstance(s, jax.ShapeDtypeStruct):
            assert (s.shape, s.dtype) == (np.shape(r), r.dtype)
        else:
            assert s == r
    other = mesh((2, 4), ("x", "y"))
    sharding = jax.sharding.NamedSharding(other, jax.sharding.PartitionSpec("y"))
    target = jax.tree.map(
        lambda s: (
            s.update(sharding=sharding)
            if isinstance(s, jax.ShapeDtypeStruct) and s.shape and s.shape[0] % 4 == 0
            else s
        ),
        abstract,
    )
    got = jaxckpt.restore(tmp_path / "c", target)
    assert got["params"]["w"].sharding == sharding
    np.testing.assert_array_equal(got["params"]["w"], np.arange(64.0).reshape(8, 8))


def test_inspect_shows_a_key_array_as_restore_returns_it(tmp_path, capsys):
    jaxckpt.save(tmp_path / "c", {"rng": jax.random.split(jax.random.key(0), 3)})
    code, out, _ = run(capsys, "inspect", tmp_path / "c")
    assert code == 0
    row = next(line for line in out.splitlines() if line.lstrip().startswith("rng"))
    assert "key<threefry2x32>[3]" in row and "key data uint32[3,2]" in row


# -- the manager calls an Orbax user reaches for ---------------------------------------------


def test_manager_best_step_metadata_should_save_reload_delete(tmp_path):
    run_dir = tmp_path / "run"
    mgr = jaxckpt.CheckpointManager(
        run_dir, save_interval_steps=2, best_fn=lambda m: m["loss"], async_save=False
    )
    assert mgr.best_step() is None
    for step, loss in [(2, 0.5), (4, 0.2), (6, 0.9)]:
        assert mgr.should_save(step) and not mgr.should_save(step + 1)
        mgr.save(step, {"w": np.full(3, step, np.float32)}, metrics={"loss": loss})
    assert mgr.best_step() == 4 and mgr.latest_step() == 6
    meta = mgr.metadata(4)
    assert meta.entries["w"].shape == (3,) and meta.abstract()["w"].dtype == np.float32
    with pytest.raises(jaxckpt.CheckpointNotFoundError, match=r"Step 5 is not in .*\[2, 4, 6\]"):
        mgr.metadata(5)
    reader = jaxckpt.CheckpointManager(run_dir, read_only=True)
    mgr.save(8, {"w": np.full(3, 8, np.float32)}, metrics={"loss": 0.1})
    reader.reload()
    assert reader.all_steps() == [2, 4, 6, 8] and reader.best_step() == 8
    mgr.delete(4)
    assert reader.all_steps() == [2, 6, 8] and mgr.metrics(4) is None
    with pytest.raises(jaxckpt.CheckpointNotFoundError, match="Nothing was deleted"):
        mgr.delete(4)
    plain = jaxckpt.CheckpointManager(tmp_path / "plain")
    plain.save(1, {"w": np.ones(2)})
    plain.save(3, {"w": np.ones(2)})
    plain.wait()
    assert plain.best_step() == 3  # without best_fn: the latest


def test_logging_names_what_retention_deleted(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="jaxckpt")
    with jaxckpt.CheckpointManager(tmp_path / "run", max_to_keep=1) as mgr:
        for step in range(3):
            mgr.save(step, {"w": np.ones(2)})
    deleted = sorted(r.getMessage() for r in caplog.records if "deleted step" in r.getMessage())
    assert deleted == [f"deleted step {s} from {tmp_path / 'run'} (retention)" for s in (0, 1)]
