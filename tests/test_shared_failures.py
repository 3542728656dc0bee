"""Issue 60, item 3, in a real 2-process ``jax.distributed`` group on 127.0.0.1
(``tests/shared_worker.py``): ``latest_step``, ``all_steps``, ``metadata``, ``should_save`` and ``run_table`` on one
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
