"""Issue 63: what a save, a restore and a manager step send to an object store, counted at
fake-gcs-server's proxy: no listing that grows with the checkpoint or the run, retention off
the next save's path. (The multi-process counts against the model: test_pod_scale_groups.py.)
"""

from __future__ import annotations

import time
import urllib.parse
import uuid

import numpy as np
import pytest
from gcs_server import BUCKET
from helpers import assert_tree_equal, mesh, put

import jaxckpt
from jaxckpt._runtime.pools import settle


@pytest.fixture
def prefix(gcs) -> str:
    return f"pod-{uuid.uuid4().hex[:8]}"


def _tree(n: int, k: float = 0.0) -> dict:
    m = mesh((8,), ("d",))
    return {f"a{i:02d}": put(np.arange(64, dtype=np.float32) + i + k, m, "d") for i in range(n)}


def _listings(seen: list, prefix: str) -> list[str]:
    """The listing requests (GCS ``objects.list``) under ``prefix`` among ``seen``."""
    out = []
    for method, path, _ in seen:
        parts = urllib.parse.urlsplit(path)
        query = dict(urllib.parse.parse_qsl(parts.query))
        if method == "GET" and parts.path == f"/storage/v1/b/{BUCKET}/o":
            if query.get("prefix", "").startswith(prefix) or prefix in query.get("startOffset", ""):
                out.append(path)
    return out


def test_a_restore_lists_nothing(gcs, prefix):
    url = f"gs://{BUCKET}/{prefix}/ck"
    tree = _tree(30)  # 240 chunks: a listing would be a page of its own
    jaxckpt.save(url, tree, planner=jaxckpt.DefaultSavePlanner(pack_bytes=0))
    settle()
    before = len(gcs.proxy.seen)
    got = jaxckpt.restore(url)
    assert _listings(gcs.proxy.seen[before:], prefix) == []
    assert_tree_equal(got, {k: np.asarray(v) for k, v in tree.items()})


def test_a_manager_step_lists_only_its_own_step_range(gcs, prefix):
    # 5 steps of 30 arrays (~280 objects each) kept: a listing of the run would be 2 pages.
    run = f"gs://{BUCKET}/{prefix}"
    mgr = jaxckpt.CheckpointManager(run, max_to_keep=5)
    for step in range(1, 6):
        mgr.save(step, _tree(30, step))
    mgr.wait()
    before = len(gcs.proxy.seen)
    mgr.save(6, _tree(30, 6))  # returns once staged: what it listed is on the step's path
    shown = [urllib.parse.unquote(p) for p in _listings(gcs.proxy.seen[before:], prefix)]
    mgr.wait()
    # The step range from 00000006 (empty: one page), maybe the save's own (empty) prefix;
    # never the run whole (retention does, on process 0, in the background).
    assert f"startOffset={prefix}/00000006&endOffset={prefix}/:" in shown[0], shown
    assert not [p for p in shown if f"startOffset={prefix}/&" in p], shown
    assert len(shown) <= 2, shown
    assert mgr.all_steps() == [2, 3, 4, 5, 6]
    assert_tree_equal(mgr.restore(6), {k: np.asarray(v) for k, v in _tree(30, 6).items()})
    mgr.close()


def test_retention_is_off_the_next_saves_path(gcs, prefix):
    run = f"gs://{BUCKET}/{prefix}"
    mgr = jaxckpt.CheckpointManager(run, max_to_keep=1)
    mgr.save(1, _tree(4, 1))
    mgr.wait()
    step1 = urllib.parse.quote(f"{prefix}/00000001/", safe="")
    gcs.fault = lambda method, path: "hold" if method == "DELETE" and step1 in path else None
    try:
        mgr.save(2, _tree(4, 2))  # its commit in the background, then retention of step 1
        mgr.save(3, _tree(4, 3))  # waits for step 2's commit, not for step 1's deletes
        mgr.last_save.wait()
        for _ in range(600):  # retention lists the run before it deletes: let it get there
            if any(a == "hold" for _, _, a in gcs.proxy.seen):
                break
            time.sleep(0.1)
        assert any(a == "hold" for _, _, a in gcs.proxy.seen), "no delete was held"
        assert mgr.last_save.done()  # step 3 committed while step 1's deletes are held
        assert jaxckpt.metadata(f"{run}/00000003").entries  # committed behind held deletes
    finally:
        gcs.fault = None
        gcs.proxy.release()
    mgr.wait()
    assert mgr.all_steps() == [3]
    mgr.close()


def test_an_incremental_step_whose_known_base_was_deleted_by_hand_saves(gcs, prefix):
    # The ledger knows step 2; it is gone: the save lists the run and takes step 1 as its base.
    from jaxckpt._storage import catalog
    from jaxckpt._storage.location import Location

    run = f"gs://{BUCKET}/{prefix}"
    mgr = jaxckpt.CheckpointManager(run, incremental=True, async_save=False)
    mgr.save(1, _tree(3, 1))
    mgr.save(2, _tree(3, 2))
    catalog.delete(Location(f"{run}/00000002"))
    mgr.save(3, _tree(3, 3))
    assert mgr.all_steps() == [1, 3]
    assert_tree_equal(mgr.restore(3), {k: np.asarray(v) for k, v in _tree(3, 3).items()})
    mgr.close()
