"""Keeping steps by time (``keep_every_n_secs``) beside ``max_to_keep``, ``keep_every_n_steps``
and best-N: the pure rule of ``jaxckpt._manager.retention`` and a manager carrying it out,
with commit times in ``metrics.json``."""

from __future__ import annotations

import json

import numpy as np
import pytest

import jaxckpt
from jaxckpt._manager import retention
from jaxckpt._manager.retention import Policy, first_in_windows, steps_to_delete


def test_first_step_committed_in_each_window_is_kept_for_good():
    times = {s: 25.0 * s for s in range(1, 13)}  # windows of 60 s: [1, 2], [3, 4], [5, 6, 7], ...
    assert first_in_windows(times, 60, times) == {1, 3, 5, 8, 10, 12}
    gone = steps_to_delete(list(times), max_to_keep=2, keep_every_n_secs=60, committed=times)
    assert gone == [2, 4, 6, 7]  # kept: 1, 3, 5, 8, 10, 12 for good, and 9, 11 by max_to_keep
    # A step without a recorded time is in no window: max_to_keep decides for it.
    del times[1]
    assert 1 in steps_to_delete(list(range(1, 13)), max_to_keep=2, keep_every_n_secs=60,
                                committed=times)  # fmt: skip


def test_time_steps_and_best_compose_by_one_rule():
    steps = list(range(1, 11))
    times = {s: 10.0 * s for s in steps}  # windows of 35 s: [1, 2, 3], [4, 5, 6], [7, ..., 10]
    loss = {s: abs(s - 5) for s in steps}  # best: 5, then 4 and 6
    gone = steps_to_delete(
        steps,
        max_to_keep=2,
        keep_every_n_steps=3,  # 3, 6, 9 for good too
        score=lambda s: -loss[s],
        keep_every_n_secs=35,
        committed=times,
    )
    # For good: 1, 4, 7 (time) and 3, 6, 9 (steps). The best 2 of the rest (2, 5, 8, 10): 5
    # (loss 0) and 8 (loss 3, tied with 2: the newer wins). 10, the newest, anyway.
    assert gone == [2]


def test_manager_keeps_by_commit_time(tmp_path, monkeypatch):
    class FakeTime:
        now = 0.0

        def time(self):
            return self.now

    clock = FakeTime()
    monkeypatch.setattr(retention, "time", clock)
    mgr = jaxckpt.CheckpointManager(tmp_path, max_to_keep=2, keep_every_n_secs=60, async_save=False)
    for step in range(1, 13):
        clock.now = 25.0 * step  # each step commits 25 s after the last one
        mgr.save(step, {"w": np.full(3, step)})
    assert mgr.all_steps() == [1, 3, 5, 8, 9, 10, 11, 12]
    on_disk = json.loads((tmp_path / "metrics.json").read_text())
    assert on_disk["committed"] == {str(s): 25.0 * s for s in mgr.all_steps()}
    mgr.delete(11)
    assert "11" not in json.loads((tmp_path / "metrics.json").read_text())["committed"]
    mgr.close()


def test_older_run_directories_without_commit_times_still_work(tmp_path):
    with jaxckpt.CheckpointManager(tmp_path) as old:  # no keep_every_n_secs: no times written
        for step in range(1, 5):
            old.save(step, {"w": np.full(3, step)}, metrics={"loss": 1.0 / step})
    assert "committed" not in json.loads((tmp_path / "metrics.json").read_text())
    with jaxckpt.CheckpointManager(tmp_path, max_to_keep=1, keep_every_n_secs=3600) as mgr:
        mgr.save(5, {"w": np.full(3, 5)}, metrics={"loss": 0.1})
    # Steps 1-4 have no time: in no window, so max_to_keep decides among them (4, the
    # newest); step 5 is the first of its window, kept for good besides.
    assert mgr.all_steps() == [4, 5]
    doc = json.loads((tmp_path / "metrics.json").read_text())
    assert set(doc["committed"]) == {"5"} and set(doc["steps"]) == {"4", "5"}
    assert mgr.metrics(5) == {"loss": 0.1}  # metrics() still gives the step's metrics only


def test_a_damaged_commit_time_is_ignored(tmp_path):
    with jaxckpt.CheckpointManager(tmp_path, keep_every_n_secs=60) as mgr:
        mgr.save(1, {"w": np.zeros(2)})
    doc = json.loads((tmp_path / "metrics.json").read_text())
    doc["committed"] = {"1": "yesterday", "2": float("inf"), "x": 5.0, "-3": 1.0, "٣": 1.0}
    (tmp_path / "metrics.json").write_text(json.dumps(doc))
    assert mgr._metrics.read_all()[1] == {}
    with jaxckpt.CheckpointManager(tmp_path, max_to_keep=1, keep_every_n_secs=60) as mgr:
        mgr.save(2, {"w": np.ones(2)})  # retention reads the damaged times, and goes on
    # 2: the first of its window, kept for good; 1 has no usable time left: max_to_keep keeps it
    assert mgr.all_steps() == [1, 2]


@pytest.mark.parametrize("bad", [0, -5, float("nan"), "60"])
def test_policy_refuses_a_bad_window(bad):
    with pytest.raises(ValueError, match="keep_every_n_secs must be a positive number"):
        Policy(max_to_keep=1, keep_every_n_secs=bad)


# Retention as Orbax, t5x, Flax and Levanter users know it (issue 51.4) ---------------------------


def test_steps_without_metrics_are_kept_by_default_with_best_fn(tmp_path):
    best = dict(max_to_keep=1, best_fn=lambda m: m["loss"])
    with jaxckpt.CheckpointManager(tmp_path / "kept", **best, async_save=False) as mgr:
        mgr.save(1, {"x": np.zeros(2)})  # no metrics: kept (Orbax, t5x)
        for step, loss in ((2, 0.5), (3, 0.9), (4, 0.7)):
            mgr.save(step, {"x": np.zeros(2)}, metrics={"loss": loss})
        assert mgr.all_steps() == [1, 2, 4]  # 2: the best; 4: the newest; 3 deleted
    kw = dict(**best, keep_checkpoints_without_metrics=False, async_save=False)
    with jaxckpt.CheckpointManager(tmp_path / "worst", **kw) as mgr:
        mgr.save(1, {"x": np.zeros(2)})
        for step, loss in ((2, 0.5), (3, 0.9)):
            mgr.save(step, {"x": np.zeros(2)}, metrics={"loss": loss})
        assert mgr.all_steps() == [2, 3]  # without metrics: ranked worst, deleted first


def test_keep_every_n_steps_keeps_one_step_per_span_of_continuous_saves():
    steps = [3, 7, 12, 13, 18, 21, 26]  # saved by time: none lands on a multiple of 10
    gone = steps_to_delete(steps, max_to_keep=1, keep_every_n_steps=10)
    assert gone == [3, 7, 13, 18]  # kept: 12 (first at or after 10), 21 (20), 26 (the newest)
    # Where the multiples are saved, the rule is the one of exact multiples.
    assert steps_to_delete(list(range(1, 11)), max_to_keep=2, keep_every_n_steps=4) == [
        1,
        2,
        3,
        5,
        6,
        7,
    ]


def test_a_pinned_step_survives_retention_until_unpinned(tmp_path):
    with jaxckpt.CheckpointManager(tmp_path, max_to_keep=1, async_save=False) as mgr:
        mgr.save(1, {"x": np.zeros(2)})
        mgr.pin(1)
        mgr.save(2, {"x": np.zeros(2)})
        mgr.save(3, {"x": np.zeros(2)})
        assert mgr.all_steps() == [1, 3] and mgr.pinned_steps() == [1]
        with pytest.raises(jaxckpt.CheckpointNotFoundError, match=r"Step 2 .*\[1, 3\].*Pin one"):
            mgr.pin(2)
    with jaxckpt.CheckpointManager(tmp_path, max_to_keep=1, async_save=False) as mgr:
        assert mgr.pinned_steps() == [1]  # stored with the run
        assert json.loads((tmp_path / "metrics.json").read_text())["pinned"] == [1]
        mgr.unpin(1)
        mgr.save(4, {"x": np.zeros(2)})
        assert mgr.all_steps() == [4] and mgr.pinned_steps() == []


def test_pinning_a_step_only_the_local_tier_holds_says_why_with_every_listed_step(tmp_path):
    kw = dict(local_directory=tmp_path / "local", save_interval_steps=10, async_save=False)
    with jaxckpt.CheckpointManager(tmp_path / "run", **kw) as mgr:
        for step in (10, 11, 12):
            mgr.save(step, {"x": np.full(2, step)})
        mgr.wait()
        assert mgr.all_steps() == [10, 11, 12] and mgr.all_steps("persistent") == [10]
        with pytest.raises(
            jaxckpt.CheckpointNotFoundError,
            match=r"Step 12 is held only by the local tier .*local_max_to_keep=2.*"
            r"all_steps\(\) lists \[10, 11, 12\], of which .*run holds \[10\]: pin one of "
            r"those\. To keep step 12's state for good, restore\(12\) and save it",
        ):
            mgr.pin(12)
        with pytest.raises(jaxckpt.CheckpointNotFoundError, match=r"Step 13 .*\[10, 11, 12\]"):
            mgr.pin(13)
        mgr.pin(10)
        assert mgr.pinned_steps() == [10]


def test_a_deleted_pinned_step_is_unpinned(tmp_path):
    with jaxckpt.CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, {"x": np.zeros(2)})
        mgr.pin(1)
        mgr.delete(1)
        assert mgr.pinned_steps() == []


# NaN and infinite metrics rank worst; metrics best_fn cannot score are refused (issue 62) ------


@pytest.mark.parametrize("mode", ["min", "max"])
def test_a_diverged_run_keeps_a_bounded_number_of_steps(tmp_path, mode):
    """A loss that became NaN (or infinite) ranks worst: those steps are not kept as steps
    without metrics, and the disk holds max_to_keep + the newest, however long the run goes."""
    bad = [float("nan"), float("inf"), -float("inf")]
    with jaxckpt.CheckpointManager(
        tmp_path, max_to_keep=2, best_fn=lambda m: m["loss"], best_mode=mode, async_save=False
    ) as mgr:
        for step in range(1, 4):
            mgr.save(step, {"w": np.full(2, step)}, metrics={"loss": float(step)})
        for step in range(4, 16):
            mgr.save(step, {"w": np.full(2, step)}, metrics={"loss": bad[step % 3]})
            assert len(mgr.all_steps()) <= 3
        best = [1, 2] if mode == "min" else [2, 3]  # the finite ones, then the newest
        assert mgr.all_steps() == best + [15]
        assert mgr.best_step() == (1 if mode == "min" else 3)


def test_nan_and_infinities_rank_below_every_finite_score_and_above_no_metrics():
    p = Policy(best_fn=lambda m: m["loss"])
    scores = [p.score({"loss": v}) for v in (float("nan"), float("inf"), -float("inf"), 1e308)]
    assert scores[:3] == [-float("inf")] * 3 and scores[3] == -1e308
    assert p.score(None) is None  # only a step without metrics has no score
    metrics = {"1": {"loss": 0.5}, "2": {"loss": float("nan")}, "3": {"loss": 0.7}}
    # Step 2 (NaN) goes first; with keep_without_metrics it is not kept as unscored.
    assert Policy(max_to_keep=1, best_fn=p.best_fn).doomed([1, 2, 3, 4], metrics, {}) == [2, 3]


@pytest.mark.parametrize(
    "metrics, why",
    [
        ({"loss": None}, r"\{'loss': None\}: it returned None, not a number"),
        ({"loss": "low"}, r"\{'loss': 'low'\}: it returned 'low', not a number"),
        ({"acc": 0.5}, r"\{'acc': 0.5\}: it raised KeyError: 'loss'"),
    ],
)
def test_metrics_best_fn_cannot_score_are_refused_naming_it_the_step_and_metric(
    tmp_path, metrics, why
):
    with jaxckpt.CheckpointManager(tmp_path, max_to_keep=2, best_fn=lambda m: m["loss"]) as mgr:
        with pytest.raises(
            jaxckpt.InvalidArgumentError, match=f"best_fn cannot score the metrics of step 3, {why}"
        ) as e:
            mgr.save(3, {"w": np.zeros(2)}, metrics=metrics)
        assert "Nothing was saved" in str(e.value)
        assert mgr.all_steps() == [] and mgr.save(3, {"w": np.zeros(2)}, metrics={"loss": 1.0})
