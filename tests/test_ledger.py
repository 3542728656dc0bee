"""The run's ledger (issue 50): every manager call agrees across both tiers.

Each test is a sequence an operator or an Orbax user runs, that went wrong before the ledger:
a rollback with a local tier resumed the abandoned branch after a restart, a forgotten delete
let retention remove the rollback point, deletes leaked held arrays, a wiped local disk
crashed an open manager, ``should_save`` ignored the local tier, a refused restore moved the
iterators, and more (see each test).
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import uuid

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from test_s3 import BUCKET, s3  # noqa: F401 (fixture)

import jaxckpt
from jaxckpt._runtime.pools import settle
from jaxckpt._storage.catalog import list_keys
from jaxckpt._storage.location import Location
from jaxckpt._tiers import tier_choice

MESH = Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))
SHARDING = NamedSharding(MESH, PartitionSpec("a", "b"))


def _state(v: float) -> dict:
    return {"w": jax.device_put(jnp.full((8, 4), v, jnp.float32), SHARDING), "v": float(v)}


def _target() -> dict:
    return {"w": jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=SHARDING), "v": None}


def _value(tree: dict) -> float:
    return float(np.asarray(tree["w"])[0, 0])


class Counter:
    """A data iterator: its position is its state."""

    def __init__(self) -> None:
        self.position = 0

    def get_state(self) -> dict:
        return {"position": self.position}

    def set_state(self, state: dict) -> None:
        self.position = state["position"]


def _tiered(tmp_path, **kw) -> jaxckpt.CheckpointManager:
    return jaxckpt.CheckpointManager(
        tmp_path / "ckpt",
        save_interval_steps=5,
        local_directory=tmp_path / "local",
        local_save_interval_steps=1,
        local_max_to_keep=2,
        **kw,
    )


# 1. Rollback with a local tier -----------------------------------------------------------------


def test_rollback_with_a_local_tier_resumes_the_new_branch_after_a_restart(tmp_path):
    with _tiered(tmp_path) as mgr:
        for step in range(11):
            assert mgr.save(step, _state(step))
        mgr.wait()
        assert mgr.all_steps() == [0, 5, 9, 10]
        assert _value(mgr.restore(5, _target())) == 5
        with pytest.raises(jaxckpt.CheckpointExistsError, match=r"\[9, 10\].*rollback\(5\)"):
            mgr.save(6, _state(106))  # the abandoned branch is still there: refused, nothing saved
        assert mgr.all_steps() == [0, 5, 9, 10]
        assert mgr.rollback(5) == [9, 10]  # both tiers
        assert mgr.all_steps() == [0, 5] and mgr.all_steps("local") == []
        for step in (6, 7):
            mgr.save(step, _state(100 + step))
        mgr.wait()
        assert mgr.all_steps("local") == [6, 7]  # the steps saved last, not the highest numbers
    with _tiered(tmp_path) as mgr:  # a restart
        assert mgr.latest_step() == 7
        assert _value(mgr.restore(target=_target())) == 107
        assert mgr.restored_from == tier_choice.RestoredFrom("local", 7)


def test_every_listed_step_can_be_deleted_from_every_tier(tmp_path):
    with _tiered(tmp_path) as mgr:
        for step in range(11):
            mgr.save(step, _state(step))
        mgr.wait()
        mgr.delete(9)  # only the local tier holds it
        mgr.delete(10)  # both tiers hold it
        assert mgr.all_steps() == [0, 5] and mgr.all_steps("local") == []
        assert _value(mgr.restore(target=_target())) == 5
        with pytest.raises(jaxckpt.CheckpointNotFoundError, match=r"Step 9 .*steps: \[0, 5\]"):
            mgr.delete(9)
        mgr.save(6, _state(6))  # the newest step is 5 again
        mgr.wait()
    with _tiered(tmp_path) as mgr:
        assert mgr.all_steps() == [0, 5, 6]


# 2. A forgotten rollback is refused --------------------------------------------------------------


def test_a_forgotten_rollback_is_refused_and_the_new_branch_survives_a_restart(tmp_path):
    kw = dict(max_to_keep=3)
    with jaxckpt.CheckpointManager(tmp_path, **kw) as mgr:
        for step in (3, 6, 9, 12):
            mgr.save(step, _state(step), force=True)
        mgr.wait()
        assert mgr.all_steps() == [6, 9, 12]
        mgr.restore(6)
        with pytest.raises(jaxckpt.CheckpointExistsError, match=r"\[9, 12\].*rollback\(6\)"):
            mgr.save(7, _state(107), force=True)
        assert mgr.all_steps() == [6, 9, 12]  # the rollback point is still there
        assert not mgr.should_save(7)  # exactly what save() would do
        mgr.rollback(6)
        assert mgr.should_save(7)
        mgr.save(7, _state(107))
    with jaxckpt.CheckpointManager(tmp_path, **kw) as mgr:
        assert mgr.all_steps() == [6, 7]
        assert _value(mgr.restore()) == 107


@pytest.mark.parametrize("local", [False, True])
def test_a_refused_save_after_a_restore_names_every_newer_step_and_the_rollback(tmp_path, local):
    """docs/manager.md: after restore(8) with steps 9 and 10 saved, save(9) names both and
    rollback(8), not rollback(9) (which would leave step 9 of the abandoned branch)."""
    kw = {"local_directory": tmp_path / "local"} if local else {}
    with jaxckpt.CheckpointManager(tmp_path / "run", max_to_keep=3, **kw) as mgr:
        for step in range(1, 11):
            mgr.save(step, _state(step))
        mgr.wait()
        mgr.restore(8, _target())
        for step, head in [(9, "Step 9 is already saved"), (10, "Step 10 is already saved")]:
            with pytest.raises(
                jaxckpt.CheckpointExistsError,
                match=rf"{head} in .*Nothing was saved\. To go on from step 8, call "
                r"CheckpointManager\.rollback\(8\) first: it deletes steps \[9, 10\] from "
                r"every tier",
            ):
                mgr.save(step, _state(100 + step))
        assert mgr.rollback(8) == [9, 10]
        mgr.save(9, _state(109))


def test_a_failed_save_can_be_saved_again(tmp_path):
    class Fails(jaxckpt.DefaultSavePlanner):
        def resolve_data(self, item):
            raise RuntimeError("the user's planner failed")

    with jaxckpt.CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, _state(1))
        with pytest.raises(RuntimeError, match="planner failed"):
            jaxckpt.save(str(tmp_path / "00000002"), _state(2), planner=Fails())
        assert mgr.should_save(2)
        mgr.save(2, _state(2))
        assert mgr.all_steps() == [1, 2]


# 3. Nothing leaks ----------------------------------------------------------------------------------


def _frozen_and_moving(v: float) -> dict:
    frozen = np.arange(70_000, dtype=np.float32)  # its own array: referenced, not copied
    return {"frozen": frozen, "moving": np.full(64, v, np.float32)}


def _left(root: str) -> list[str]:
    return sorted(k for k in list_keys(Location(root)) if k != "metrics.json")


@pytest.fixture(params=["memory", "s3", "gcs"])
def store(request) -> str:
    if request.param == "memory":
        return f"memory://ledger-{uuid.uuid4().hex[:8]}"
    request.getfixturevalue(request.param)  # moto, or fake-gcs-server behind its proxy
    scheme = "s3" if request.param == "s3" else "gs"
    return f"{scheme}://{BUCKET}/ledger-{uuid.uuid4().hex[:8]}"


def test_deleting_every_step_of_an_incremental_run_leaves_nothing(store):
    with jaxckpt.CheckpointManager(store, incremental=True, async_save=False) as mgr:
        for step in range(1, 5):
            mgr.save(step, _frozen_and_moving(step))
        assert any("../00000001/" in t for t in jaxckpt.metadata(f"{store}/00000004").refs.values())
        for step in (1, 2, 3, 4):  # the holder first: its arrays stay while others hold them
            mgr.delete(step)
        assert mgr.all_steps() == []
    assert _left(store) == []


def test_retention_and_rollback_of_an_incremental_run_leave_only_listed_steps(store):
    with jaxckpt.CheckpointManager(store, incremental=True, async_save=False, max_to_keep=2) as mgr:
        for step in range(1, 6):
            mgr.save(step, _frozen_and_moving(step))
        mgr.rollback(4)
        assert mgr.all_steps() == [4]
        mgr.delete(4)
    assert _left(store) == []


def test_a_clean_up_never_deletes_a_step_committed_after_its_listing(store):
    """The clean-up after a retention (in the background) lists the steps after the index's
    newest, then judges each one without a manifest by its save's lease. A save that commits
    in between lets its lease go after its commit: the step must be read as committed, not
    as a dead save's leftovers (its manifest is looked for again before anything goes)."""
    from jaxckpt._manager import cleanup

    path = f"{store}/00000005"
    jaxckpt.save(path, _frozen_and_moving(5))
    settle()  # its lease let go, as once its commit's clean-up ran
    listed = {"00000005": [k for k in list_keys(Location(path)) if k != "manifest.json"]}
    cleanup.clean_listed(Location(store), lambda names: {}, listed, 4)
    assert jaxckpt.restore(path)["moving"][0] == 5


def test_an_overwritten_base_leaves_nothing_once_its_referrer_is_deleted(store):
    with jaxckpt.CheckpointManager(store, incremental=True, async_save=False) as mgr:
        mgr.save(1, _frozen_and_moving(1))
        mgr.save(2, _frozen_and_moving(2))  # references step 1's frozen array
        moved = {"frozen": np.arange(70_000, dtype=np.float32) + 1, "moving": np.zeros(64)}
        jaxckpt.save(f"{store}/00000001", moved, overwrite=True)  # by hand: a new generation
        mgr.delete(2)  # the old generation's array is held by nothing now
        assert mgr.all_steps() == [1]
        jaxckpt.restore(f"{store}/00000001")
        mgr.delete(1)
    assert _left(store) == []


# 4. One tier's fault is not the run's ------------------------------------------------------------


def test_a_local_directory_wiped_while_open_falls_back_to_the_persistent_tier(tmp_path, caplog):
    with _tiered(tmp_path) as mgr:
        for step in range(8):
            mgr.save(step, _state(step))
        mgr.wait()
        shutil.rmtree(tmp_path / "local")
        with caplog.at_level(logging.INFO, logger="jaxckpt"):
            got = mgr.restore(target=_target())
        assert _value(got) == 5 and mgr.restored_from == tier_choice.RestoredFrom("persistent", 5)
        assert "cannot be read" in caplog.text and "persistent" in caplog.text
        assert mgr.all_steps() == [0, 5]
        mgr.save(8, _state(8))  # the local tier starts again
        mgr.wait()
        assert _value(mgr.restore(target=_target())) == 8


def test_a_local_directory_replaced_by_a_file_falls_back(tmp_path):
    with _tiered(tmp_path) as mgr:
        for step in range(3):
            mgr.save(step, _state(step))
        mgr.wait()
        shutil.rmtree(tmp_path / "local")
        (tmp_path / "local").write_text("not a directory")
        assert _value(mgr.restore(target=_target())) == 0
        assert mgr.restored_from == tier_choice.RestoredFrom("persistent", 0)


# 5. should_save is exactly "save would save now" -----------------------------------------------


def test_should_save_answers_for_both_tiers_and_reads(tmp_path):
    with _tiered(tmp_path) as mgr:
        assert mgr.should_save(0) and mgr.should_save(1)  # 1: the local tier saves it
        for step in range(3):
            assert mgr.save(step, _state(step)) == mgr.should_save(step) or step <= 2
        mgr.wait()
        assert not mgr.should_save(2) and not mgr.should_save(1)  # saved already
        assert mgr.should_save(3)
    reader = jaxckpt.CheckpointManager(tmp_path / "ckpt", read_only=True)
    assert not reader.should_save(10)
    plain = jaxckpt.CheckpointManager(tmp_path / "plain", save_interval_steps=2)
    assert [plain.should_save(s) for s in range(4)] == [True, False, True, False]
    assert plain.save(np.int32(2), _state(2))  # an integer scalar is a step
    assert plain.save(jnp.asarray(4), _state(4))
    plain.wait()
    assert plain.all_steps() == [2, 4] and not plain.should_save(np.int64(4))
    plain.close()


@pytest.mark.parametrize("where", ["local", "memory", "tiered"])
def test_after_reload_should_save_knows_a_step_saved_by_hand_after_the_newest(tmp_path, where):
    """A plain ``jaxckpt.save`` of a step after the manager's newest, then ``reload()``:
    ``save`` refuses the steps up to it, so ``should_save`` answers ``False`` for them too
    (before, it answered ``True`` from the newest step the manager had saved itself)."""
    if where == "tiered":
        mgr, run = _tiered(tmp_path), str(tmp_path / "ckpt")
    else:
        run = str(tmp_path) if where == "local" else f"memory://reload-{uuid.uuid4().hex[:8]}"
        mgr = jaxckpt.CheckpointManager(run, save_interval_steps=1)
    with mgr:
        mgr.save(5, _state(5), force=True)
        mgr.wait()
        jaxckpt.save(f"{run}/00000009", _state(9))  # an operator's step, after the newest
        mgr.reload()
        assert mgr.all_steps() == [5, 9] and mgr.latest_step() == 9
        for step in (7, 9):
            assert not mgr.should_save(step), step
            with pytest.raises(jaxckpt.CheckpointExistsError, match=r"rollback"):
                mgr.save(step, _state(step), force=True)
        assert mgr.should_save(10) and mgr.save(10, _state(10))
        mgr.wait()
        assert mgr.all_steps() == [5, 9, 10]


def test_a_resumed_should_save_loop_never_raises(tmp_path):
    with jaxckpt.CheckpointManager(tmp_path, save_interval_steps=2) as mgr:
        for step in range(7):
            if mgr.should_save(step):
                mgr.save(step, _state(step))
    with jaxckpt.CheckpointManager(tmp_path, save_interval_steps=2) as mgr:
        start = mgr.latest_step()
        mgr.restore(start)
        for step in range(start - 3, 10):  # a loop that restarts a little early
            if mgr.should_save(step):
                mgr.save(step, _state(step))
        mgr.wait()
        assert mgr.all_steps() == [0, 2, 4, 6, 8]


# 6. A refused restore changes nothing ------------------------------------------------------------


@pytest.mark.parametrize("tiered", [False, True])
def test_a_refused_restore_moves_no_iterator(tmp_path, tiered):
    mgr = _tiered(tmp_path) if tiered else jaxckpt.CheckpointManager(tmp_path / "ckpt")
    with mgr:
        it = Counter()
        it.position = 5
        mgr.save(5, _state(5), iterators={"train": it})
        mgr.wait()
        it.position = 99
        bad = {"w": jax.ShapeDtypeStruct((4, 4), jnp.float32, sharding=SHARDING), "v": None}
        with pytest.raises(jaxckpt.ShapeMismatchError, match="'w'"):
            mgr.restore(5, bad, iterators={"train": it})
        assert it.position == 99
        with pytest.raises(jaxckpt.KeyMismatchError, match="'eval'"):
            mgr.restore(5, _target(), iterators={"train": it, "eval": Counter()})
        assert it.position == 99
        with pytest.raises(jaxckpt.KeyMismatchError, match="other"):
            mgr.restore(5, {**_target(), "other": None}, iterators={"train": it})
        assert it.position == 99
        assert _value(mgr.restore(5, _target(), iterators={"train": it})) == 5
        assert it.position == 5


# 7. The local tier takes what the persistent tier takes -------------------------------------------


def test_iterators_with_bare_sharding_targets_use_the_newest_local_step(tmp_path):
    with _tiered(tmp_path) as mgr:
        it = Counter()
        for step in range(8):
            it.position = step
            mgr.save(step, _state(step), iterators={"train": it})
        mgr.wait()
        it.position = 0
        got = mgr.restore(target={"w": SHARDING, "v": None}, iterators={"train": it})
        assert mgr.restored_from == tier_choice.RestoredFrom("local", 7)
        assert _value(got) == 7 and it.position == 7 and got["w"].sharding == SHARDING


def test_a_complex_leaf_saves_in_both_tiers(tmp_path):
    with _tiered(tmp_path) as mgr:
        for step in range(6):
            mgr.save(step, {**_state(step), "c": complex(step, -1)})
        mgr.wait()
        got = mgr.restore(target={**_target(), "c": None})
        assert mgr.restored_from.tier == "local" and got["c"] == complex(5, -1)
        assert mgr.restore(5)["c"] == complex(5, -1)


# 9. Errors tell the truth -------------------------------------------------------------------------


def test_a_manager_budget_too_small_names_the_manager_argument(tmp_path):
    state = {"x": np.zeros(1 << 18, np.float32)}  # one 1 MiB chunk
    with jaxckpt.CheckpointManager(tmp_path, max_host_bytes=64 << 10) as mgr:
        with pytest.raises(
            jaxckpt.CheckpointError, match=r"CheckpointManager\(max_host_bytes=6553"
        ) as e:
            mgr.save(1, state)
        assert "planner=" not in str(e.value) and "'x'" in str(e.value)
        assert mgr.should_save(1)  # nothing was saved: the step may be saved again
        assert mgr.all_steps() == []


def test_a_deadline_message_does_not_claim_an_uncommitted_commit():
    from jaxckpt._storage import location

    class Never:
        def result(self, timeout=None):
            raise TimeoutError

        def cancel(self):
            return True

        def done(self):
            return False

    loc = location.Location("memory://deadline")
    loc.io_timeout = 0.01
    with pytest.raises(jaxckpt.CheckpointError, match="before its commit has not committed"):
        location.wait(Never(), loc, "writing manifest.json")


# The restore's log line names the one condition that failed (issue 56.3) -------------------------


def test_the_restore_log_names_why_the_local_tier_was_not_used(tmp_path, caplog):
    with _tiered(tmp_path) as mgr:
        for step in range(3):
            mgr.save(step, _state(step))
        mgr.wait()
        cases = [
            (dict(target=None), "restore() was given no target"),
            (dict(target=_target(), keys="w"), "keys= or planner= were given"),
            (dict(target={**_target(), "v": 0.0}), "leaves are not all jax.Arrays"),
        ]
        for kwargs, why in cases:
            caplog.clear()
            with caplog.at_level(logging.INFO, logger="jaxckpt"):
                mgr.restore(**kwargs)
            assert mgr.restored_from.tier == "persistent"
            line = [r.getMessage() for r in caplog.records if "persistent tier" in r.getMessage()]
            assert line and why in line[0], (why, line)
            others = {w for _, w in cases} - {why}
            assert not any(o in line[0] for o in others)


KILL_MID_ROLLBACK = """
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import numpy as np
import jaxckpt
from jaxckpt._manager.run import Run

run = sys.argv[1]
with jaxckpt.CheckpointManager(run) as mgr:
    for step in (3, 6, 9, 12):
        mgr.save(step, {"w": np.full(4, step, np.float32)})
    mgr.wait()
real = Run.delete
def delete_then_die(self, step, *steps):  # the process dies right after deleting the newest step
    real(self, step, *steps)
    os._exit(17)
Run.delete = delete_then_die
mgr = jaxckpt.CheckpointManager(run)
mgr.rollback(6)
"""


def test_a_rollback_killed_midway_leaves_the_old_branch_and_can_be_run_again(tmp_path):
    """A process killed inside ``rollback(6)`` (after deleting step 12, before step 9): the
    restarted run holds only steps of the abandoned branch up to the rollback point (docs/
    manager.md: deleted newest first), refuses a save of the new branch naming the rollback,
    and ``rollback(6)`` run again finishes it; the new branch then survives a restart."""
    run = str(tmp_path / "run")
    done = subprocess.run([sys.executable, "-c", KILL_MID_ROLLBACK, run], timeout=300)
    assert done.returncode == 17  # killed midway, not finished
    with jaxckpt.CheckpointManager(run) as mgr:
        assert mgr.all_steps() == [3, 6, 9]  # the newest went first; 9 and the point remain
        with pytest.raises(jaxckpt.CheckpointExistsError, match=r"\[9\].*rollback\(6\)"):
            mgr.save(7, {"w": np.full(4, 7, np.float32)})
        assert mgr.rollback(6) == [9]
        mgr.save(7, {"w": np.full(4, 7, np.float32)})
    with jaxckpt.CheckpointManager(run) as mgr:
        assert mgr.all_steps() == [3, 6, 7]
        assert mgr.restore()["w"].tolist() == [7.0] * 4
