"""A read never mixes two saves: a checkpoint overwritten while it is read raises
CheckpointChangedError (retry), or the read returns one generation whole."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from test_s3 import BUCKET, prefix, s3  # noqa: F401  (fixtures: the moto server)

import jaxckpt
from jaxckpt._runtime.pools import settle

LEAVES = 64
UNPACKED = jaxckpt.DefaultSavePlanner(pack_bytes=0)
CHUNK_FILES = jaxckpt.DefaultSavePlanner(pack_bytes=0, layout="chunks")


def state(g: int) -> dict:
    return {f"l{i:02d}": np.full(16384, g, np.int32) for i in range(LEAVES)}


class OverwriteMidway(jaxckpt.DefaultLoadPlanner):
    """Overwrites the checkpoint with generation 1 once the first box has been read.

    One box read ahead at a time, so every later box is read after the overwrite. With
    ``settled``, the overwrite's clean-up has deleted the replaced save's objects by then.
    Data objects' reads keep half the host budget in flight (``_api/restoring.py``): a budget
    of 4 boxes reads 2 ahead there.
    """

    read_ahead_bytes = 1

    def __init__(self, path, planner=UNPACKED, settled=False) -> None:
        super().__init__(max_host_bytes=4 * 16384 * 4)
        self.read_ahead_bytes = 1
        self.path, self.done = path, False
        self.planner, self.settled = planner, settled

    def commit_tensor(self, item, array):
        if not self.done:
            self.done = True
            jaxckpt.save(self.path, state(1), overwrite=True, planner=self.planner)
            if self.settled:
                settle()
        super().commit_tensor(item, array)


@pytest.mark.parametrize("where", ["local", "s3-chunks", "s3"])
def test_overwrite_during_restore_raises_changed(tmp_path, where, request):
    """Local and an object per chunk: the unchanged-check after the reads sees the new
    manifest. Data objects (the default on object stores) are named for their save, so a
    read that answered is its own save's; once the overwrite's clean-up has deleted them,
    the next read fails and the check names the overwrite as the cause."""
    path = (
        tmp_path / "c" if where == "local" else f"s3://{BUCKET}/{request.getfixturevalue('prefix')}"
    )
    planner = CHUNK_FILES if where == "s3-chunks" else UNPACKED
    jaxckpt.save(path, state(0), planner=planner)
    with pytest.raises(
        jaxckpt.CheckpointChangedError, match=r"replaced .* while it was being read.*Retry"
    ):
        jaxckpt.restore(path, planner=OverwriteMidway(path, planner, settled=where == "s3"))
    back = jaxckpt.restore(path)  # the retry reads the new generation whole
    assert all((a == 1).all() for a in back.values())


def test_every_read_checks_the_stamp(tmp_path):
    """verify, export and convert read through Reader.read, which checks after each read."""
    path = tmp_path / "c"
    jaxckpt.save(path, state(0), planner=UNPACKED)
    from jaxckpt._sources import detect as _sources
    from jaxckpt._storage import location as _location

    _, reader = _sources.open_source(_location.Location(path))
    m = jaxckpt.metadata(path)
    jaxckpt.save(path, state(1), overwrite=True, planner=UNPACKED)
    item = jaxckpt.ReadItem("l00", (0,), (16384,))
    with pytest.raises(jaxckpt.CheckpointChangedError, match=str(path)):
        list(reader.read(m.entries, [item]))


WRITER = textwrap.dedent(
    """
    import sys
    import numpy as np
    import jaxckpt
    path, rounds = sys.argv[1], int(sys.argv[2])
    planner = jaxckpt.DefaultSavePlanner(pack_bytes=0)
    print("ready", flush=True)
    for g in range(1, rounds + 1):
        jaxckpt.save(path, {f"l{i:02d}": np.full(16384, g, np.int32) for i in range(64)},
                     overwrite=True, planner=planner)
    print(rounds, flush=True)
    """
)


def test_restores_racing_overwrites_in_another_process(tmp_path):
    """Two real processes: every restore returns one generation whole or raises Changed."""
    path = tmp_path / "c"
    jaxckpt.save(path, state(0), planner=UNPACKED)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(path), "60"], env=env, stdout=subprocess.PIPE, text=True
    )
    whole = changed = 0
    try:
        assert writer.stdout.readline().strip() == "ready"  # imports done: the race starts
        deadline = time.monotonic() + 300  # a bound for a stuck writer, never reached normally
        while writer.poll() is None and time.monotonic() < deadline:
            try:
                back = jaxckpt.restore(path)
            except jaxckpt.CheckpointChangedError:
                changed += 1
                continue
            except jaxckpt.CheckpointNotFoundError:  # between rename steps without an atomic swap
                continue
            gens = {int(a[0]) for a in back.values()} | {int(a[-1]) for a in back.values()}
            assert len(gens) == 1, f"a restore mixed generations {sorted(gens)}"
            whole += 1
    finally:
        out, _ = writer.communicate(timeout=300)
    assert writer.returncode == 0 and out.strip() == "60", (writer.returncode, out)
    assert whole > 0, (whole, changed)  # restores really ran beside the writer


def test_stamp_survives_a_same_size_rewrite(tmp_path):
    """An identical manifest written again (the plan cache reuses it) is still a new save."""
    path = tmp_path / "c"
    jaxckpt.save(path, state(0), planner=UNPACKED)
    from jaxckpt._storage import location as _location

    loc = _location.Location(path)
    raw, stamp = _location.read_stamped(loc)
    assert not _location.manifest_changed(loc, stamp)
    jaxckpt.save(path, state(0), overwrite=True, planner=UNPACKED)
    assert _location.read_stamped(loc)[0] == raw  # the same bytes ...
    assert _location.manifest_changed(loc, stamp)  # ... of another save


def test_a_lease_is_judged_by_this_process_clock_not_the_writers():
    """writer.json's liveness needs no agreement of clocks (docs/object_storage.md, *Limits*):
    a lease whose writer's clock runs far ahead stays alive only while it is rewritten, and a
    live lease from a writer whose clock is behind by up to an hour is never taken for dead."""
    import json as _json
    import uuid

    from jaxckpt._storage import lease as _lease
    from jaxckpt._storage.location import Location, kvstore

    loc = Location(f"memory://lease-{uuid.uuid4().hex[:8]}/step")
    kv = kvstore(loc.kvstore)

    def beat(at: float) -> None:
        record = {"host": "another-host", "pid": 1, "beat": at}
        kv.write("writer.json", _json.dumps(record).encode()).result()

    live = _lease.object_is_live
    t = 1000.0  # this process's monotonic clock, as the tests give it
    beat(time.time() + 10_000)  # the writer's clock is hours ahead: its beat is "in the future"
    assert live(loc, "writer.json", clock=t)
    assert live(loc, "writer.json", clock=t + _lease.STALE_S - 1)  # not rewritten, not yet stale
    assert not live(loc, "writer.json", clock=t + _lease.STALE_S)  # silent for STALE_S: dead
    beat(time.time() + 10_000)  # rewritten (a new generation): alive again, timed afresh
    assert live(loc, "writer.json", clock=t + 2 * _lease.STALE_S)
    beat(time.time() + _lease.STALE_S + 10)  # beating every BEAT_S, seen across 10 looks
    for i in range(10):
        beat(time.time() - _lease.SKEW_S + 60)  # the writer's clock is ~1 h behind ours
        assert live(loc, "writer.json", clock=t + 3 * _lease.STALE_S + i * _lease.BEAT_S)
    beat(time.time() - _lease.STALE_S - _lease.SKEW_S - 1)  # older than any clock skew: dead
    assert not live(loc, "writer.json", clock=t + 4 * _lease.STALE_S)
    kv.write("writer.json", None).result()  # deleted
    assert not live(loc, "writer.json", clock=t + 4 * _lease.STALE_S)
