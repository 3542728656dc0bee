"""Issue 63, item 3: throttling is slowness, not failure (fake-gcs-server behind the proxy).

A store over its request rate answers 429 with ``Retry-After``; tensorstore retries with
jaxckpt's policy (``jaxckpt._storage.urls.retries``: backoff with jitter, the first retry no
sooner than a second) and the deadlines count a "slow down" as an answer
(``jaxckpt._storage.throttle``). A create-if-absent write whose answer is lost is retried and
refused (412); the save recognises its own write by reading it back. Behaviour only: no timing
is asserted beyond the Retry-After that each retry must respect.
"""

from __future__ import annotations

import time
import urllib.parse
import uuid

import numpy as np
import pytest
from gcs_server import BUCKET
from helpers import assert_tree_equal, mesh, put
from http_proxy import Throttle

import jaxckpt
from jaxckpt._runtime.pools import settle


@pytest.fixture
def prefix(gcs) -> str:
    return f"throttle-{uuid.uuid4().hex[:8]}"


def _tree(n: int) -> dict:
    m = mesh((8,), ("d",))
    return {f"a{i:02d}": put(np.arange(64, dtype=np.float32) + i, m, "d") for i in range(n)}


@pytest.mark.parametrize(("layout", "rate"), [("chunks", 60), ("auto", 10)])
def test_a_throttled_save_and_restore_complete_exactly(gcs, prefix, monkeypatch, layout, rate):
    # 24 arrays of 8 chunks: ~220 requests as an object per chunk against 60 requests/s; as
    # data objects of at most 256 bytes (7 records each), ~28 objects written, then read,
    # against 10 requests/s: most are told to wait.
    monkeypatch.setenv("JAXCKPT_IO_TIMEOUT", "4")  # shorter than the throttling lasts
    tree = _tree(24)
    url = f"gs://{BUCKET}/{prefix}/ck"
    throttle = Throttle(rate=rate, retry_after=1.0)
    gcs.fault = throttle
    planner = jaxckpt.DefaultSavePlanner(pack_bytes=0, layout=layout, object_bytes=256)
    jaxckpt.save(url, tree, planner=planner)
    assert_tree_equal(jax_to_host(jaxckpt.restore(url, tree)), jax_to_host(tree))
    gcs.fault = None
    settle()
    assert throttle.throttled > 20, throttle.throttled
    assert throttle.early == [], throttle.early[:5]  # no retry sooner than Retry-After asked


def jax_to_host(tree: dict) -> dict:
    return {k: np.asarray(v) for k, v in tree.items()}


def _name(path: str) -> str:
    query = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(path).query))
    return query.get("name", "")


@pytest.mark.parametrize(
    ("lost", "layout"),
    [("manifest.json", "auto"), ("writer.json", "auto"), ("zarr.json", "chunks")],
)
def test_a_conditional_write_whose_answer_was_lost_is_recognised_as_this_saves(
    gcs, prefix, lost, layout
):
    # The first create-if-absent of `lost` lands, its answer does not; tensorstore retries it
    # and the retry is refused (412): the save reads it back and finds its own bytes.
    dropped: list[str] = []

    def fault(method: str, path: str):
        name = _name(path)
        if method == "POST" and name.endswith(lost) and "ifGenerationMatch" in path:
            if not dropped:
                dropped.append(name)
                return "forward-then-drop"
        return None

    tree = _tree(2)
    url = f"gs://{BUCKET}/{prefix}/ck"
    gcs.fault = fault
    jaxckpt.save(url, tree, planner=jaxckpt.DefaultSavePlanner(pack_bytes=0, layout=layout))
    gcs.fault = None
    assert dropped, "the write was never seen"
    assert_tree_equal(jaxckpt.restore(url), jax_to_host(tree))
    settle()
    assert not any(k.endswith("writer.json") for k in gcs.keys(f"{prefix}/ck"))


def _slow_down(method: str, path: str, headers, body: bytes) -> tuple:
    return 429, {"Retry-After": "1"}, b'{"error": {"code": 429, "message": "slow down"}}'


def test_a_commit_throttled_longer_than_the_deadline_still_commits(gcs, prefix, monkeypatch):
    # 8 s of 429 to the commit alone, nothing else in flight: past the deadline (4 s, so
    # 5 s without an answer fails) but answered all along, so the save waits and commits.
    monkeypatch.setenv("JAXCKPT_IO_TIMEOUT", "4")
    first: list[float] = []
    told: list[float] = []

    def fault(method: str, path: str):
        if method == "POST" and _name(path).endswith("/ck/manifest.json"):
            now = time.monotonic()
            first[:] = first or [now]
            if now - first[0] < 8:
                told.append(now)
                return _slow_down
        return None

    tree = _tree(2)
    url = f"gs://{BUCKET}/{prefix}/ck"
    gcs.fault = fault
    jaxckpt.save(url, tree)
    gcs.fault = None
    assert len(told) >= 3 and told[-1] - told[0] > 5, told
    assert_tree_equal(jaxckpt.restore(url), jax_to_host(tree))


@pytest.mark.parametrize("layout", ["chunks", "auto"])
def test_a_chunk_write_that_fails_once_is_retried(gcs, prefix, layout):
    """A chunk's object (``layout="chunks"``) or a data object (the default) answered 503
    once: written again, the save completes."""
    failed: list[str] = []

    def fault(method: str, path: str):
        name = _name(path)
        if method == "POST" and ("/c/" in name or "/data/" in name) and not failed:
            failed.append(name)
            return 503
        return None

    tree = _tree(2)
    url = f"gs://{BUCKET}/{prefix}/ck"
    gcs.fault = fault
    jaxckpt.save(url, tree, planner=jaxckpt.DefaultSavePlanner(pack_bytes=0, layout=layout))
    gcs.fault = None
    assert failed and ("/data/" in failed[0]) == (layout == "auto"), failed
    assert_tree_equal(jaxckpt.restore(url), jax_to_host(tree))
