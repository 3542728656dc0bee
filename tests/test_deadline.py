"""Object-store operations end within a deadline (issue 29.4), against a real S3 server.

The server is a separate ``moto_server`` process on 127.0.0.1, so that it can be stopped
(SIGSTOP: a stalled server that accepts connections and never answers) and killed (a dead one).
Timing is asserted only as "fails within a generous bound".
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import boto3
import numpy as np
import pytest
from helpers import assert_tree_equal

import jaxckpt
from jaxckpt._cli.main import main
from jaxckpt._format.plan import ReadItem
from jaxckpt._runtime.pools import settle
from jaxckpt._sources import detect
from jaxckpt._storage.location import Location, wait

BUCKET = "deadline"
DEADLINE = 3  # seconds, set per test through JAXCKPT_IO_TIMEOUT or io_timeout=
BOUND = 90  # what the test allows each failing call: generous, far below tensorstore's ~900 s


@pytest.fixture
def server(monkeypatch):
    """A moto_server process of its own, with the AWS variables pointing at it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = Path(sys.executable).with_name("moto_server")
    proc = subprocess.Popen(
        [str(exe), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    for k, v in {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    for _ in range(300):
        try:
            client.create_bucket(Bucket=BUCKET)
            break
        except Exception:  # not listening yet
            time.sleep(0.1)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait()


def _fails_in_time(fn, *args, **kwargs) -> jaxckpt.CheckpointError:
    t = time.monotonic()
    with pytest.raises(
        jaxckpt.CheckpointError, match=r"did not finish within .*JAXCKPT_IO_TIMEOUT"
    ) as e:
        fn(*args, **kwargs)
    assert time.monotonic() - t < BOUND
    return e.value


def test_a_stalled_server_fails_every_operation_within_the_deadline(server, monkeypatch, capsys):
    url = f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}"
    jaxckpt.save(url, {"w": np.arange(8.0), "step": 1})
    monkeypatch.setenv("JAXCKPT_IO_TIMEOUT", str(DEADLINE))
    os.kill(server.pid, signal.SIGSTOP)  # accepts connections, never answers
    try:
        err = _fails_in_time(
            lambda: jaxckpt.save_async(url, {"w": np.zeros(8)}, overwrite=True).wait()
        )
        assert (
            url in str(err)
            and "127.0.0.1" in str(err)
            and "last committed checkpoint is intact" in str(err)
        )
        _fails_in_time(jaxckpt.save, url + "-new", {"w": np.zeros(8)})
        _fails_in_time(jaxckpt.restore, url)
        _fails_in_time(jaxckpt.metadata, url)
        t = time.monotonic()
        assert main(["verify", url]) == 2
        assert main(["inspect", url]) == 2
        assert time.monotonic() - t < 2 * BOUND
        assert capsys.readouterr().err.count("did not finish within") == 2
    finally:
        os.kill(server.pid, signal.SIGCONT)
    got = jaxckpt.restore(url)  # the last committed checkpoint, intact
    assert got["step"] == 1
    np.testing.assert_array_equal(got["w"], np.arange(8.0))


def test_the_manager_has_its_own_deadline(server):
    directory = f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}"
    with jaxckpt.CheckpointManager(directory, async_save=False, io_timeout=DEADLINE) as mgr:
        mgr.save(1, {"w": np.ones(4)})
        os.kill(server.pid, signal.SIGSTOP)
        try:
            _fails_in_time(mgr.save, 2, {"w": np.zeros(4)})
            _fails_in_time(mgr.restore, 1)
            _fails_in_time(mgr.latest_step)
        finally:
            os.kill(server.pid, signal.SIGCONT)
        assert mgr.all_steps() == [1]
        np.testing.assert_array_equal(mgr.restore()["w"], np.ones(4))


def test_a_dead_server_fails_within_the_deadline(server, monkeypatch):
    url = f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}"
    jaxckpt.save(url, {"w": np.ones(4)})
    settle()  # its clean-up after the commit, before the server dies (else it waits 30 s)
    monkeypatch.setenv("JAXCKPT_IO_TIMEOUT", str(DEADLINE))
    server.kill()  # connections refused: tensorstore would retry for ~900 s
    server.wait()
    _fails_in_time(jaxckpt.save, url, {"w": np.zeros(4)}, overwrite=True)
    _fails_in_time(jaxckpt.restore, url)


def _upload(client, folder: Path, prefix: str) -> None:
    for f in sorted(folder.rglob("*")):
        if f.is_file():
            client.upload_file(str(f), BUCKET, f"{prefix}/{f.relative_to(folder).as_posix()}")


def test_orbax_and_safetensors_reads_fail_within_the_deadline(server, tmp_path, monkeypatch):
    """Checkpoints of other libraries on an object store are read under the same deadline."""
    ocp = pytest.importorskip("orbax.checkpoint")
    st = pytest.importorskip("safetensors.numpy")
    client = boto3.client(
        "s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"], region_name="us-east-1"
    )
    with ocp.StandardCheckpointer() as c:
        c.save(tmp_path / "orbax", {"w": np.arange(8.0)})
    st.save_file({"w": np.arange(8.0)}, tmp_path / "m.safetensors")
    run = uuid.uuid4().hex[:8]
    _upload(client, tmp_path / "orbax", f"{run}/orbax")
    client.upload_file(str(tmp_path / "m.safetensors"), BUCKET, f"{run}/m.safetensors")
    orbax_url, st_url = f"s3://{BUCKET}/{run}/orbax", f"s3://{BUCKET}/{run}/m.safetensors"
    for url in (orbax_url, st_url):  # readable while the server answers
        np.testing.assert_array_equal(jaxckpt.restore(url)["w"], np.arange(8.0))
    monkeypatch.setenv("JAXCKPT_IO_TIMEOUT", str(DEADLINE))
    # Opened (metadata read) while the server answers, then its arrays read after it stalls.
    opened = [detect.open_source(Location(url)) for url in (orbax_url, st_url)]
    os.kill(server.pid, signal.SIGSTOP)
    try:
        for url in (orbax_url, st_url):
            assert url in str(_fails_in_time(jaxckpt.restore, url))
        items = [ReadItem("w", (0,), (8,))]
        for url, (manifest, reader) in zip((orbax_url, st_url), opened):
            err = _fails_in_time(lambda m=manifest, r=reader: list(r.read(m.entries, items)))
            assert url.rpartition("/")[0] in str(err)
    finally:
        os.kill(server.pid, signal.SIGCONT)


@pytest.mark.parametrize("value", ["soon", "0", "-1", "inf"])
def test_a_bad_deadline_setting_is_an_error(monkeypatch, value):
    monkeypatch.setenv("JAXCKPT_IO_TIMEOUT", value)
    with pytest.raises(jaxckpt.CheckpointError, match="JAXCKPT_IO_TIMEOUT"):
        jaxckpt.metadata(f"s3://{BUCKET}/x")
    with pytest.raises(jaxckpt.CheckpointError, match="io_timeout must be a positive"):
        jaxckpt.CheckpointManager("s3://b/x", io_timeout=float(value) if value != "soon" else 0)


def test_local_paths_and_memory_have_no_deadline(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXCKPT_IO_TIMEOUT", "0.000001")  # would fail any object-store call
    jaxckpt.save(tmp_path / "c", {"w": np.ones(4)})
    jaxckpt.save("memory://deadline-test", {"w": np.ones(4)})
    assert jaxckpt.restore("memory://deadline-test")["w"].shape == (4,)


@pytest.mark.parametrize("how", ["stalled", "dead"])
def test_one_deadline_bounds_a_whole_save_and_restore_of_many_arrays(server, monkeypatch, how):
    """80 arrays in flight when the server stalls or dies: the save fails within about one
    deadline (the first miss cancels the rest), not one deadline per array (issue 41.8)."""
    url = f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}"
    state = {f"a{i:02d}": np.full(1 << 18, i, np.float32) for i in range(80)}  # 80 x 1 MiB
    jaxckpt.save(url, state)
    monkeypatch.setenv("JAXCKPT_IO_TIMEOUT", str(DEADLINE))
    t = time.monotonic()
    handle = jaxckpt.save_async(url, {k: v + 1 for k, v in state.items()}, overwrite=True)
    time.sleep(0.2)
    (os.kill(server.pid, signal.SIGSTOP) if how == "stalled" else server.kill())
    try:
        with pytest.raises(jaxckpt.CheckpointError, match="did not finish within|not waited for"):
            handle.wait(timeout=300)  # a TimeoutError here would mean it never gave up
        assert time.monotonic() - t < 10 * DEADLINE  # one deadline per array: 80 x 3 s
        t = time.monotonic()
        with pytest.raises(jaxckpt.CheckpointError, match="did not finish within|not waited for"):
            jaxckpt.restore(url)
        assert time.monotonic() - t < 10 * DEADLINE
    finally:
        if how == "stalled":
            os.kill(server.pid, signal.SIGCONT)
    if how == "stalled":  # the last committed checkpoint is whole (read with the default
        monkeypatch.delenv("JAXCKPT_IO_TIMEOUT")  # deadline: the server works off a backlog)
        assert_tree_equal(jaxckpt.restore(url), state)


def test_a_deadline_counts_from_the_last_answer_to_a_watched_request(monkeypatch):
    """A request queued behind others of the same save waits while they are answered, and
    fails one deadline after the last answer (the writer and reader watch each request)."""
    monkeypatch.setenv("JAXCKPT_IO_TIMEOUT", "1")
    loc = Location(f"s3://{BUCKET}/c", one_operation=True)
    slow, never = concurrent.futures.Future(), concurrent.futures.Future()
    answers = [concurrent.futures.Future() for _ in range(30)]
    for fut in [slow, never, *answers]:
        loc.watch(fut)

    def serve() -> None:  # answer one request every 0.1 s, then the slow one
        for fut in answers:
            time.sleep(0.1)
            fut.set_result(None)
        slow.set_result("done")

    threading.Thread(target=serve, daemon=True).start()
    t = time.monotonic()
    assert wait(slow, loc, "reading x") == "done"  # 3 s, while answers came every 0.1 s
    assert time.monotonic() - t > 2  # so it outlasted its own 1 s deadline
    with pytest.raises(jaxckpt.CheckpointError, match="reading y at s3://deadline/c did not"):
        wait(never, loc, "reading y")  # nothing answered any more
    assert never.cancelled()
