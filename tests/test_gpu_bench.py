"""benchmarks/gpu.py, the benchmark kept ready for a lent GPU, still runs: a smoke test.

On the CPU backend it runs in short mode (16 MiB, one warm call). Only the table's shape is
checked: a row per library (or Orbax's "not installed" line) and one for jaxckpt within a
host-memory budget, every cell filled; no time is asserted, because this machine's times mean nothing for a GPU.
"""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _table(out: str) -> tuple[list[str], list[list[str]]]:
    rows = [
        [c.strip() for c in line.strip().strip("|").split("|")]
        for line in out.splitlines()
        if line.startswith("| ") and not line.startswith("|---")
    ]
    assert rows, f"no table in the output:\n{out}"
    return rows[0], rows[1:]


def _gpu_py(cwd, pythonpath: str, *args: str) -> subprocess.CompletedProcess:
    """benchmarks/gpu.py in short mode, in a fresh process."""
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--short", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": pythonpath},
        cwd=cwd,
        timeout=300,
    )


def test_gpu_benchmark_prints_one_row_per_library_in_short_mode(tmp_path):
    out_md = tmp_path / "gpu-cpu.md"
    proc = _gpu_py(tmp_path, str(ROOT), "--out", str(out_md))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Short mode" in proc.stdout
    header, rows = _table(proc.stdout)
    assert header[0] == "library" and "save_async blocks, s" in header
    assert "resharded restore GB/s" in header and any("RSS" in h for h in header)
    assert "state ÷ blocking time, GB/s" in header  # the rate off the devices while it blocks
    names = [r[0] for r in rows]
    assert names[0] == "jaxckpt" and names[-1].startswith("`jax.device_get`")
    assert "jaxckpt, max_host_bytes=2 MiB" in names  # the budget: an eighth of the 16 MiB state
    assert "orbax" in names or "orbax: not installed" in proc.stdout
    for row in rows:
        assert len(row) == len(header) and all(row), row
    assert out_md.read_text() in proc.stdout  # --out keeps exactly the printed report


def test_gpu_benchmark_degrades_without_orbax(tmp_path):
    # A device machine may lack orbax: a stand-in package that fails to import plays it.
    fake = tmp_path / "site" / "orbax"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('no orbax on this machine')\n")
    (fake / "checkpoint.py").write_text("raise ImportError('no orbax on this machine')\n")
    proc = _gpu_py(
        tmp_path, os.pathsep.join([str(tmp_path / "site"), str(ROOT)]), "--libs", "orbax"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "orbax: not installed" in proc.stdout
