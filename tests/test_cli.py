"""The command line, run in-process through ``main([...])`` on real checkpoints."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import mesh, one_array_per_leaf, put  # noqa: F401 (autouse)

import jaxckpt
from jaxckpt._cli.main import main


def _tree() -> dict:
    m = mesh((4, 2), ("x", "y"))
    return {
        "params": {
            "dense": {
                "kernel": put(jnp.arange(64.0).reshape(8, 8), m, "x", "y"),
                "bias": put(jnp.linspace(0, 1, 8).astype(jnp.bfloat16), m, None),
            },
            "emb": np.arange(12, dtype=np.int16).reshape(3, 4),
        },
        "flags": np.array([True, False]),
        "nibbles": np.array([1, 2, 15], dtype=ml_dtypes.uint4),
        "step": 7,
        "name": "run-1",
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """A run directory: two committed steps and one unfinished one."""
    d = tmp_path_factory.mktemp("runs")
    jaxckpt.save(d / "000100", _tree())
    jaxckpt.save(d / "000020", _tree())
    (d / "000300" / "arrays").mkdir(parents=True)
    (d / ".000400.tmp-abcd1234").mkdir()
    return d


@pytest.fixture
def ckpt(tmp_path) -> Path:
    """A fresh checkpoint the test may damage."""
    jaxckpt.save(tmp_path / "c", _tree())
    return tmp_path / "c"


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(err: str, *needles: str) -> None:
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and err.endswith(lines[0] + "\n"), err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], (n, lines[0])


# inspect ------------------------------------------------------------------------------------


def test_inspect_prints_the_tree_with_shapes_dtypes_grids_shardings(capsys, runs):
    code, out, _ = run(capsys, "inspect", runs / "000100")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith(f"{runs / '000100'}: 5 arrays (301 B)") and "2 values" in lines[0]
    assert "params/" in lines and "  dense/" in lines
    kernel = next(line for line in lines if line.strip().startswith("kernel"))
    assert kernel.startswith("    kernel")
    assert "float32[8,8]" in kernel and "chunks 4x2 of [2,4]" in kernel and "256 B" in kernel
    assert "spec=P('x', 'y')" in kernel.replace("PartitionSpec(", "P(")  # jax <= 0.8 spells it out
    assert any("bfloat16[8]" in line for line in lines)
    assert any("uint4[3]" in line for line in lines)
    assert any(line.startswith("step") and "= 7" in line for line in lines)
    assert any(line.startswith("name") and "= 'run-1'" in line for line in lines)


def test_inspect_json_lists_every_entry(capsys, runs):
    code, out, _ = run(capsys, "inspect", "--json", runs / "000100")
    assert code == 0
    doc = json.loads(out)
    entries = {e["key"]: e for e in doc["entries"]}
    assert set(entries) == {
        "params/dense/kernel",
        "params/dense/bias",
        "params/emb",
        "flags",
        "nibbles",
        "step",
        "name",
    }
    k = entries["params/dense/kernel"]
    assert (k["shape"], k["dtype"], k["chunks"], k["grid"], k["nbytes"]) == (
        [8, 8],
        "float32",
        [2, 4],
        [4, 2],
        256,
    )
    assert entries["nibbles"]["storage_dtype"] == "uint8"
    assert entries["step"] == {"key": "step", "kind": "value", "value": 7}
    assert doc["arrays"] == 5 and doc["nbytes"] == 256 + 16 + 24 + 2 + 3


def test_inspect_shows_saved_iterator_positions(capsys, tmp_path):
    class Position:
        def get_state(self):
            return {"next_index": 12}

        def set_state(self, state):
            pass

    path = tmp_path / "c"
    jaxckpt.save(path, {"x": 1}, iterators={"train": Position()})
    assert main(["inspect", str(path)]) == 0
    assert "iterator 'train': the position of 1 process (json; --json shows it)" in (
        capsys.readouterr().out
    )
    assert main(["inspect", "--json", str(path)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["iterators"] == {
        "train": {"process_count": 1, "states": {"0": {"json": {"next_index": 12}}}}
    }


def test_inspect_missing_checkpoint_is_one_line_exit_2(capsys, tmp_path):
    code, out, err = run(capsys, "inspect", tmp_path / "nope")
    assert code == 2 and out == ""
    assert_one_line_error(err, "jaxckpt inspect: error:", str(tmp_path / "nope"), "does not exist")


def test_inspect_unfinished_save_says_it_is_not_committed(capsys, runs):
    code, _, err = run(capsys, "inspect", runs / "000300")
    assert code == 2
    assert_one_line_error(err, str(runs / "000300"), "unfinished or failed save")


def test_inspect_damaged_manifest_exits_1_naming_it(capsys, ckpt):
    (ckpt / "manifest.json").write_text("{not json")
    code, _, err = run(capsys, "inspect", ckpt)
    assert code == 1
    assert_one_line_error(err, f"{ckpt}/manifest.json", "not valid JSON", "restore an earlier")


def test_unknown_url_scheme_is_one_line_exit_2(capsys):
    code, _, err = run(capsys, "inspect", "ftp://host/ckpt")
    assert code == 2
    assert_one_line_error(err, "'ftp'", "ftp://host/ckpt", "use a local path")


def test_usage_errors_exit_2(capsys):
    assert main(["frobnicate"]) == 2
    assert "invalid choice" in capsys.readouterr().err
    assert main([]) == 2
    assert main(["--help"]) == 0
    assert "inspect" in capsys.readouterr().out


# verify -------------------------------------------------------------------------------------


def test_verify_clean_checkpoint(capsys, runs):
    code, out, _ = run(capsys, "verify", runs / "000100")
    assert code == 0
    assert out.startswith(f"OK: {runs / '000100'}: 5 arrays, 12 chunks")


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x55
    path.write_bytes(bytes(data))


def test_verify_names_every_damaged_chunk_and_key(capsys, ckpt):
    kernel = ckpt / "arrays" / "params.dense.kernel" / "c"
    _flip(kernel / "0" / "1")
    _flip(kernel / "3" / "0")
    (ckpt / "arrays" / "params.emb" / "c" / "0" / "0").unlink()
    code, out, _ = run(capsys, "verify", ckpt)
    assert code == 1
    damaged = [line for line in out.splitlines() if line.startswith("DAMAGED ")]
    assert damaged == [
        "DAMAGED params/dense/kernel chunk (0,1) at arrays/params.dense.kernel/c/0/1: "
        "fails its checksum",
        "DAMAGED params/dense/kernel chunk (3,0) at arrays/params.dense.kernel/c/3/0: "
        "fails its checksum",
        "DAMAGED params/emb chunk (0,0) at arrays/params.emb/c/0/0: is missing",
    ]
    summary = out.splitlines()[-1]
    assert summary.startswith(f"DAMAGED: {ckpt}: 3 of 12 chunks bad, 2 of 5 arrays affected")
    assert "params/dense/kernel ((0,1) (3,0)); params/emb ((0,0))" in summary
    assert "Restore an earlier checkpoint" in summary


def test_verify_checks_each_arrays_zarr_json(capsys, ckpt):
    # jaxckpt reads by the manifest, but other zarr readers need zarr.json.
    (ckpt / "arrays" / "flags" / "zarr.json").unlink()
    meta = json.loads((ckpt / "arrays" / "params.emb" / "zarr.json").read_text())
    meta["shape"] = [4, 4]
    (ckpt / "arrays" / "params.emb" / "zarr.json").write_text(json.dumps(meta))
    code, out, _ = run(capsys, "verify", ckpt)
    assert code == 1
    damaged = [line for line in out.splitlines() if line.startswith("DAMAGED ")]
    assert len(damaged) == 2
    assert damaged[0] == "DAMAGED flags metadata at arrays/flags/zarr.json: is missing"
    assert damaged[1].startswith(
        "DAMAGED params/emb metadata at arrays/params.emb/zarr.json: does not match the manifest"
    )
    assert 'Expected "shape" of [3,4] but received: [4,4]' in damaged[1]
    assert "0 of 12 chunks bad, 2 of 5 arrays affected: flags (zarr.json); params/emb" in out


def test_verify_missing_checkpoint_exits_2(capsys, tmp_path):
    code, _, err = run(capsys, "verify", tmp_path)
    assert code == 2
    assert_one_line_error(
        err,
        "jaxckpt verify: error:",
        str(tmp_path),
        "a folder without a checkpoint",
        "manifest.json",
    )


def test_verify_progress_goes_to_stderr(capsys, runs):
    code, out, err = run(capsys, "verify", "--progress", runs / "000100")
    assert code == 0
    assert "verify:" in err and "100%" in err and "verify:" not in out


# ls -----------------------------------------------------------------------------------------


def test_ls_lists_steps_in_order_with_status_and_size(capsys, runs):
    code, out, _ = run(capsys, "ls", runs)
    assert code == 0
    rows = [line.split() for line in out.splitlines()]
    assert rows[0] == ["NAME", "STATUS", "SIZE", "ADDED", "SAVED", "TIERS"]
    assert [r[:2] for r in rows[1:-1]] == [
        ["000020", "committed"],
        ["000100", "committed"],
        ["000300", "incomplete"],
    ]
    on_disk = sum(f.stat().st_size for f in (runs / "000100").rglob("*") if f.is_file())
    size = f"{on_disk / 1024:.1f} KiB".split() if on_disk >= 1024 else [str(on_disk), "B"]
    assert rows[2][2:6] == size + size  # nothing shared: it adds all it holds
    assert rows[2][8] == "persistent" and rows[3][2:] == ["0", "B", "0", "B", "-", "-"]
    assert out.splitlines()[-1].startswith("total: 3 entries (2 committed, 1 incomplete), ")


def test_ls_all_and_json_include_hidden_temporaries(capsys, runs):
    code, out, _ = run(capsys, "ls", "--all", "--json", runs)
    assert code == 0
    doc = json.loads(out)
    assert doc["total_bytes"] == sum(e["added"] for e in doc["entries"])
    names = [(e["name"], e["committed"]) for e in doc["entries"]]
    assert names == [
        ("000020", True),
        ("000100", True),
        ("000300", False),
        (".000400.tmp-abcd1234", False),
    ]
    assert doc["entries"][0]["nbytes"] > 256


def test_ls_errors(capsys, tmp_path, runs):
    code, _, err = run(capsys, "ls", tmp_path / "absent")
    assert code == 2
    assert_one_line_error(err, str(tmp_path / "absent"), "is not a directory", "Check the path")
    code, _, err = run(capsys, "ls", runs / "000100")
    assert code == 2
    assert_one_line_error(err, "is itself a checkpoint", f"jaxckpt inspect {runs / '000100'}")
    code, out, err = run(capsys, "ls", tmp_path)
    assert code == 0 and out == "" and "no checkpoints" in err


# export -------------------------------------------------------------------------------------


def _read_safetensors(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def test_export_safetensors_is_exact(capsys, runs, tmp_path):
    out_path = tmp_path / "model.safetensors"
    code, out, err = run(capsys, "export", runs / "000100", out_path)
    assert code == 0 and f"wrote {out_path}: 4 arrays" in out
    assert "skipped 1 array .safetensors cannot hold: nibbles (uint4)" in err
    header, data = _read_safetensors(out_path)
    meta = header.pop("__metadata__")
    assert meta["value:step"] == "7" and json.loads(meta["value:name"]) == "run-1"
    want = jaxckpt.restore(runs / "000100")
    dtypes = {"F32": np.float32, "BF16": ml_dtypes.bfloat16, "I16": np.int16, "BOOL": np.bool_}
    keys = {"params/dense/kernel", "params/dense/bias", "params/emb", "flags"}
    assert set(header) == keys
    for key, h in header.items():
        a, b = h["data_offsets"]
        got = np.frombuffer(data[a:b], dtypes[h["dtype"]]).reshape(h["shape"])
        ref = want
        for part in key.split("/"):
            ref = ref[part]
        assert got.dtype == ref.dtype and got.tobytes() == ref.tobytes(), key
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    loaded = safetensors_numpy.load_file(str(out_path))
    np.testing.assert_array_equal(loaded["params/dense/kernel"], want["params"]["dense"]["kernel"])


def test_export_npz_selected_keys(capsys, runs, tmp_path):
    out_path = tmp_path / "w.npz"
    code, _, err = run(capsys, "export", runs / "000100", out_path, "--keys", "params", "step")
    assert code == 0
    assert "params/dense/bias (bfloat16)" in err and ".safetensors holds bfloat16" in err
    with np.load(out_path) as z:
        assert sorted(z.files) == ["params/dense/kernel", "params/emb", "step"]
        np.testing.assert_array_equal(z["params/dense/kernel"], np.arange(64.0).reshape(8, 8))
        assert z["params/emb"].dtype == np.int16 and int(z["step"]) == 7


def test_export_errors_name_the_file_and_the_fix(capsys, runs, tmp_path):
    src = runs / "000100"
    code, _, err = run(capsys, "export", src, tmp_path / "x.h5")
    assert code == 2
    assert_one_line_error(err, str(tmp_path / "x.h5"), "must end in .safetensors or .npz")
    (tmp_path / "old.npz").write_bytes(b"keep")
    code, _, err = run(capsys, "export", src, tmp_path / "old.npz")
    assert code == 2
    assert_one_line_error(err, str(tmp_path / "old.npz"), "exists", "--force")
    assert (tmp_path / "old.npz").read_bytes() == b"keep"
    assert main(["export", str(src), str(tmp_path / "old.npz"), "--force"]) == 0
    capsys.readouterr()
    code, _, err = run(capsys, "export", src, tmp_path / "no" / "dir" / "x.npz")
    assert code == 2
    assert_one_line_error(err, str(tmp_path / "no" / "dir"), "does not exist", "create it")
    code, _, err = run(capsys, "export", src, tmp_path / "y.npz", "--keys", "paramz")
    assert code == 2
    assert_one_line_error(err, "--keys paramz match no key", "jaxckpt inspect")
    assert "keys=" not in err  # the flag, not the Python argument (issue 56)
    assert not (tmp_path / "y.npz").exists()
    code, _, err = run(capsys, "export", tmp_path / "absent", tmp_path / "z.npz")
    assert code == 2
    assert_one_line_error(err, str(tmp_path / "absent"), "does not exist")


def test_export_damaged_chunk_exits_1_and_leaves_no_file(capsys, ckpt, tmp_path):
    _flip(ckpt / "arrays" / "params.emb" / "c" / "0" / "0")
    out_path = tmp_path / "o.safetensors"
    code, _, err = run(capsys, "export", ckpt, out_path)
    assert code == 1
    assert_one_line_error(err, "Key 'params/emb'", "chunk (0,0)", "fails its checksum")
    assert not out_path.exists() and not list(tmp_path.glob(".o.safetensors*"))


def test_python_dash_m_runs_the_cli(runs):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    r = subprocess.run(
        [sys.executable, "-m", "jaxckpt", "inspect", str(runs / "000100")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "float32[8,8]" in r.stdout


def test_cli_never_initialises_a_jax_backend(runs):
    # docs/cli.md promises the CLI is safe beside a job that holds the accelerators.
    code = (
        "import sys\n"
        "from jaxckpt._cli.main import main\n"
        "for cmd in ('inspect', 'verify'):\n"
        "    assert main([cmd, sys.argv[1]]) == 0\n"
        "assert main(['ls', sys.argv[2]]) == 0\n"
        "from jax._src import xla_bridge\n"
        "assert not xla_bridge._backends, xla_bridge._backends\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(runs / "000100"), str(runs)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr


def _cli_md_example() -> tuple[str, str]:
    """The command and the output of docs/cli.md's inspect example."""
    doc = (Path(__file__).resolve().parent.parent / "docs" / "cli.md").read_text()
    block = doc.split("## inspect\n", 1)[1].split("```\n", 2)[1]
    command, _, output = block.partition("\n")
    return command.removeprefix("$ "), output


def test_cli_md_inspect_example_is_what_inspect_prints(capsys, tmp_path, monkeypatch):
    # The page's example predated packing (issue 31.9); pinned to the real output now. Packed
    # arrays say "packed"; where in the pack only with -v (issue 31.8).
    m = mesh((4, 2), ("x", "y"))
    kernel = put(jnp.arange(1024 * 512, dtype=jnp.float32).reshape(1024, 512), m, "x", "y")
    tree = {
        "params": {
            "dense": {"kernel": kernel, "bias": put(jnp.zeros(512), m)},
            "norm": {"scale": np.ones(512, np.float32)},
        },
        "step": 7,
    }
    monkeypatch.chdir(tmp_path)
    planner = jaxckpt.DefaultSavePlanner(pack_bytes=256 << 10)  # the default (autouse: off)
    jaxckpt.save("checkpoints/000100", tree, planner=planner)
    command, output = _cli_md_example()
    assert command == "jaxckpt inspect checkpoints/000100"
    # The sharding column is jax's own repr, which differs between jax versions (P(...) or
    # PartitionSpec(...), memory_kind or not): compared up to it.
    code, printed, err = run(capsys, *command.split()[1:])
    assert (code, err) == (0, "")
    same = re.compile(r"NamedSharding\(mesh=Mesh\('x': 4, 'y': 2\), spec=(P|PartitionSpec)\(.*\)")
    assert same.sub("SHARDING", printed) == same.sub("SHARDING", output)
    assert printed.count("NamedSharding(") == output.count("NamedSharding(") == 2
    code, verbose, _ = run(capsys, "inspect", "-v", "checkpoints/000100")
    assert "packed in arrays/pack.float32.0 at 512  2.0 KiB" in verbose
    assert "packed in" not in output and " at 0 " not in output
    code, out, _ = run(capsys, "inspect", "--json", "checkpoints/000100")
    entries = {e["key"]: e for e in json.loads(out)["entries"]}
    assert entries["params/norm/scale"]["offset"] == 512


def test_prng_keys_read_as_docs_cli_md_says(capsys, tmp_path):
    """Issue 56.2: the doc shows what `inspect` prints for a key and for a batch of keys."""
    import jax

    jaxckpt.save(
        tmp_path / "c", {"one": jax.random.key(0), "four": jax.random.split(jax.random.key(1), 4)}
    )
    code, out, _ = run(capsys, "inspect", tmp_path / "c")
    doc = (Path(__file__).parents[1] / "docs" / "cli.md").read_text()
    for shown in (
        "key<threefry2x32>[] (key data uint32[2])",
        "key<threefry2x32>[4] (key data uint32[4,2])",
    ):
        assert code == 0 and shown in out and f"`{shown}`" in doc
