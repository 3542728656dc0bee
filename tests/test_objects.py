"""Format v5's data objects (issue 63.1): a few objects per process, not one per chunk.

On S3 (moto) and GCS (fake-gcs-server) through the shared ``store`` fixture, and on
``memory://`` for what does not need a server (hostile manifests). Saves use
``DefaultSavePlanner(layout="objects")`` with small objects; the default (``"auto"``) writes
the same layout on object stores, and a file per chunk on local disks and for compressed or
incremental saves, as ``layout="chunks"`` does everywhere.
"""

from __future__ import annotations

import json
import re
import uuid

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_equal, mesh, put
from test_object_stores import Store, store  # noqa: F401, F811 (the fixture)
from test_s3 import s3  # noqa: F401 (the store fixture's S3 side)

import jaxckpt
from jaxckpt._cli.main import main
from jaxckpt._runtime.pools import settle
from jaxckpt._storage.location import Location, kvstore


def planner(object_bytes: int = 1 << 20, **kw) -> jaxckpt.DefaultSavePlanner:
    return jaxckpt.DefaultSavePlanner(
        layout="objects", object_bytes=object_bytes, pack_bytes=0, max_chunk_bytes=256, **kw
    )


def many_arrays(n: int = 12) -> dict:
    """``n`` sharded matrices of 8 chunks each (256-byte chunks), a vector and a scalar."""
    m = mesh((4, 2), ("data", "model"))
    tree = {
        f"w{i}": put(jnp.arange(512.0).reshape(16, 32) + i, m, "data", "model") for i in range(n)
    }
    return {**tree, "v": np.arange(5, dtype=np.int16), "step": 4}


def host(tree: dict) -> dict:
    return {k: np.asarray(v) if hasattr(v, "shape") else v for k, v in tree.items()}


def data_objects(found: list[str]) -> list[str]:
    return [k for k in found if re.fullmatch(r"(g[0-9a-f]+/)?data/\d+\.\d+", k)]


def test_a_save_writes_a_few_objects_and_restores_resharded(store: Store):  # noqa: F811
    url = f"{store.url}/v5"
    tree = many_arrays()
    jaxckpt.save(url, tree, planner=planner(object_bytes=4096))
    found = store.keys(f"{store.prefix}/v5")
    objs = data_objects(found)
    # 12 x 8 chunks of 256 B + checksums: 24.4 KiB in objects of at most 4 KiB, not 98 objects
    assert 6 <= len(objs) <= 8, found
    assert not any("/c/" in k or k.endswith("zarr.json") for k in found), found
    doc = json.loads(store.get(f"{store.prefix}/v5/manifest.json"))
    assert doc["version"] == 5 and doc["objects"]["processes"] == 1
    assert_tree_equal(jaxckpt.restore(url), host(tree))
    other = mesh((2, 4), ("a", "b"))
    target = {k: None for k in tree} | {"w3": put(jnp.zeros((16, 32)), other, "b", "a")}
    got = jaxckpt.restore(url, target)
    assert got["w3"].sharding == target["w3"].sharding
    np.testing.assert_array_equal(np.asarray(got["w3"]), np.asarray(tree["w3"]))
    assert main(["verify", url]) == 0


def test_overwrite_keeps_the_layout_per_save(store: Store):  # noqa: F811
    """An overwrite writes its objects under its own generation; the old ones go."""
    url = f"{store.url}/ow"
    jaxckpt.save(url, many_arrays(2), planner=planner())
    tree = {**many_arrays(2), "step": 5}
    jaxckpt.save(url, tree, planner=planner(), overwrite=True)
    assert_tree_equal(jaxckpt.restore(url), host(tree))
    settle()  # the clean-up after the commit: the first save's objects go
    (gen,) = {k.split("/")[0] for k in data_objects(store.keys(f"{store.prefix}/ow"))}
    assert gen.startswith("g"), gen
    jaxckpt.save(url, tree, overwrite=True)  # back to a file per chunk
    assert_tree_equal(jaxckpt.restore(url), host(tree))


def test_a_corrupted_record_is_named(store: Store):  # noqa: F811
    url = f"{store.url}/bad"
    jaxckpt.save(url, many_arrays(2), planner=planner())
    (obj,) = data_objects(store.keys(f"{store.prefix}/bad"))
    data = bytearray(store.get(f"{store.prefix}/bad/{obj}"))
    data[300] ^= 0xFF  # inside the second record of the first array
    store.put(f"{store.prefix}/bad/{obj}", bytes(data))
    with pytest.raises(
        jaxckpt.CorruptChunkError, match=r"Key 'w0'.*chunk \(0,1\).*fails its checksum"
    ):
        jaxckpt.restore(url)
    assert main(["verify", url]) != 0


class Trip(jaxckpt.DefaultSavePlanner):
    """Fails while handing over its fifth box, after its first data object is written."""

    def resolve_data(self, item):
        self.n = getattr(self, "n", 0) + 1
        if self.n == 5:
            raise RuntimeError("tripwire")
        return super().resolve_data(item)


def test_a_failed_save_leaves_nothing(store: Store):  # noqa: F811
    url = f"{store.url}/failed"
    trip = Trip(layout="objects", object_bytes=600, pack_bytes=0, max_chunk_bytes=256)
    with pytest.raises(RuntimeError, match="tripwire"):
        jaxckpt.save(url, many_arrays(2), planner=trip)
    settle()
    assert store.keys(f"{store.prefix}/failed") == []


def test_a_truncated_object_is_named(store: Store):  # noqa: F811
    url = f"{store.url}/short"
    jaxckpt.save(url, many_arrays(2), planner=planner())
    (obj,) = data_objects(store.keys(f"{store.prefix}/short"))
    store.put(f"{store.prefix}/short/{obj}", store.get(f"{store.prefix}/short/{obj}")[:1000])
    with pytest.raises(jaxckpt.CorruptChunkError, match=rf"Key 'w\d'.*data object {obj}.*"):
        jaxckpt.restore(url)


def _saved(url: str) -> tuple[object, dict]:
    jaxckpt.save(url, many_arrays(2), planner=planner())
    kv = kvstore(Location(url).kvstore)
    return kv, json.loads(kv.read("manifest.json").result().value)


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda o: o["owners"]["arrays/w0"].append([0, 1]), "declares 9 chunks"),
        (lambda o: o["owners"]["arrays/w0"].__setitem__(0, [1, 8]), "bad runs"),
        (lambda o: o["owners"]["arrays/w0"].__setitem__(0, [0, 1 << 40]), "bad runs"),
        (lambda o: o.__setitem__("target", 1 << 60), "target"),
        (lambda o: o.__setitem__("processes", 0), "processes"),
        (lambda o: o.__setitem__("folder", "../x/data"), "folder"),
        (lambda o: o["owners"].pop("arrays/v"), "exactly the stored arrays"),
    ],
)
def test_a_hostile_objects_field_is_refused(change, match):
    url = f"memory://v5-hostile-{uuid.uuid4().hex}"
    kv, doc = _saved(url)
    change(doc["objects"])
    kv.write("manifest.json", json.dumps(doc).encode()).result()
    with pytest.raises(jaxckpt.ManifestError, match=match):
        jaxckpt.restore(url)


def test_huge_shapes_are_refused_before_any_table():
    url = f"memory://v5-huge-{uuid.uuid4().hex}"
    kv, doc = _saved(url)
    doc["entries"]["v"].update(shape=[1 << 40], chunks=[1])
    doc["objects"]["owners"]["arrays/v"] = [[0, 1 << 24], [0, 1 << 24]]
    kv.write("manifest.json", json.dumps(doc).encode()).result()
    with pytest.raises(jaxckpt.ManifestError, match="over 16777216 records"):
        jaxckpt.restore(url)


def test_local_disks_and_layout_chunks_keep_a_file_per_chunk(tmp_path):
    tree = many_arrays(1)
    default = jaxckpt.DefaultSavePlanner(pack_bytes=0, max_chunk_bytes=256)  # layout "auto"
    for p in (default, planner()):  # the default, and objects asked for
        jaxckpt.save(tmp_path / "c", tree, overwrite=True, planner=p)
        assert json.loads((tmp_path / "c/manifest.json").read_text())["version"] < 5
        assert (tmp_path / "c/arrays/w0/c/0/0").exists()
        assert_tree_equal(jaxckpt.restore(tmp_path / "c"), host(tree))
    url = f"memory://chunks-{uuid.uuid4().hex}"
    jaxckpt.save(url, tree, planner=jaxckpt.DefaultSavePlanner(layout="chunks"))
    assert jaxckpt.metadata(url).version < 5
    jaxckpt.save(f"{url}-default", tree)
    assert jaxckpt.metadata(f"{url}-default").version == 5
    for kw in ({"compression": "zstd"}, {"digests": True}):  # never in data objects
        jaxckpt.save(f"{url}-{next(iter(kw))}", tree, **kw)
        assert jaxckpt.metadata(f"{url}-{next(iter(kw))}").version < 5
    with pytest.raises(jaxckpt.InvalidArgumentError, match="layout"):
        jaxckpt.DefaultSavePlanner(layout="records")


def test_zero_d_and_empty_arrays_in_data_objects():
    """A 0-d array is one chunk (its one box's writer); an empty one has none."""
    m = mesh((4, 2), ("data", "model"))
    tree = {
        "s": put(np.float32(3.5), m),
        "e": np.zeros((0, 3), np.float32),
        "w": put(jnp.arange(64.0).reshape(8, 8), m, "data", "model"),
    }
    url = f"memory://v5-0d-{uuid.uuid4().hex}"
    jaxckpt.save(url, tree, planner=jaxckpt.DefaultSavePlanner(pack_bytes=0))
    assert jaxckpt.metadata(url).version == 5
    assert_tree_equal(jaxckpt.restore(url), host(tree))


def test_a_v5_checkpoint_copied_to_a_local_disk_reads(tmp_path):
    url = f"memory://v5-copy-{uuid.uuid4().hex}"
    tree = many_arrays(2)
    kv, _ = _saved(url)
    for key in kv.list().result():
        out = tmp_path / key.decode()
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(kv.read(key).result().value)
    assert_tree_equal(jaxckpt.restore(tmp_path), host(tree))


def test_a_group_of_two_writes_two_times_a_few_objects(gcs, tmp_path):
    """A real 2-process group on fake GCS: each process writes its own data objects (O(2)
    objects for 6 arrays of 8 chunks per process), and each restores its resharded part."""
    from pathlib import Path

    from groups import run_group

    prefix = f"t-{uuid.uuid4().hex[:8]}"
    (tmp_path / "url").write_text(f"gs://ckpts/{prefix}")
    records = run_group(Path(__file__).parent / "objects_worker.py", "two", 2, tmp_path, 300)
    assert all(r.get("ok") for r in records), records
    objs = data_objects(gcs.keys(f"{prefix}/two"))
    assert sorted(objs) == ["data/0.0", "data/1.0"], objs


@pytest.mark.parametrize(
    "mib, processes, size_mib", [(1, 1, 4), (64, 1, 4), (1024, 1, 64), (8192, 2, 128)]
)
def test_object_size_spreads_each_process_over_requests(mib, processes, size_mib):
    """At most ``object_bytes``, and small enough that the busiest process writes 16 objects
    side by side, but never below 4 MiB."""
    from jaxckpt._format.entries import ArrayEntry
    from jaxckpt._format.objects import from_plans, table

    rows = mib * 1024  # float32 rows of 1 KiB: chunks of 256 rows (256 KiB)
    e = ArrayEntry("w", (rows, 256), "float32", "float32", (256, 256), "arrays/w")
    corners = np.arange(0, rows, 256).reshape(-1, 1) * np.array([[1, 0]])
    writers = np.arange(len(corners)) * processes // len(corners)
    objects = from_plans([(e, corners, writers)], processes)
    assert 0 <= objects.target - (size_mib << 20) < 4096  # (checksums: 4 B per record)
    t = table(objects, {"arrays/w": e})
    each = -(-(mib // processes) // size_mib)  # objects per process, checksums aside
    assert processes * each <= len(t.names) <= processes * (each + 1), len(t.names)
    assert objects.owners["arrays/w"] == tuple(
        (p, len(corners) // processes) for p in range(processes)
    )


def test_an_async_save_within_a_budget_of_one_chunk():
    """A budgeted async save streams its chunks through a ring: each is copied into its record
    and released before the next is staged."""
    url = f"memory://v5-budget-{uuid.uuid4().hex}"
    tree = many_arrays(3)
    h = jaxckpt.save_async(url, tree, planner=planner(), max_host_bytes=256)
    h.wait()
    assert_tree_equal(jaxckpt.restore(url), host(tree))
    assert jaxckpt.metadata(url).version == 5


def test_a_partial_restore_reads_only_its_records(gcs):
    """Restoring one array of twelve fetches that array's records (byte ranges), not the
    objects they share with other arrays (adjacent records: one range per object)."""
    import time

    prefix = f"t-{uuid.uuid4().hex[:8]}"
    url = f"gs://ckpts/{prefix}/part"
    jaxckpt.save(url, many_arrays(), planner=planner(object_bytes=4096))
    settle()
    start, t = len(gcs.proxy.log), time.monotonic()
    got = jaxckpt.restore(url, keys=["w5"])
    time.sleep(0.05)  # let the proxy log what it answered
    np.testing.assert_array_equal(got["w5"], np.arange(512.0).reshape(16, 32) + 5)
    data = [r for r in gcs.proxy.log[start:] if r.start >= t and "data%2F0." in r.path]
    assert sum(r.down for r in data) == 8 * (256 + 4), [(r.path, r.down) for r in data]


def test_convert_diff_and_export_read_data_objects(tmp_path):
    """Everything that reads through the Reader reads v5: convert to a file per chunk on a
    local disk, diff against it (equal), export it."""
    url = f"memory://v5-tools-{uuid.uuid4().hex}"
    tree = many_arrays(2)
    _saved(url)
    jaxckpt.convert(url, str(tmp_path / "c"))
    assert (tmp_path / "c/arrays/w0/c/0/0").exists()
    assert_tree_equal(jaxckpt.restore(tmp_path / "c"), host(tree))
    assert main(["diff", url, str(tmp_path / "c")]) == 0
    assert main(["export", url, str(tmp_path / "out.npz")]) == 0
    with np.load(tmp_path / "out.npz") as z:
        np.testing.assert_array_equal(z["w1"], np.asarray(tree["w1"]))


def test_records_longer_than_a_request_are_read_in_parts(store: Store):  # noqa: F811
    """A range longer than ``PART_BYTES`` is read as several requests: the box comes back
    whole and writable, resharded boxes too, and a bad byte in a later part is still named."""
    from jaxckpt._storage.objects import PART_BYTES

    rows = 2 * PART_BYTES // (64 * 4) + 16  # a chunk of (rows/2, 64) float32: > PART_BYTES
    m = mesh((2, 4), ("data", "model"))
    tree = {"w": put(jnp.arange(rows * 64.0).reshape(rows, 64), m, "data")}
    url = f"{store.url}/parts"
    jaxckpt.save(url, tree, planner=jaxckpt.DefaultSavePlanner(layout="objects", pack_bytes=0))
    got = jaxckpt.restore(url)
    assert_tree_equal(got, host(tree))
    assert got["w"].flags.writeable
    other = jax.sharding.NamedSharding(mesh((4, 2), ("a", "b")), jax.sharding.PartitionSpec("a"))
    assert_tree_equal(jaxckpt.restore(url, {"w": other}), host(tree))  # a box inside a chunk
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    assert_tree_equal(jaxckpt.restore(url, {"w": one}), host(tree))  # a box of both chunks
    obj = sorted(data_objects(store.keys(f"{store.prefix}/parts")))[0]  # chunk (0,0) first
    data = bytearray(store.get(f"{store.prefix}/parts/{obj}"))
    data[PART_BYTES + 8] ^= 0xFF  # in the second request of the first record
    store.put(f"{store.prefix}/parts/{obj}", bytes(data))
    with pytest.raises(
        jaxckpt.CorruptChunkError, match=rf"Key 'w'.*chunk \(0,0\).*{obj}.*checksum"
    ):
        jaxckpt.restore(url)
    store.put(f"{store.prefix}/parts/{obj}", bytes(data[: PART_BYTES + 16]))
    with pytest.raises(jaxckpt.CorruptChunkError, match=rf"Key 'w'.*{obj}.*(shorter|answered)"):
        jaxckpt.restore(url)
