"""The scenarios S3 and GCS share: one store-agnostic fixture, ``store``, run on each.

``store`` gives a fresh URL prefix in the store's bucket, the test's own hands on its bytes
(list, get, put) below jaxckpt, and the store's fault hooks (``hold_commit``). What only one
store has (its URLs' options, its emulator's proxy, the rules of its fault hooks, its error
messages) stays in tests/test_s3.py and tests/test_gcs.py. Saves here store one array per
leaf (``one_array_per_leaf``), in the default layout of object stores: each process's chunks as
records in a few data objects (format v5, ``data/P.K``); a scenario about chunk files says
``layout="chunks"``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import re
import uuid
from collections.abc import Callable, Iterator

import jax.numpy as jnp
import numpy as np
import pytest
import test_gcs
import test_s3
from helpers import assert_tree_equal, mesh, one_array_per_leaf, put  # noqa: F401 (autouse)
from test_gcs import generations_of
from test_s3 import BUCKET, FailingPlanner, jax_to_numpy, keys, s3, state  # noqa: F401

import jaxckpt
from jaxckpt._cli.main import main
from jaxckpt._format.manifest import Manifest, storage_entries
from jaxckpt._format.objects import table
from jaxckpt._runtime.pools import settle
from jaxckpt._storage import catalog
from jaxckpt._storage.location import Location


@dataclasses.dataclass(frozen=True)
class Store:
    """One object store as a scenario sees it."""

    url: str  # the test's own prefix: s3://ckpts/t-1a2b3c4d or gs://ckpts/t-1a2b3c4d
    prefix: str  # that prefix in the bucket, for keys, get and put
    keys: Callable[[str], list[str]]  # the keys below a prefix, relative to it, sorted
    get: Callable[[str], bytes]
    put: Callable[[str, bytes], None]
    # Fault hook: hold the write of the prefix's manifest.json, its request (``"request"``) or
    # its answer (``"answer"``); returns what heals the link.
    hold_commit: Callable[[str], Callable[[], None]]


@pytest.fixture(params=["s3", "gcs"])
def store(request, monkeypatch) -> Iterator[Store]:
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    if request.param == "gcs":
        emulated = request.getfixturevalue("gcs")
        hold = functools.partial(test_gcs.hold_commit, emulated, prefix)
        yield Store(
            f"gs://{BUCKET}/{prefix}", prefix, emulated.keys, emulated.get, emulated.put, hold
        )
        return
    client = request.getfixturevalue("s3")
    proxies = []

    def hold_commit(lost: str) -> Callable[[], None]:
        proxy, heal = test_s3.hold_commit(monkeypatch, lost)
        proxies.append(proxy)
        return heal

    yield Store(
        f"s3://{BUCKET}/{prefix}",
        prefix,
        functools.partial(keys, client),
        lambda key: client.get_object(Bucket=BUCKET, Key=key)["Body"].read(),
        lambda key, body: client.put_object(Bucket=BUCKET, Key=key, Body=body),
        hold_commit,
    )
    for proxy in proxies:
        proxy.stop()


def test_save_restore_onto_another_mesh(store):
    url = f"{store.url}/ckpt"
    tree = state()
    jaxckpt.save(url, tree)
    settle()  # its lease (writer.json) goes after the commit, in the background
    found = store.keys(f"{store.prefix}/ckpt")
    assert found == ["data/0.0", "manifest.json"], found  # the default: one data object here
    doc = json.loads(store.get(f"{store.prefix}/ckpt/manifest.json"))  # a real object, JSON
    assert doc["version"] == 5 and doc["objects"]["processes"] == 1
    assert_tree_equal(jaxckpt.restore(url), jax_to_numpy(tree))
    other = mesh((2, 2), ("a", "b"))
    target = {"w": put(jnp.zeros((8, 8)), other, "b", "a"), "b": None, "step": None}
    got = jaxckpt.restore(url, target)
    assert got["w"].sharding == target["w"].sharding
    np.testing.assert_array_equal(np.asarray(got["w"]), np.arange(64.0).reshape(8, 8))
    assert jaxckpt.metadata(url).entries["w"].chunks == (2, 4)


def test_compressed_chunks_round_trip_and_overwrite_raw_ones(store):
    """Compression on object stores (issue 52.4): fewer bytes in the store, the same values,
    in a fresh prefix and over a raw checkpoint (the default's data object: w's one chunk and
    b's); the raw one's objects go after the commit. A compressed save keeps a file per chunk."""
    url = f"{store.url}/z"
    tree = {"w": np.zeros((256, 256), np.float32), "b": np.arange(8.0), "step": 1}
    jaxckpt.save(url, tree)
    raw = len(store.get(f"{store.prefix}/z/data/0.0"))
    assert raw > 256 * 256 * 4
    jaxckpt.save(url, {**tree, "step": 2}, overwrite=True, compression="zstd")
    settle()
    (gen,) = generations_of(store.keys(f"{store.prefix}/z"))
    assert len(store.get(f"{store.prefix}/z/{gen}/arrays/w/c/0/0")) < raw // 100  # zeros
    assert not any(k.startswith("data/") for k in store.keys(f"{store.prefix}/z"))
    assert_tree_equal(jaxckpt.restore(url), {**tree, "step": 2})
    assert jaxckpt.metadata(url).entries["w"].codec == "zstd"


def test_overwrite_refused_then_replaced(store):
    url = store.url
    jaxckpt.save(url, state())
    with pytest.raises(
        jaxckpt.CheckpointExistsError, match=f"already exists at {url}.*overwrite=True"
    ):
        jaxckpt.save(url, state(2.0))
    assert jaxckpt.restore(url)["step"] == 1
    assert_tree_equal(jaxckpt.restore(url), jax_to_numpy(state()))
    jaxckpt.save(url, state(3.0), overwrite=True)
    settle()  # the replaced generation goes in the background
    assert_tree_equal(jaxckpt.restore(url), jax_to_numpy(state(3.0)))
    (gen,) = generations_of(store.keys(store.prefix))
    assert re.fullmatch("g[0-9a-f]{8}", gen)
    store.put(f"{store.prefix}/notes.txt", b"mine")  # never deleted, overwrite or not
    with pytest.raises(jaxckpt.CheckpointExistsError, match="even with overwrite=True"):
        jaxckpt.save(url, state(), overwrite=True)
    assert "notes.txt" in store.keys(store.prefix)


def test_cli(store, capsys):
    run = f"{store.url}/run"
    jaxckpt.save(f"{run}/000010", state())
    jaxckpt.save(f"{run}/000002", state(2.0))
    with pytest.raises(RuntimeError):
        jaxckpt.save(f"{run}/000020", state(), planner=FailingPlanner("b"))
    store.put(f"{store.prefix}/run/000020/data/0.0", b"\0" * 64)  # what a crash leaves
    capsys.readouterr()
    assert main(["ls", run]) == 0
    rows = [line.split()[:7] for line in capsys.readouterr().out.splitlines()[1:-1]]
    assert rows == [  # no save time on object stores without the manager's commit times
        ["000002", "committed", "272", "B", "272", "B", "-"],
        ["000010", "committed", "272", "B", "272", "B", "-"],
        ["000020", "incomplete", "?", "?", "-", "-"],
    ]
    assert main(["inspect", f"{run}/000010"]) == 0
    assert "float32[8,8]  chunks 4x2 of [2,4]" in capsys.readouterr().out
    assert main(["verify", f"{run}/000010"]) == 0
    name, offset = record(store, f"{store.prefix}/run/000010", "w", (1, 1))
    body = bytearray(store.get(f"{store.prefix}/run/000010/{name}"))
    body[offset] ^= 1
    store.put(f"{store.prefix}/run/000010/{name}", bytes(body))
    capsys.readouterr()
    assert main(["verify", f"{run}/000010"]) == 1
    said = capsys.readouterr().out
    assert "DAMAGED w chunk (1,1) in data object data/0.0: fails its checksum" in said, said
    assert main(["inspect", f"{run}/000020"]) == 2
    said = capsys.readouterr().err
    assert f"No checkpoint at {run}/000020" in said and "unfinished or failed save" in said


def record(store: Store, prefix: str, key: str, idx: tuple[int, ...]) -> tuple[str, int]:
    """The data object holding chunk ``idx`` of ``key``'s record in the v5 checkpoint at
    ``prefix``, and the record's first byte there."""
    m = Manifest.from_json(store.get(f"{prefix}/manifest.json"))
    stored = {e.path: e for e in storage_entries(m).values()}
    where = table(m.objects, stored)
    entry = m.entries[key]
    objs, offsets, _ = where.where[entry.path]
    flat = int(np.ravel_multi_index(idx, entry.grid))
    return where.names[objs[flat]], int(offsets[flat])


def test_delete_removes_a_checkpoint_and_refuses_a_parent(store):
    run = store.url
    jaxckpt.save(f"{run}/000001", state())
    jaxckpt.save(f"{run}/000002", state())
    with pytest.raises(jaxckpt.CheckpointError, match=f"Refusing to delete {run}: .*'000001/"):
        catalog.delete(Location(run))
    assert catalog.delete(Location(f"{run}/000001"))
    left = store.keys(store.prefix)
    assert [k.split("/")[0] for k in left] == ["000002"] * len(left)
    assert {k.split("/")[0] for k in left} == {"000002"}
    assert catalog.children(Location(run)) == [("000002", True)]
    catalog.delete(Location(f"{run}/000001"))  # nothing there: not an error


@pytest.mark.parametrize("lost", ["request", "answer"])
def test_a_commit_past_its_deadline_says_what_is_committed(store, monkeypatch, lost, caplog):
    url = store.url
    jaxckpt.save(url, {"w": np.zeros(4)})
    heal = store.hold_commit(lost)
    monkeypatch.setenv("JAXCKPT_IO_TIMEOUT", "3")
    caplog.set_level(logging.WARNING, logger="jaxckpt")
    if lost == "answer":  # the write landed: the save is committed, and says so
        jaxckpt.save(url, {"w": np.ones(4)}, overwrite=True)
        assert any("but it is in place" in r.getMessage() for r in caplog.records)
        want = np.ones(4)
    else:
        with pytest.raises(
            jaxckpt.CheckpointError,
            match="outcome of its commit is unknown.*"
            "previous checkpoint is committed.*Nothing was deleted",
        ) as e:
            jaxckpt.save(url, {"w": np.ones(4)}, overwrite=True)
        assert "has not committed" not in str(e.value)  # the deadline's own advice is not
        assert "did not finish within" in str(e.value)  # quoted: the outcome is unknown
        want = np.zeros(4)
    heal()
    np.testing.assert_array_equal(jaxckpt.restore(url)["w"], want)


class UnreadableManifest(jaxckpt.DefaultSavePlanner):
    """Plans a manifest whose tree names a key it has no entry for: it would not read back."""

    def create_global_plan(self):
        plan = super().create_global_plan()
        tree = {"type": "leaf", "key": "not-an-entry"}
        return dataclasses.replace(plan, manifest=dataclasses.replace(plan.manifest, tree=tree))


def test_a_manifest_that_would_not_read_back_is_never_committed(store):
    # The manifest is encoded and parsed once more while the data is written (Writer.
    # encode_ahead); its error must still stop the commit, and the save's data must go.
    jaxckpt.save(store.url, state())
    with pytest.raises(jaxckpt.ManifestError, match="about to be committed"):
        jaxckpt.save(store.url, state(2.0), overwrite=True, planner=UnreadableManifest())
    settle()
    assert_tree_equal(jaxckpt.restore(store.url), jax_to_numpy(state()))
    assert generations_of(store.keys(store.prefix)) == {"data"}  # the failed save's went
