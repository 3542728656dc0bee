"""A failed save into format v5's data objects (the default on object stores) resumes: the
retry adopts the failed save's generation, keeps each data object that holds exactly the bytes
it would write (every record's CRC-32C trailer checked with a ranged read) and writes the
others; the result restores bit-exact. On GCS (fake-gcs-server) and S3 (moto), through their
request logs: what the retry sends is what was missing.
"""

from __future__ import annotations

import os

import partial_save_worker as worker
import pytest
from http_proxy import Proxy
from test_resume_save import Throttled
from test_s3 import BUCKET, keys, prefix, s3  # noqa: F401  (fixtures: the moto server)

import jaxckpt
from jaxckpt._storage import resume

ARRAYS, ELEMENTS = 32, 1 << 15  # float32: 128 KiB per array, one chunk each
CHUNK = ELEMENTS * 4
RECORD = CHUNK + 4  # a chunk's bytes, then its CRC-32C
# Objects of two records (two arrays each): 16 objects, a process's least.
PLANNER = {"layout": "objects", "object_bytes": 2 * RECORD, "pack_bytes": 0}


def state(changed: int | None = None) -> dict:
    return worker.state(changed, ARRAYS, ELEMENTS)


def _assert_restores(url: str, want: dict) -> None:
    got = jaxckpt.restore(url)
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].tobytes() == v.tobytes(), k


def _fail_then_retry(url: str, changed: int | None) -> tuple[jaxckpt.SaveHandle, int]:
    """A save the store fails after 22 of 32 items (11 objects whole), then its retry."""
    with pytest.raises(jaxckpt.CheckpointError, match="throttled"):
        jaxckpt.save(url, state(), planner=Throttled(22, **PLANNER))
    kept0 = resume.bytes_kept()
    h = jaxckpt.save_async(url, state(changed), planner=Throttled(99, **PLANNER))
    h.wait()
    return h, resume.bytes_kept() - kept0


def test_a_gcs_save_into_data_objects_resumes_writing_what_is_missing(gcs):
    from gcs_server import BUCKET as GCS_BUCKET

    url = f"gs://{GCS_BUCKET}/resume-v5-{os.urandom(4).hex()}"
    before = len(gcs.proxy.seen)
    h, kept = _fail_then_retry(url, changed=None)
    assert h.resumed_bytes == kept == 11 * 2 * CHUNK  # 11 objects of 2 records
    assert h.nbytes == (ARRAYS - 22) * CHUNK  # written: the 10 chunks missing
    uploads = [p for m, p, _ in gcs.proxy.seen[before:] if m == "POST" and "%2Fdata%2F" in p]
    assert len(uploads) == 11 + 5, uploads  # the failed save's 11 objects, the retry's 5
    _assert_restores(url, state())


def test_an_s3_retry_whose_data_changed_rewrites_that_object_only(s3, prefix, monkeypatch):  # noqa: F811
    url = f"s3://{BUCKET}/{prefix}"
    with pytest.raises(jaxckpt.CheckpointError, match="throttled"):
        jaxckpt.save(url, state(), planner=Throttled(22, **PLANNER))
    written = [k for k in keys(s3, prefix) if k.startswith("data/")]
    assert len(written) == 11 and any(k.endswith("writer.json") for k in keys(s3, prefix))
    proxy = Proxy(os.environ["AWS_ENDPOINT_URL"])
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    try:
        h = jaxckpt.save_async(url, state(changed=0), planner=Throttled(99, **PLANNER))
        h.wait()  # a00 was written (in the first object); now it differs
        sent = [r for r in proxy.log if r.method == "PUT" and "/data/" in r.path]
        assert sum(r.up for r in sent) == 6 * 2 * RECORD  # that object again, the 5 missing
        assert h.resumed_bytes == 10 * 2 * CHUNK
    finally:
        proxy.stop()
    _assert_restores(url, state(changed=0))


def test_another_object_size_does_not_adopt(s3, prefix):  # noqa: F811
    """The object target is part of the plan a retry must match: another one starts afresh."""
    url = f"s3://{BUCKET}/{prefix}"
    with pytest.raises(jaxckpt.CheckpointError, match="throttled"):
        jaxckpt.save(url, state(), planner=Throttled(22, **PLANNER))
    other = {**PLANNER, "object_bytes": 4 * RECORD}
    h = jaxckpt.save_async(url, state(), planner=Throttled(99, **other))
    h.wait()
    assert h.resumed_bytes == 0
    _assert_restores(url, state())
