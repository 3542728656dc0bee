"""Every file in benchmarks/ still loads: each script answers `--help`, each library imports.

The benchmarks reach into jaxckpt's private modules, which move when a module is split; a
script that no longer imports would otherwise be found only by the next person who runs it
(docs/benchmarks.md cites them). The files are found by globbing, so a new one is covered.
A script is a file with an `if __name__ == "__main__":` block or an argparse parser; the rest
(`_state.py`, `_libs.py`, ...) are libraries of the scripts.
"""

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
FILES = sorted(BENCH.glob("*.py"))


def _is_script(path: Path) -> bool:
    text = path.read_text()
    return bool(re.search(r"^if __name__ == .__main__.:", text, re.M)) or "argparse" in text


SCRIPTS = [p for p in FILES if _is_script(p)]
LIBRARIES = [p for p in FILES if not _is_script(p)]


def test_the_glob_finds_both_kinds():
    names = {p.name for p in SCRIPTS}, {p.name for p in LIBRARIES}
    assert {"compare.py", "what_if.py", "_tiers_bench.py"} <= names[0]
    assert {"_state.py", "_libs.py"} <= names[1]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_answers_help(script, tmp_path):
    # As a user runs it: the scripts set their own device count, the suite's flags are not set.
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    r = subprocess.run(
        [sys.executable, str(script), "--help"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    assert r.stdout.startswith(f"usage: {script.name} "), r.stdout[:500]
    assert not list(tmp_path.iterdir()), "--help wrote into the current directory"


@pytest.mark.parametrize("library", LIBRARIES, ids=lambda p: p.name)
def test_library_imports(library, monkeypatch):
    # The scripts import each other as top-level modules, with benchmarks/ on sys.path.
    monkeypatch.syspath_prepend(str(BENCH))
    before = set(sys.modules)
    try:
        importlib.import_module(library.stem)
    finally:
        for name in set(sys.modules) - before:
            if str(getattr(sys.modules[name], "__file__", "")).startswith(str(BENCH)):
                del sys.modules[name]
