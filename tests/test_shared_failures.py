"""Issue 60, items 2 and 3, in real 2-process ``jax.distributed`` groups on 127.0.0.1
(``tests/shared_worker.py``).

2. A restore that fails on one process (a corrupt or missing chunk only it reads, a target
   only it refuses) fails on every process with that process's error type, naming the process
   and the key, within seconds; nobody returns arrays whose first collective would wait
   forever. A restore onto the host on one process meets nobody. Restores made together
   afterwards work (no count out of step). A process reading slowly makes as many
   coordination-service operations as a quick one: it waits for a failure, it does not poll.
3. ``latest_step``, ``all_steps``, ``metadata``, ``should_save`` and ``run_table`` on one
   process, with a local tier, return without the other; saves and restores made together
   afterwards work. Steps a ``save_interval_secs`` schedule does not save make no key-value
   operation and leave no key.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from groups import run_group

WORKER = Path(__file__).with_name("shared_worker.py")
GROUP_TIMEOUT_S = 240
PROMPT_S = 20  # far below JAXCKPT_SYNC_TIMEOUT (60 s in groups)


def _ok(records: list[dict], check: str) -> None:
    for p, r in enumerate(records):
        got = r["checks"].get(check, "not run")
        assert got == "ok", f"check {check!r} on process {p}:\n{got}"


@pytest.fixture(scope="module")
def restores(tmp_path_factory) -> list[dict]:
    return run_group(WORKER, "restore", 2, tmp_path_factory.mktemp("shared"), GROUP_TIMEOUT_S)


@pytest.mark.parametrize("case", ["corrupt", "corrupt_shared"])
def test_a_chunk_only_process_1_reads_fails_the_restore_on_both(restores, case):
    p0, p1 = (r["data"][case] for r in restores)
    for p in (p0, p1):  # the same error on both: process 1's type, naming it and the key
        assert p["type"] == "CorruptChunkError", p
        assert "failed on process 1: Key 'w': chunk (7,0)" in p["msg"], p
        assert "restore again on every process" in p["msg"], p
        assert p["secs"] < PROMPT_S, (p0, p1)
    assert p0["msg"] == p1["msg"]


def test_a_restore_across_processes_costs_one_agreement(restores):
    _ok(restores, "counted")
    for p, r in enumerate(restores):
        ops = r["data"]["restore_ops"]
        # one agreement: a few operations per process, none per box or leaf
        assert 1 <= ops["total"] <= 12, (p, ops)


def test_a_slow_readers_store_operations_do_not_grow_with_its_reading_time(restores):
    # Process 0 (the leader) reads its 4 boxes in 4 s; process 1 waits for it in the
    # agreement. Process 0 watches for a failure with one blocking get (no listing per
    # second) and meets process 1, which posted long before: one listing, in the agreement.
    _ok(restores, "slow_counted")
    p0, p1 = (r["data"]["slow_ops"] for r in restores)
    assert restores[0]["data"]["slow_read_boxes"] == 4, restores[0]["data"]
    assert p0.get("key_value_dir_get", 0) <= 1, p0
    assert p0.get("blocking_key_value_get", 0) <= 1, p0
    assert p0["total"] <= 8, p0
    # process 1's wait for the answer: one get until its notice (2 s), then one to the end
    assert p1.get("key_value_dir_get", 0) == 0 and p1["total"] <= 12, p1


def test_a_failure_left_by_an_unfinished_restore_is_reported_as_such_and_cleared(restores):
    for p, r in enumerate(restores):
        got = r["data"]["stale"]
        assert got["type"] == "DistributedError", got
        assert f"this process ({p}) stopped reading as a failure was posted" in got["msg"], got
        assert "left by an earlier restore of this path" in got["msg"], got
        assert "Restore again on every process" in got["msg"], got
    _ok(restores, "after_stale")


def test_no_restore_leaves_its_watcher_thread_running(restores):
    # failed restores, restores agreed and a restore made alone alike
    for r in restores:
        assert r["data"]["watchers_left"] == [], r["data"]["watchers_left"]


def test_a_missing_chunk_fails_the_restore_on_both_with_one_error(restores):
    # Every process finds a chunk missing (a listing counts the declared chunks): the error
    # names the first and says the other found it too.
    p0, p1 = (r["data"]["missing"] for r in restores)
    assert p0 == {**p1, "secs": p0["secs"]}, (p0, p1)
    assert p0["type"] == "CorruptChunkError", p0
    assert "failed on process 0: Key 'w': chunk (7,0)" in p0["msg"], p0
    assert "also on process 1: CorruptChunkError" in p0["msg"] and ".." not in p0["msg"], p0
    assert p0["secs"] < PROMPT_S and p1["secs"] < PROMPT_S, (p0, p1)


def test_a_process_still_reading_stops_once_another_has_failed(restores):
    p0, p1 = (r["data"]["corrupt_slow"] for r in restores)
    assert p1["type"] == p0["type"] == "CorruptChunkError", (p0, p1)
    assert "failed on process 1" in p0["msg"], p0
    # 4 boxes on process 0 (a device each), 3 s each: it stopped after the first ones
    assert restores[0]["data"]["slow_boxes"] < 4, restores[0]["data"]


def test_a_target_refused_on_process_1_fails_the_restore_on_both(restores):
    p0, p1 = (r["data"]["refused"] for r in restores)
    for p in (p0, p1):
        assert p["type"] == "ShapeMismatchError", p
        assert "failed on process 1: " in p["msg"] and "'w'" in p["msg"], p


def test_restores_of_different_targets_fail_on_both_instead_of_hanging(restores):
    for r in restores:
        got = r["data"]["differ"]
        assert got["type"] == "DistributedError", got
        assert "made different restores (processes [0]; processes [1]" in got["msg"], got
        assert "must call restore with the same target" in got["msg"], got


def test_restores_together_work_after_failed_ones(restores):
    for check in ("after_corrupt", "after_shared", "after_alone", "after_unshared"):
        _ok(restores, check)


def test_a_restore_onto_the_host_on_one_process_meets_nobody(restores):
    assert restores[0]["data"]["alone_secs"] < PROMPT_S


def test_a_save_made_on_one_process_says_at_once_it_is_collective(restores):
    p0 = restores[0]["data"]
    log = p0["save_alone_0_log"]  # process 0 (the coordinator) knows whom it waits for
    assert log and log[0].startswith("jaxckpt.save("), log
    want = ") is a collective call: every process must make it; waiting for process 1 to call it"
    assert want in log[0], log
    err = p0["save_alone_0"]
    assert err["type"] == "DistributedError", err
    assert "process 1 did not reach 'plan'" in err["msg"], err
    assert "must be called on every process" in err["msg"], err
    log = restores[1]["data"]["save_alone_1_log"]  # process 1 waits for process 0's answer
    assert (
        log
        and "is a collective call: every process must make it; waiting for process 0" in (log[0])
    ), log
    err = restores[1]["data"]["save_alone_1"]
    assert err["type"] == "DistributedError" and "must be called on every process" in err["msg"]
    _ok(restores, "save_after_alone")


def test_a_restore_across_processes_made_on_one_says_it_is_collective(restores):
    log = restores[0]["data"]["restore_alone_log"]
    want = ") is a collective call: every process must make it; waiting for process 1 to call it"
    assert log and log[0].startswith("jaxckpt.restore(") and want in log[0], log
    err = restores[0]["data"]["restore_alone"]
    assert err["type"] == "DistributedError", err
    assert "must be called on every process" in err["msg"] and "[1]" in err["msg"], err


@pytest.fixture(scope="module")
def tier(tmp_path_factory) -> list[dict]:
    return run_group(WORKER, "tier", 2, tmp_path_factory.mktemp("tier"), GROUP_TIMEOUT_S)


def test_a_local_part_damaged_on_process_1_makes_both_use_the_persistent_step(tier):
    _ok(tier, "tier")
    for r in tier:  # the local tier's restores already agree: all fall back together
        assert r["data"]["tier_from"] == ["persistent", 2], r["data"]
        assert r["data"]["tier_secs"] < PROMPT_S, r["data"]


def test_an_elastic_restore_of_a_part_damaged_on_process_1_falls_back_on_both(tier):
    _ok(tier, "tier_elastic")
    for r in tier:  # the elastic restore's verdict is the same agreement
        assert r["data"]["elastic_from"] == ["persistent", 2], r["data"]


def test_a_persistent_step_damaged_where_process_1_reads_fails_on_both(tier):
    for r in tier:
        got = r["data"]["tier_persistent"]
        assert got["type"] == "CorruptChunkError", got
        assert "failed on process 1: Key 'w': chunk (7,0)" in got["msg"], got
        assert got["secs"] < PROMPT_S, got


@pytest.fixture(scope="module")
def calls(tmp_path_factory) -> list[dict]:
    return run_group(WORKER, "calls", 2, tmp_path_factory.mktemp("calls"), GROUP_TIMEOUT_S)


def test_calls_on_one_process_do_not_wait_for_the_others(calls):
    alone = calls[0]["data"]["alone"]
    assert calls[0]["data"]["alone_secs"] < PROMPT_S
    assert alone["latest"] == 2 and alone["all"] == [0, 1, 2], alone
    assert alone["meta"] == ["w"] and alone["table"] == 1, alone
    assert calls[0]["data"]["together"] == calls[1]["data"]["together"] == [2, [0, 1, 2]]


def test_local_save_and_restore_together_work_after_calls_alone(calls):
    _ok(calls, "after_alone")
    for r in calls:
        assert r["data"]["restored_from"] == ["local", 3], r["data"]


def test_steps_a_timed_schedule_does_not_save_cost_no_store_operation(calls):
    _ok(calls, "schedule")
    for r in calls:
        assert r["data"]["warmup_ops"] > 0, r["data"]  # the first steps agree; they count
        assert r["data"]["schedule_ops"] == [], r["data"]["schedule_ops"][:10]
    data = calls[0]["data"]
    assert data["schedule_keys"] == data["keys_before"], data  # no key per step
    assert not [k for k in data["schedule_keys"] if k.startswith("jaxckpt/decide/")], data
