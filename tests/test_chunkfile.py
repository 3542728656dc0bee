"""Local chunks read in place (jaxckpt._storage.chunkfile) give exactly what tensorstore's decode gives,
for every box of every chunk grid (edge chunks included), and treat each file as hostile."""

from __future__ import annotations

import itertools
import math
import os
import sys

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts
from helpers import one_array_per_leaf  # noqa: F401 (autouse: the tests edit per-array files)
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxckpt
from jaxckpt._format.grid import c_order_blocks
from jaxckpt._format.manifest import ArrayEntry
from jaxckpt._format.plan import ReadItem
from jaxckpt._storage import chunkfile as _chunkfile
from jaxckpt._storage import crc as _crc
from jaxckpt._storage import reader as _reader
from jaxckpt._storage.location import Location
from jaxckpt._storage.writer import array_spec

DTYPES = ["float32", "bfloat16", "int8", "uint16", "complex64", "float64", "bool"]


def _write(root, data: np.ndarray, chunks, checksum) -> ArrayEntry:
    name = np.dtype(data.dtype).name
    entry = ArrayEntry(
        key="a/b",
        shape=data.shape,
        dtype=name,
        storage_dtype=name,
        chunks=tuple(chunks),
        path="arrays/a.b",
        checksum=checksum,
    )
    spec = array_spec({"driver": "file", "path": f"{root}/arrays/a.b/"}, entry)
    store = ts.open({**spec, "store_data_equal_to_fill_value": True}, create=True).result()
    store.write(data).result()
    return entry


def _read(root, entry: ArrayEntry, offsets, sizes, *, direct: bool) -> np.ndarray:
    old, _chunkfile.enabled = _chunkfile.enabled, direct
    try:
        reader = _reader.CheckpointReader(Location(root))
        [(_, got)] = reader.read({entry.key: entry}, [ReadItem(entry.key, offsets, sizes)])
    finally:
        _chunkfile.enabled = old
    return got


@st.composite
def _case(draw):
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.integers(1, 9)) for _ in range(ndim))
    chunks = tuple(draw(st.integers(1, s)) for s in shape)
    offsets = tuple(draw(st.integers(0, s - 1)) for s in shape)
    sizes = tuple(draw(st.integers(1, s - o)) for s, o in zip(shape, offsets))
    return shape, chunks, offsets, sizes, draw(st.sampled_from(DTYPES)), draw(st.booleans())


@settings(max_examples=60, deadline=None)
@given(case=_case())
def test_in_place_read_equals_tensorstore_on_every_box(tmp_path_factory, case):
    shape, chunks, offsets, sizes, dtype, checksum = case
    root = tmp_path_factory.mktemp("c")
    rng = np.random.default_rng(0)
    data = rng.integers(
        0,
        256,
        math.prod(shape) * np.dtype(getattr(ml_dtypes, dtype, dtype)).itemsize,
        dtype=np.uint8,
    )
    data = data.view(getattr(ml_dtypes, dtype, dtype)).reshape(shape)
    if dtype == "bool":
        data = data.view(np.uint8) % 2 == 1
    entry = _write(root, data, chunks, "crc32c" if checksum else None)
    want = data[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
    assert _chunkfile.supports(root, entry) == (dtype != "bool")
    for direct in (True, False):
        got = _read(root, entry, offsets, sizes, direct=direct)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert got.tobytes() == want.tobytes(), direct


def test_in_place_reads_are_counted_and_a_shared_chunk_is_read_once(tmp_path):
    data = np.arange(64, dtype=np.float32).reshape(8, 8)
    entry = _write(tmp_path, data, (4, 8), "crc32c")
    chunk = 4 * 8 * 4 + 4  # elements and the crc32c tail
    before = _reader.file_bytes_read()
    _read(tmp_path, entry, (2, 0), (4, 8), direct=True)  # half of each of two chunks
    assert _reader.file_bytes_read() - before == 2 * chunk
    # Two boxes in flight that each need half of chunk 0 (a reshard): one read, both parts.
    items = [ReadItem("a/b", (0, 0), (2, 8)), ReadItem("a/b", (2, 0), (2, 8))]
    before = _reader.file_bytes_read()
    got = list(_reader.CheckpointReader(Location(tmp_path)).read({"a/b": entry}, items))
    assert _reader.file_bytes_read() - before == chunk
    np.testing.assert_array_equal(np.concatenate([g for _, g in got]), data[:4])
    # A budget of one box: the first box's wait starts the read for it alone, the second box
    # reads the chunk again (what the class docstring promises, no deadlock, right bytes).
    before = _reader.file_bytes_read()
    reader = _reader.CheckpointReader(Location(tmp_path))
    got = list(reader.read({"a/b": entry}, items, max_inflight_bytes=1))
    assert _reader.file_bytes_read() - before == 2 * chunk
    np.testing.assert_array_equal(np.concatenate([g for _, g in got]), data[:4])
    assert not reader._inplace._gathering and not reader._inplace._due  # nothing left behind


@st.composite
def _tiling(draw):
    """An array, its chunk grid and boxes tiling it along cuts of their own (a reshard)."""
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(1, 10)) for _ in range(ndim))
    chunks = tuple(draw(st.integers(1, s)) for s in shape)
    cuts = [
        sorted(draw(st.sets(st.integers(1, s - 1), max_size=3))) if s > 1 else [] for s in shape
    ]
    return shape, chunks, cuts, draw(st.integers(1, 64)), draw(st.integers(1, 4096))


@settings(max_examples=60, deadline=None)
@given(case=_tiling())
def test_boxes_straddling_chunks_get_their_bytes_each_chunk_read_once(tmp_path_factory, case):
    """Any tiling of any chunk grid, read in blocks of any size within any read-ahead budget:
    every box holds exactly its bytes, and with every box in flight no chunk is read twice."""
    shape, chunks, cuts, block, budget = case
    data = np.random.default_rng(2).standard_normal(shape).astype(np.float32)
    root = tmp_path_factory.mktemp("c")
    entry = _write(root, data, chunks, "crc32c")
    bounds = [list(zip([0, *c], [*c, s])) for c, s in zip(cuts, shape)]
    items = [
        ReadItem("a/b", tuple(a for a, _ in box), tuple(b - a for a, b in box))
        for box in itertools.product(*bounds)
    ]
    old, _chunkfile._BLOCK = _chunkfile._BLOCK, block
    try:
        for ahead in (budget, 1 << 30):
            before = _reader.file_bytes_read()
            reader = _reader.CheckpointReader(Location(root))
            for item, got in reader.read({"a/b": entry}, items, max_inflight_bytes=ahead):
                want = data[tuple(slice(o, o + n) for o, n in zip(item.offsets, item.sizes))]
                np.testing.assert_array_equal(got, want)
            read = _reader.file_bytes_read() - before
            assert not reader._inplace._gathering and not reader._inplace._due  # all submitted
            assert all(b.nbytes <= max(block, 4) for b in reader._inplace._scratch)
        grid = [-(-s // c) for s, c in zip(shape, chunks)]
        assert read == math.prod(grid) * (math.prod(chunks) * 4 + 4)  # all in flight: once each
    finally:
        _chunkfile._BLOCK = old


@settings(max_examples=100, deadline=None)
@given(
    shape=st.lists(st.integers(1, 6), max_size=4).map(tuple),
    limit=st.integers(1, 400),
    itemsize=st.sampled_from([1, 2, 4, 8]),
)
def test_blocks_tile_the_chunk_file_in_order(shape, limit, itemsize):
    covered = np.zeros(shape, np.int64)
    at = 0
    for offset, region in c_order_blocks(shape, itemsize, limit):
        n = math.prod(b - a for a, b in region)
        assert offset == at and (n * itemsize <= limit or n == 1)  # contiguous, in file order
        covered[tuple(slice(a, b) for a, b in region)] += 1
        flat = np.arange(math.prod(shape)).reshape(shape)[tuple(slice(a, b) for a, b in region)]
        assert (np.diff(flat.reshape(-1)) == 1).all()  # one run of the file
        at += n * itemsize
    assert (covered == 1).all() and at == math.prod(shape) * itemsize


def test_damaged_chunk_shared_by_two_boxes_fails_both_naming_it(tmp_path):
    data = np.arange(64, dtype=np.float32).reshape(8, 8)
    entry = _write(tmp_path, data, (4, 8), "crc32c")
    chunk = tmp_path / "arrays" / "a.b" / "c" / "1" / "0"
    raw = bytearray(chunk.read_bytes())
    raw[5] ^= 1
    chunk.write_bytes(bytes(raw))
    items = [ReadItem("a/b", (0, 0), (8, 4)), ReadItem("a/b", (0, 4), (8, 4))]
    reader = _reader.CheckpointReader(Location(tmp_path))
    for item in items:  # each box alone: both need half of the damaged chunk
        with pytest.raises(
            jaxckpt.CorruptChunkError, match=r"Key 'a/b': chunk \(1,0\) of arrays/a.b .*checksum"
        ):
            list(reader.read({"a/b": entry}, [item]))
    with pytest.raises(jaxckpt.CorruptChunkError, match=r"chunk \(1,0\).*verify"):
        list(reader.read({"a/b": entry}, items))


@pytest.fixture(params=[True, False], ids=["in-place", "tensorstore"])
def direct(request, monkeypatch):
    monkeypatch.setattr(_chunkfile, "enabled", request.param)
    return request.param


def _saved(tmp_path):
    path = tmp_path / "c"
    jaxckpt.save(path, {"w": jnp.arange(4096, dtype=jnp.float32).reshape(64, 64)})
    return path, path / "arrays" / "w" / "c" / "0" / "0"


def test_flipped_byte_names_key_and_chunk(tmp_path, direct):
    path, chunk = _saved(tmp_path)
    raw = bytearray(chunk.read_bytes())
    raw[100] ^= 1
    chunk.write_bytes(bytes(raw))
    with pytest.raises(
        jaxckpt.CorruptChunkError, match=r"Key 'w': chunk \(0,0\).*checksum.*verify"
    ):
        jaxckpt.restore(path)


@pytest.mark.parametrize("change", ["truncated", "padded"])
def test_chunk_of_the_wrong_size_names_key_and_sizes(tmp_path, change):
    path, chunk = _saved(tmp_path)
    raw = chunk.read_bytes()
    chunk.write_bytes(raw[:-10] if change == "truncated" else raw + b"\0" * 4096)
    have = len(raw) - 10 if change == "truncated" else len(raw) + 4096
    with pytest.raises(
        jaxckpt.CorruptChunkError,
        match=rf"Key 'w': chunk \(0,0\) of arrays/w in .* holds {have} bytes, the manifest "
        rf"implies {len(raw)}.*restore an earlier one",
    ):
        jaxckpt.restore(path)


def test_fifo_in_place_of_a_chunk_is_refused_without_hanging(tmp_path):
    path, chunk = _saved(tmp_path)
    chunk.unlink()
    os.mkfifo(chunk)
    with pytest.raises(jaxckpt.CorruptChunkError, match=r"Key 'w': chunk \(0,0\).*not a regular"):
        jaxckpt.restore(path)


@pytest.mark.parametrize("swap", ["fifo", "link", "padded"])
def test_read_ahead_hint_of_a_large_chunk_neither_hangs_nor_follows(tmp_path, swap):
    """Chunks of 256 KiB and more get a read-ahead hint before they are read: a FIFO, a link
    or an oversized file in place of one is still refused by the read, without hanging."""
    path = tmp_path / "c"
    jaxckpt.save(path, {"w": jnp.ones((512, 256), jnp.float32)})  # one chunk of 512 KiB
    chunk = path / "arrays" / "w" / "c" / "0" / "0"
    assert chunk.stat().st_size >= _chunkfile._PREFETCH_MIN
    raw = chunk.read_bytes()
    chunk.unlink()
    if swap == "fifo":
        os.mkfifo(chunk)
    elif swap == "link":
        (tmp_path / "secret").write_bytes(raw)
        chunk.symlink_to(tmp_path / "secret")
    else:
        chunk.write_bytes(raw + bytes(1 << 20))
    # (the listing before the read refuses the link already, as a ManifestError)
    with pytest.raises((jaxckpt.CorruptChunkError, jaxckpt.ManifestError), match=r"Key 'w'"):
        jaxckpt.restore(path)


def test_link_swapped_in_after_the_listing_is_not_followed(tmp_path):
    # The listing (Reader.check_chunks) refuses links; a link made after it, before the read,
    # must still not be followed: the file is opened with O_NOFOLLOW.
    path, chunk = _saved(tmp_path)
    entry = jaxckpt.metadata(path).entries["w"]
    reader = _reader.CheckpointReader(Location(path))
    reader.check_chunks(entry)
    secret = tmp_path / "secret"
    secret.write_bytes(chunk.read_bytes())  # same size and checksum: only the link is wrong
    chunk.unlink()
    chunk.symlink_to(secret)
    item = ReadItem("w", (0, 0), (64, 64))
    with pytest.raises(jaxckpt.CorruptChunkError, match=r"Key 'w': chunk \(0,0\).*cannot be read"):
        list(reader.read({"w": entry}, [item]))


@settings(max_examples=50, deadline=None)
@given(st.binary(min_size=0, max_size=5000), st.sampled_from(["uint8", "float32", "int64"]))
def test_crc32c_without_the_gil_equals_google_crc32c(raw, dtype):
    import google_crc32c

    itemsize = np.dtype(dtype).itemsize
    raw = raw[: len(raw) // itemsize * itemsize]
    a = np.frombuffer(raw, np.uint8).copy().view(dtype)
    want = google_crc32c.value(raw)
    assert _crc.crc32c(a) == want
    old, _crc._extend = _crc._extend, None  # the fallback: the extension's value()
    try:
        assert _crc.crc32c(a) == want
    finally:
        _crc._extend = old


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the manylinux wheel's layout")
def test_the_native_crc32c_is_found_here():
    assert _crc._extend is not None  # else restores checksum under the GIL, one at a time
