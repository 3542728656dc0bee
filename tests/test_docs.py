"""Every ```python block in README.md and docs/*.md runs as a reader would run it.

Each page runs in a fresh `python` process, its blocks in order in one namespace, as one
script would: without the suite's 8 simulated devices (a page that needs a mesh of 8 sets
`XLA_FLAGS` itself, as README.md's first block does), on the CPU as on a laptop, in an empty
working directory that must still be empty afterwards (examples write under
`tempfile.mkdtemp()`), with warnings as errors as in the rest of the suite.

A block that needs infrastructure a test machine lacks (a cluster, a cloud bucket) is marked
with an HTML comment line `<!-- not run: REASON -->` right before it; the set of such blocks is
pinned below so that skipping one more is a deliberate change.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"(<!-- not run: (?P<why>[^>]*) -->\n)?```python\n(?P<code>.*?)```", re.S)
NOT_RUN = {
    ("multihost.md", "needs a cluster"),
    ("multihost.md", "starts jax.distributed processes"),
    ("object_storage.md", "needs an S3 bucket"),
    ("object_storage.md", "needs a GCS bucket"),
    ("observability.md", "needs tensorboard or wandb"),
}
TIMEOUT_S = 180  # a page takes a few seconds; this only stops a hung one

# Runs the blocks given as JSON on stdin in __main__'s namespace, each compiled under the name
# "PAGE[block I]" (registered in linecache, so a traceback shows the doc's line). The warning
# filters are those of pyproject.toml's [tool.pytest.ini_options].
RUNNER = """
import json, linecache, sys, traceback, warnings
warnings.filterwarnings("error")
warnings.filterwarnings("ignore", category=DeprecationWarning, module="jax.*")
warnings.filterwarnings("ignore", category=DeprecationWarning, module="optax.*")
namespace = sys.modules["__main__"].__dict__
for name, code in json.load(sys.stdin):
    linecache.cache[name] = (len(code), None, code.splitlines(True), name)
    try:
        exec(compile(code, name, "exec"), namespace)
    except BaseException:
        traceback.print_exc()  # through linecache, unlike the default hook on Python 3.11
        sys.exit(1)
"""


def _blocks(page: Path):
    return list(BLOCK.finditer(page.read_text()))


RUN = [p for p in PAGES if any(not m.group("why") for m in _blocks(p))]


def _reader_env(tmp: Path) -> dict[str, str]:
    """The environment of a reader on a CPU-only machine: no device flags from the suite."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["JAX_PLATFORMS"] = "cpu"  # a laptop's platform, without probing for an accelerator
    env["TMPDIR"] = str(tmp)  # what the examples' tempfile.mkdtemp() writes stays in tmp_path
    return env


def _python(args, *, cwd: Path, env: dict, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args],
        input=stdin,
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


@pytest.mark.parametrize("page", RUN, ids=lambda p: p.name)
def test_doc_code_blocks_run(page, tmp_path):
    blocks = [
        (f"{page.name}[block {i}]", m.group("code"))
        for i, m in enumerate(_blocks(page))
        if not m.group("why")
    ]
    cwd, tmp = tmp_path / "cwd", tmp_path / "tmp"
    cwd.mkdir()
    tmp.mkdir()
    r = _python(["-c", RUNNER], cwd=cwd, env=_reader_env(tmp), stdin=json.dumps(blocks))
    assert r.returncode == 0, f"{page.name} failed:\n{r.stderr[-4000:]}"
    assert "Traceback" not in r.stderr, r.stderr[-4000:]  # e.g. in a background thread
    left = sorted(p.name for p in cwd.iterdir())
    assert not left, f"{page.name} wrote {left} into the current directory; use tempfile"


def test_pages_run_without_the_suites_devices(tmp_path):
    # What the pages above get unless they set XLA_FLAGS: one CPU device, as on a laptop.
    r = _python(
        ["-c", "import jax; print(jax.device_count(), jax.default_backend())"],
        cwd=tmp_path,
        env=_reader_env(tmp_path),
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["1", "cpu"]


def test_skipped_blocks_are_pinned():
    skipped = {(p.name, m.group("why")) for p in PAGES for m in _blocks(p) if m.group("why")}
    assert skipped == NOT_RUN
