"""When a CheckpointManager saves: ``save_interval_secs`` (by time, and 0: continuously) beside
``save_interval_steps``, ``force`` and preemption; ``should_save`` agrees with ``save``; on
several processes process 0 decides for all (a real 2-process group)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import jaxckpt
from jaxckpt._manager import schedule


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _manager(path, **kw):
    mgr = jaxckpt.CheckpointManager(path, **kw)
    clock = mgr._schedule.clock = Clock()
    mgr._schedule.last_start = 0.0  # the clock starts with the manager
    return mgr, clock


def test_time_based_saves_count_from_the_last_save_of_any_kind(tmp_path):
    mgr, clock = _manager(tmp_path, save_interval_secs=10, save_interval_steps=5, async_save=False)
    saved = []
    for step in range(1, 17):
        clock.now = 3.0 * step  # a step takes 3 s
        force = step == 13
        if mgr.save(step, {"w": np.full(2, step)}, force=force):
            saved.append(step)
    # 4: 12 s after the start; 5: a multiple of 5 (the clock restarts at 15 s); 9: 27 s;
    # 10: a multiple; 13: forced (39 s); 15: a multiple (45 s); 16 is 3 s after it.
    assert saved == [4, 5, 9, 10, 13, 15]
    assert mgr.all_steps() == saved
    mgr.close()


def test_with_seconds_alone_step_multiples_do_not_save(tmp_path):
    mgr, clock = _manager(tmp_path, save_interval_secs=100)
    assert mgr.save_interval_steps is None  # the default: 1 only without save_interval_secs
    assert not any(mgr.save(step, {"x": step}) for step in range(1, 6))  # no time passed
    clock.now = 100.0
    assert mgr.save(6, {"x": 6})
    mgr.close()
    assert jaxckpt.CheckpointManager(tmp_path).save_interval_steps == 1


def test_continuous_saves_as_soon_as_the_last_one_committed_and_never_waits(tmp_path):
    mgr, _ = _manager(tmp_path, save_interval_secs=0)
    gate = threading.Event()
    finish = mgr._finish

    def held(*args):  # the commit of step 1 waits for the gate
        gate.wait(timeout=120)
        finish(*args)

    mgr._finish = held
    assert mgr.save(1, {"x": 1})
    returned = []
    loop = threading.Thread(target=lambda: returned.extend(mgr.save(s, {"x": s}) for s in (2, 3)))
    loop.start()
    loop.join(timeout=60)  # generous: save() must not wait for the held commit at all
    assert not loop.is_alive() and returned == [False, False]  # one in flight: no second save
    assert not mgr.should_save(4) and not mgr.save(4, {"x": 4})
    gate.set()
    mgr.wait()
    assert mgr.should_save(5) and mgr.save(5, {"x": 5})  # committed: the next call saves
    mgr.close()
    assert mgr.all_steps() == [1, 5]


def test_should_save_and_save_give_the_same_answer_for_a_step(tmp_path):
    mgr, clock = _manager(tmp_path, save_interval_secs=10, async_save=False)
    clock.now = 5.0
    assert not mgr.should_save(1)
    clock.now = 50.0  # due now, but should_save(1) already said no: save(1) agrees
    assert not mgr.save(1, {"x": 1})
    assert mgr.should_save(2)
    clock.now = 51.0
    assert mgr.save(2, {"x": 2})
    assert not mgr.should_save(3)  # the clock restarted at 51 s
    mgr.close()


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"save_interval_secs": -1}, "save_interval_secs must be a number of seconds >= 0"),
        ({"save_interval_secs": float("nan")}, "save_interval_secs must be"),
        ({"save_interval_secs": "60"}, "save_interval_secs must be"),
        ({"keep_every_n_secs": 0}, "keep_every_n_secs must be a positive number"),
        ({"keep_every_n_secs": True}, "keep_every_n_secs must be a positive number"),
        ({"save_interval_steps": 0}, "save_interval_steps must be a positive int"),
    ],
)
def test_bad_intervals_are_refused(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        jaxckpt.CheckpointManager(tmp_path, **kw)


def test_single_process_decisions_use_no_key_value_store(tmp_path, monkeypatch):
    def no_store():
        raise AssertionError("a single process asked the key-value store")

    monkeypatch.setattr(schedule._distributed, "kv_client", no_store)
    mgr, clock = _manager(tmp_path, save_interval_secs=1)
    for step in range(1, 6):
        clock.now = float(step)
        mgr.save(step, {"x": step})
    mgr.close()
    assert mgr.all_steps()


def test_two_processes_save_the_same_steps_continuously(loops_group):
    records, _ = loops_group
    a, b = (r["continuous"] for r in records)
    assert a == b, (a, b)  # process 0 decided for both, though their clocks and commits differ
    # Process 0 holds each save in flight for 3 more steps, then waits for it: the steps in
    # between found one in flight, on process 1 too, though its own commits were done.
    assert a["saved"] == [1, 5, 9, 13, 17, 21], a
    assert a["committed"] == a["saved"]


def test_two_processes_save_the_same_steps_by_time(loops_group):
    records, _ = loops_group
    a, b = (r["timed"] for r in records)
    assert a == b, (a, b)
    assert a["saved"] and a["committed"] == a["saved"]
    assert a["asked"] == a["saved"]  # should_save(step) said what save(step) then did


def test_the_schedule_leaves_no_key_in_the_store(loops_group):
    records, _ = loops_group  # each answer is deleted by the process it was for (issue 60)
    assert records[0]["answers_left"] == 0


def test_a_schedule_that_changes_with_the_step(tmp_path):
    """Levanter's "every 1,000 until 10,000, then every 5,000", scaled down."""
    sched = [(0, 10), (100, 50)]
    with jaxckpt.CheckpointManager(tmp_path, save_interval_steps=sched, async_save=False) as mgr:
        wanted = [s for s in range(0, 260) if mgr.should_save(s)]
        assert wanted == [*range(0, 100, 10), 100, 150, 200, 250]
        for s in range(0, 160):
            mgr.save(s, {"x": np.zeros(1)})
        assert mgr.all_steps() == [*range(0, 100, 10), 100, 150]


@pytest.mark.parametrize("bad", [0, -1, [], [(0, 0)], [(5, 1), (2, 3)], [(0, 1, 2)], "10", 1.5])
def test_a_bad_schedule_is_refused_naming_the_argument(tmp_path, bad):
    with pytest.raises(ValueError, match="save_interval_steps must be a positive int"):
        jaxckpt.CheckpointManager(tmp_path, save_interval_steps=bad)
