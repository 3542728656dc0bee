"""A save's meeting keys cannot drift, the coordination service's load per save is bounded, and
long waits say whom they wait for: real ``jax.distributed`` groups of 2 and 4 processes on
127.0.0.1 (tests/sync_worker.py runs the checks in each process, with ``pytest.raises``).

A process that fails before a save's first cross-host step (its data iterator's
``get_state``, its planner, the manager's own checks) used to leave a per-process count of saves
behind, so that every later save failed on every process; now that save fails everywhere with
the error named, and the next one (the same path included) works, through ``jaxckpt.save``,
``save_async``, ``CheckpointManager`` and its local tier.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from groups import run_group

WORKER = Path(__file__).with_name("sync_worker.py")
GROUP_TIMEOUT_S = 240
SHARED = [
    "save_fails_then_works",
    "save_async_fails_then_works",
    "coordinator_fails_then_works",
    "counts",
    "keys_bounded",
    "slow_process_logged",
]
TWO_ONLY = [
    "manager_fails_then_works",
    "manager_early_then_works",
    "local_tier_fails_then_works",
    "skipped_save_named",
]


@pytest.fixture(scope="module")
def groups(tmp_path_factory) -> dict[int, list[dict]]:
    two = tmp_path_factory.mktemp("sync2")
    four = tmp_path_factory.mktemp("sync4")
    return {
        2: run_group(WORKER, "sync2", 2, two, GROUP_TIMEOUT_S),
        4: run_group(WORKER, "sync4", 4, four, GROUP_TIMEOUT_S),
    }


def _ok(records: list[dict], check: str) -> None:
    for p, record in enumerate(records):
        got = record["checks"].get(check, "not run")
        assert got == "ok", f"check {check!r} on process {p}:\n{got}"


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("check", SHARED)
def test_each_group_check(groups, n, check):
    _ok(groups[n], check)


@pytest.mark.parametrize("check", TWO_ONLY)
def test_two_process_check(groups, check):
    _ok(groups[2], check)


def test_store_operations_per_save_do_not_grow_with_leaves_or_processes(groups):
    """Each process's posts (sets) per save are a constant: the same for 3 leaves as for 300
    and for 2 processes as for 4, except the coordinator's one answer per process at the first
    step. Reads and waits grow only with how long a process waits (in doubling slices)."""
    sets = {}
    for n, records in groups.items():
        for p, record in enumerate(records):
            ops = record["data"]
            small, large = ops["ops_3"], ops["ops_300"]
            assert small.get("key_value_set", 0) == large.get("key_value_set", 0), (n, p, ops)
            sets[n, p] = small.get("key_value_set", 0) - (n - 1 if p == 0 else 0)
            assert large["total"] <= 60, (n, p, large)  # a few dozen, not one per leaf
    assert len(set(sets.values())) <= 2, sets  # the coordinator's own, and everyone else's
    assert sets[2, 1] == sets[4, 1] == sets[4, 3], sets
    assert sets[2, 0] == sets[4, 0], sets
