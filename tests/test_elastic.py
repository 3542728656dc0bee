"""Elastic recovery (issue 46): a local step restored onto another process count or mesh.

The plan (``jaxckpt._tiers.elastic.plan``, a pure function) is checked here against its
promises on small layouts: every needed byte arrives exactly once, no box is read twice, and
nothing crosses between processes that its destination holds. A single-process manager
restores its local step onto another mesh and onto bare ``Sharding`` leaves. The multi-process
cases (4 -> 2 processes with ``local_replicas=2``, 2 -> 4 with empty disks, a process killed
during an elastic restore, a sender killed mid-stream and seen dead by its heartbeat) run in
real ``jax.distributed`` groups (``tests/tiers_worker.py``, stages ``el_*``); 4 -> 4 onto
another mesh is ``test_tiers.py``'s (d). Issue 54: process 0's shares are per layout (their
size does not grow with the leaves) and a description naming groups it lacks is refused.
"""

from __future__ import annotations

import base64
import itertools
import json
import logging
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from groups import run_group
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import jaxckpt
from jaxckpt._tiers import elastic, tier_choice

WORKER = Path(__file__).with_name("tiers_worker.py")


def _rows(n: int, rows: int, cols: int) -> list:
    """``n`` boxes of whole rows tiling ``(rows, cols)``."""
    return [((q * rows // n, 0), (rows // n, cols)) for q in range(n)]


def _grid(a: int, b: int, shape: tuple) -> list:
    """The ``a x b`` grid of boxes tiling ``shape``."""
    h, w = shape[0] // a, shape[1] // b
    return [((i * h, j * w), (h, w)) for i in range(a) for j in range(b)]


def _check(plans: dict, saved: dict, holders: dict, needs: dict) -> dict:
    """The plan's promises; returns the bytes moved between processes per leaf (elements)."""
    held = {
        (i, b): {h for q, boxes in saved[i].items() if b in boxes for h in holders[q]}
        for i in saved
        for boxes in saved[i].values()
        for b in boxes
    }
    got: dict = {}  # (process, leaf, target #) -> elements received or kept
    moved: dict = {}
    reads = set()
    for reader, plan in plans.items():
        for r in plan.reads:
            assert reader in held[(r.leaf, r.box)], "a box read where it is not held"
            assert (reader, r.leaf, r.box) not in reads, "a box read twice by one process"
            reads.add((reader, r.leaf, r.box))
            for c in r.pieces:
                assert elastic.intersect(c.region, r.box) == c.region
                if c.process != reader:
                    assert c.process not in held[(r.leaf, r.box)], "sent to a holder"
                    moved[r.leaf] = moved.get(r.leaf, 0) + elastic.volume(c.region)
                key = (c.process, r.leaf, c.target)
                got[key] = got.get(key, 0) + elastic.volume(c.region)
        for h, incoming in plan.incoming.items():
            for r in incoming:  # the receiver's view is the sender's, restricted to it
                assert all(c.process == reader for c in r.pieces)
                assert any(r.box == s.box and r.leaf == s.leaf for s in plans[h].reads)
    # Each box is read once for all the processes that lack it: at most one reader per box
    # apart from the holders that need it themselves.
    for i, b in held:
        readers = {p for p, leaf, box in reads if (leaf, box) == (i, b)}
        needing = {p for p in needs if any(elastic.intersect(b, t) for t in needs[p].get(i, ()))}
        assert len(readers - needing) <= 1
    for p in needs:
        for i, boxes in needs[p].items():
            for k, t in enumerate(boxes):
                assert got.get((p, i, k), 0) == elastic.volume(t), "a target box not filled once"
    return moved


def test_plan_four_to_two_moves_only_what_each_lacks():
    # 4 old processes saved rows; replicas=2: new process 0 holds parts 0, 3, 2, process 1
    # parts 1, 0, 3 (the disks of old processes 0 and 1). Target: a 2 x 2 grid.
    shape = (16, 8)
    saved = {0: {q: [b] for q, b in enumerate(_rows(4, *shape))}}
    holders = {0: [0, 1], 1: [1], 2: [0], 3: [0, 1]}
    grid = _grid(2, 2, shape)
    needs = {0: {0: grid[:2]}, 1: {0: grid[2:]}}
    plans = elastic.plan({0: shape}, saved, holders, needs, {0: 4})
    moved = _check(plans, saved, holders, needs)
    # Process 0 needs rows 0-7 (part 1's rows 4-7 only process 1 holds), process 1 rows 8-15
    # (part 2's rows 8-11 only process 0 holds): 2 x 4 rows x 8 columns move, nothing else.
    assert moved == {0: 2 * 4 * 8}
    assert [r.part for r in plans[0].reads] == [0, 2] and [r.part for r in plans[1].reads] == [
        1,
        3,
    ]


def test_plan_reads_a_box_once_for_all_who_lack_it_and_spreads_the_sending():
    shape = (32, 4)
    saved = {0: {q: [b] for q, b in enumerate(_rows(2, *shape))}}
    holders = {0: [0, 1], 1: [0, 1]}  # both parts on both old disks; two new empty processes
    needs = {p: {0: [b]} for p, b in enumerate(_rows(4, *shape))}  # 4 processes, 8 rows each
    plans = elastic.plan({0: shape}, saved, holders, needs, {0: 4})
    _check(plans, saved, holders, needs)
    # Processes 2 and 3 both need part 1, which neither holds: one holder reads it once and
    # sends each its rows.
    assert plans[2].incoming.keys() == plans[3].incoming.keys() == {0}
    assert len([r for p in (0, 1) for r in plans[p].reads if r.part == 1]) == 1
    # Two boxes that only new processes need go out from different holders.
    needs = {2: {0: [_rows(2, *shape)[0]]}, 3: {0: [_rows(2, *shape)[1]]}}
    plans = elastic.plan({0: shape}, saved, holders, needs, {0: 4})
    _check(plans, saved, holders, needs)
    assert plans[2].incoming.keys() == {0} and plans[3].incoming.keys() == {1}


@pytest.mark.parametrize("seed", range(6))
def test_plan_random_holders_and_grids(seed):
    rng = np.random.default_rng(seed)
    shape = (24, 12)
    old, new = int(rng.integers(1, 5)), int(rng.integers(1, 5))
    saved = {0: {}, 1: {}}
    for q, b in enumerate(_grid(old, 1, shape)):
        saved[0][q] = [b]
    for q in range(old):  # leaf 1: replicated, every part holds the whole array
        saved[1][q] = [((0, 0), shape)]
    holders = {q: sorted({int(h) for h in rng.integers(0, new, 2)}) for q in range(old)}
    cells = _grid(new, 2, shape)
    needs = {p: {0: cells[2 * p : 2 * p + 2], 1: [((0, 0), shape)]} for p in range(new)}
    plans = elastic.plan({0: shape, 1: shape}, saved, holders, needs, {0: 4, 1: 2})
    _check(plans, saved, holders, needs)
    # The replicated leaf is read from one part by each process that holds one, once.
    for plan in plans.values():
        assert len([r for r in plan.reads if r.leaf == 1]) <= 1


def test_plan_refuses_boxes_that_do_not_tile_or_that_nobody_holds():
    shape = (8, 4)
    rows = _rows(2, *shape)
    needs = {0: {0: [((0, 0), shape)]}}
    overlap = {0: {0: [rows[0]], 1: [((2, 0), (6, 4))]}}
    with pytest.raises(ValueError, match="do not tile"):
        elastic.plan({0: shape}, overlap, {0: [0], 1: [0]}, needs, {0: 4})
    gap = {0: {0: [rows[0]]}}
    with pytest.raises(ValueError, match="do not tile"):
        elastic.plan({0: shape}, gap, {0: [0]}, needs, {0: 4})
    outside = {0: {0: [rows[0], ((4, 0), (8, 4))]}}
    with pytest.raises(ValueError, match="do not tile"):
        elastic.plan({0: shape}, outside, {0: [0]}, needs, {0: 4})
    whole = {0: {0: [rows[0]], 1: [rows[1]]}}
    with pytest.raises(ValueError, match="held by no process"):
        elastic.plan({0: shape}, whole, {0: [0], 1: []}, needs, {0: 4})


def test_plan_json_round_trip_and_slabs_cover_the_box():
    shape = (16, 8)
    saved = {0: {q: [b] for q, b in enumerate(_rows(4, *shape))}}
    needs = {0: {0: _grid(2, 2, shape)[:2]}, 1: {0: _grid(2, 2, shape)[2:]}}
    plans = elastic.plan({0: shape}, saved, {q: [q % 2] for q in range(4)}, needs, {0: 4})
    for plan in plans.values():
        assert elastic.plan_from_json(plan.to_json()) == plan
    box = ((2, 1, 0), (5, 3, 7))
    for limit in (1, 4, 28, 100, 10**6):
        cut = elastic.slabs(box, 4, limit)
        assert sum(elastic.volume(s) for s in cut) == elastic.volume(box)
        assert all(elastic.volume(s) * 4 <= max(limit, 4) for s in cut)
        for a, b in itertools.combinations(cut, 2):
            assert elastic.intersect(a, b) is None


def test_plan_for_a_thousand_processes_is_linear_in_the_boxes():
    # 1,000 old processes saved rows of a (1000 x 1024) leaf; 500 new ones need 2 rows each
    # of another layout; every part has 2 holders. Each box is read once.
    n_old, n_new, shape = 1000, 500, (1000, 1024)
    saved = {0: {q: [((q, 0), (1, 1024))] for q in range(n_old)}}
    holders = {q: [q % n_new, (q + 1) % n_new] for q in range(n_old)}
    needs = {p: {0: [((2 * ((p + 7) % n_new), 0), (2, 1024))]} for p in range(n_new)}
    plans = elastic.plan({0: shape}, saved, holders, needs, {0: 4})
    reads = sum(len(p.reads) for p in plans.values())
    assert reads == n_old
    assert math.prod(shape) == sum(
        elastic.volume(c.region) for p in plans.values() for r in p.reads for c in r.pieces
    )


# -- single process: another mesh, bare shardings -------------------------------------------


def _state(step: int) -> dict:
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
    w = jnp.arange(64 * 32, dtype=jnp.float32).reshape(64, 32) + step
    return {
        "w": jax.device_put(w, NamedSharding(mesh, PartitionSpec("a", "b"))),
        "b": jax.device_put(jnp.full(16, step, jnp.bfloat16), NamedSharding(mesh, PartitionSpec())),
        "key": jax.random.key(step),
        "host": np.arange(3) + step,
        "step": step,
    }


def _bytes(x) -> bytes:
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x).tobytes()


def test_local_step_onto_another_mesh_and_bare_shardings(tmp_path, caplog):
    kw = dict(save_interval_steps=5, local_directory=tmp_path / "local")
    other = Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))
    want = _state(6)
    with jaxckpt.CheckpointManager(tmp_path / "ckpt", **kw) as mgr:
        for step in range(7):
            mgr.save(step, _state(step))
        mgr.wait()
        bare = {
            "w": NamedSharding(other, PartitionSpec("b", "a")),
            "b": NamedSharding(other, PartitionSpec("a")),
            "key": want["key"].sharding,
            "host": None,
            "step": None,
        }
        with caplog.at_level(logging.INFO, logger="jaxckpt"):
            got = mgr.restore(target=bare)
        assert mgr.restored_from == tier_choice.RestoredFrom("local", 6, resharded_from=1)
        assert "restored step 6 from the local tier (resharded" in caplog.text
        for key in ("w", "b", "key"):
            assert got[key].sharding == bare[key] and _bytes(got[key]) == _bytes(want[key])
        assert got["step"] == 6 and got["host"].tolist() == [6, 7, 8]
        abstract = {
            **bare,
            "w": jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=bare["w"]),
        }
        got = mgr.restore(target=abstract)
        assert mgr.restored_from.resharded_from == 1 and _bytes(got["w"]) == _bytes(want["w"])
        arrays = {**abstract, "w": jax.device_put(jnp.zeros((64, 32)), bare["w"])}  # jax.Array
        got = mgr.restore(target=arrays)
        assert mgr.restored_from.resharded_from == 1 and _bytes(got["w"]) == _bytes(want["w"])
        # A target that does not fit the step (another dtype) falls back, with the reason.
        wrong = {**abstract, "w": jax.ShapeDtypeStruct((64, 32), jnp.int32, sharding=bare["w"])}
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="jaxckpt"):
            with pytest.raises(jaxckpt.CheckpointError):
                mgr.restore(target=wrong)  # the persistent step does not fit it either
        assert "the target is int32[64, 32], the local step float32[64, 32]" in caplog.text


# -- multi-process ------------------------------------------------------------------------------


GROUP_TIMEOUT_S = 240


def _ok(records: list, check: str) -> None:
    for p, r in enumerate(records):
        got = r["checks"].get(check, "not run")
        assert got == "ok", f"check {check!r} on process {p}:\n{got}"


def _data(records: list, name: str) -> list:
    return [r["data"].get(name) for r in records]


@pytest.fixture(scope="module")
def elastic_job(tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("elastic")
    out = {}
    for stage, n in (("el_train", 4), ("el_two", 2), ("el_four", 4), ("el_kill", 4)):
        out[stage] = run_group(WORKER, stage, n, work, GROUP_TIMEOUT_S)
    return out


def test_four_to_two_processes_restore_the_newest_local_step(elastic_job):
    two = elastic_job["el_two"]
    _ok(elastic_job["el_train"], "train")
    _ok(two, "el_sds")
    # Local step 7 (persistent: 5), saved by 4, resharded onto a (2, 2) mesh of 2 processes.
    assert _data(two, "el_sds") == [["local", 7, []]] * 2
    assert _data(two, "el_sds_resharded") == [4] * 2
    # Each process holds 3 of the 4 parts: only what it lacks moves, each box read once.
    moved = _data(two, "el_sds_stats")
    assert all(m["sent"] > 0 and m["received"] > 0 for m in moved)
    assert sum(m["sent"] for m in moved) == sum(m["received"] for m in moved)
    assert all(m["received"] < m["needed"] for m in moved)
    _ok(two, "el_bare")
    assert _data(two, "el_bare") == [["local", 7, []]] * 2


def test_a_process_dying_in_an_elastic_restore_makes_the_others_fall_back(elastic_job):
    two = elastic_job["el_two"]
    assert two[1]["data"].get("killed"), "process 1 was not killed"
    _ok(two[:1], "el_die")
    assert two[0]["data"]["el_die"] == ["persistent", 5, []]
    assert any("processes [1] did not report (dead?)" in m for m in two[0]["data"]["el_die_log"])


def test_two_to_four_processes_with_empty_disks(elastic_job):
    four = elastic_job["el_four"]
    _ok(four, "el_grow")
    # Step 8 was saved by the 2 processes; processes 2 and 3 start with empty disks.
    assert _data(four, "el_grow") == [["local", 8, []]] * 4
    assert _data(four, "el_grow_resharded") == [2] * 4
    assert [m["read"] for m in _data(four, "el_grow_stats")][2:] == [0, 0]


def test_a_sender_killed_mid_stream_is_seen_dead_and_all_fall_back(elastic_job):
    # Process 1 dies as it sends its first piece to processes 2 and 3: they see it dead by
    # its heartbeat within the I/O deadline (5 s here) and every survivor falls back to the
    # persistent step, long before JAXCKPT_SYNC_TIMEOUT (90 s here) would have passed.
    group = elastic_job["el_kill"]
    killed = group[1]["data"].get("killed")
    assert killed, "process 1 was not killed"
    for p in (0, 2, 3):
        _ok(group[p : p + 1], "el_kill")
        assert group[p]["data"]["el_kill"] == ["persistent", 5, []]
    after = max(group[p]["data"]["el_kill_end"] for p in (0, 2, 3)) - killed
    restore = max(group[p]["data"]["el_kill_s"] for p in (0, 2, 3))
    print(f"\nkilled sender: all fell back {after:.1f} s after the kill (restore {restore:.1f} s)")
    assert after < 60, f"the fallback took {after:.0f} s: it waited for JAXCKPT_SYNC_TIMEOUT"


def test_a_part_whose_boxes_do_not_tile_falls_back_with_the_reason(tmp_path, caplog):
    # A hostile (or damaged) description on disk: part 0 of step 6 lists one box of "w" less.
    import dataclasses

    from jaxckpt._tiers import local_part

    kw = dict(save_interval_steps=5, local_directory=tmp_path / "local")
    with jaxckpt.CheckpointManager(tmp_path / "ckpt", **kw) as mgr:
        for step in range(7):
            mgr.save(step, _state(step))
        mgr.wait()
        path = next((tmp_path / "local").glob("jaxckpt-*/p0/00000006/part-0-of-1"))
        info = local_part.read_info(path)
        snap = local_part.snapshot(_state(6), step=6, save=info.save, process=0, count=1)
        i = [li.key for li in snap.info.leaves].index("w")
        leaves = list(snap.info.leaves)
        leaves[i] = dataclasses.replace(leaves[i], boxes=leaves[i].boxes[:-1])
        snap.info = dataclasses.replace(snap.info, leaves=tuple(leaves))
        del snap.copies[(i, len(leaves[i].boxes))]
        local_part.write_part(path, snap, overwrite=True)
        other = Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))
        target = {
            "w": NamedSharding(other, PartitionSpec("b", "a")),
            "b": NamedSharding(other, PartitionSpec()),
            "key": _state(0)["key"].sharding,
            "host": None,
            "step": None,
        }
        with caplog.at_level(logging.INFO, logger="jaxckpt"):
            got = mgr.restore(target=target)
        assert mgr.restored_from == tier_choice.RestoredFrom("persistent", 5)
        assert got["step"] == 5 and _bytes(got["w"]) == _bytes(_state(5)["w"])
        assert "the saved boxes do not tile the array" in caplog.text


def test_plan_leaves_of_one_layout_are_planned_once_and_each_still_moves():
    shape = (16, 8)
    rows = _rows(4, *shape)
    saved = {i: {q: [b] for q, b in enumerate(rows)} for i in range(3)}
    saved[2] = {q: [((q * 4, 0), (4, 8))] for q in range(4)}  # the same boxes: one layout
    holders = {0: [0, 1], 1: [1], 2: [0], 3: [0, 1]}
    grid = _grid(2, 2, shape)
    needs = {0: {i: grid[:2] for i in range(3)}, 1: {i: grid[2:] for i in range(3)}}
    plans = elastic.plan(dict.fromkeys(range(3), shape), saved, holders, needs, {0: 4, 1: 4, 2: 4})
    assert _check(plans, saved, holders, needs) == {i: 2 * 4 * 8 for i in range(3)}
    for plan in plans.values():  # leaf by leaf, each leaf's reads alike
        assert [r.leaf for r in plan.reads] == sorted(r.leaf for r in plan.reads)
        per_leaf = {
            i: [(r.part, r.box, r.pieces) for r in plan.reads if r.leaf == i] for i in range(3)
        }
        assert per_leaf[0] == per_leaf[1] == per_leaf[2]


def _posted(parts: int, leaves: int, of=None) -> dict:
    """What the holders post for ``leaves`` row-sharded (16 x 4) leaves of one layout saved
    by ``parts`` processes, process ``q`` holding part ``q``."""
    from jaxckpt._tiers import elastic_restore

    data = dict.fromkeys(range(leaves), ("float32", ()))
    posted = {}
    for q, b in enumerate(_rows(parts, 16, 4)):
        desc = elastic_restore.part_description([[b]] * leaves, data)
        if of is not None:
            desc["of"] = of
        posted[q] = {"parts": {str(q): desc}}
    posted[0]["leaves"] = [[f"w{i}", "array", [16, 4], "float32", ""] for i in range(leaves)]
    return {p: json.dumps(v) for p, v in posted.items()}


def test_shares_are_per_layout_not_per_leaf():
    # 10 or 1,000 leaves of one layout: each process's share is the same size; only the
    # verdict's list of leaves grows, and each process expands its share to every leaf.
    from jaxckpt._tiers import elastic_moves, elastic_restore

    def wanted(got):  # process p needs rows 8p..8p+7 of every leaf
        return [0] * len(got), [{p: [((8 * p, 0), (8, 4))] for p in range(2)}]

    holders = {q: [q % 2] for q in range(4)}
    sizes = {}
    for n in (10, 1000):
        common, own = elastic_restore.plan_shares(_posted(4, n), holders, wanted, 2)
        sizes[n] = [len(own[p]) for p in range(2)]
        leaves, plan, needs = elastic_moves.share_of(json.loads(common), own[1])
        assert len(leaves) == n and sorted(needs) == list(range(n))
        # Process 1 holds parts 1 and 3 (rows 4-7, 12-15) and needs rows 8-15: part 3 from
        # its own disk, part 2's rows from process 0; it reads part 1 for process 0. Leaf by
        # leaf, for every leaf.
        assert [(r.leaf, r.part) for r in plan.reads] == [(i, q) for i in range(n) for q in (1, 3)]
        assert [(r.leaf, r.part) for r in plan.incoming[0]] == [(i, 2) for i in range(n)]
    assert sizes[10] == sizes[1000]


def test_a_description_naming_groups_it_lacks_is_refused():
    from jaxckpt._tiers import elastic_restore

    def wanted(got):
        return [0] * len(got), [{0: [((0, 0), (16, 4))]}]

    bad = base64.b64encode(np.array([0, 7], "<i4").tobytes()).decode()
    with pytest.raises(jaxckpt.CheckpointError, match="names groups it does not have"):
        elastic_restore.plan_shares(_posted(2, 2, of=bad), {0: [0], 1: [0]}, wanted, 1)
    with pytest.raises(jaxckpt.CheckpointError, match="describes 1 leaves, not 2"):
        elastic_restore.plan_shares(_posted(2, 2, of="AAAAAA=="), {0: [0], 1: [0]}, wanted, 1)
    with pytest.raises(jaxckpt.CheckpointError, match="not what jaxckpt posts"):
        elastic_restore.plan_shares(_posted(2, 2, of="!!"), {0: [0], 1: [0]}, wanted, 1)
