"""One process of a group for tests/test_sync_names.py (run as a script, see tests/groups.py):

    python tests/sync_worker.py STAGE PROCESS_ID NUM_PROCESSES PORT WORKDIR

A save's meeting keys come from what every process knows alike, so a process that fails before
a save's first cross-host step fails that save on every process (naming its error) and the next
save works; the store operations of a save are counted (``jaxckpt._runtime.kvstore``); a long
wait is logged on process 0 with the processes it waits for. Each check records ``"ok"`` or its
traceback in ``WORKDIR/STAGE-PID.json``; ``data`` holds what the test compares across
processes and groups.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

import groups
import jax
import numpy as np
import pytest
from worker_record import Record as Checks

import jaxckpt
from jaxckpt._runtime import kvstore

FAILS = {"sync2": 1, "sync4": 2}  # the process that fails early in each stage


class Iterator:
    """A data iterator whose ``get_state`` fails where ``fail`` (as one host's loader may)."""

    def __init__(self, fail: bool) -> None:
        self.fail, self.position = fail, 3

    def get_state(self) -> dict:
        if self.fail:
            raise RuntimeError(f"loader state lost on process {jax.process_index()}")
        return {"position": self.position}

    def set_state(self, state: dict) -> None:
        self.position = state["position"]


class FailingPlanner(jaxckpt.DefaultSavePlanner):
    """Fails to plan on process ``on`` (before the save's first cross-host step)."""

    def __init__(self, on: int) -> None:
        super().__init__()
        self.on = on

    def create_global_plan(self):
        if jax.process_index() == self.on:
            raise RuntimeError(f"planner broke on process {self.on}")
        return super().create_global_plan()


def state(leaves: int = 3) -> dict:
    """``leaves`` arrays sharded over every device of the group, built without collectives."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    sharding = NamedSharding(Mesh(np.array(jax.devices()), ("d",)), PartitionSpec("d"))
    n = len(jax.devices()) * 4
    return {
        f"w{i:03d}": jax.make_array_from_callback(
            (n,), sharding, lambda idx, i=i: np.arange(n, dtype=np.float32)[idx] + i
        )
        for i in range(leaves)
    }


def check(tree: dict) -> None:
    for key, leaf in tree.items():
        for shard in leaf.addressable_shards:
            want = np.arange(leaf.shape[0], dtype=np.float32)[shard.index] + int(key[1:])
            assert np.array_equal(np.asarray(shard.data), want), key


def barrier(name: str) -> None:
    """All processes here, through jax's own barrier (not counted with jaxckpt's operations)."""
    from jax._src import distributed

    distributed.global_state.client.wait_at_barrier(name, 60_000)


def expect_early_failure(fails: int, what: str, call) -> float:
    """``call()`` raises on every process, naming ``fails``'s error ``what``; seconds taken."""
    pid = jax.process_index()
    if pid == fails:
        want = rf"failed on this process \({fails}\): RuntimeError: {what}"
    else:
        want = rf"failed on process {fails}: RuntimeError: {what}"
    t0 = time.monotonic()
    with pytest.raises(jaxckpt.DistributedError, match=want):
        call()
    return time.monotonic() - t0


def run_stage(stage: str, checks: Checks, work: Path, pid: int) -> None:
    fails, data = FAILS[stage], checks.result["data"]
    tree = state()

    def save_fails_then_works():
        it = {"data": Iterator(pid == fails)}
        lost = f"loader state lost on process {fails}"
        path = work / "a"
        data["save_raised_s"] = expect_early_failure(
            fails, lost, lambda: jaxckpt.save(path, tree, iterators=it)
        )
        assert not path.exists()
        jaxckpt.save(path, tree, iterators={"data": Iterator(False)})  # the same path again
        jaxckpt.save(work / "b", tree)
        check(jaxckpt.restore(path, jax.tree.map(lambda a: a.sharding, tree)))

    def save_async_fails_then_works():
        it = {"data": Iterator(pid == fails)}
        lost = f"loader state lost on process {fails}"
        expect_early_failure(
            fails, lost, lambda: jaxckpt.save_async(work / "c", tree, iterators=it).wait()
        )
        jaxckpt.save_async(work / "c", tree).wait()
        jaxckpt.save_async(work / "d", tree).wait()

    def coordinator_fails_then_works():
        planner = FailingPlanner(0)
        expect_early_failure(
            0, "planner broke on process 0", lambda: jaxckpt.save(work / "e", tree, planner=planner)
        )
        jaxckpt.save(work / "e", tree)

    checks.run("save_fails_then_works", save_fails_then_works)
    checks.run("save_async_fails_then_works", save_async_fails_then_works)
    checks.run("coordinator_fails_then_works", coordinator_fails_then_works)
    checks.run("counts", lambda: count_operations(data, work))
    checks.run("keys_bounded", lambda: keys_bounded(data, work, pid))
    checks.run("slow_process_logged", lambda: slow_process(data, work, pid, fails))
    if stage == "sync2":
        checks.run("manager_fails_then_works", lambda: manager(work, pid, fails, tree))
        checks.run("manager_early_then_works", lambda: manager_early(work, pid, fails, tree))
        checks.run("local_tier_fails_then_works", lambda: local_tier(work, pid, fails, tree))
        checks.run("skipped_save_named", lambda: skipped(work, pid, fails, tree))


def manager(work: Path, pid: int, fails: int, tree: dict) -> None:
    lost = f"loader state lost on process {fails}"
    with jaxckpt.CheckpointManager(work / "m") as mgr:
        it = {"data": Iterator(pid == fails)}
        expect_early_failure(fails, lost, lambda: mgr.save(1, tree, iterators=it))
        assert mgr.save(1, tree, iterators={"data": Iterator(False)})  # the same step again
        assert mgr.save(2, tree)
        mgr.wait()
        assert mgr.all_steps() == [1, 2], mgr.all_steps()


def manager_early(work: Path, pid: int, fails: int, tree: dict) -> None:
    """A failure in the manager itself, before it starts the save (a metric it cannot use)."""
    with jaxckpt.CheckpointManager(work / "me", best_fn=lambda m: m["loss"]) as mgr:
        loss = "not a number" if pid == fails else 0.5
        match = f"failed on process {fails}: " if pid != fails else "not a number"
        with pytest.raises((jaxckpt.CheckpointError, ValueError), match=match):
            mgr.save(1, tree, metrics={"loss": loss})
        assert mgr.save(2, tree, metrics={"loss": 0.25})
        mgr.wait()
        assert mgr.all_steps() == [2], mgr.all_steps()


def local_tier(work: Path, pid: int, fails: int, tree: dict) -> None:
    """A local-only save that fails on one process; the next saves (both tiers) work."""
    mgr = jaxckpt.CheckpointManager(
        work / "lt", save_interval_steps=2, local_directory=work / "local"
    )
    with mgr:
        it = {"data": Iterator(pid == fails)}
        if pid == fails:
            with pytest.raises(RuntimeError, match="loader state lost"):
                mgr.save(1, tree, iterators=it)
        else:
            mgr.save(1, tree, iterators=it)
        assert mgr.save(2, tree)
        assert mgr.save(3, tree)
        mgr.wait()
        assert 2 in mgr.all_steps(), mgr.all_steps()


def skipped(work: Path, pid: int, fails: int, tree: dict) -> None:
    """A process that never calls a save is named at the deadline; the path works after."""
    os.environ["JAXCKPT_SYNC_TIMEOUT"] = "3"
    try:
        if pid != fails:
            match = rf"process {fails} did not reach 'plan' within 3 s"
            if pid != 0:
                match = "process 0 \\(the coordinator\\) did not release 'plan'"
            with pytest.raises(jaxckpt.DistributedError, match=match):
                jaxckpt.save(work / "skip", tree)
        barrier("skipped")
        jaxckpt.save(work / "skip", tree)
    finally:
        os.environ["JAXCKPT_SYNC_TIMEOUT"] = "60"


def count_operations(data: dict, work: Path) -> None:
    """Store operations of one save, of 3 leaves and of 300, on this process."""
    for leaves in (3, 300):
        tree = state(leaves)
        barrier(f"count {leaves}")
        before = kvstore.operations()
        jaxckpt.save(work / f"count{leaves}", tree)
        after = kvstore.operations()
        data[f"ops_{leaves}"] = {k: after[k] - before.get(k, 0) for k in after}


def keys_bounded(data: dict, work: Path, pid: int) -> None:
    """The keys saves leave in the store stop growing: 20 more saves add none."""
    from jax._src import distributed

    client = distributed.global_state.client
    counts = []
    for k in range(20):
        barrier(f"keys {k}")
        counts.append(len(client.key_value_dir_get("jaxckpt/")))
        jaxckpt.save(work / "keys" / str(k), state(1))
    data["keys_in_store"] = counts
    # A snapshot lands anywhere in a save (its keys come and go, so single snapshots peak): a
    # key kept per save would lift every later snapshot by the processes at each save, so the
    # later saves' lowest count would pass the earlier ones' highest.
    assert min(counts[10:]) <= max(counts[:10]), counts
    assert counts[-1] <= 6 * 10, counts


def slow_process(data: dict, work: Path, pid: int, slow: int) -> None:
    """Process ``slow`` starts its save late; process 0 says whom it waits for, and why."""
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    handler = Keep(level=logging.WARNING)
    logging.getLogger("jaxckpt").addHandler(handler)
    try:
        barrier("slow")
        if pid == slow:
            time.sleep(7)
        jaxckpt.save(work / "slow", state())
    finally:
        logging.getLogger("jaxckpt").removeHandler(handler)
    data["waiting_logs"] = [m for m in seen if "still waiting" in m]
    if pid == 0:
        want = f"still waiting on process {slow} to plan the save"
        assert any(want in m for m in seen), seen


def main(argv: list[str]) -> None:
    stage, pid, n, port, work = argv[0], int(argv[1]), int(argv[2]), int(argv[3]), Path(argv[4])
    groups.join(pid, n, port)
    checks = Checks(work / f"{stage}-{pid}.json")
    run_stage(stage, checks, work, pid)
    try:  # process 0 hosts the coordination service: nobody exits before the others
        barrier("end")  # (its early exit terminated a process still finishing its check)
    except Exception:  # noqa: BLE001 - a process that never came: its record says why
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
