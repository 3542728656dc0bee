"""File-system failures and links at the target are typed errors that leave nothing behind
(issue 29.3, 29.9): the last committed checkpoint stays intact and no temporary remains."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import tmpfs

import jaxckpt
from jaxckpt._runtime.pools import settle


def _only(d: Path, *names: str) -> None:
    assert sorted(os.listdir(d)) == sorted(names)  # no hidden .NAME.tmp-* left


# 29.3: a link at the target is refused, with or without overwrite, and nothing is touched ----


@pytest.mark.parametrize("overwrite", [False, True])
def test_saving_to_a_symlink_is_refused_and_touches_nothing(tmp_path, overwrite):
    real, link = tmp_path / "real", tmp_path / "link"
    jaxckpt.save(real, {"s": 3})
    os.symlink(real, link)
    with pytest.raises(
        jaxckpt.CheckpointExistsError,
        match=r"link is a symbolic link .*never saves through or replaces a link.*Save to the link's target",
    ):
        jaxckpt.save(link, {"w": np.ones(2)}, overwrite=overwrite)
    assert link.is_symlink() and os.readlink(link) == str(real)
    _only(tmp_path, "real", "link")
    _only(real, "manifest.json")
    assert jaxckpt.restore(link) == {"s": 3}  # reading through a link is fine


@pytest.mark.parametrize("target", ["missing", "file"])
def test_a_link_to_nothing_or_to_a_file_is_refused_too(tmp_path, target):
    link = tmp_path / "link"
    if target == "file":
        (tmp_path / "file").write_text("mine")
    os.symlink(tmp_path / target, link)
    with pytest.raises(jaxckpt.CheckpointExistsError, match="is a symbolic link"):
        jaxckpt.save(link, {"w": np.ones(2)}, overwrite=True)
    assert link.is_symlink()
    _only(tmp_path, "link", *(["file"] if target == "file" else []))


def test_a_linked_parent_directory_still_works(tmp_path):
    (tmp_path / "disk").mkdir()
    os.symlink(tmp_path / "disk", tmp_path / "runs")
    jaxckpt.save(tmp_path / "runs" / "c", {"s": 1})
    jaxckpt.save(tmp_path / "runs" / "c", {"s": 2}, overwrite=True)
    settle()  # the replaced checkpoint goes in the background
    assert jaxckpt.restore(tmp_path / "disk" / "c") == {"s": 2}
    _only(tmp_path / "disk", "c")


# 29.9: OS errors are CheckpointErrors naming the path and the cause ---------------------------


@pytest.mark.parametrize("how", ["save", "save_async", "manager"])
def test_a_parent_that_is_a_file_is_a_checkpoint_error(tmp_path, how):
    (tmp_path / "f").write_text("mine")
    with pytest.raises(jaxckpt.CheckpointError, match=r"f/c.*Not a directory") as e:
        if how == "manager":
            jaxckpt.CheckpointManager(tmp_path / "f" / "c")
        elif how == "save":
            jaxckpt.save(tmp_path / "f" / "c", {"w": np.ones(2)})
        else:
            jaxckpt.save_async(tmp_path / "f" / "c", {"w": np.ones(2)}).wait()
    assert isinstance(e.value.__cause__, NotADirectoryError)
    assert (tmp_path / "f").read_text() == "mine"
    _only(tmp_path, "f")


@pytest.fixture
def read_only_dir(tmp_path):
    """A tmpfs remounted read-only, or skip where mounting is not allowed."""
    with tmpfs(tmp_path / "ro") as mnt:
        jaxckpt.save(mnt / "c", {"w": np.arange(4.0)})
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        yield mnt


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_read_only_file_system_is_a_checkpoint_error(read_only_dir, overwrite):
    path = read_only_dir / ("c" if overwrite else "new")
    with pytest.raises(
        jaxckpt.CheckpointError,
        match=r"Save to .*ro/(c|new) failed .*Read-only file system.*intact",
    ) as e:
        jaxckpt.save(path, {"w": np.zeros(4)}, overwrite=overwrite)
    assert isinstance(e.value.__cause__, OSError)
    _only(read_only_dir, "c")
    np.testing.assert_array_equal(jaxckpt.restore(read_only_dir / "c")["w"], np.arange(4.0))


_FSIZE = """
import resource, signal, sys
import numpy as np, jaxckpt
d = sys.argv[1]
jaxckpt.save(d, {"w": np.arange(4.0)}, planner=jaxckpt.DefaultSavePlanner(pack_bytes=0))
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
resource.setrlimit(resource.RLIMIT_FSIZE, (100, resource.RLIM_INFINITY))
try:
    jaxckpt.save(d, {"w": np.zeros(4)}, overwrite=True, planner=jaxckpt.DefaultSavePlanner(pack_bytes=0))
except jaxckpt.CheckpointError as e:
    print("CheckpointError:", e)
    print("cause:", type(e.__cause__).__name__)
"""


def test_a_zarr_json_that_cannot_be_written_is_a_checkpoint_error(tmp_path):
    d = tmp_path / "c"
    r = subprocess.run(
        [sys.executable, "-c", _FSIZE, str(d)], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "CheckpointError: Save to " in r.stdout and "zarr.json" in r.stdout, r.stdout + r.stderr
    assert "intact" in r.stdout and "cause: ValueError" in r.stdout
    _only(tmp_path, "c")
    np.testing.assert_array_equal(jaxckpt.restore(d)["w"], np.arange(4.0))


# issue 62.7: a bucket's FUSE mount renames no directory; a save there says to use the URL --


@pytest.fixture
def no_dir_rename(tmp_path):
    """A FUSE mount (tests/fuse_mount.py) of ``tmp_path/src`` that refuses directory renames,
    as gcsfuse, Mountpoint for S3 and s3fs do: ``(source, mountpoint)``."""
    try:
        import fuse  # noqa: F401  (fusepy; it raises OSError where libfuse 2 is missing)
    except (ImportError, OSError) as e:
        pytest.skip(f"no fusepy with libfuse 2 here: {e}")
    if not os.path.exists("/dev/fuse") or shutil.which("fusermount") is None:
        pytest.skip("no FUSE here (/dev/fuse, fusermount)")
    src, mnt = tmp_path / "src", tmp_path / "mnt"
    src.mkdir()
    mnt.mkdir()
    server = Path(__file__).parent / "fuse_mount.py"
    log = tmp_path / "fuse.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, str(server), str(src), str(mnt)], stdout=out, stderr=out
        )
    for _ in range(100):
        if os.path.ismount(mnt) or proc.poll() is not None:
            break
        time.sleep(0.1)
    if not os.path.ismount(mnt):
        proc.kill()
        proc.wait()
        pytest.skip(f"cannot mount FUSE here: {log.read_text()[-300:]}")
    try:
        yield src, mnt
    finally:
        settle()
        subprocess.run(["fusermount", "-u", str(mnt)], check=False)
        proc.wait(timeout=30)


def test_a_save_onto_a_mount_that_renames_no_directory_names_the_url_to_use(no_dir_rename):
    src, mnt = no_dir_rename
    state = {"w": np.arange(4096.0).reshape(64, 64), "step": 3}
    with pytest.raises(jaxckpt.CheckpointError, match=r"does not rename directories.*gs://"):
        jaxckpt.save(mnt / "ckpt", state)
    settle()
    assert os.listdir(src) == []  # no target, no staging directory left
    # Reading through such a mount is fine: a checkpoint saved elsewhere and copied in
    jaxckpt.save(src.parent / "elsewhere", state)
    shutil.copytree(src.parent / "elsewhere", src / "ckpt")
    got = jaxckpt.restore(mnt / "ckpt")
    assert got["step"] == 3 and got["w"].tobytes() == state["w"].tobytes()
