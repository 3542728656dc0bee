"""The local tier of CheckpointManager (docs/tiers.md): parts, replicas, agreement, recovery.

Single-process tests cover the part format, retention, run identity and the agreement's pure
decision (:func:`choose`). The recovery cases of issue 33.4 run in real ``jax.distributed``
groups on 127.0.0.1 (``tests/tiers_worker.py``), four restarts of one job, each process with
its own local directory and one shared persistent directory:

1. ``train`` (4 processes): steps 0..7; process 3 is killed during its local save of step 8;
2. ``restart`` (4): (a)+(e) local step 7, whole; (b) process 1's local dir wiped: step 7 from
   its peer's replica; steps 8, 9 again; process 2 killed while replicating step 9;
3. ``replaced`` (4, process 2's local dir wiped): (d) another mesh gets local step 8,
   resharded (issue 46; tests/test_elastic.py has the other elastic cases); (e) step 8, part 2
   from its replica; (c) processes 1 and 2 wiped: persistent step 5;
4. ``two`` (2): (d) another process count, parts 1 and 2 held by no one: persistent step 5.

These move replicas peer to peer (``jax.experimental.transfer``, the default). Two more groups:
``kv`` (2) forces the key-value relay (``JAXCKPT_REPLICATION=kv``), recovers a wiped process
from its peer's replica and saves a step again (its replica is replaced, issue 41.5);
``memory`` (2) sends a 200 MiB part by each transport and bounds the peak RSS growth of sender
and receiver by the chunk window, not the part size.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from groups import run_group
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import jaxckpt
from jaxckpt._tiers import local_part, local_run, tier_choice

WORKER = Path(__file__).with_name("tiers_worker.py")
GROUP_TIMEOUT_S = 240


def _run_group(stage: str, n: int, work: Path) -> list[dict]:
    return run_group(WORKER, stage, n, work, GROUP_TIMEOUT_S)


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("tiers")
    out = {"work": work}
    for stage, n in (("train", 4), ("restart", 4), ("replaced", 4), ("two", 2)):
        out[stage] = _run_group(stage, n, work)
    return out


def _ok(records: list[dict], check: str, processes=None) -> None:
    for p in processes if processes is not None else range(len(records)):
        got = records[p]["checks"].get(check, "not run")
        assert got == "ok", f"check {check!r} on process {p}:\n{got}"


def _data(records: list[dict], name: str, processes=None) -> list:
    return [records[p]["data"].get(name) for p in processes or range(len(records))]


def test_steps_per_tier(job):
    _ok(job["train"], "train")
    assert _data(job["train"], "persistent_steps") == [[0, 5]] * 4
    assert _data(job["train"], "local_steps") == [[5, 6, 7]] * 4  # local_max_to_keep=3
    assert _data(job["train"], "all_steps") == [[0, 5, 6, 7]] * 4


def test_a_all_restart_newest_local_step_bit_exact(job):
    _ok(job["restart"], "a")
    assert _data(job["restart"], "a") == [["local", 7, []]] * 4


def test_e_killed_during_local_save_previous_whole_step(job):
    assert job["train"][3]["data"].get("killed"), "process 3 was not killed saving step 8"
    # Step 8 of process 3 was written but not committed: its temporary is removed at start,
    # and every process restores step 7 (test_a).
    assert job["restart"][3]["data"]["tmp_before"], "no temporary of the interrupted save"
    assert job["restart"][3]["data"]["tmp_after"] == []


def test_b_wiped_local_dir_restores_from_peer_replica(job):
    _ok(job["restart"], "b")
    assert _data(job["restart"], "b") == [["local", 7, [1]]] * 4
    assert job["restart"][1]["data"]["b_local_after"] == [7]  # the fetched part is kept


def test_e_killed_during_replication_previous_whole_step(job):
    _ok(job["restart"], "again_8")
    assert job["restart"][2]["data"].get("killed"), "process 2 was not killed replicating"
    _ok(job["replaced"], "e")
    # Step 9's part 2 is lost with process 2's disk and its replica never completed.
    assert _data(job["replaced"], "e") == [["local", 8, [2]]] * 4


def test_c_part_and_its_replica_lost_falls_back_to_persistent(job):
    _ok(job["replaced"], "c")
    assert _data(job["replaced"], "c") == [["persistent", 5, []]] * 4


def test_d_other_mesh_reshards_the_local_step(job):
    # Issue 46: another mesh no longer falls back to the persistent tier. Step 9 lacks part 2
    # (its disk wiped, its replica never completed); step 8's part 2 is on process 3.
    _ok(job["replaced"], "d_mesh")
    assert _data(job["replaced"], "d_mesh") == [["local", 8, []]] * 4
    assert _data(job["replaced"], "d_mesh_resharded") == [4] * 4


def test_d_fewer_processes_without_every_part_use_persistent(job):
    # Processes 0 and 1 of 4 (disk 1 wiped in (c)): parts 1 and 2 are held by no one.
    _ok(job["two"], "d_count")
    assert _data(job["two"], "d_count") == [["persistent", 5, []]] * 2


def test_f_foreign_files_and_other_runs_are_kept(job):
    work = job["work"]
    run = json.loads((work / "persistent" / local_run.RUN_FILE).read_text())["run"]
    for p in (0, 3):  # the local disks of processes 1 and 2 were wiped whole, (b) and (c)
        local = work / "local" / f"p{p}"
        assert (local / "notes.txt").read_text() == "not jaxckpt's"
        assert (local / "jaxckpt-0123456789abcdef" / f"p{p}" / "00000001" / "keep.txt").exists()
        mine = local / f"jaxckpt-{run}" / f"p{p}"
        assert (mine / "00000001" / "foreign.txt").read_text() == "foreign"
        assert not (mine / "00000001" / f"part-{p}-of-4").exists()  # retention took ours
        assert (mine / "00000099" / f"part-{p}-of-4" / "manifest.json").exists()  # never used


def test_replicas_move_peer_to_peer_where_jax_has_a_transfer_server(job):
    # jax.experimental.transfer works from the floor (0.6.2) on: the default is peer to peer.
    # Every process replicated step 8 in `restart`; in `replaced` only the holder of part 2's
    # replica (3) and its receiver (2) moved bytes.
    assert _data(job["restart"], "transport_8") == ["transfer"] * 4
    assert _data(job["replaced"], "transport", [2, 3]) == ["transfer"] * 2


@pytest.fixture(scope="module")
def kv_group(tmp_path_factory) -> list[dict]:
    return _run_group("kv", 2, tmp_path_factory.mktemp("tiers-kv"))


def test_kv_relay_when_forced_replicates_and_recovers_from_peer(kv_group):
    _ok(kv_group, "kv_save")
    _ok(kv_group, "kv_b")
    assert _data(kv_group, "kv_b") == [["local", 1, [1]]] * 2
    assert _data(kv_group, "transport") == ["kv"] * 2  # no transfer server was started


def test_a_step_saved_again_replaces_the_replica_its_peer_holds(kv_group):
    _ok(kv_group, "kv_again")
    assert _data(kv_group, "kv_again") == [["local", 1, [1]]] * 2


def test_replication_host_memory_is_bounded_by_the_window_not_the_part(tmp_path):
    from tiers_worker import PART_MIB

    records = _run_group("memory", 2, tmp_path)
    window, pulled, relayed = records[0]["data"]["chunks"]
    for mode, chunk in (("transfer", pulled), ("kv", relayed)):
        _ok(records, f"memory_{mode}")
        # The sender holds WINDOW chunks offered (in the store on process 0 for the relay),
        # the receiver one being written and one arriving; the allocator's per-thread arenas
        # each keep a freed chunk (at most 8 per core): 8 x the window, plus 48 MiB slack.
        bound = 8 * window * chunk + (48 << 20)
        assert bound < (PART_MIB << 20) * 0.6
        for p, r in enumerate(records):
            got = r["data"][f"growth_{mode}"]
            assert got < bound, f"{mode}: process {p} grew {got >> 20} MiB, bound {bound >> 20}"


# -- single process -------------------------------------------------------------------------


def _state(step: int) -> dict:
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
    w = jnp.arange(64 * 32, dtype=jnp.float32).reshape(64, 32) + step
    return {
        "w": jax.device_put(w, NamedSharding(mesh, PartitionSpec("a", "b"))),
        "r": jax.device_put(jnp.full(16, step, jnp.bfloat16), NamedSharding(mesh, PartitionSpec())),
        "key": jax.random.key(step),
        "host": np.arange(3) + step,
        "step": step,
    }


def _abstract(tree):
    def leaf(x):
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        return None

    return jax.tree.map(leaf, tree)


def _same(got, want) -> None:
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        if isinstance(w, jax.Array) and jax.dtypes.issubdtype(w.dtype, jax.dtypes.prng_key):
            g, w = jax.random.key_data(g), jax.random.key_data(w)
        if isinstance(w, jax.Array):
            assert g.sharding == w.sharding
        assert np.asarray(g).tobytes() == np.asarray(w).tobytes()


def test_part_round_trip_is_a_plain_checkpoint(tmp_path):
    state = _state(3)
    snap = local_part.snapshot(state, step=3, save="s", process=0, count=1)
    local_part.write_part(tmp_path / "part", snap, overwrite=False)
    info = local_part.read_info(tmp_path / "part")
    assert info == snap.info and info.layout == local_part.target_layout(_abstract(state), 1)
    # Sorted keys host, key, r, step, w: values have no boxes, r (replicated) one, w 8.
    assert [len(li.boxes) for li in info.leaves] == [0, 1, 1, 0, 8]
    _same(local_part.rebuild(tmp_path / "part", info, _abstract(state)), state)
    plain = jaxckpt.restore(tmp_path / "part")  # any jaxckpt reader can read a part
    assert set(plain) == {"description", "boxes", "values"}


def test_target_layout_tells_layouts_apart():
    state = _state(0)
    same = local_part.target_layout(_abstract(state), 1)
    assert same == local_part.target_layout(_abstract(_state(5)), 1)
    other = _abstract(state)
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))
    other["w"] = jax.ShapeDtypeStruct(
        (64, 32), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec("a", "b"))
    )
    assert local_part.target_layout(other, 1) != same
    assert local_part.target_layout(_abstract(state), 2) != same  # another process count
    assert local_part.target_layout(None, 1) is None
    assert local_part.target_layout({**_abstract(state), "w": np.zeros(1)}, 1) is None


def test_hostile_part_description_is_ignored(tmp_path):
    snap = local_part.snapshot({"x": jnp.arange(4)}, step=1, save="s", process=0, count=1)
    bad = json.loads(snap.info.to_json())
    bad["leaves"][0]["boxes"] = [[[3], [4]]]  # outside its array
    jaxckpt.save(tmp_path / "bad", {"description": json.dumps(bad), "boxes": {}, "values": {}})
    assert local_part.read_info(tmp_path / "bad") is None
    jaxckpt.save(tmp_path / "other", {"description": "[1, 2]"})
    assert local_part.read_info(tmp_path / "other") is None
    assert local_part.read_info(tmp_path / "absent") is None


def _posted(parts, target="L", persistent=(0,)):
    """What each process posts; ``parts`` per process as ``[step, part, save, layout]``, all
    saved by as many processes as there are now."""
    n = len(parts)
    return {
        p: {
            "parts": [[s, q, n, save, layout] for s, q, save, layout in held],
            "target": target,
            "persistent": list(persistent) if p == 0 else [],
        }
        for p, held in enumerate(parts)
    }


def test_choose_newest_complete_local_step():
    both = [[5, 0, "a", "L"], [5, 1, "a", "L"]]
    c = tier_choice.choose(2, _posted([[both[0]], [both[1]]]))
    assert (c["tier"], c["step"], c["fetch"]) == ("local", 5, {})
    # Part 1 only on process 0: process 1 fetches it from there.
    c = tier_choice.choose(2, _posted([both, []]))
    assert (c["tier"], c["step"], c["fetch"]) == ("local", 5, {"1": 0})
    # Newer but incomplete: the older whole step.
    newer = [[6, 0, "a", "L"]]
    c = tier_choice.choose(2, _posted([[*both, *newer], []]))
    assert (c["tier"], c["step"]) == ("local", 5)


def test_choose_never_mixes_saves_or_layouts():
    mixed = [[[5, 0, "a", "L"]], [[5, 1, "b", "L"]]]  # step 5 saved twice (a restart between)
    c = tier_choice.choose(2, _posted(mixed, persistent=[0]))
    assert (c["tier"], c["step"]) == ("persistent", 0)
    other = [[[5, 0, "a", "M"]], [[5, 1, "a", "M"]]]
    c = tier_choice.choose(2, _posted(other))
    assert (c["tier"], c["step"], c["local_steps"]) == ("persistent", 0, [5])
    c = tier_choice.choose(2, _posted(other, target=None, persistent=[]))
    assert c["tier"] is None and "target has no shardings" in c["why"]


def test_choose_counts_only_the_newest_save_of_a_step():
    old = [[5, 0, "a", "L"], [5, 1, "a", "L"]]  # step 5, saved whole by save "a"
    # Saved again by "b" (later), part 1 lost: step 5 is not whole, "a" is never used.
    parts = [[*old, [5, 0, "b", "L"]], [old[1]]]
    c = tier_choice.choose(2, _posted(parts, persistent=[0]))
    assert (c["tier"], c["step"], c["local_steps"]) == ("persistent", 0, [])
    c = tier_choice.choose(
        2, _posted([[*parts[0], [4, 0, "a", "L"]], [*parts[1], [4, 1, "a", "L"]]])
    )
    assert (c["tier"], c["step"], c["save"], c["local_steps"]) == ("local", 4, "a", [4])
    c = tier_choice.choose(2, _posted(parts, persistent=[]), step=5)
    assert c["tier"] is None and c["why"] == (
        "no complete local step: the parts of processes [1] of local step 5 (saved by 2) are "
        "held by no process"
    )
    # "b" whole too: it wins, and only its holders send.
    parts = [[*old, [5, 0, "b", "L"]], [[5, 1, "b", "L"]]]
    c = tier_choice.choose(2, _posted(parts))
    assert (c["tier"], c["step"], c["save"], c["fetch"]) == ("local", 5, "b", {})
    c = tier_choice.choose(2, _posted([[*old, [5, 0, "b", "L"], [5, 1, "b", "L"]], []]))
    assert (c["save"], c["fetch"]) == ("b", {"1": 0})


def test_choose_prefers_newer_persistent_and_spreads_senders():
    parts = [[[4, q, "a", "L"] for q in range(4)], [], [], []]
    c = tier_choice.choose(4, _posted(parts, persistent=[0, 5]))
    assert (c["tier"], c["step"]) == ("persistent", 5)
    c = tier_choice.choose(4, _posted(parts, persistent=[0, 4]))  # as new: local is faster
    assert (c["tier"], c["step"]) == ("local", 4)
    two_holders = [[[4, 1, "a", "L"], [4, 2, "a", "L"]], [[4, 3, "a", "L"]], [], []]
    two_holders[1] += [[4, 0, "a", "L"], [4, 2, "a", "L"]]
    c = tier_choice.choose(4, _posted(two_holders))
    assert c["fetch"] == {"0": 1, "1": 0, "2": 0, "3": 1}  # part 2 to the less busy holder
    assert tier_choice.choose(4, _posted(parts, persistent=[9]), step=4)["step"] == 4


def test_manager_local_tier_single_process(tmp_path, caplog):
    kw = dict(save_interval_steps=5, local_directory=tmp_path / "local", local_max_to_keep=2)
    with jaxckpt.CheckpointManager(tmp_path / "ckpt", **kw) as mgr:
        for step in range(8):
            assert mgr.save(step, _state(step))
        mgr.wait()
        assert mgr.all_steps("persistent") == [0, 5]
        assert mgr.all_steps("local") == [6, 7]
        assert mgr.all_steps() == [0, 5, 6, 7] and mgr.latest_step() == 7
        with caplog.at_level(logging.INFO, logger="jaxckpt"):
            _same(mgr.restore(target=_abstract(_state(0))), _state(7))
        assert mgr.restored_from == tier_choice.RestoredFrom("local", 7)
        assert "restored step 7 from the local tier" in caplog.text
        # Without shardings the local part cannot be rebuilt: the persistent tier, logged.
        assert mgr.restore()["step"] == 5
        assert mgr.restored_from == tier_choice.RestoredFrom("persistent", 5)
        assert mgr.restore(6, target=_abstract(_state(0)))["step"] == 6
    run = json.loads((tmp_path / "ckpt" / local_run.RUN_FILE).read_text())["run"]
    marker = json.loads((tmp_path / "local" / f"jaxckpt-{run}" / local_run.MARKER).read_text())
    assert marker["persistent"] == str(tmp_path / "ckpt")


def test_a_new_persistent_directory_is_a_new_run(tmp_path):
    kw = dict(local_directory=tmp_path / "local")
    with jaxckpt.CheckpointManager(tmp_path / "a", **kw) as mgr:
        mgr.save(1, _state(1))
    with jaxckpt.CheckpointManager(tmp_path / "b", **kw) as mgr:  # same local dir, other run
        assert mgr.all_steps() == []
        with pytest.raises(jaxckpt.CheckpointNotFoundError, match="or its local tier"):
            mgr.restore(target=_abstract(_state(0)))
    assert len(list((tmp_path / "local").iterdir())) == 2  # the first run's dir is kept


def test_local_step_of_an_earlier_save_is_replaced(tmp_path):
    kw = dict(save_interval_steps=100, local_directory=tmp_path / "local")
    with jaxckpt.CheckpointManager(tmp_path / "ckpt", **kw) as mgr:
        mgr.save(0, _state(0))
        mgr.save(1, _state(1))
    with jaxckpt.CheckpointManager(tmp_path / "ckpt", **kw) as mgr:  # a restart at step 0
        with pytest.raises(jaxckpt.CheckpointExistsError, match="Step 1 is already saved"):
            mgr.save(1, _state(11))
        assert mgr.rollback(0) == [1]
        mgr.save(1, _state(11))
        mgr.wait()
        assert mgr.restore(target=_abstract(_state(0)))["step"] == 11


def test_a_step_saved_again_after_a_rollback_replaces_its_local_part(tmp_path):
    # Issue 41.5: the re-save of step 3 by the same manager was skipped (same save id), and
    # restore() gave the old step 3 from the local tier.
    mesh = Mesh(np.array(jax.devices()), ("a",))

    def state(w: float) -> dict:
        return {"w": jax.device_put(jnp.full((8, 4), w), NamedSharding(mesh, PartitionSpec("a")))}

    target = _abstract(state(0.0))
    kw = dict(save_interval_steps=100, local_directory=tmp_path / "local")
    with jaxckpt.CheckpointManager(tmp_path / "ckpt", **kw) as mgr:
        for step in range(4):
            mgr.save(step, state(float(step)))
        mgr.wait()
        assert float(mgr.restore(0, target=target)["w"][0, 0]) == 0.0
        mgr.rollback(2)
        mgr.save(3, state(1003.0), force=True)
        mgr.wait()
        assert float(mgr.restore(target=target)["w"][0, 0]) == 1003.0
        assert mgr.restored_from == tier_choice.RestoredFrom("local", 3)
