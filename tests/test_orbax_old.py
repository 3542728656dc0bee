"""Checkpoints written by an old orbax-checkpoint (0.11.25, see data/orbax_old/make_fixture.py)
restore bit-exactly; orbax itself need not be installed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import jaxckpt

DATA = Path(__file__).resolve().parent / "data" / "orbax_old"
EXPECTED = json.loads((DATA / "expected.json").read_text())


def _at(tree, key: str):
    for part in key.split("/"):
        tree = tree[int(part)] if isinstance(tree, (list, tuple)) else tree[part]
    return tree


def _assert_leaves(got, expected: dict) -> None:
    """Every leaf of ``expected`` (make_fixture's ``describe``) is in ``got``, bit for bit."""
    for key, want in expected.items():
        leaf = _at(got, key)
        if want["kind"] == "python":
            assert type(leaf).__name__ == want["type"] and leaf == want["value"], key
            continue
        if want["kind"] == "prng_key":
            continue  # restored as key arrays: test_prng_keys_come_back_as_keys
        a = np.asarray(leaf)
        ref = np.asarray(want["value"], dtype=want["dtype"])
        assert (a.dtype.name, list(a.shape)) == (want["dtype"], want["shape"]), key
        assert a.tobytes() == ref.tobytes(), key


@pytest.mark.parametrize("where", ["standard", "manager/1/state", "manager/2/state"])
def test_old_ocdbt_items_without_the_flag_open(where):
    doc = json.loads((DATA / where / "_METADATA").read_text())
    assert "use_ocdbt" not in doc  # the premise: Orbax < 0.11.31 did not record it
    want = EXPECTED["standard"] if where == "standard" else EXPECTED["manager"][where[8]]["state"]
    _assert_leaves(jaxckpt.restore(DATA / where), want)
    assert jaxckpt.metadata(DATA / where).created["use_ocdbt"] is True


def test_ocdbt_item_without_its_database_root_is_a_typed_error(tmp_path):
    item = tmp_path / "standard"
    shutil.copytree(DATA / "standard", item)
    (item / "manifest.ocdbt").unlink()
    with pytest.raises(jaxckpt.CorruptChunkError, match=r"standard: an OCDBT item .*manifest"):
        jaxckpt.restore(item)


def test_use_ocdbt_of_another_type_is_a_typed_error(tmp_path):
    item = tmp_path / "standard"
    shutil.copytree(DATA / "standard", item)
    doc = json.loads((item / "_METADATA").read_text())
    (item / "_METADATA").write_text(json.dumps(doc | {"use_ocdbt": "yes"}))
    with pytest.raises(jaxckpt.ManifestError, match=r"_METADATA: \"use_ocdbt\" is 'yes'"):
        jaxckpt.restore(item)
