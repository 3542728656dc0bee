"""Issue 63, item 5: the counts behind benchmarks/pod_scale.py's table, measured with real
groups of 2 and 4 processes, and 8 on request (4 CPU devices each) against fake-gcs-server through its proxy:
objects per save, requests per process for a save and a restore, listing pages, and
coordination-service operations, each checked against the model of the default layout (format
v5's data objects: ``pod_scale.DataObjects``). Counts, never times.
"""

from __future__ import annotations

import os
import sys
import urllib.parse
import uuid
from pathlib import Path

import pytest
from gcs_server import BUCKET
from groups import run_group

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import pod_scale  # noqa: E402

WORKER = Path(__file__).resolve().parent / "pod_worker.py"


def _listings(seen: list, prefix: str) -> list[str]:
    out = []
    for method, path, _ in seen:
        parts = urllib.parse.urlsplit(path)
        if method == "GET" and parts.path == f"/storage/v1/b/{BUCKET}/o" and prefix in path:
            out.append(path)
    return out


# 8 processes (32 devices) on 2 cores: run on request (JAXCKPT_GROUP_OF_8=1), as the waits of
# a loaded machine poll the coordination service more than the model's typical count.
GROUPS = [2, 4, 8] if os.environ.get("JAXCKPT_GROUP_OF_8") else [2, 4]


@pytest.mark.parametrize("processes", GROUPS)
def test_a_groups_counts_match_the_model(gcs, tmp_path, monkeypatch, processes):
    prefix = f"pod-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("POD_URL", f"gs://{BUCKET}/{prefix}")
    before = len(gcs.proxy.seen)
    records = run_group(WORKER, "pod", processes, tmp_path, timeout_s=600)
    assert all(r["exact"] for r in records), records
    assert all(r["incremental_exact"] for r in records), records
    assert records[0]["referenced"] > 0, records  # step 2 holds step 1's arrays: marked
    # in the saved order (a dict's keys sorted): a process's records fill its objects in order
    state = [a for _, a in sorted(pod_scale.toy_transformer().items())]
    want = pod_scale.model(state, devices=4 * processes, per_process=4)
    assert len(gcs.keys(f"{prefix}/ck")) == want.objects
    saves = [r["save_requests"] for r in records]
    assert saves[0] == want.save_requests_max, (saves, want)
    assert sum(saves) == round(want.save_requests_mean * processes), (saves, want)
    restores = [r["restore_requests"] for r in records]
    assert max(restores) == want.restore_requests_max, (restores, want)
    ck = urllib.parse.quote(f"{prefix}/ck", safe="")
    listings = _listings(gcs.proxy.seen[before:], ck)
    assert len(listings) == want.save_pages, listings  # process 0's, of the empty prefix
    # Typical counts; a process that waits longer at a sync point polls again.
    coordination = [r["save_coordination"] for r in records]
    assert coordination[0] <= 2 * want.coordination_ops[0], records
    assert max(coordination[1:]) <= 2 * want.coordination_ops[1], records
    # A restore: one agreement (its read errors shared), O(1) per process but 0, and one
    # answer per process on process 0.
    restoring = [r["restore_coordination"] for r in records]
    leader, others = pod_scale.COORDINATION_PER_RESTORE
    assert 0 < restoring[0] <= 2 * (leader + processes - 1), records
    assert 0 < max(restoring[1:]) <= 2 * others, records
