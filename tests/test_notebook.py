"""notebooks/quickstart.ipynb runs top to bottom in a fresh kernel, so it never rots."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

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
    assert "manifest.json" in _text(code[4])  # the checkpoint's files, listed by the notebook
    assert not list(tmp_path.iterdir())  # written under a temporary directory, not here
