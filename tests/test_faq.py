"""docs/faq.md lists every error class a user can meet."""

from pathlib import Path

import jaxckpt

FAQ = (Path(__file__).resolve().parent.parent / "docs" / "faq.md").read_text()


def test_every_error_class_has_a_section():
    errors = [n for n in jaxckpt.__all__ if n.endswith("Error")]
    assert len(errors) >= 10
    for name in errors:
        assert f"## `{name}`" in FAQ or (
            name == "CheckpointError" and "## Plain `CheckpointError`" in FAQ
        ), name
