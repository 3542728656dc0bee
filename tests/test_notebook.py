"""notebooks/quickstart.ipynb runs top to bottom in a fresh kernel, so it never rots."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from helpers import HtmlTable

import jaxckpt

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOK = Path(__file__).parents[1] / "notebooks" / "quickstart.ipynb"


def _text(cell) -> str:
    out = []
    for o in cell.get("outputs", []):
        out.append(o.get("text", ""))
        out.append(o.get("data", {}).get("text/plain", ""))
    return "".join(out)


def _html(cell) -> str:
    return "".join(o.get("data", {}).get("text/html", "") for o in cell.get("outputs", []))


def test_metadata_renders_as_a_table_and_a_short_repr(tmp_path):
    tree = {"params": {"w": np.zeros((512, 512), np.float32), "b": np.ones(3)}, "step": 7,
            "name": "<run & 1>"}  # fmt: skip
    jaxckpt.save(tmp_path / "c", tree)
    info = jaxckpt.metadata(tmp_path / "c")
    t = HtmlTable(info._repr_html_())
    assert t.rows[0] == ["key", "type", "stored", "bytes", "sharding"]
    assert "2 arrays (1.0 MiB), 2 values" in t.caption
    rows = {r[0]: r[1:] for r in t.rows[1:]}
    assert rows["params/"] == [""] and rows["w"][:3] == ["float32[512,512]", "chunks 1x1 of [512,512]",
                                                         "1.0 MiB"]  # fmt: skip
    assert rows["b"][0] == "float64[3]" and rows["step"] == ["= 7"]
    assert rows["name"] == ["= '<run & 1>'"]  # escaped in the HTML, itself in the text
    text = repr(info)
    assert text.startswith("CheckpointMetadata: 2 arrays (1.0 MiB), 2 values, format v")
    assert len(text.splitlines()) <= 10 and "float32[512,512]" in text


def test_a_long_tree_repr_keeps_its_largest_arrays_and_counts_the_others(tmp_path):
    tree = {f"layer{i}": {"w": np.zeros(2 + i), "n": i} for i in range(50)}
    jaxckpt.save(tmp_path / "c", tree | {"emb": np.zeros((64, 64))})
    info = jaxckpt.metadata(tmp_path / "c")
    lines = repr(info).splitlines()
    assert len(lines) <= 22 and lines[1].split()[:2] == ["emb", "float64[64,64]"]  # the largest
    shown = [line.split()[1] for line in lines[1:] if " w " in f" {line.strip()} "]
    assert shown == [f"float64[{2 + i}]" for i in range(41, 50)]  # then the next largest
    assert lines[-1] == (
        "  ... and 41 other arrays (7.0 KiB) and 50 values not shown (str() shows every entry; "
        ".entries has them all)"
    )
    assert len(str(info).splitlines()) == 1 + 50 * 3 + 1  # str(): every entry, as inspect


def test_a_short_tree_repr_shows_every_entry_however_large(tmp_path):
    """Four arrays and four values: all shown, the largest array (w) too (it was cut)."""
    params = {"a": np.zeros(3), "b": np.zeros((4, 4)), "w": np.zeros((512, 512), np.float32)}
    tree = {"c": np.zeros(5), "params": params, "v": None, "x": 1, "y": 2.0, "z": ""}
    jaxckpt.save(tmp_path / "c", tree)
    info = jaxckpt.metadata(tmp_path / "c")
    keys = [line.split()[0] for line in repr(info).splitlines()[1:]]
    assert keys == ["c", "params/", "a", "b", "w", "v", "x", "y", "z"], keys
    assert "more" not in repr(info) and "not shown" not in repr(info)
    assert str(info) == repr(info)


def test_quickstart_notebook_runs_on_cpu(tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), (
        "commit the notebook without outputs"
    )
    # A fresh kernel without the test suite's XLA_FLAGS: the notebook's first cell sets them.
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["JUPYTER_PLATFORM_DIRS"] = "1"
    client = nbclient.NotebookClient(
        nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute(env=env)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert "no TPU: 8 simulated CPU devices" in _text(code[0])
    assert "jaxckpt is already installed" in _text(code[1])
    assert _text(code[2]).count("CpuDevice") == 8
    everything = "".join(_text(c) for c in code)
    assert "params/" in everything and "float32[256,512]" in everything  # jaxckpt inspect
    assert "restored onto {'x': 2, 'y': 4} step 100" in everything
    assert "quickstart OK" in _text(code[-1])
    # the notebook views: metadata, a run's table and a diff render as HTML tables
    html = [HtmlTable(_html(c)) for c in code if _html(c)]
    meta, run, changes = html
    assert meta.rows[0] == ["key", "type", "stored", "bytes", "sharding"]
    assert ["w1", "float32[256,512]"] == next(r[:2] for r in meta.rows if r[0] == "w1")
    assert [r[0] for r in run.rows[1:]] == ["00000001", "00000002", "00000003"]
    assert "best" in run.rows[3] and "total: 3 entries (3 committed)" in run.caption
    assert ["step", "value", "1 → 3"] in changes.rows
    assert "manifest.json" in _text(code[4])  # the checkpoint's files, listed by the notebook
    assert not list(tmp_path.iterdir())  # written under a temporary directory, not here
