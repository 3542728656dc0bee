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


def test_reading_without_jaxckpt_points_at_the_packed_recipe():
    # `zarr.open_array(CKPT + "/arrays/params.w")` fails for packed arrays (issue 31.9): the
    # answer names the manifest's path and offset and links format.md's recipe, which runs.
    answer = FAQ.split("**Can I read a checkpoint without jaxckpt?**", 1)[1].split("\n\n", 1)[0]
    assert '"/arrays/params.w"' not in answer
    assert "`offset`" in answer and "format.md#packed-arrays-version-2" in answer
    fmt = (Path(__file__).resolve().parent.parent / "docs" / "format.md").read_text()
    assert "### Packed arrays (version 2)\n" in fmt  # the anchor the link names
    recipe = fmt.split("### Packed arrays (version 2)", 1)[1].split("```python\n", 1)[1]
    assert "zarr.open_array" in recipe.split("```", 1)[0]  # (tests/test_docs.py runs it)
