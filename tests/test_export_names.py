"""`jaxckpt export` never writes outside its archive (issue 29.10): key paths become .npz member
names and .safetensors tensor names, so a key that is not a safe relative name is refused."""

from __future__ import annotations

import zipfile

import numpy as np
import pytest

import jaxckpt
from jaxckpt._cli.main import main


@pytest.fixture
def hostile(tmp_path):
    d = tmp_path / "c"  # dict keys ".." and "" are legal in a tree: keys "../../evil", "/tmp/x"
    jaxckpt.save(
        d,
        {
            "..": {"..": {"evil": np.ones(2)}},
            "": {"tmp": {"x": np.ones(3)}},
            "ok": {"w": np.arange(4.0)},
            "v": 3,
        },
    )
    assert {"../../evil", "/tmp/x"} <= set(jaxckpt.metadata(d).entries)
    return d


@pytest.mark.parametrize("kind", [".npz", ".safetensors"])
@pytest.mark.parametrize("key", ["../../evil", "/tmp/x"])
def test_a_key_that_is_no_safe_member_name_is_refused(hostile, capsys, kind, key):
    out = hostile.parent / f"out{kind}"
    assert main(["export", str(hostile), str(out), "--keys", key, "ok"]) == 2
    err = capsys.readouterr().err
    assert f"key {key!r} is not a safe name inside out{kind}" in err and "--keys" in err, err
    assert sorted(p.name for p in hostile.parent.iterdir()) == ["c"]  # nothing written anywhere


@pytest.mark.parametrize("key", ["a/./b", "C:/x", "a\\b", "x/../../y"])
def test_other_unsafe_names_are_refused(tmp_path, capsys, key):
    d = tmp_path / "c"
    parts = key.split("/")
    tree = np.ones(2)
    for p in reversed(parts):
        tree = {p: tree}
    jaxckpt.save(d, tree)
    assert main(["export", str(d), str(tmp_path / "o.npz")]) == 2
    assert "is not a safe name" in capsys.readouterr().err


def test_safe_keys_still_export(hostile):
    out = hostile.parent / "out.npz"
    assert main(["export", str(hostile), str(out), "--keys", "ok", "v"]) == 0
    with zipfile.ZipFile(out) as z:
        assert sorted(z.namelist()) == ["ok/w.npy", "v.npy"]
    np.testing.assert_array_equal(np.load(out)["ok/w"], np.arange(4.0))
