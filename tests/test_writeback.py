"""Early write-back (jaxckpt._storage.writeback): every chunk file a local save writes gets its hint,
the hint changes no byte on disk, and it never follows a link, raises, or touches object stores."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import tensorstore as ts
from helpers import assert_tree_equal, mesh, one_array_per_leaf, put  # noqa: F401 (autouse)
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxckpt
from jaxckpt._format.manifest import ArrayEntry
from jaxckpt._planning import packing as _pack
from jaxckpt._storage import writeback as _writeback
from jaxckpt._storage.writer import array_spec

needs_linux = pytest.mark.skipif(
    _writeback._sync_file_range is None, reason="sync_file_range is Linux-only"
)


def _chunk_files(root: Path) -> set[str]:
    return {
        str(p.relative_to(root))
        for p in root.rglob("*")
        if p.is_file() and p.name not in ("zarr.json", "manifest.json")
    }


def _state():
    m = mesh((4, 2), ("data", "model"))
    return {
        "w": put(np.arange(64 * 24, dtype=np.float32).reshape(64, 24), m, "data", "model"),
        "b": put(np.arange(24, dtype=np.int32), m, None),  # replicated: written once
        "s": put(np.float32(3.5), m),  # 0-d: the chunk file is `c` itself
    }


@needs_linux
def test_every_chunk_file_of_a_local_save_gets_its_hint(tmp_path, monkeypatch):
    monkeypatch.setattr(_writeback, "enabled", True)
    state = _state()
    before = _writeback.started()
    jaxckpt.save(tmp_path / "ck", state)
    files = _chunk_files(tmp_path / "ck")
    assert len(files) == 8 + 1 + 1, sorted(files)
    assert _writeback.started() - before == len(files)
    assert_tree_equal(jaxckpt.restore(tmp_path / "ck", state), state)


def test_the_hint_changes_no_byte_on_disk(tmp_path, monkeypatch):
    state = _state()
    for on in (True, False):
        monkeypatch.setattr(_writeback, "enabled", on)
        before = _writeback.started()
        jaxckpt.save(tmp_path / str(on), state)
        if not on:
            assert _writeback.started() == before  # off means off
    on, off = tmp_path / "True", tmp_path / "False"
    assert _chunk_files(on) == _chunk_files(off)
    for name in _chunk_files(on):
        assert (on / name).read_bytes() == (off / name).read_bytes(), name


def test_object_store_saves_give_no_hints(monkeypatch):
    monkeypatch.setattr(_writeback, "enabled", True)
    state = _state()
    before = _writeback.started()
    jaxckpt.save("memory://writeback/ck", state)
    assert _writeback.started() == before
    assert_tree_equal(jaxckpt.restore("memory://writeback/ck", state), state)


@needs_linux
def test_a_hint_never_follows_a_link_nor_raises(tmp_path):
    outside = tmp_path / "outside"
    outside.write_bytes(b"not ours")
    (tmp_path / "link").symlink_to(outside)
    ours = tmp_path / "ours"
    ours.write_bytes(b"chunk")
    paths = [str(tmp_path / "missing"), str(tmp_path / "link"), str(ours)]
    before = _writeback.started()
    _writeback._start(paths)  # raises nothing
    assert _writeback.started() - before == 1  # only the regular file: no link is followed
    assert outside.read_bytes() == b"not ours"


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_chunk_files_are_the_files_tensorstore_writes(tmp_path_factory, data):
    """The paths we hint are exactly the chunk files of a box, for any grid (edges, 0-d)."""
    ndim = data.draw(st.integers(0, 3))
    shape = tuple(data.draw(st.integers(1, 9)) for _ in range(ndim))
    chunks = tuple(data.draw(st.integers(1, n)) for n in shape)
    # a box on the chunk grid, as the save planner writes them
    offsets, sizes = [], []
    for n, c in zip(shape, chunks):
        k = -(-n // c)
        lo = data.draw(st.integers(0, k - 1))
        hi = data.draw(st.integers(lo + 1, k))
        offsets.append(lo * c)
        sizes.append(min(hi * c, n) - lo * c)
    root = tmp_path_factory.mktemp("grid")
    entry = ArrayEntry(
        key="a",
        shape=shape,
        dtype="uint8",
        storage_dtype="uint8",
        chunks=chunks,
        path="arrays/a",
        checksum="crc32c",
    )
    store = ts.open(
        {
            **array_spec({"driver": "file", "path": f"{root}/arrays/a/"}, entry),
            "store_data_equal_to_fill_value": True,
        },
        create=True,
    ).result()
    box = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
    store[box].write(np.ones(sizes, np.uint8)).result()
    folder = str(root / "arrays" / "a")
    hinted = _writeback.chunk_files(folder, offsets, sizes, chunks)
    assert len(hinted) == len(set(hinted))
    assert {os.path.relpath(p, root) for p in hinted} == _chunk_files(root)


@needs_linux
def test_packed_leaves_get_their_pack_files_hinted(tmp_path, monkeypatch):
    """Small leaves share pack arrays (the default): the hints name the pack's chunk files."""
    monkeypatch.setattr(_writeback, "enabled", True)
    monkeypatch.setattr(_pack, "DEFAULT_PACK_BYTES", 1 << 18)  # undo the module's autouse fixture
    m = mesh((4, 2), ("data", "model"))
    state = {f"p{i}": put(np.full((16,), i, np.float32), m) for i in range(20)}
    state["w"] = put(np.ones((1024, 1024), np.float32), m, "data", "model")  # 512 KiB shards
    before = _writeback.started()
    jaxckpt.save(tmp_path / "ck", state)
    files = _chunk_files(tmp_path / "ck")
    assert "arrays/pack.float32.0/c/0" in files and len(files) == 1 + 8, sorted(files)
    assert _writeback.started() - before == len(files)
    assert_tree_equal(jaxckpt.restore(tmp_path / "ck", state), state)


def test_a_cancelled_write_gets_no_hint_and_raises_nothing():
    """A save that fails cancels its writes in flight; waiting for the hints must not replace
    the save's own error (tensorstore raises asyncio's CancelledError, a BaseException)."""
    promise, fut = ts.Promise.new()
    fut.cancel()
    hints = _writeback.Hints(group_bytes=1)
    hints.add(fut, ["/nonexistent/c/0"], 8)
    hints.wait()  # would raise CancelledError before the fix
