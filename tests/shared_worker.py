"""One process of a 2-process JAX group for tests/test_shared_failures.py (issue 60, 2 and 3).

    python tests/shared_worker.py STAGE PROCESS_ID NUM_PROCESSES PORT WORKDIR

* ``restore``: a restore that fails on process 1 only (a corrupt or a missing chunk only it
  reads, a shared read of a replicated array, a target only it refuses) fails on both with
  process 1's error type, naming process 1 and the key; a process reading slowly stops once
  process 1 has failed; a restore onto the host on process 0 alone needs nobody; restores
  made together afterwards work, also replicated reads not shared, placed box by box. A
  restore in which process 0 reads slowly costs it as many store operations as a quick one.
  Then ``jaxckpt.save`` made on one process alone (each in turn): it logs at once that the
  call is collective and whom it waits for, and its deadline error says so; the next save
  made together works.
* ``tier``: a local step whose part on process 1 is damaged: the local tier's restore (on its
  own layout, or elastic onto another) fails there, and both processes restore the persistent
  step together; a persistent step with a
  chunk only process 1 reads damaged fails on both, naming process 1.
* ``calls``: with a local tier, ``latest_step`` / ``all_steps`` / ``metadata`` /
  ``should_save`` / ``run_table`` on process 0 alone return without the other; the next
  local save and restore made together work (replicated). A ``save_interval_secs`` schedule
  makes no key-value operation at steps it does not save, and leaves no key per step.

Records go to ``WORKDIR/STAGE-PID.json`` after each check, as in ``tiers_worker.py``.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import groups
import jax
import numpy as np
import worker_record

import jaxckpt

ROWS = 64


class Record(worker_record.Record):
    def failure(self, name: str, fn) -> None:
        """Run ``fn``, which should raise: record the error's type, message and seconds."""
        t0 = time.monotonic()
        try:
            fn()
            self.data[name] = {"type": None, "secs": time.monotonic() - t0}
        except Exception as e:  # noqa: BLE001 - recorded for the test to check
            self.data[name] = {"type": type(e).__name__, "msg": str(e)}
            self.data[name]["secs"] = time.monotonic() - t0
        self.flush()


def sync(name: str) -> None:
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)


def sharding(spec: tuple = ("a",)):
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    return NamedSharding(Mesh(np.array(jax.devices()), ("a",)), PartitionSpec(*spec))


def value() -> np.ndarray:
    return np.arange(ROWS * 8, dtype=np.float32).reshape(ROWS, 8)


def target(spec: tuple = ("a",), shape: tuple = (ROWS, 8)) -> dict:
    return {"w": jax.ShapeDtypeStruct(shape, np.float32, sharding=sharding(spec))}


def check(tree: dict) -> None:
    w = tree["w"]
    for s in w.addressable_shards:
        assert np.array_equal(np.asarray(s.data), value()[s.index]), s.index


def stage_restore(rec: Record, work: Path, pid: int, n: int) -> None:
    good, bad, gone = work / "good", work / "bad", work / "gone"
    v = value()
    arr = jax.make_array_from_callback(v.shape, sharding(), lambda i: v[i])
    jaxckpt.save(good, {"w": arr}, planner=jaxckpt.DefaultSavePlanner(pack_bytes=0))
    last = str(len(jax.devices()) - 1)  # the last rows' chunk: only process 1's devices hold it
    if pid == 0:
        shutil.copytree(good, bad)
        chunk = bad / "arrays" / "w" / "c" / last / "0"
        raw = bytearray(chunk.read_bytes())
        raw[len(raw) // 2] ^= 1
        chunk.write_bytes(bytes(raw))
        shutil.copytree(good, gone)
        (gone / "arrays" / "w" / "c" / last / "0").unlink()
    sync("corrupted")
    rec.failure("corrupt", lambda: jaxckpt.restore(bad, target()))
    rec.run("after_corrupt", lambda: check(jaxckpt.restore(good, target())))

    def counted() -> None:  # the store operations of one restore across processes
        from jaxckpt._runtime import kvstore

        before = kvstore.operations()
        check(jaxckpt.restore(good, target()))
        after = kvstore.operations()
        rec.data["restore_ops"] = {k: n - before.get(k, 0) for k, n in after.items()}

    rec.run("counted", counted)

    def slow_counted() -> None:  # process 0 reads for 4 s: its store operations do not grow
        from jaxckpt._runtime import kvstore

        slow = Slow(1.0 if pid == 0 else 0.0)
        before = kvstore.operations()
        check(jaxckpt.restore(good, target(), planner=slow))
        after = kvstore.operations()
        rec.data["slow_ops"] = {k: n - before.get(k, 0) for k, n in after.items()}
        rec.data["slow_read_boxes"] = slow.boxes

    rec.run("slow_counted", slow_counted)
    # a failure left posted by a restore whose agreement never finished (a process crashed):
    # the next restore of the path stops on it, says so on both, and clears it
    if pid == 0:
        from jaxckpt._runtime import agreement, kvstore

        key = f"{agreement.PREFIX}/{agreement.scope_of(str(good))}/restore-failed"
        kvstore.kv_client().key_value_set(key, "1")
    sync("stale failure posted")
    rec.failure("stale", lambda: jaxckpt.restore(good, target(), planner=Slow(0.5)))
    rec.run("after_stale", lambda: check(jaxckpt.restore(good, target())))
    rec.failure("missing", lambda: jaxckpt.restore(gone, target()))
    # a replicated target: each process reads half of the array, a collective gathers them
    rec.failure("corrupt_shared", lambda: jaxckpt.restore(bad, target(())))
    rec.run("after_shared", lambda: check(jaxckpt.restore(good, target(()))))
    # process 0 reads slowly (3 s a box): it stops reading once process 1 has failed
    slow = Slow(3.0 if pid == 0 else 0.0)
    rec.failure("corrupt_slow", lambda: jaxckpt.restore(bad, target(), planner=slow))
    rec.data["slow_boxes"] = slow.boxes
    wrong = target(shape=(ROWS, 4)) if pid == 1 else target()
    rec.failure("refused", lambda: jaxckpt.restore(good, wrong))
    # both valid, but different: process 1's replicated one would gather, process 0's not
    other = target(()) if pid == 1 else target()
    rec.failure("differ", lambda: jaxckpt.restore(good, other))
    if pid == 0:  # onto the host, alone: it meets nobody (process 1 does not call it)
        t0 = time.monotonic()
        assert np.array_equal(jaxckpt.restore(good)["w"], v)
        rec.data["alone_secs"] = time.monotonic() - t0
    rec.run("after_alone", lambda: check(jaxckpt.restore(good, target())))

    def unshared() -> None:  # replicated, read whole by each, placed box by box (no collective)
        for _ in range(3):
            planner = jaxckpt.DefaultLoadPlanner(share_reads=False, max_host_bytes=1)
            check(jaxckpt.restore(good, {"w": sharding(())}, planner=planner))

    rec.run("after_unshared", unshared)
    save_alone(rec, work, pid)
    # every restore's watcher ended with it (one blocked at exit would abort the process)
    rec.data["watchers_left"] = [t.name for t in threading.enumerate() if "watcher" in t.name]
    rec.flush()


def save_alone(rec: Record, work: Path, pid: int) -> None:
    """``jaxckpt.save`` on one process, the other not calling it (a short deadline)."""
    v = value()
    tree = {"w": jax.make_array_from_callback(v.shape, sharding(), lambda i: v[i])}
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: lines.append(r.getMessage())  # type: ignore[method-assign]
    logging.getLogger("jaxckpt").addHandler(handler)
    os.environ["JAXCKPT_SYNC_TIMEOUT"] = "6"
    for alone in (0, 1):
        if pid == alone:
            rec.failure(f"save_alone_{alone}", lambda: jaxckpt.save(work / "alone", tree))
            rec.data[f"save_alone_{alone}_log"] = [m for m in lines if "collective" in m]
            lines.clear()
        sync(f"alone {alone}")
    if pid == 0:  # a restore onto arrays of both processes, alone: it waits in an agreement
        rec.failure("restore_alone", lambda: jaxckpt.restore(work / "good", target()))
        rec.data["restore_alone_log"] = [m for m in lines if "collective" in m]
    sync("restore alone")
    del os.environ["JAXCKPT_SYNC_TIMEOUT"]
    logging.getLogger("jaxckpt").removeHandler(handler)

    def together() -> None:
        jaxckpt.save(work / "alone", tree)
        check(jaxckpt.restore(work / "alone", target()))

    rec.run("save_after_alone", together)


class Slow(jaxckpt.DefaultLoadPlanner):
    """Takes ``secs`` over each box it is given, one box at a time; counts them."""

    def __init__(self, secs: float) -> None:
        super().__init__(share_reads=False, max_host_bytes=1)
        self.secs, self.boxes = secs, 0

    def commit_tensor(self, item, array) -> None:
        self.boxes += 1
        time.sleep(self.secs)
        super().commit_tensor(item, array)


def stage_tier(rec: Record, work: Path, pid: int, n: int) -> None:
    # 2 MiB: not packed, so the last rows' chunk is a file of its own that only process 1 reads
    v = np.arange(1024 * 512, dtype=np.float32).reshape(1024, 512)
    tree = {"w": jax.make_array_from_callback(v.shape, sharding(), lambda i: v[i])}
    want = {"w": jax.ShapeDtypeStruct(v.shape, np.float32, sharding=sharding())}

    def manager() -> jaxckpt.CheckpointManager:
        return jaxckpt.CheckpointManager(
            work / "persistent",
            save_interval_steps=2,
            local_directory=work / "local" / f"p{pid}",
            local_save_interval_steps=1,
            local_replicas=1,
        )

    def restored(out: dict) -> None:
        for s in out["w"].addressable_shards:
            assert np.array_equal(np.asarray(s.data), v[s.index]), s.index

    mgr = manager()
    for step in range(4):  # persistent: 0 and 2; local: 0 to 3
        mgr.save(step, tree)
    mgr.wait()
    mgr.close()
    if pid == 1:  # every chunk in process 1's local directory: its own part of step 3 too
        for f in sorted((work / "local" / "p1").rglob("*")):
            if f.is_file() and "c" in f.relative_to(work / "local" / "p1").parts:
                raw = bytearray(f.read_bytes())
                raw[len(raw) // 2] ^= 1
                f.write_bytes(bytes(raw))
    sync("local damaged")
    mgr = manager()

    def local_fails() -> None:
        t0 = time.monotonic()
        restored(mgr.restore(target=want))
        rec.data["tier_secs"] = time.monotonic() - t0
        rec.data["tier_from"] = [mgr.restored_from.tier, mgr.restored_from.step]

    rec.run("tier", local_fails)

    def elastic_fails() -> None:  # onto another layout: an elastic restore of the local step
        replicated = {"w": jax.ShapeDtypeStruct(v.shape, np.float32, sharding=sharding(()))}
        restored(mgr.restore(target=replicated))
        rec.data["elastic_from"] = [mgr.restored_from.tier, mgr.restored_from.step]

    rec.run("tier_elastic", elastic_fails)
    if pid == 0:  # the last rows' chunk of persistent step 2: only process 1 reads it
        chunk = work / "persistent" / "00000002" / "arrays" / "w" / "c" / "7" / "0"
        raw = bytearray(chunk.read_bytes())
        raw[len(raw) // 2] ^= 1
        chunk.write_bytes(bytes(raw))
    sync("persistent damaged")
    rec.failure("tier_persistent", lambda: mgr.restore(2, target=want))
    mgr.close()


def stage_calls(rec: Record, work: Path, pid: int, n: int) -> None:
    v = value()
    tree = {"w": jax.make_array_from_callback(v.shape, sharding(), lambda i: v[i])}
    mgr = jaxckpt.CheckpointManager(
        work / "persistent",
        save_interval_steps=4,
        local_directory=work / "local" / f"p{pid}",
        local_save_interval_steps=1,
        local_replicas=1,
    )
    for step in range(3):
        mgr.save(step, tree)
    mgr.wait()
    if pid == 0:  # alone, as logging code calls them
        t0 = time.monotonic()
        rec.data["alone"] = {
            "latest": mgr.latest_step(),
            "all": mgr.all_steps(),
            "meta": list(mgr.metadata(0).entries),
            "should": mgr.should_save(3),
            "table": len(jaxckpt.run_table(work / "persistent").rows),
        }
        rec.data["alone_secs"] = time.monotonic() - t0
    sync("alone")
    rec.data["together"] = [mgr.latest_step(), mgr.all_steps()]

    def save_and_restore() -> None:
        mgr.save(3, tree)
        mgr.wait()
        check(mgr.restore(target=target()))
        rec.data["restored_from"] = [mgr.restored_from.tier, mgr.restored_from.step]

    rec.run("after_alone", save_and_restore)
    mgr.close()
    rec.run("schedule", lambda: schedule(rec, work, tree))


def schedule(rec: Record, work: Path, tree: dict) -> None:
    """Steps of a save_interval_secs schedule that do not save: KV operations and keys."""
    from jax._src import distributed

    mgr = jaxckpt.CheckpointManager(work / "timed", save_interval_secs=3600)
    real = distributed.global_state.client
    counted = Counting(real)
    distributed.global_state.client = counted
    try:
        for step in range(2):  # the first steps tell process 0 how long a step takes
            mgr.save(step, tree)
        rec.data["warmup_ops"] = len(counted.ops)  # the counting sees the agreements
        counted.ops.clear()
        sync("counting")
        rec.data["keys_before"] = [k for k, _ in real.key_value_dir_get("jaxckpt/")]
        for step in range(2, 62):
            assert not mgr.save(step, tree)
            time.sleep(0.002)
        rec.data["schedule_ops"] = list(counted.ops)
        sync("counted")
        rec.data["schedule_keys"] = [k for k, _ in real.key_value_dir_get("jaxckpt/")]
    finally:
        distributed.global_state.client = real
        mgr.close()


class Counting:
    """jax's real key-value client, each call's name recorded."""

    def __init__(self, client) -> None:
        self.client, self.ops = client, []

    def __getattr__(self, name: str):
        call = getattr(self.client, name)

        def counted(*args, **kwargs):
            self.ops.append(name)
            return call(*args, **kwargs)

        return counted


def main(argv: list[str]) -> None:
    stage, pid, n, port, work = argv[0], int(argv[1]), int(argv[2]), int(argv[3]), Path(argv[4])
    groups.join(pid, n, port)
    rec = Record(work / f"{stage}-{pid}.json")
    {"restore": stage_restore, "tier": stage_tier, "calls": stage_calls}[stage](rec, work, pid, n)
    sync("end")  # process 0 hosts the coordination service: nobody exits before the others
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
