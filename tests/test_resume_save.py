"""A failed save resumes (issue 60, item 6): retrying the same step after a save died or failed
writes only the chunks the failed save had not written with the same bytes, and the result
restores bit-exact. Shown on a local disk and on S3 (moto), with a real process SIGKILLed at
~90% of its writes (tests/partial_save_worker.py) and with a store that refuses requests.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import partial_save_worker as worker
import pytest
from groups import run_group
from helpers import mesh, put
from http_proxy import Proxy
from test_s3 import BUCKET, keys, prefix, s3  # noqa: F401  (fixtures: the moto server)

import jaxckpt
from jaxckpt._planning import save_planner
from jaxckpt._storage import resume
from jaxckpt._storage.crc import crc32c

TOTAL = worker.ARRAYS * worker.ELEMENTS * 4
CHUNK = worker.ELEMENTS * 4


def _kill_at_90(url: str) -> None:
    """Run the worker's save of ``url`` and let it kill itself after 18 of 20 chunks."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
    done = subprocess.run(
        [sys.executable, worker.__file__, url, str(worker.ARRAYS * 9 // 10)],
        env=env,
        capture_output=True,
        timeout=300,
    )
    assert done.returncode == -9, done.stderr.decode()[-2000:]


def _chunk_files(folder: Path) -> dict[str, tuple[int, int]]:
    """Each chunk file under ``folder``: (inode, size), by path relative to ``folder``."""
    out = {}
    for p in folder.rglob("*"):
        if p.is_file() and (p.parent.name == "c" or p.name == "c"):
            st = p.stat()
            out[str(p.relative_to(folder))] = (st.st_ino, st.st_size)
    return out


def _assert_restores(url: str, want: dict) -> None:
    got = jaxckpt.restore(url)
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].tobytes() == v.tobytes(), k


def test_a_local_save_killed_at_90_percent_resumes_writing_the_rest(tmp_path):
    url = str(tmp_path / "ckpt")
    _kill_at_90(url)
    (left,) = [p for p in tmp_path.iterdir() if p.name.startswith(".ckpt.tmp-")]
    before = _chunk_files(left / "arrays")
    assert len(before) >= 18, sorted(before)
    kept0 = resume.bytes_kept()
    h = jaxckpt.save_async(url, worker.state())
    h.wait()
    after = _chunk_files(tmp_path / "ckpt" / "arrays")
    rewritten = {k for k, v in after.items() if before.get(k) != v}
    assert len(after) == worker.ARRAYS and len(rewritten) == worker.ARRAYS - len(before)
    assert h.nbytes == len(rewritten) * CHUNK <= TOTAL * 0.15  # ~10% of the bytes
    assert h.resumed_bytes == resume.bytes_kept() - kept0 == len(before) * CHUNK
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # adopted, renamed into place
    _assert_restores(url, worker.state())


def test_a_local_retry_rewrites_the_chunks_whose_data_changed(tmp_path):
    url = str(tmp_path / "ckpt")
    _kill_at_90(url)
    (left,) = [p for p in tmp_path.iterdir() if p.name.startswith(".ckpt.tmp-")]
    # The chunks the killed save finished (a file cut short by the kill is written again).
    whole = {k for k in _chunk_files(left / "arrays") if _intact(left / "arrays" / k)}
    h = jaxckpt.save_async(url, worker.state(changed=0))  # a0 differs now: written again
    h.wait()
    assert h.nbytes == (worker.ARRAYS - len(whole - {"a00/c/0"})) * CHUNK, sorted(whole)
    _assert_restores(url, worker.state(changed=0))


def _intact(path: Path) -> bool:
    """Whether a chunk file is whole: its bytes and the CRC-32C trailer that ends them."""
    data = path.read_bytes()
    body = np.frombuffer(data[:-4], np.uint8)
    return len(body) == CHUNK and crc32c(body) == int.from_bytes(data[-4:], "little")


def test_a_different_plan_does_not_adopt_and_its_save_cleans_up(tmp_path):
    url = str(tmp_path / "ckpt")
    _kill_at_90(url)
    other = {k: v.astype(np.float64) for k, v in worker.state().items()}  # other dtypes
    h = jaxckpt.save_async(url, other)
    h.wait()
    assert h.resumed_bytes == 0 and h.nbytes == 2 * TOTAL
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # the leftover went
    _assert_restores(url, other)


def test_an_s3_save_killed_at_90_percent_resumes_sending_10_percent(s3, prefix, monkeypatch):  # noqa: F811
    url = f"s3://{BUCKET}/{prefix}"
    _kill_at_90(url)
    left = [k for k in keys(s3, prefix) if "/c/" in k]
    assert len(left) >= 18 and "writer.json" in keys(s3, prefix)  # no commit
    proxy = Proxy(os.environ["AWS_ENDPOINT_URL"])
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    try:
        h = jaxckpt.save_async(url, worker.state(), planner=CHUNKS())
        h.wait()
        sent = sum(r.up for r in proxy.log if r.method == "PUT" and "/c/" in r.path)
        assert sent == (worker.ARRAYS - len(left)) * (CHUNK + 4) <= TOTAL * 0.15
        assert h.resumed_bytes == len(left) * CHUNK
    finally:
        proxy.stop()
    _assert_restores(url, worker.state())


def test_an_s3_save_the_store_refused_partway_resumes(s3, prefix, monkeypatch):  # noqa: F811
    """A store that refuses requests (throttled for good, a lost permission) fails the save;
    it keeps what it wrote, marked dead at once, and the retry sends only the rest."""
    url = f"s3://{BUCKET}/{prefix}"
    state = worker.state()
    puts = {"n": 0}

    def rule(method, path):
        if method == "PUT" and "/c/" in path:
            puts["n"] += 1
            if puts["n"] > 15:
                return 403
        return "pass"

    proxy = Proxy(os.environ["AWS_ENDPOINT_URL"], rule)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    try:
        with pytest.raises(jaxckpt.CheckpointError, match="403|denied|Forbidden"):
            jaxckpt.save(url, state, planner=CHUNKS())
        written = len([k for k in keys(s3, prefix) if "/c/" in k])
        proxy.rule = lambda method, path: "pass"
        proxy.log.clear()
        h = jaxckpt.save_async(url, state, planner=CHUNKS())
        h.wait()
        assert h.nbytes == (worker.ARRAYS - written) * CHUNK and written >= 10
    finally:
        proxy.stop()
    _assert_restores(url, state)


def test_a_manager_reopened_after_a_preemption_resumes_the_step(tmp_path):
    """A job preempted mid-save restarts: the manager it opens keeps the failed save of the step
    after its newest committed one, and saving that step again resumes it; once a later step
    commits, a failed save of an earlier one goes."""
    run = tmp_path / "run"
    with jaxckpt.CheckpointManager(run) as mgr:
        mgr.save(4, worker.state(changed=4))
    _kill_at_90(str(run / "00000005"))
    with jaxckpt.CheckpointManager(run) as mgr:  # its clean-up at opening keeps the leftover
        assert any(p.name.startswith(".00000005.tmp-") for p in run.iterdir())
        kept0 = resume.bytes_kept()
        mgr.save(5, worker.state())
        mgr.wait()
        assert resume.bytes_kept() - kept0 >= 18 * CHUNK
        _assert_restores(str(run / "00000005"), worker.state())
    _kill_at_90(str(run / "00000006"))
    with jaxckpt.CheckpointManager(run) as mgr:
        mgr.save(7, worker.state())
        mgr.wait()
    with jaxckpt.CheckpointManager(run) as mgr:
        assert mgr.all_steps() == [4, 5, 7]
    assert not any(p.name.startswith(".") for p in run.iterdir())  # step 6's went


def test_an_object_store_manager_keeps_a_refused_save_for_its_retry(s3, prefix, monkeypatch):  # noqa: F811
    # Its steps as an object per chunk, whose resume keeps chunk by chunk (data objects, the
    # default there, resume object by object: tests/test_resume_objects.py).
    monkeypatch.setattr(save_planner, "DEFAULT_LAYOUT", "chunks")
    run = f"s3://{BUCKET}/{prefix}"
    refuse = {"on": True}

    def rule(method, path):
        refused = refuse["on"] and method == "PUT" and "/a19/c/" in path  # the others land
        return 403 if refused else "pass"

    proxy = Proxy(os.environ["AWS_ENDPOINT_URL"], rule)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    try:
        with jaxckpt.CheckpointManager(run, async_save=False) as mgr:
            with pytest.raises(jaxckpt.CheckpointError):
                mgr.save(1, worker.state())
        refuse["on"] = False
        with jaxckpt.CheckpointManager(run, async_save=False) as mgr:
            assert "00000001/writer.json" in keys(s3, prefix)  # kept at opening
            kept0 = resume.bytes_kept()
            mgr.save(1, worker.state())
            assert resume.bytes_kept() - kept0 == (worker.ARRAYS - 1) * CHUNK
            assert mgr.all_steps() == [1]
    finally:
        proxy.stop()
    _assert_restores(f"{run}/00000001", worker.state())


def CHUNKS() -> jaxckpt.DefaultSavePlanner:  # noqa: N802 - a constant's spelling
    """An object per chunk on object stores, whose failed saves resume chunk by chunk (data
    objects, the default there, resume object by object: tests/test_resume_objects.py)."""
    return jaxckpt.DefaultSavePlanner(layout="chunks")


class Throttled(jaxckpt.DefaultSavePlanner):
    """Storage failing the save once ``n`` items were handed to it (a ``CheckpointError``, as a
    deadline or a refused request raises)."""

    def __init__(self, n: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.n = n

    def resolve_data(self, item):
        self.n -= 1
        if self.n < 0:
            raise jaxckpt.CheckpointError("throttled: injected by the test")
        return super().resolve_data(item)


def test_a_sharded_save_resumes_chunk_by_chunk(tmp_path):
    """Shards of 2 MiB in chunks of 1 MiB (written straight to disk, ``directwrite``): half the
    shards were written when storage failed the save; the retry's data differs in one chunk of
    a written shard. It writes the missing shards and that chunk, and keeps the rest."""
    m = mesh((8,), ("data",))
    host = np.arange(8192 * 512, dtype=np.float32).reshape(8192, 512)
    url = str(tmp_path / "ckpt")
    with pytest.raises(jaxckpt.CheckpointError, match="throttled"):
        jaxckpt.save(
            url, {"w": put(host, m, "data")}, planner=Throttled(8, max_chunk_bytes=1 << 20)
        )
    host[600, 7] = -1.0  # in the second chunk of the first shard
    h = jaxckpt.save_async(
        url, {"w": put(host, m, "data")}, planner=Throttled(99, max_chunk_bytes=1 << 20)
    )
    h.wait()
    assert h.resumed_bytes == 7 << 20 and h.nbytes == 9 << 20
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    _assert_restores(url, {"w": host})


def test_a_two_process_save_one_process_died_in_resumes_on_both(tmp_path):
    """Process 1 dies after writing 10 of its 16 chunks; process 0 (the coordinator) fails the
    save and keeps the staging directory. A new group saves again: the coordinator adopts it and
    tells process 1, and each process writes only its missing chunks; bit-exact."""
    mh = Path(__file__).with_name("resume_mh_worker.py")
    died = run_group(mh, "die", 2, tmp_path, 150)
    assert died[1]["data"] == {"died": True} and died[0]["data"] == {"raised": True}
    assert len([n for n in os.listdir(tmp_path) if n.startswith(".ckpt.tmp-")]) == 1
    retry = run_group(mh, "retry", 2, tmp_path, 150)
    chunk = 64 << 10  # 16 per process
    assert [r["data"]["resumed"] for r in retry] == [16 * chunk, 10 * chunk]
    assert [r["data"]["nbytes"] for r in retry] == [0, 6 * chunk]
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".ckpt")]


def test_a_gcs_save_the_store_failed_partway_resumes(gcs):
    """The same on GCS (fake-gcs-server behind its precondition proxy): the generation is
    adopted by compare-and-swap on its dead writer.json and the stored CRC-32C of each chunk is
    read with a ranged request."""
    from gcs_server import BUCKET as GCS_BUCKET

    url = f"gs://{GCS_BUCKET}/resume-{os.urandom(4).hex()}"
    with pytest.raises(jaxckpt.CheckpointError, match="throttled"):
        jaxckpt.save(url, worker.state(), planner=Throttled(15, layout="chunks"))
    # a0 was written; now it differs
    h = jaxckpt.save_async(url, worker.state(changed=0), planner=CHUNKS())
    h.wait()
    assert h.resumed_bytes == 14 * CHUNK and h.nbytes == 6 * CHUNK
    _assert_restores(url, worker.state(changed=0))
