"""Names on storage: every key save accepts restores; staging names fit; odd paths are refused."""

from __future__ import annotations

import os
import unicodedata

import numpy as np
import pytest
from helpers import assert_tree_equal, one_array_per_leaf  # noqa: F401 (autouse: names on disk)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_s3 import BUCKET, prefix, s3  # noqa: F401  (fixtures)

import jaxckpt
from jaxckpt._format.names import MAX_NAME, is_storage_path, storage_name
from jaxckpt._runtime.pools import settle

ODD = [
    "ünï©ødé", "Straße", "STRASSE", "straße", "a", "A", "é", "e\u0301",  # NFC and NFD
    "日本語", "😀🚀", "שָׁלוֹם", "مرحبا", "a b", "a.b", "a..b", ".hidden", "-dash", "x.__lock",
    "con", "", " ", "k" * 300, "é" * 200, "\u200b", "a\x00b", "tab\there",
]  # fmt: skip


def _check_names(path: str) -> None:
    entries = jaxckpt.metadata(path).entries.values()
    names = [e.path for e in entries if hasattr(e, "path")]
    assert all(is_storage_path(n) and n.isascii() and len(n) - 7 <= MAX_NAME for n in names)
    assert len({n.lower() for n in names}) == len(names)


def _tree(keys) -> dict:
    return {k: np.arange(i, i + 3, dtype=np.int16) for i, k in enumerate(keys)}


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.lists(
        st.text(min_size=0, max_size=40).filter(lambda k: "/" not in k),
        min_size=1,
        max_size=6,
        unique=True,
    )
)
def test_any_unicode_keys_round_trip_local(tmp_path_factory, keys):
    path = str(tmp_path_factory.mktemp("u") / "ck")
    tree = {"outer": _tree(keys), **_tree([k + "!" for k in keys])}
    jaxckpt.save(path, tree)
    assert_tree_equal(jaxckpt.restore(path), tree)
    _check_names(path)


def test_odd_keys_round_trip_local(tmp_path):
    tree = _tree(ODD + [unicodedata.normalize("NFD", k) for k in ODD if k.isalpha()])
    jaxckpt.save(tmp_path / "ck", tree)
    assert_tree_equal(jaxckpt.restore(tmp_path / "ck"), tree)
    _check_names(str(tmp_path / "ck"))


def test_odd_keys_round_trip_memory():
    tree = _tree(ODD)
    jaxckpt.save(f"memory://names/{os.getpid()}", tree)
    assert_tree_equal(jaxckpt.restore(f"memory://names/{os.getpid()}"), tree)


def test_odd_keys_round_trip_s3(s3, prefix):  # noqa: F811
    tree = _tree(ODD)
    url = f"s3://{BUCKET}/{prefix}/ck"
    jaxckpt.save(url, tree)
    assert_tree_equal(jaxckpt.restore(url), tree)
    _check_names(url)


def test_storage_names_are_deterministic_and_keep_plain_keys():
    keys = ["params/dense/kernel", "Params/Dense/Kernel", "ünï", "a" * 300]
    first = [storage_name(k, set()) for k in keys]
    taken: set[str] = set()
    assert [storage_name(k, taken) for k in keys] == [
        "arrays/params.dense.kernel",
        "arrays/Params.Dense.Kernel-1",
        first[2],
        first[3],
    ]
    assert storage_name("ünï", set()) == storage_name("ünï", set())


def test_old_storage_paths_still_read():
    # Paths today's main wrote (its rule kept any str.isalnum() character; those with
    # non-ASCII never restored) and generation prefixes stay accepted.
    for p in ["arrays/params.dense.kernel", "arrays/x_y-1", "g0a1b2c3d/arrays/w", "arrays/_"]:
        assert is_storage_path(p)
    for p in ["arrays/../x", "arrays/ünï", "/etc/passwd", "arrays/", "arrays/.x"]:
        assert not is_storage_path(p)


@pytest.mark.parametrize(
    "name",
    ["n" * 200, "n" * 242, "n" * 255, "é" * 127, "日" * 85],
    ids=["200", "242", "255", "utf8-254", "utf8-255"],
)
def test_long_checkpoint_names(tmp_path, name):
    path = tmp_path / name
    jaxckpt.save(path, {"w": np.arange(3)})
    jaxckpt.save(path, {"w": np.arange(4)}, overwrite=True)
    settle()  # the replaced checkpoint goes in the background
    np.testing.assert_array_equal(jaxckpt.restore(path)["w"], np.arange(4))
    assert os.listdir(tmp_path) == [name]  # no staging left behind
    mgr_dir = tmp_path / "runs"
    jaxckpt.save(mgr_dir / name, {"w": np.arange(2)})
    from jaxckpt._storage import catalog as _catalog
    from jaxckpt._storage import location as _location

    _catalog.delete(_location.Location(mgr_dir / name))
    assert os.listdir(mgr_dir) == []


def test_too_long_name_is_a_typed_error(tmp_path):
    with pytest.raises(jaxckpt.CheckpointError, match="256 bytes; file names are limited to 255"):
        jaxckpt.save(tmp_path / ("n" * 256), {"w": np.arange(3)})
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "path, match",
    [
        ("run\\1/ck", "backslash"),
        ("a\x00b", "NUL"),
        ("x.__lock/ck", "reserved by tensorstore"),
        ("file://TMP/a%20b", "'%' in a file:// URL"),
        ("file://TMP/a?b", "'\\?' in a file:// URL"),
        ("file://TMP/a#b", "'#' in a file:// URL"),
        ("file://relative/ck", "not an absolute file:// URL"),
    ],
)
def test_paths_tensorstore_reads_differently_are_refused(tmp_path, monkeypatch, path, match):
    path = path.replace("TMP", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(jaxckpt.CheckpointError, match=match):
        jaxckpt.save(path, {"w": np.arange(3)})
    assert os.listdir(tmp_path) == []  # nothing written anywhere below


def test_dotdot_paths_work(tmp_path, monkeypatch):
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")
    jaxckpt.save("../ck", {"w": np.arange(3)})
    np.testing.assert_array_equal(jaxckpt.restore(str(tmp_path / "ck"))["w"], np.arange(3))
    assert sorted(os.listdir(tmp_path)) == ["ck", "sub"]


def test_tilde_is_the_home_directory_everywhere_a_local_path_is_taken(
    tmp_path, monkeypatch, capsys
):
    # "~/ck" used to become ./~/ck under the current directory (issue 31.7).
    from jaxckpt._cli.main import main

    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir(), cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    jaxckpt.save("~/ck", {"w": np.arange(3)})
    assert (home / "ck" / "manifest.json").is_file() and os.listdir(cwd) == []
    np.testing.assert_array_equal(jaxckpt.restore("~/ck")["w"], np.arange(3))
    assert jaxckpt.metadata("~/ck").entries["w"].shape == (3,)
    with jaxckpt.CheckpointManager("~/run") as mgr:
        mgr.save(1, {"w": np.arange(2)})
    assert mgr.all_steps() == [1] and (home / "run" / "00000001").is_dir()
    assert mgr.directory == str(home / "run")  # its messages name the real place
    for argv in (
        ["inspect", "~/ck"],
        ["verify", "~/ck"],
        ["ls", "~/run"],
        ["export", "~/ck", "~/w.npz"],
        ["convert", "~/ck", "~/ck2"],
    ):
        assert main(argv) == 0, capsys.readouterr().err
    assert (home / "w.npz").is_file() and (home / "ck2" / "manifest.json").is_file()
    assert os.listdir(cwd) == []
    with pytest.raises(jaxckpt.CheckpointNotFoundError, match=f"{home}/nope does not exist"):
        jaxckpt.restore("~/nope")  # the message names where it looked
