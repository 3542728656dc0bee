"""Object storage on gs://: fake-gcs-server on 127.0.0.1, behind the precondition proxy of
tests/gcs_server.py (the emulator ignores the generation preconditions real GCS honours).

The same protocol as tests/test_s3.py and tests/test_reliability.py check on S3: arrays first,
``manifest.json`` last and only if it is still the one the save saw; nothing deleted before
the commit; what other steps reference kept; every operation within its deadline. The
scenarios GCS shares with S3 run on both from tests/test_object_stores.py.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import logging
import re
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np
import pytest
import tensorstore as ts
from gcs_server import BUCKET, ENV
from helpers import assert_tree_equal, mesh, put
from http_proxy import Request, Shaping, sequential_round_trips
from test_commit import check_one_winner, race
from test_s3 import jax_to_numpy as host
from test_s3 import state

import jaxckpt
from jaxckpt._cli.main import main
from jaxckpt._runtime.pools import settle
from jaxckpt._storage import lease
from jaxckpt._storage.location import ABSENT, Location, wait

DEADLINE = 3  # seconds: JAXCKPT_IO_TIMEOUT of the tests whose server stalls


@pytest.fixture
def prefix(gcs) -> str:
    return f"t-{uuid.uuid4().hex[:8]}"


def unpacked(layout: str = "auto") -> jaxckpt.DefaultSavePlanner:
    return jaxckpt.DefaultSavePlanner(pack_bytes=0, layout=layout)


def generations_of(keys: list[str]) -> set[str]:
    """The top-level folders of a checkpoint's keys: ``arrays`` (a file per chunk), ``data``
    (format v5's data objects) or ``gXXXXXXXX``."""
    return {k.split("/")[0] for k in keys if k != "manifest.json"}


# The emulator and the proxy ------------------------------------------------------------------


def test_the_proxy_answers_the_preconditions_the_emulator_ignores(gcs, prefix, monkeypatch):
    def honoured(url: str, name: str) -> dict[str, bool]:
        monkeypatch.setenv(ENV[0], url)  # read when a store opens; a new context, a new store
        spec = {"driver": "gcs", "bucket": BUCKET, "path": f"{prefix}/{name}/"}
        kv = ts.KvStore.open(spec, context=ts.Context()).result()
        first = kv.write("k", b"one").result().generation
        kv.write("k", b"two").result()
        said = {
            "upload ifGenerationMatch=0 (412)": kv.write("k", b"x", if_equal=ABSENT).result(),
            "upload ifGenerationMatch=OLD (412)": kv.write("k", b"y", if_equal=first).result(),
        }
        now = kv.read("k").result().stamp.generation
        said["read ifGenerationNotMatch=NOW (304)"] = kv.read("k", if_not_equal=now).result()
        return {
            what: not got.generation if "upload" in what else got.state == "unspecified"
            for what, got in said.items()
        }

    # Real GCS honours all three: through the proxy, tensorstore gets what GCS would answer.
    assert all(honoured(gcs.url, "proxied").values())
    # The emulator alone honours none of them (if it starts to, the proxy can go).
    assert not any(honoured(gcs.server_url, "direct").values())


def test_the_link_rate_is_shared_by_the_requests_in_flight(gcs, prefix):
    """Shaping(link_rate=): two uploads at once pass at the link's rate between them, not each
    at it (benchmarks/compression.py shapes a machine's link so), and so do two downloads."""
    names = [f"{prefix}/o{i}" for i in range(2)]
    blob = bytes(500_000)

    def send(name: str) -> None:
        q = urllib.parse.urlencode({"uploadType": "media", "name": name})
        req = urllib.request.Request(f"{gcs.url}/upload/storage/v1/b/{BUCKET}/o?{q}", blob)
        urllib.request.urlopen(req, timeout=30).read()

    def fetch(name: str) -> None:
        path = f"/storage/v1/b/{BUCKET}/o/{urllib.parse.quote(name, safe='')}?alt=media"
        assert len(urllib.request.urlopen(gcs.url + path, timeout=30).read()) == len(blob)

    gcs.proxy.shaping = Shaping(link_rate=5e6)  # two bodies: 0.2 s at least
    for fn in (send, fetch):
        t = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            list(pool.map(fn, names))
        assert time.monotonic() - t >= 2 * len(blob) / 5e6


def test_the_emulator_used_directly_reads_and_saves_with_a_warning(
    gcs, monkeypatch, caplog, capsys
):
    """What users run in CI: fake-gcs-server without the proxy. Reads never rely on a
    precondition (the unchanged-check compares the generation a read returns); a save works
    for one writer and says once per store that concurrent saves are not protected."""
    bucket = f"direct-{uuid.uuid4().hex[:8]}"  # a bucket of its own: a store opened afresh
    status, _, _ = gcs.proxy.ask(
        "POST", "/storage/v1/b?project=test", json.dumps({"name": bucket}).encode()
    )
    assert status == 200
    monkeypatch.setenv(ENV[0], gcs.server_url)
    caplog.set_level(logging.WARNING, logger="jaxckpt")
    seen = len(gcs.proxy.seen)
    run = f"gs://{bucket}/run"
    tree = state()
    jaxckpt.save(f"{run}/00000001", tree, planner=unpacked())
    (said,) = [r.getMessage() for r in caplog.records]
    assert f"gs://{bucket}/run/00000001: the store at {gcs.server_url} ignores write" in said
    assert "concurrent saves to one path are NOT protected" in said
    jaxckpt.save(f"{run}/00000001", state(2.0), overwrite=True, planner=unpacked())
    jaxckpt.save(f"{run}/00000002", tree)
    assert len(caplog.records) == 1  # once per process and store
    settle()
    assert_tree_equal(jaxckpt.restore(f"{run}/00000001"), host(state(2.0)))
    assert_tree_equal(jaxckpt.restore(f"{run}/00000002"), host(tree))
    assert jaxckpt.metadata(f"{run}/00000001").entries["w"].chunks == (2, 4)
    mgr = jaxckpt.CheckpointManager(run, async_save=False)
    assert mgr.all_steps() == [1, 2]
    assert_tree_equal(mgr.restore(), host(tree))
    mgr.close()
    inc = jaxckpt.CheckpointManager(f"gs://{bucket}/inc", async_save=False, incremental=True)
    inc.save(1, _frozen_and_moving(0, 1))
    inc.save(2, _frozen_and_moving(0, 2))  # references step 1's frozen: a held-by marker
    assert jaxckpt.metadata(f"gs://{bucket}/inc/00000002").refs
    assert_tree_equal(inc.restore(2), host(_frozen_and_moving(0, 2)))
    inc.close()
    capsys.readouterr()
    assert main(["ls", run]) == 0
    assert [r.split()[:2] for r in capsys.readouterr().out.splitlines()[1:]] == [
        ["00000001", "committed"],
        ["00000002", "committed"],
        ["total:", "2"],  # the run table's total line
    ]
    assert main(["verify", f"{run}/00000001"]) == 0
    assert "every checksum matches" in capsys.readouterr().out
    assert len(gcs.proxy.seen) == seen  # not one request went through the proxy


# Saving and restoring ------------------------------------------------------------------------


def test_save_async_packs_small_leaves(gcs, prefix):
    url = f"gs://{BUCKET}/{prefix}"
    tree = {f"x{i}": np.full(3, i, np.float32) for i in range(20)} | {"w": np.arange(5.0)}
    handle = jaxckpt.save_async(url, tree)
    handle.wait()
    settle()  # its lease (writer.json) goes after the commit, in the background
    found = gcs.keys(prefix)
    assert found == ["data/0.0", "manifest.json"], found  # the default: records in data objects
    owners = json.loads(gcs.get(f"{prefix}/manifest.json"))["objects"]["owners"]
    packs = {k.split("/")[1] for k in owners}
    assert packs == {"pack.float32.0", "pack.float64.0"}, owners  # 21 leaves, two arrays
    assert_tree_equal(jaxckpt.restore(url), tree)


def test_more_than_1000_objects_saved_then_overwritten(gcs, prefix):
    """115 arrays of 8 chunks as a file per chunk: 1,035 objects, two listing pages. The
    overwrite commits only once its own arrays are all there, and the old checkpoint is whole
    until then."""
    url = f"gs://{BUCKET}/{prefix}"
    m = mesh((8,), ("d",))
    tree = {f"a{i:03d}": put(np.full(64, i, np.float32), m, "d") for i in range(115)}
    jaxckpt.save(url, tree, planner=unpacked("chunks"))
    settle()  # its lease (writer.json) goes after the commit, in the background
    old = gcs.keys(prefix)
    assert len(old) == 115 * 9 + 1 and generations_of(old) == {"arrays"}
    old_manifest = gcs.get(f"{prefix}/manifest.json")
    at_commit: list[tuple[list[str], bytes]] = []
    manifest = urllib.parse.quote(f"{prefix}/manifest.json", safe="")

    def commit_seen(method: str, path: str):
        if method == "POST" and f"name={manifest}" in path:
            at_commit.append((gcs.keys(prefix), gcs.get(f"{prefix}/manifest.json")))
        return None

    gcs.fault = commit_seen
    seen_before = len(gcs.proxy.seen)
    new = {k: v + 1 for k, v in tree.items()}
    jaxckpt.save(url, new, planner=unpacked("chunks"), overwrite=True)
    settle()  # the replaced generation goes in the background
    gcs.fault = None
    ((keys, manifest_then),) = at_commit
    assert manifest_then == old_manifest and set(old) <= set(keys)  # the old one whole
    (gen,) = generations_of(keys) - {"arrays"}
    assert sum(k.startswith(gen + "/") for k in keys) == 115 * 9 + 1  # + its writer.json
    after = gcs.keys(prefix)
    assert generations_of(after) == {gen} and len(after) == 115 * 9 + 1, after[:5]
    assert_tree_equal(jaxckpt.restore(url), host(new))
    listings = [p for _, p, _ in gcs.proxy.seen[seen_before:] if "/o?" in p and prefix in p]
    assert any("pageToken=" in p for p in listings), listings  # more than one page was read


def _is_data(r: Request) -> bool:
    """A chunk's or a data object's read or write, or a zarr.json written with them (its
    upload's name)."""
    name = r.path.split("?")[0] if r.method == "GET" else r.path
    return (
        "%2Fc%2F" in name
        or "%2Fdata%2F" in name
        or name.endswith("%2Fc")
        or "%2Fc&" in name
        or (r.method == "POST" and "%2Fzarr.json" in r.path)
    )


def _requests_of(gcs, call) -> list[Request]:
    """The requests ``call`` sent and waited for (not the background clean-up before it)."""
    settle()
    start, t = len(gcs.proxy.log), time.monotonic()
    call()
    # The proxy stamps a request's end after its answer is sent, so the call may return first
    # (under load, by a few ms): 0.02 s of slack, below the 0.05 s latency every request takes.
    end = time.monotonic() + 0.02
    time.sleep(0.05)  # let the proxy log what it answered
    return [r for r in gcs.proxy.log[start:] if r.start >= t and r.end <= end]


@pytest.mark.parametrize("layout", ["chunks", "auto"])
def test_save_and_restore_wait_on_a_few_round_trips_whatever_the_leaf_count(gcs, prefix, layout):
    """Issue 52: a save waits on at most 3 round trips besides its data: 2 to an empty prefix
    (the manifest read, the listing and the lease together; the commit), 3 over a checkpoint
    (the lease of a fresh generation); a restore on 1 before its data (the manifest beside the
    listing) and 1 after (the unchanged-check; none with the default's data objects, named
    for their save); the same for 4 leaves or 400. Counts of requests that waited one on
    another (a latency on the link keeps them apart), never times."""
    gcs.proxy.shaping = Shaping(latency=0.05)
    m = mesh((4, 2), ("data", "model"))
    planner = functools.partial(jaxckpt.DefaultSavePlanner, layout=layout)
    chunks = layout == "chunks"
    for n in (4, 400):
        tree = {"w": put(jnp.ones((1024, 512)), m, "data", "model")}  # 2 MiB: not packed
        tree |= {f"s{i:03d}": np.full(3, i, np.float32) for i in range(n)}
        run = f"gs://{BUCKET}/{prefix}/{n}"
        # plans cached; the store's one check (see generations)
        jaxckpt.save(f"{run}/warm", tree, planner=planner())
        url = f"{run}/ck"
        saved = _requests_of(gcs, functools.partial(jaxckpt.save, url, tree, planner=planner()))
        waited = sequential_round_trips([r for r in saved if not _is_data(r)])
        assert len(waited) == 2, [(r.method, r.path) for r in waited]
        data = [r for r in saved if _is_data(r)]
        # w's 8 chunks, 1 pack; 2 zarr.json. Data objects: 1 (2 MiB, below 4 MiB an object)
        assert len(data) == (8 + 1 + 2 if chunks else 1), [r.path for r in data]
        again = _requests_of(
            gcs, functools.partial(jaxckpt.save, url, tree, overwrite=True, planner=planner())
        )
        waited = sequential_round_trips([r for r in again if not _is_data(r)])
        assert len(waited) == 3, [(r.method, r.path) for r in waited]
        got: list = []
        read = _requests_of(gcs, lambda u=url, t=tree, g=got: g.append(jaxckpt.restore(u, t)))
        first_data = min(r.start for r in read if _is_data(r))
        before = sequential_round_trips([r for r in read if r.end <= first_data])
        assert len(before) == 1, [(r.method, r.path) for r in before]
        assert len(sequential_round_trips([r for r in read if not _is_data(r)])) == 1 + chunks
        assert len([r for r in read if _is_data(r)]) == 8 + 1  # a read per box of w, 1 pack
        # the pack and w's boxes in one pipeline: one round trip for all of them
        assert len(sequential_round_trips([r for r in read if _is_data(r)])) == 1
        assert_tree_equal(got[-1], tree)


def test_a_manager_step_waits_on_three_round_trips_besides_its_data(gcs, prefix):
    """Issue 63.4: an incremental ``CheckpointManager`` step on an object store: the check
    of the run's newer steps (one listing page), then the lease with the base's manifest read
    beside it, then the data with the base's held-by marker beside it, then the commit; the
    metrics and the run index after it, off the call. Counts of requests that waited one on
    another (a latency on the link keeps them apart), never times."""
    run = f"gs://{BUCKET}/{prefix}/run"
    mgr = jaxckpt.CheckpointManager(run, incremental=True, async_save=False)
    tree = _frozen_and_moving(0, 1)  # "frozen" is referenced by step 2, the rest written
    mgr.save(1, tree)
    mgr.wait()
    gcs.proxy.shaping = Shaping(latency=0.05)
    new = _frozen_and_moving(0, 2)
    saved = _requests_of(gcs, lambda: mgr.save(2, new))
    mgr.close()
    data = [r for r in saved if _is_data(r)]
    first = min(r.start for r in data)
    before = sequential_round_trips([r for r in saved if r.end <= first])
    assert len(before) == 2, [(r.method, r.path) for r in before]  # the listing, the lease
    name = "%2F00000001%2Fmanifest.json"
    (base,) = [r for r in saved if r.method == "GET" and name in r.path]
    (lease,) = [r for r in saved if r.method == "POST" and "writer.json" in r.path]
    assert base.start < lease.end and lease.start < base.end  # one round trip for both
    (marker,) = [r for r in saved if "held-by" in r.path and r.method == "POST"]
    assert marker.start < max(r.end for r in data)  # sent with the data, not after it
    after = [r for r in saved if r.start >= max(r.end for r in data + [marker])]
    assert [r.method for r in after] == ["POST"] and "manifest.json" in after[0].path
    # Its restore: the manifest, then the data with the holder's marker read beside it.
    got: list = []
    read = _requests_of(gcs, lambda: got.append(jaxckpt.restore(f"{run}/00000002", tree)))
    first = min(r.start for r in read if _is_data(r) and "%2F00000001%2F" in r.path)
    before = sequential_round_trips([r for r in read if r.end <= first])  # of "frozen", step 1's
    assert len(before) == 1 and "manifest.json" in before[0].path, [r.path[40:140] for r in before]
    assert any("held-by" in r.path for r in read), [r.path for r in read]
    assert_tree_equal(got[0], new)


def test_boxes_that_stop_changing_are_read_back_from_the_base_at_once(gcs, prefix):
    """An array that changed in the base's step has no full digests there (only probes): the
    next step reads the base's boxes back to compare them, all in one round trip, not one
    round trip per box."""
    m = mesh((4, 2), ("data", "model"))
    w = put(jnp.arange(1024 * 512.0).reshape(1024, 512), m, "data", "model")  # 8 boxes of 256 KiB
    run = f"gs://{BUCKET}/{prefix}/run"
    mgr = jaxckpt.CheckpointManager(run, incremental=True, async_save=False)
    mgr.save(1, {"w": w})
    mgr.save(2, {"w": w + 1})  # changed: step 2 records probes of w's boxes, no digests
    mgr.wait()
    gcs.proxy.shaping = Shaping(latency=0.05)
    saved = _requests_of(gcs, lambda: mgr.save(3, {"w": w + 1}))  # unchanged since step 2
    mgr.close()
    back = [r for r in saved if r.method == "GET" and "%2F00000002%2Farrays%2Fw%2Fc" in r.path]
    assert len(back) == 8, [r.path for r in saved]
    assert len(sequential_round_trips(back)) == 1, [(r.start, r.end) for r in back]
    assert jaxckpt.metadata(f"{run}/00000003").refs  # w referenced, not written again
    reader = jaxckpt.CheckpointManager(run, read_only=True)
    assert_tree_equal(reader.restore(3, target={"w": w}), {"w": w + 1})


# Races (an overwrite refused, then done: tests/test_object_stores.py) ----------------------------------------------------------------------------


@pytest.mark.parametrize("use_async", [False, True], ids=["save", "save_async"])
def test_two_saves_racing_to_one_path_one_commits(gcs, prefix, use_async):
    for r in range(2):
        path = f"gs://{BUCKET}/{prefix}/ck{r}"
        check_one_winner(path, race(path, use_async=use_async))
        settle()  # the winner's clean-up runs after its commit, in the background
        found = gcs.keys(f"{prefix}/ck{r}")  # the winner's arrays and manifest, nothing else
        assert "manifest.json" in found and len(generations_of(found)) == 1, found
        assert not any(k.endswith("writer.json") for k in found), found


# The manager ---------------------------------------------------------------------------------


def _frozen_and_moving(frozen: float, k: float) -> dict:
    return {"frozen": jnp.full(300_000, frozen, jnp.float32), "w": jnp.full(16, k), "k": k}


def test_manager_retention_keeps_what_incremental_steps_reference(gcs, prefix):
    run = f"gs://{BUCKET}/{prefix}"
    mgr = jaxckpt.CheckpointManager(run, max_to_keep=2, incremental=True, async_save=False)
    trees = {1: _frozen_and_moving(0, 1), 2: _frozen_and_moving(0, 2), 3: _frozen_and_moving(0, 3)}
    for step, tree in trees.items():
        mgr.save(step, tree)
    assert mgr.all_steps() == [2, 3]
    refs = {s: jaxckpt.metadata(f"{run}/{s:08d}").refs for s in (2, 3)}
    assert refs[2] == refs[3] == {"arrays/frozen": "../00000001/arrays/frozen"}, refs
    left = gcs.keys(f"{prefix}/00000001")  # step 1 retired: only what 2 and 3 hold stays
    assert "manifest.json" not in left and {"held-by/00000002", "held-by/00000003"} <= set(left)
    assert {k.split("/")[1] for k in left if k.startswith("arrays/")} == {"frozen"}, left
    for step in (2, 3):
        assert_tree_equal(mgr.restore(step), host(trees[step]))
    mgr.save(4, _frozen_and_moving(1, 4))  # frozen changed: a copy of its own
    mgr.save(5, _frozen_and_moving(1, 5))  # references 4; retires 3, the last to hold 1
    assert mgr.all_steps() == [4, 5]
    assert jaxckpt.metadata(f"{run}/00000005").refs == {
        "arrays/frozen": "../00000004/arrays/frozen"
    }
    assert gcs.keys(f"{prefix}/00000001") == [] and gcs.keys(f"{prefix}/00000003") == []
    assert_tree_equal(mgr.restore(5), host(_frozen_and_moving(1, 5)))
    mgr.close()


# Deadlines and lost answers ------------------------------------------------------------------


def test_a_stalled_server_fails_within_the_deadline_and_names_it(gcs, prefix, monkeypatch):
    url = f"gs://{BUCKET}/{prefix}"
    tree = {f"a{i:02d}": np.full(1 << 16, i, np.float32) for i in range(40)}
    jaxckpt.save(url, tree, planner=unpacked())
    monkeypatch.setenv("JAXCKPT_IO_TIMEOUT", str(DEADLINE))
    stalled = []

    def rule(method: str, path: str):  # once the arrays' data flows: accepted, never answered
        stalled.extend([True] if method == "POST" and "%2Fdata%2F" in path else [])
        return "hold" if stalled else None

    gcs.fault = rule
    t = time.monotonic()
    with pytest.raises(jaxckpt.CheckpointError, match="did not finish within") as e:
        new = {k: v + 1 for k, v in tree.items()}
        jaxckpt.save_async(url, new, overwrite=True, planner=unpacked()).wait()
    assert stalled  # it stalled in the middle of the writes, its data objects in flight
    assert time.monotonic() - t < 10 * DEADLINE
    said = str(e.value)
    assert url in said and f"{gcs.url} is not answering" in said, said
    assert "last committed checkpoint is intact" in said
    t = time.monotonic()
    with pytest.raises(jaxckpt.CheckpointError, match=f"{gcs.url} is not answering"):
        jaxckpt.restore(url)
    assert time.monotonic() - t < 10 * DEADLINE
    gcs.fault = None
    gcs.proxy.release()
    assert_tree_equal(jaxckpt.restore(url), tree)  # the old checkpoint, intact


def test_a_save_busier_than_the_deadline_keeps_its_heartbeat(gcs, prefix, monkeypatch):
    """A save whose requests take longer in all than one operation's deadline commits: its
    heartbeat (rewriting writer.json, every 0.2 s here) does not queue behind the save's own
    requests and miss the deadline, which would fail a healthy save as if the server stalled."""
    monkeypatch.setenv("JAXCKPT_IO_TIMEOUT", "2")
    monkeypatch.setattr(lease, "BEAT_S", 0.2)
    # 500 requests (a zarr.json and a chunk per array, a file per chunk), 64 at a time, each
    # 0.5 s: ~4 s in all.
    gcs.proxy.shaping = Shaping(latency=0.5)
    tree = {f"a{i:03d}": np.full(4, i, np.float32) for i in range(250)}
    url = f"gs://{BUCKET}/{prefix}"
    t = time.monotonic()
    jaxckpt.save(url, tree, planner=unpacked("chunks"))
    log = [r for r in gcs.proxy.log if r.start >= t]
    beats = [r for r in log if r.method == "POST" and "writer.json" in urllib.parse.unquote(r.path)]
    assert len(beats) >= 3, [r.path for r in beats]  # it beat while the data was written
    assert max(r.end for r in log) - t > 2  # and the data outlasted one deadline
    # Each beat goes out when it is due (0.2 s after the last was answered), not behind the
    # save's queued requests: a long save on a slow link would look dead to another save's
    # clean-up if its beats waited behind its data.
    times = [r.start for r in beats] + [max(r.end for r in log if r not in beats)]
    assert max(b - a for a, b in zip(times, times[1:])) < 2, [round(x - t, 2) for x in times]
    gcs.proxy.shaping = Shaping()
    assert_tree_equal(jaxckpt.restore(url), tree)


def test_the_deadline_error_names_the_gcs_endpoint(monkeypatch):
    monkeypatch.setenv("JAXCKPT_IO_TIMEOUT", "0.05")
    for url in [None, "http://10.1.2.3:4443"]:
        if url is None:  # Google's own
            monkeypatch.delenv(ENV[0], raising=False)
        else:  # an emulator or proxy
            monkeypatch.setenv(ENV[0], url)
        named = url or "https://storage.googleapis.com"
        never: concurrent.futures.Future = concurrent.futures.Future()
        with pytest.raises(
            jaxckpt.CheckpointError,
            match=f"reading x at gs://bkt/c did not finish .*: {re.escape(named)} is not answering",
        ):
            wait(never, Location("gs://bkt/c"), "reading x")
        assert never.cancelled()


def hold_commit(gcs, prefix: str, lost: str) -> Callable[[], None]:
    """Fault hook: the emulator holds the upload of ``prefix``'s manifest.json, its request
    (``lost="request"``) or its answer (``"answer"``); returns what heals the link."""
    manifest = urllib.parse.quote(f"{prefix}/manifest.json", safe="")

    def rule(method: str, path: str):
        if method == "POST" and path.startswith("/upload/") and f"name={manifest}" in path:
            return "hold" if lost == "request" else "forward-then-hold"
        return None

    gcs.fault = rule
    return lambda: setattr(gcs, "fault", None)


# Bad buckets, credentials (the command line and deleting: tests/test_object_stores.py) --------


def test_missing_bucket(gcs):
    with pytest.raises(jaxckpt.CheckpointError, match="gs://no-such-bucket/x.*Not Found"):
        jaxckpt.save("gs://no-such-bucket/x", state())
    with pytest.raises(jaxckpt.CheckpointNotFoundError, match="No checkpoint at gs://no-such"):
        jaxckpt.restore("gs://no-such-bucket/x")


def test_a_failed_listing_names_the_gcs_credentials(gcs, prefix):
    def rule(method: str, path: str):  # e.g. a firewall's error page instead of GCS's answer
        if method == "GET" and path.startswith(f"/storage/v1/b/{BUCKET}/o?"):  # a listing
            return lambda *_: (403, {"Content-Type": "text/html"}, b"<html>Forbidden</html>")
        return None

    gcs.fault = rule
    with pytest.raises(
        jaxckpt.CheckpointError,
        match=f"Cannot list gs://{BUCKET}/{prefix}: .*credentials "
        r"\(GOOGLE_APPLICATION_CREDENTIALS or the application default credentials",
    ) as e:
        jaxckpt.save(f"gs://{BUCKET}/{prefix}", state())
    assert "AWS" not in str(e.value)
