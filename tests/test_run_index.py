"""Issue 63, item 2: a manager finds its steps from the run's index, never by listing the run.

A ``CheckpointManager`` on fake-gcs-server behind the logging proxy: every listing it sends
(each manager step, a reopen, a delete) covers the index (``DIR/.steps/``) or the key range of
one step's names, one page each, however many steps the run holds. Runs without an index (a
run of plain ``jaxckpt.save`` steps) open and list right; an interrupted delete is finished.
"""

from __future__ import annotations

import re
import time
import urllib.parse
import uuid

import numpy as np
import pytest
from gcs_server import BUCKET, _is_listing

import jaxckpt
from jaxckpt._manager import run_index
from jaxckpt._storage.location import Location

TREE = {f"a{i}": np.arange(16.0) + i for i in range(6)}


@pytest.fixture
def run(gcs) -> str:
    return f"{BUCKET}/index-{uuid.uuid4().hex[:8]}/run"


def _listings(gcs, since: int, run: str) -> list[tuple[str, str]]:
    """The (start, end) of each listing since log entry ``since``, relative to ``run/``."""
    time.sleep(0.05)  # let the proxy log what it answered
    out = []
    for r in gcs.proxy.log[since:]:
        if not _is_listing(r.method, r.path):
            continue
        q = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(r.path).query))
        assert "pageToken" not in q, r.path  # one page
        prefix = run.split("/", 1)[1] + "/"
        start, end = q.get("startOffset", ""), q.get("endOffset", "")
        assert start.startswith(prefix) and end.startswith(prefix), (start, end)
        out.append((start[len(prefix) :], end[len(prefix) :]))
    return out


def _one_step_or_index(ranges: list[tuple[str, str]], newest: int) -> None:
    """Each range is the index, one step's prefix, or the names after ``newest`` - 1 (a save's
    check, which holds nothing but the step being saved)."""
    for start, end in ranges:
        if (start, end) == (".steps/", ".steps0"):
            continue
        if start.endswith("/"):
            assert end == start[:-1] + "0", (start, end)  # one step's own prefix
            continue
        assert end == ":" and int(start) >= newest, (start, end, newest)


def test_manager_steps_list_the_index_and_one_step_never_the_run(gcs, run):
    url = f"gs://{run}"
    counts = []
    with jaxckpt.CheckpointManager(url, max_to_keep=3) as mgr:
        for step in range(8):
            n = len(gcs.proxy.log)
            mgr.save(step, TREE)
            mgr.wait()
            ranges = _listings(gcs, n, run)
            _one_step_or_index(ranges, step)
            counts.append(len(ranges))
        assert mgr.all_steps() == [5, 6, 7]
    # The save's check, its own prefix, the index (retention), the deleted step's prefix:
    # the same count at step 7 (3 steps kept, 5 deleted) as at step 3.
    assert counts[3:] == [counts[3]] * 5 and counts[3] <= 4, counts
    marked, deleting = run_index.read(Location(url))
    assert (sorted(marked), deleting) == ([5, 6, 7], frozenset())
    n = len(gcs.proxy.log)
    with jaxckpt.CheckpointManager(url, max_to_keep=3) as again:  # a restart
        assert again.all_steps() == [5, 6, 7]
        ranges = _listings(gcs, n, run)
        # Opening: the index and the names after its newest step (clean-up, process 0);
        # all_steps(): the same two.
        assert ranges == [(".steps/", ".steps0"), ("00000008", ":")] * 2, ranges
        n = len(gcs.proxy.log)
        again.delete(6)
        _one_step_or_index(_listings(gcs, n, run), 8)
        assert again.all_steps() == [5, 7]
        assert jaxckpt.CheckpointManager(url, read_only=True).restore(7)["a1"][0] == 1.0


def test_a_run_without_an_index_opens_and_lists_right(gcs, run):
    url = f"gs://{run}"
    for step in (1, 2, 30):  # an old run: steps without markers
        jaxckpt.save(f"{url}/{step:08d}", TREE)
    assert gcs.keys(run.split("/", 1)[1] + "/.steps") == []
    with jaxckpt.CheckpointManager(url, max_to_keep=2) as mgr:
        assert mgr.all_steps() == [1, 2, 30]  # listed once whole, then indexed (process 0)
        assert gcs.keys(run.split("/", 1)[1] + "/.steps") == ["00000001", "00000002", "00000030"]
        jaxckpt.save(f"{url}/00000040", TREE)  # newer, unindexed: after the index's newest
        assert mgr.all_steps() == [1, 2, 30, 40]
        mgr.save(41, TREE)
        mgr.wait()
        assert mgr.all_steps() == [40, 41]  # retention saw step 40; it is indexed now
    marked, _ = run_index.read(Location(url))
    assert sorted(marked) == [40, 41]


def test_step_0_without_a_marker_is_listed_and_indexed():
    """Step 0 saved unmarked (an old run, a plain save, one by hand) is a step like any other:
    the listing of the names after the index's newest step and ``reload()``'s whole listing
    find it (they took its number for none)."""
    url = f"memory://index-{uuid.uuid4().hex[:8]}/run"
    jaxckpt.save(f"{url}/00000000", TREE)  # a run without an index: step 0 alone
    with jaxckpt.CheckpointManager(url) as mgr:
        assert mgr.all_steps() == [0]
        mgr.save(1, TREE)
        mgr.wait()
        mgr.delete(0)
        jaxckpt.save(f"{url}/00000000", TREE)  # by hand, below the index's newest
        mgr.reload()
        assert mgr.all_steps() == [0, 1]
    assert sorted(run_index.read(Location(url))[0]) == [0, 1]


def test_a_committed_step_whose_marker_is_missing_stays_listed(gcs, run):
    url = f"gs://{run}"
    with jaxckpt.CheckpointManager(url) as mgr:
        mgr.save(1, TREE)
        mgr.save(2, TREE)
        mgr.wait()
    from jaxckpt._storage.location import kvstore

    loc = Location(url)
    kvstore(loc.kvstore, loc).write(".steps/00000002", None).result()  # a crash before it
    with jaxckpt.CheckpointManager(url) as mgr:
        assert mgr.all_steps() == [1, 2]
    assert sorted(run_index.read(loc)[0]) == [1, 2]  # written again when the run opened


def test_an_interrupted_delete_is_finished_when_the_run_opens(gcs, run):
    url = f"gs://{run}"
    with jaxckpt.CheckpointManager(url) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, TREE)
        mgr.wait()
    loc = Location(url)
    from jaxckpt._storage.location import kvstore

    kvstore(loc.kvstore, loc).write(".steps/00000002.deleting", b"").result()  # then a crash
    assert jaxckpt.CheckpointManager(url, read_only=True).all_steps() == [1, 3]
    with jaxckpt.CheckpointManager(url) as mgr:
        assert mgr.all_steps() == [1, 3]
    keys = gcs.keys(run.split("/", 1)[1])
    assert not [k for k in keys if k.startswith(("00000002", ".steps/00000002"))], keys


def test_what_a_failed_save_left_below_a_commit_is_removed_after_it(gcs, run):
    url = f"gs://{run}"
    prefix = run.split("/", 1)[1]
    with jaxckpt.CheckpointManager(url) as mgr:
        mgr.save(1, TREE)
        mgr.wait()
        gcs.put(f"{prefix}/00000002/arrays/a0/c/0", b"x")  # a save of step 2 that failed
        assert mgr.all_steps() == [1]
        mgr.save(3, TREE)  # its check lists the names after step 1: step 2's leftovers
        mgr.wait()  # process 0 removes them after step 3's commit
        assert mgr.all_steps() == [1, 3]
    assert not [k for k in gcs.keys(prefix) if k.startswith("00000002")], gcs.keys(prefix)


def test_a_groups_manager_steps_list_one_page_per_listing(gcs, tmp_path, monkeypatch):
    # 2 processes: process 0 alone lists for each step (the save's check, agreed with the
    # others; its step's own prefix; the index (retention) and the deleted step's prefix), the
    # same count at every step; process 1 lists nothing.
    from pathlib import Path

    from groups import run_group

    prefix = f"index-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("INDEX_URL", f"gs://{BUCKET}/{prefix}/run")
    before = len(gcs.proxy.log)
    worker = Path(__file__).resolve().parent / "index_worker.py"
    records = run_group(worker, "index", 2, tmp_path, timeout_s=600)
    assert all(r["exact"] and r["all_steps"] == [5, 6] for r in records), records
    first, other = records
    assert first["open"] <= 2 and other["open"] <= 2, records  # the index, the names after it
    assert other["steps"] == [0] * 6, records
    for r in records:  # process 1 never listed step 8: it hears process 0's refusal
        assert re.search(r"[Ss]tep 7.*\b8\b.*rollback", r.get("refused", "")), records
    assert max(first["steps"]) <= 4 and first["steps"][2:] == [first["steps"][2]] * 4, records
    assert first["reopen"] <= 2 and other["reopen"] <= 2, records
    ranges = _listings(gcs, before, f"{BUCKET}/{prefix}/run")  # each one page (checked there)
    _one_step_or_index(ranges, 0)
    assert ("", ":") not in ranges and not [r for r in ranges if r[0] == ""], ranges
