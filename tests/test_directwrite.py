"""Chunk files written straight to disk (jaxckpt._storage.directwrite): byte for byte what
tensorstore writes (edge chunks, boxes of several chunks, carried dtypes), with ``O_DIRECT``
where the file system takes it and through the page cache where it does not; readable by
jaxckpt, tensorstore and zarr-python; a full disk fails the save cleanly."""

from __future__ import annotations

import errno
import math
import os
import subprocess
import sys
from pathlib import Path

import google_crc32c
import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts
from helpers import assert_tree_equal, mesh, one_array_per_leaf, put, tmpfs  # noqa: F401
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jaxckpt
from jaxckpt import CheckpointError
from jaxckpt._format.dtypes import dtype_from_name, storage_dtype_name
from jaxckpt._format.manifest import ArrayEntry
from jaxckpt._format.plan import WriteItem
from jaxckpt._runtime import pools
from jaxckpt._storage import directwrite as _dw
from jaxckpt._storage import writeback as _writeback
from jaxckpt._storage.location import Location
from jaxckpt._storage.writer import Writer

needs_o_direct = pytest.mark.skipif(not _dw.O_DIRECT, reason="no O_DIRECT on this OS")


@pytest.fixture(autouse=True)
def every_chunk_direct(monkeypatch):
    """Test-sized chunks go to the direct writer too (the threshold leaves them to
    tensorstore), through buffers of three 4096-byte blocks, so chunks span several; a fresh
    memory of refusals and fresh buffers, so no test sees another's."""
    monkeypatch.setattr(_dw, "MIN_CHUNK_BYTES", 1)
    monkeypatch.setattr(_dw, "BUFFER_BYTES", 3 * 4096)
    monkeypatch.setattr(_dw, "COPY_BYTES", 1000)
    monkeypatch.setattr(_dw, "_spare", [])
    monkeypatch.setattr(_dw, "_refused", set())
    monkeypatch.setattr(_dw, "enabled", True)


def _values(name: str, shape: tuple[int, ...]) -> np.ndarray:
    rng = np.random.default_rng(sum(map(ord, name)))
    dtype = dtype_from_name(name)
    if name in ("int4", "uint4"):
        lo = -8 if name == "int4" else 0
        return rng.integers(lo, lo + 16, shape).astype(dtype)
    if np.issubdtype(dtype, np.integer):
        return rng.integers(np.iinfo(dtype).min, np.iinfo(dtype).max, shape, dtype=dtype)
    if np.issubdtype(dtype, np.complexfloating):
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def _write(root: Path, data: np.ndarray, chunks, boxes, *, direct: bool) -> dict[str, bytes]:
    """Write ``data`` as the array ``a`` in ``boxes`` (``(offsets, sizes)``) through the
    ``Writer``, with the direct writer on or off; the files of its folder, by relative path."""
    name = data.dtype.name
    entry = ArrayEntry("a", data.shape, name, storage_dtype_name(data.dtype), chunks, "arrays/a")
    _dw.enabled = direct
    writer = Writer(Location(root), overwrite=False)
    try:
        writer.open_arrays([entry], create=True)
        items = [
            (
                WriteItem("a", off, size, name, 0),
                data[tuple(slice(o, o + s) for o, s in zip(off, size))],
            )
            for off, size in boxes
        ]
        assert writer.write({"a": entry}, items) == data.nbytes
        writer.flush()
        folder = writer.staging / "arrays" / "a"
        return {
            str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()
        }
    finally:
        writer.abort()
        _dw.enabled = True


def _boxes(shape, chunks, cuts) -> list:
    """Chunk-aligned boxes: each axis cut after ``cuts`` chunks (``()``: the whole axis)."""
    axes = []
    for n, c, k in zip(shape, chunks, cuts):
        edges = sorted({0, n, *(min(n, c * i) for i in k)})
        axes.append(list(zip(edges, edges[1:])))
    out = [((), ())]
    for spans in axes:
        out = [(o + (a,), s + (b - a,)) for o, s in out for a, b in spans]
    return out


CASES = {  # shape, chunks, cuts (in chunks) of the boxes along each axis
    "edges both axes, one box": ((13, 10), (4, 3), ((), ())),
    "edges, four boxes of several chunks": ((13, 10), (4, 3), ((2,), (2,))),
    "3-d, edge in the last axis": ((5, 6, 7), (2, 6, 4), ((1,), (), ())),
    "1-d, chunks over several buffers": ((10000,), (3000,), ((2,),)),
    "rows over several buffers": ((300, 50), (128, 50), ((1,), ())),
}
DTYPES = ["float32", "bfloat16", "int4", "uint4", "float8_e4m3fn", "complex128", "int16"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_chunk_files_are_byte_for_byte_tensorstores(tmp_path, dtype, case):
    shape, chunks, cuts = CASES[case]
    data = _values(dtype, shape)
    boxes = _boxes(shape, chunks, cuts)
    before = sum(_dw.bytes_written().values())
    ours = _write(tmp_path / "direct", data, chunks, boxes, direct=True)
    grid = [-(-n // c) for n, c in zip(shape, chunks)]
    assert sum(_dw.bytes_written().values()) - before == math.prod(grid) * (
        math.prod(chunks) * data.dtype.itemsize + 4
    )
    theirs = _write(tmp_path / "tensorstore", data, chunks, boxes, direct=False)
    assert ours.keys() == theirs.keys() and len(ours) == math.prod(grid) + 1  # + zarr.json
    for name in theirs:
        assert ours[name] == theirs[name], name


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    shape=st.lists(st.integers(1, 9), min_size=1, max_size=3).map(tuple),
    data=st.data(),
    buffer_blocks=st.integers(2, 4),
    copy_bytes=st.integers(1, 9000),
)
def test_any_chunk_grid_and_buffer_size_gives_the_zarr_layout(
    tmp_path_factory, shape, data, buffer_blocks, copy_bytes
):
    """Against the layout itself: each chunk at full shape in C order, zeros past the array's
    edge, then the CRC-32C, whatever the buffer and copy sizes."""
    chunks = tuple(data.draw(st.integers(1, n)) for n in shape)
    a = np.random.default_rng(len(shape)).standard_normal(shape).astype(np.float32)
    whole = _boxes(shape, chunks, [()] * len(shape))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_dw, "BUFFER_BYTES", buffer_blocks * 4096)
        mp.setattr(_dw, "COPY_BYTES", copy_bytes)
        mp.setattr(_dw, "_spare", [])
        files = _write(tmp_path_factory.mktemp("g"), a, chunks, whole, direct=True)
    for idx in np.ndindex(*[-(-n // c) for n, c in zip(shape, chunks)]):
        full = np.zeros(chunks, np.float32)
        part = a[tuple(slice(i * c, i * c + c) for i, c in zip(idx, chunks))]
        full[tuple(slice(0, n) for n in part.shape)] = part
        want = full.tobytes() + google_crc32c.value(full.tobytes()).to_bytes(4, "little")
        assert files["/".join(["c", *map(str, idx)])] == want, idx


def _takes_o_direct(folder: Path, nbytes: int = 4096) -> bool:
    """Whether ``folder``'s file system takes an ``O_DIRECT`` write of ``nbytes`` from a
    page-aligned buffer (tmpfs does since Linux 6.6, unaligned ones too)."""
    import mmap

    path = folder / ".probe"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _dw.O_DIRECT, 0o644)
    except OSError as e:
        assert e.errno == errno.EINVAL
        return False
    try:
        os.write(fd, memoryview(mmap.mmap(-1, 4096))[:nbytes])
        return True
    except OSError as e:
        assert e.errno == errno.EINVAL
        return False
    finally:
        os.close(fd)
        path.unlink()


def _state():
    m = mesh((4, 2), ("data", "model"))
    x = np.random.default_rng(0).standard_normal((256, 1024)).astype(np.float32)
    return {
        "w": put(x, m, "data", "model"),  # 8 chunks of 64x512: 128 KiB
        "b": put(x[:, :8].astype(ml_dtypes.bfloat16), m, "data"),
        "q": put(np.arange(48 * 4).reshape(48, 4).astype(ml_dtypes.uint4), m, None),
    }


def _array_files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in (root / "arrays").rglob("*")
        if p.is_file()
    }


def _chunk_sizes(root: Path) -> list[int]:
    return [p.stat().st_size for p in (root / "arrays").rglob("c/**/*") if p.is_file()]


def _assert_read_everywhere(path: Path, state) -> None:
    """jaxckpt restores the tree; tensorstore reads each array (checking each chunk's
    CRC-32C), zarr-python the float32 one (it knows no bfloat16 or uint4) where installed."""
    assert_tree_equal(jaxckpt.restore(path, state), state)
    for key in ("w", "b"):
        spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": f"{path}/arrays/{key}/"}}
        got = ts.open(spec).result().read().result()
        np.testing.assert_array_equal(got, np.asarray(state[key]))
    try:
        import zarr
    except ImportError:  # not in the floor environment; test_interop.py covers it elsewhere
        return
    np.testing.assert_array_equal(
        zarr.open_array(str(path / "arrays" / "w"), mode="r")[...], np.asarray(state["w"])
    )


@needs_o_direct
def test_a_save_on_a_real_disk_uses_o_direct_and_reads_everywhere(tmp_path):
    if not _takes_o_direct(tmp_path):
        pytest.skip(f"{tmp_path}'s file system refuses O_DIRECT")
    state = _state()
    before = _dw.bytes_written()
    jaxckpt.save(tmp_path / "direct", state)
    after = _dw.bytes_written()
    chunks = _chunk_sizes(tmp_path / "direct")
    assert after["direct"] + after["buffered"] - sum(before.values()) == sum(chunks)
    # only each file's tail, under 4096 bytes, goes through the page cache
    assert after["buffered"] - before["buffered"] == sum(n % 4096 for n in chunks)
    assert after["direct"] - before["direct"] >= 8 * 128 * 1024
    _assert_read_everywhere(tmp_path / "direct", state)
    _dw.enabled = False
    jaxckpt.save(tmp_path / "tensorstore", state)
    assert _array_files(tmp_path / "direct") == _array_files(tmp_path / "tensorstore")


def test_without_o_direct_the_page_cache_writes_the_same_files(tmp_path, monkeypatch):
    """Where the OS offers no O_DIRECT: the same writes, through the page cache, each file's
    write-back started."""
    monkeypatch.setattr(_dw, "O_DIRECT", 0)
    state = _state()
    before, hints = _dw.bytes_written(), _writeback.started()
    jaxckpt.save(tmp_path / "cached", state)
    after = _dw.bytes_written()
    assert after["direct"] == before["direct"]
    chunks = _chunk_sizes(tmp_path / "cached")
    assert after["buffered"] - before["buffered"] == sum(chunks)
    if _writeback._sync_file_range is not None and _writeback.enabled:
        assert _writeback.started() - hints == len(chunks)  # one hint per chunk file
    _assert_read_everywhere(tmp_path / "cached", state)
    _dw.enabled = False
    jaxckpt.save(tmp_path / "tensorstore", state)
    assert _array_files(tmp_path / "cached") == _array_files(tmp_path / "tensorstore")


@needs_o_direct
def test_a_refused_o_direct_write_falls_back_and_is_remembered(tmp_path, monkeypatch):
    """A file system that takes the O_DIRECT open but refuses the write (EINVAL): here an
    ext4-like disk refusing writes that are not whole blocks (alignment 1). The file is
    finished through the page cache, and later saves to the file system skip O_DIRECT."""
    if not _takes_o_direct(tmp_path) or _takes_o_direct(tmp_path, 100):
        pytest.skip(f"{tmp_path}'s file system does not refuse unaligned O_DIRECT writes")
    monkeypatch.setattr(_dw, "ALIGN", 1)
    data = _values("float32", (13, 10))
    boxes = _boxes(data.shape, (4, 3), ((), ()))
    before = _dw.bytes_written()
    ours = _write(tmp_path / "a", data, (4, 3), boxes, direct=True)
    assert _dw.bytes_written()["direct"] == before["direct"]
    assert len(_dw._refused) == 1  # this file system, remembered
    monkeypatch.setattr(_dw, "ALIGN", 4096)
    again = _write(tmp_path / "b", data, (4, 3), boxes, direct=True)
    assert _dw.bytes_written()["direct"] == before["direct"]  # not tried again
    assert ours == again == _write(tmp_path / "c", data, (4, 3), boxes, direct=False)


def test_a_tmpfs_save_writes_the_same_files(tmp_path):
    """tmpfs: O_DIRECT refused before Linux 6.6, taken since; either way the same bytes."""
    with tmpfs(tmp_path / "t", "64m") as t:
        state = _state()
        direct = _takes_o_direct(t)
        before = _dw.bytes_written()
        jaxckpt.save(t / "ck", state)
        after = _dw.bytes_written()
        assert (after["direct"] - before["direct"] >= 8 * 128 * 1024) == direct
        _assert_read_everywhere(t / "ck", state)
        _dw.enabled = False
        jaxckpt.save(t / "tensorstore", state)
        assert _array_files(t / "ck") == _array_files(t / "tensorstore")


@pytest.mark.parametrize("o_direct", [True, False])
def test_a_full_disk_fails_the_save_naming_the_path_and_leaves_nothing(
    tmp_path, monkeypatch, o_direct
):
    if not o_direct:
        monkeypatch.setattr(_dw, "O_DIRECT", 0)
    monkeypatch.setattr(_dw, "MIN_CHUNK_BYTES", 1 << 20)  # the default: large chunks only
    monkeypatch.setattr(_dw, "BUFFER_BYTES", 1 << 20)
    m = mesh((4, 2), ("data", "model"))
    state = {"w": put(np.ones((4096, 1024), np.float32), m, "data", "model")}  # 2 MiB chunks
    with tmpfs(tmp_path / "t", "8m") as t:
        before = sum(_dw.bytes_written().values())
        with pytest.raises(CheckpointError, match=r"(?s)disk is full") as info:
            jaxckpt.save(t / "ck", state)
        assert sum(_dw.bytes_written().values()) > before  # the direct writer hit it
        assert str(t / "ck") in str(info.value)
        assert "No space left" in str(info.value) and "arrays/w/c/" in str(info.value)
        assert os.listdir(t) == []  # no staging directory, no checkpoint


def test_a_file_already_there_is_replaced_not_written_through(tmp_path):
    """An incremental save links a box's chunk files, and writes the box when linking fails
    part way: the link made already must be replaced, never written into (the base's file)."""
    data = _values("float32", (8, 6))
    entry = ArrayEntry("a", (8, 6), "float32", "float32", (4, 6), "arrays/a")
    base = tmp_path / "base-chunk"
    base.write_bytes(b"the base's bytes")
    writer = Writer(Location(tmp_path / "ck"), overwrite=False)
    try:
        writer.open_arrays([entry], create=True)
        chunk = writer.staging / "arrays" / "a" / "c" / "0" / "0"
        chunk.parent.mkdir(parents=True)
        os.link(base, chunk)
        writer.write({"a": entry}, [(WriteItem("a", (0, 0), (8, 6), "float32", 0), data)])
        assert base.read_bytes() == b"the base's bytes"
        want = data[:4].tobytes()
        assert chunk.read_bytes() == want + google_crc32c.value(want).to_bytes(4, "little")
        assert chunk.stat().st_nlink == 1
    finally:
        writer.abort()


def test_what_stays_with_tensorstore(monkeypatch):
    monkeypatch.setattr(_dw, "MIN_CHUNK_BYTES", 1 << 20)
    big = ArrayEntry("a", (1024, 512), "float32", "float32", (512, 512), "arrays/a")
    x = np.zeros((512, 512), np.float32)
    assert _dw.supports(big, (0, 0), (512, 512), x)
    assert _dw.supports(big, (0, 0), (1024, 512), np.zeros((1024, 512), np.float32))
    small = ArrayEntry("a", (1024, 512), "float32", "float32", (256, 512), "arrays/a")
    assert not _dw.supports(small, (0, 0), (256, 512), x[:256])  # 512 KiB chunks
    assert not _dw.supports(big, (0, 0), (256, 512), x[:256])  # part of a chunk
    assert not _dw.supports(big, (0, 0), (512, 512), x.astype(">f4"))  # not little endian
    flags = ArrayEntry("a", (2048, 1024), "bool", "bool", (2048, 1024), "arrays/a")
    assert not _dw.supports(flags, (0, 0), (2048, 1024), np.zeros((2048, 1024), bool))
    monkeypatch.setattr(_dw, "enabled", False)
    assert not _dw.supports(big, (0, 0), (512, 512), x)


def test_buffers_are_reused_one_per_write_thread(tmp_path):
    data = _values("float32", (300, 50))
    for k in range(3):
        _write(
            tmp_path / str(k), data, (10, 50), _boxes(data.shape, (10, 50), ((), ())), direct=True
        )
    assert 1 <= len(_dw._spare) <= pools.WRITE_THREADS
    assert all(len(b.array) == 3 * 4096 for b in _dw._spare)


KILLED_MID_WRITE = """
import os, signal, sys
import numpy as np
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import jaxckpt
from jaxckpt._storage import directwrite

path, value = sys.argv[1], float(sys.argv[2])
m = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
w = jax.device_put(np.full((2048, 1024), value, np.float32), NamedSharding(m, P("data", "model")))
if value == 2.0:  # the save that dies: SIGKILL at its third chunk write
    writes, pwrite = [], os.pwrite
    def tripwire(fd, data, offset):
        writes.append(offset)
        if len(writes) == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        return pwrite(fd, data, offset)
    os.pwrite = tripwire
jaxckpt.save(path, {"w": w}, overwrite=True)  # 8 chunks of 1 MiB: all written here
assert sum(directwrite.bytes_written().values()) >= 8 << 20
"""


def test_a_save_killed_mid_write_leaves_the_last_checkpoint_whole(tmp_path):
    """SIGKILL between two chunk writes of an overwrite: the checkpoint committed before is
    restored whole, and the next save of the path commits."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    env["JAX_PLATFORMS"] = "cpu"

    def run(value: float) -> int:
        cmd = [sys.executable, "-c", KILLED_MID_WRITE, str(tmp_path / "ck"), str(value)]
        return subprocess.run(cmd, env=env, timeout=120).returncode

    assert run(1.0) == 0
    assert run(2.0) == -9  # killed
    assert (jaxckpt.restore(tmp_path / "ck")["w"] == 1.0).all()
    assert run(3.0) == 0
    assert (jaxckpt.restore(tmp_path / "ck")["w"] == 3.0).all()
