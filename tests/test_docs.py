"""Every ```python block in README.md and docs/*.md runs, in order, one namespace per page.

A block that needs infrastructure a test machine lacks (a cluster, a cloud bucket) is marked
with an HTML comment line `<!-- not run: REASON -->` right before it; the set of such blocks is
pinned below so that skipping one more is a deliberate change.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"(<!-- not run: (?P<why>[^>]*) -->\n)?```python\n(?P<code>.*?)```", re.S)
NOT_RUN = {
    ("multihost.md", "needs a cluster"),
    ("multihost.md", "starts jax.distributed processes"),
    ("object_storage.md", "needs an S3 bucket"),
}


def _blocks(page: Path):
    return list(BLOCK.finditer(page.read_text()))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_doc_code_blocks_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": f"docs_{page.stem}"}
    for i, m in enumerate(_blocks(page)):
        if m.group("why"):
            continue
        code = compile(m.group("code"), f"{page.name}[block {i}]", "exec")
        exec(code, namespace)  # noqa: S102 - our own documentation


def test_skipped_blocks_are_pinned():
    skipped = {(p.name, m.group("why")) for p in PAGES for m in _blocks(p) if m.group("why")}
    assert skipped == NOT_RUN
