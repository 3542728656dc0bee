"""Ordinary sequences that must never lose or mix a committed checkpoint (issue 41).

Each test is one sequence a user or operator runs (overwrite, rollback, a second manager on the
same run, a failing disk or server) on real storage: local files, ``memory://`` (an object store
without a server) and S3 (moto on 127.0.0.1), and checks that every committed checkpoint still
restores bit-exactly to what was saved last under its name. Each failed before this issue's
fixes; tests/test_model.py searches the space of such sequences at random.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import uuid

import jax.numpy as jnp
import numpy as np
import pytest
import tensorstore as ts
from helpers import assert_tree_equal, one_array_per_leaf  # noqa: F401 (autouse)
from http_proxy import Proxy
from test_s3 import BUCKET, keys, s3  # noqa: F401 (fixtures)

import jaxckpt
from jaxckpt._manager import run_index
from jaxckpt._runtime.pools import settle
from jaxckpt._storage import catalog, local_commit
from jaxckpt._storage.location import Location, kvstore


def _frozen_and_moving(k: float) -> dict:
    """A fine-tuning state: ``frozen`` never changes (an incremental step references it on an
    object store), ``w`` does."""
    return {"frozen": jnp.arange(300_000, dtype=jnp.float32), "w": jnp.full(16, k), "k": k}


@pytest.fixture(params=["memory", "s3"])
def store(request) -> str:
    """A fresh object-store prefix: ``memory://`` or S3 (moto)."""
    return _store(request, request.param)


def _store(request, kind: str) -> str:
    if kind == "s3":
        request.getfixturevalue("s3")
        return f"s3://{BUCKET}/rel-{uuid.uuid4().hex[:8]}"
    return f"memory://rel-{uuid.uuid4().hex[:8]}"


# 1. An object-store overwrite of a checkpoint that records digests ------------------------


def test_overwrite_with_digests_on_an_object_store_keeps_the_new_one_whole(store):
    path = f"{store}/a"
    w = jnp.arange(16.0)
    jaxckpt.save(path, {"w": w}, digests=True)
    jaxckpt.save(path, {"w": w * 2}, digests=True, overwrite=True)
    assert_tree_equal(jaxckpt.restore(path), {"w": np.asarray(w * 2)})
    m = jaxckpt.metadata(path)
    assert set(m.digests) == {m.entries["w"].path}  # moved into the new generation with it
    jaxckpt.save(path, {"w": w * 3}, digests=True, overwrite=True)  # and once more
    assert_tree_equal(jaxckpt.restore(path), {"w": np.asarray(w * 3)})


# 2. Rollback on an object store with incremental steps -------------------------------------


@pytest.mark.parametrize("policy", ["keep-1", "keep-all", "best-2"])
def test_rollback_on_an_object_store_keeps_every_committed_step(store, policy):
    kwargs = {"keep-1": {"max_to_keep": 1}, "keep-all": {}}.get(
        policy, {"max_to_keep": 2, "best_fn": lambda m: m["loss"]}
    )
    mgr = jaxckpt.CheckpointManager(store, incremental=True, async_save=False, **kwargs)
    mgr.save(1, _frozen_and_moving(1.0), metrics={"loss": 5.0})
    mgr.save(2, _frozen_and_moving(2.0), metrics={"loss": 4.0})
    mgr.save(3, _frozen_and_moving(3.0), metrics={"loss": 3.0})
    assert _refs(store, 3) == ["../00000001/arrays/frozen"]  # no copy: step 1 holds it
    if policy == "keep-all":  # step 1 retired by hand, as retention does: its manifest goes,
        catalog.delete(Location(f"{store}/00000001"))  # and its marker in the run's index
        run_index.unmark(Location(store), [1])
    assert 1 not in mgr.all_steps()
    mgr.restore(3)  # resume from step 3 but save step 1 again: into the prefix with kept arrays
    with pytest.raises(jaxckpt.CheckpointExistsError, match=r"older than steps.*3\].*rollback"):
        mgr.save(1, _frozen_and_moving(9.0), metrics={"loss": 0.5})  # refused: a newer step
    # An operator's plain save into the run: the prefix holds arrays step 3 references.
    path = f"{store}/00000001"
    jaxckpt.save(path, _frozen_and_moving(9.0), base=f"{store}/00000003", digests=True)
    assert 1 not in mgr.all_steps()  # below the run index's newest step: not in it
    mgr.reload()  # lists the run whole once and indexes it
    assert 1 in mgr.all_steps()
    assert not any(t.startswith("../00000001/") for t in _refs(store, 1))  # never itself
    for step in mgr.all_steps():
        want = 9.0 if step == 1 else float(step)
        assert_tree_equal(mgr.restore(step), _host(_frozen_and_moving(want)))
    assert 3 in mgr.all_steps()


def test_an_incremental_step_whose_base_was_deleted_by_hand_saves_on_an_older_one(store):
    """The manager takes its newest step as the base without looking first (its manifest is
    read beside the save's lease); one whose objects an operator deleted is found missing
    there, and the step is saved again on the newest step still listed."""
    mgr = jaxckpt.CheckpointManager(store, incremental=True, async_save=False)
    mgr.save(1, _frozen_and_moving(1.0))
    mgr.save(2, _frozen_and_moving(2.0))
    mgr.wait()
    loc = Location(store)
    gone = ts.KvStore.KeyRange("00000002/", "00000002/\xff")  # an operator's delete
    kvstore(loc.kvstore, loc).delete_range(gone).result()
    mgr.save(3, _frozen_and_moving(3.0))  # no error: based on step 1
    assert _refs(store, 3) == ["../00000001/arrays/frozen"]
    assert_tree_equal(mgr.restore(3), _host(_frozen_and_moving(3.0)))
    assert 2 not in mgr.all_steps()
    mgr.close()


def _refs(store: str, step: int) -> list[str]:
    return list(jaxckpt.metadata(f"{store}/{step:08d}").refs.values())


def _host(tree: dict) -> dict:
    return {k: np.asarray(v) if hasattr(v, "shape") else v for k, v in tree.items()}


# 3. Overwriting a checkpoint that others reference -----------------------------------------


def _overwrite_a_base(root: str) -> None:
    t1, t2 = _frozen_and_moving(1.0), _frozen_and_moving(2.0)
    # with digests: an object per chunk, which 2 references (a plain save's data objects are
    # not referenced); the overwrites of 1 are plain saves
    jaxckpt.save(f"{root}/1", t1, digests=True)
    jaxckpt.save(f"{root}/2", t1, base=f"{root}/1")
    jaxckpt.save(f"{root}/1", t2, overwrite=True)
    assert_tree_equal(jaxckpt.restore(f"{root}/2"), _host(t1))
    assert_tree_equal(jaxckpt.restore(f"{root}/1"), _host(t2))
    jaxckpt.save(f"{root}/1", t1, overwrite=True)  # and again: still nothing of 2 goes
    assert_tree_equal(jaxckpt.restore(f"{root}/2"), _host(t1))
    catalog.delete(Location(f"{root}/2"))  # once 2 is gone its hold on 1 goes too
    jaxckpt.save(f"{root}/1", t2, overwrite=True)
    assert_tree_equal(jaxckpt.restore(f"{root}/1"), _host(t2))


def test_overwriting_a_base_keeps_what_other_checkpoints_reference(store):
    _overwrite_a_base(store)


def test_overwriting_a_base_on_a_local_disk_keeps_the_linked_step(tmp_path):
    _overwrite_a_base(str(tmp_path))  # hard links: the other step holds its own names


def test_overwriting_a_base_on_s3_leaves_only_what_is_referenced(s3):  # noqa: F811
    prefix = f"rel-{uuid.uuid4().hex[:8]}"
    root = f"s3://{BUCKET}/{prefix}"
    t1, t2 = _frozen_and_moving(1.0), _frozen_and_moving(2.0)
    jaxckpt.save(f"{root}/1", t1, digests=True)  # an object per chunk: referable
    jaxckpt.save(f"{root}/2", _frozen_and_moving(1.5), base=f"{root}/1")  # w changed
    assert "held-by/2" in keys(s3, f"{prefix}/1")
    jaxckpt.save(f"{root}/1", t2, overwrite=True)
    settle()  # the replaced generation goes in the background
    left = keys(s3, f"{prefix}/1")
    old = sorted({k.split("/")[1] for k in left if k.startswith("arrays/")})
    assert old == ["frozen"], left  # of the replaced checkpoint only what 2 references stays
    catalog.delete(Location(f"{root}/2"))
    assert "held-by/2" not in keys(s3, f"{prefix}/1")


# 4. A second manager on the same directory while a save is in flight ----------------------


class _Pause(jaxckpt.DefaultSavePlanner):
    """Stops a save in the middle of its writes until ``go`` is set."""

    def __init__(self) -> None:
        super().__init__(pack_bytes=0)
        self.reached, self.go, self.n = threading.Event(), threading.Event(), 0

    def resolve_data(self, item):
        self.n += 1
        if self.n == 24:  # half of the arrays written
            self.reached.set()
            assert self.go.wait(60)
        return super().resolve_data(item)


@pytest.mark.parametrize("read_only", [False, True])
@pytest.mark.parametrize("where", ["local", "memory", "s3"])
def test_a_second_manager_never_touches_a_live_save(request, tmp_path, where, read_only):
    run = str(tmp_path / "run") if where == "local" else _store(request, where)
    trainer = jaxckpt.CheckpointManager(run, max_to_keep=1, async_save=False)
    trainer.save(0, {"x": np.zeros(4)})
    state = {f"a{i}": np.full(1 << 18, i, np.float32) for i in range(48)}  # 48 x 1 MiB
    pause, errors = _Pause(), []

    def save_step_1() -> None:
        try:
            jaxckpt.save(f"{run}/00000001", state, planner=pause)
        except BaseException as e:  # noqa: BLE001 - checked below
            errors.append(e)

    thread = threading.Thread(target=save_step_1)
    thread.start()
    assert pause.reached.wait(60)
    evaluator = jaxckpt.CheckpointManager(run, read_only=read_only)  # its start-up clean-up
    assert evaluator.all_steps() == [0]  # a save in flight is not listed
    pause.go.set()
    thread.join()
    assert errors == []
    assert evaluator.all_steps() == [0, 1]  # listed afresh on each call
    assert_tree_equal(evaluator.restore(1), state)
    assert_tree_equal(jaxckpt.CheckpointManager(run).restore(1), state)


def test_a_read_only_manager_never_writes(tmp_path, caplog):
    run = tmp_path / "run"
    mgr = jaxckpt.CheckpointManager(run, read_only=True)  # the trainer has not started yet
    assert mgr.all_steps() == [] and not run.exists()
    with jaxckpt.CheckpointManager(run) as trainer:
        trainer.save(3, {"w": np.ones(3)})
    (run / ".00000004.tmp-0123abcd").mkdir()  # a dead save's leftover: not the reader's to clean
    assert mgr.latest_step() == 3
    with pytest.raises(jaxckpt.CheckpointError, match=r"read-only \(read_only=True\).*trainer"):
        mgr.save(4, {"w": np.ones(3)})
    assert sorted(os.listdir(run)) == [".00000004.tmp-0123abcd", "00000003", "metrics.json"]
    with pytest.raises(ValueError, match="read_only manager has no local tier"):
        jaxckpt.CheckpointManager(run, read_only=True, local_directory=tmp_path / "l")


def test_a_dead_saves_leftovers_go_a_live_saves_stay(tmp_path):
    run = tmp_path / "run"
    with jaxckpt.CheckpointManager(run) as mgr:
        mgr.save(1, {"w": np.ones(3)})
    dead = run / ".00000002.tmp-0123abcd"
    dead.mkdir()
    live = run / ".00000003.tmp-89abcdef"
    live.mkdir()
    from jaxckpt._storage.lease import Lease

    lease = Lease.local(live)  # as a save in this or another process holds it
    try:
        jaxckpt.CheckpointManager(run)
        assert sorted(os.listdir(run)) == [".00000003.tmp-89abcdef", "00000001", "metrics.json"]
    finally:
        lease.release()
    jaxckpt.CheckpointManager(run)
    assert sorted(os.listdir(run)) == ["00000001", "metrics.json"]  # with step 1's timings


# 7. One step-name rule --------------------------------------------------------------------


def test_only_step_names_are_steps_and_retention_logs_what_it_deleted(tmp_path, caplog):
    run = tmp_path / "run"
    run.mkdir()
    jaxckpt.save(run / "100", {"w": np.ones(3)})  # not a step name: not a step
    mgr = jaxckpt.CheckpointManager(run, max_to_keep=1, async_save=False)
    assert mgr.all_steps() == []
    with pytest.raises(jaxckpt.CheckpointNotFoundError, match="committed steps: \\[\\]"):
        mgr.restore(100)
    caplog.set_level(logging.INFO, logger="jaxckpt")
    mgr.save(100, {"w": np.ones(3)})
    mgr.save(200, {"w": np.ones(3)})
    assert mgr.all_steps() == [200]
    deleted = [r.getMessage() for r in caplog.records if "deleted step" in r.getMessage()]
    assert deleted == [f"deleted step 100 from {run} (retention)"]
    assert sorted(os.listdir(run)) == ["00000200", "100", "metrics.json"]
    assert catalog.delete(Location(run / "00000100")) is False  # nothing there: nothing said


# 9. Errors that tell the truth -------------------------------------------------------------


def test_eio_from_a_flush_in_a_background_save_is_a_checkpoint_error(tmp_path, monkeypatch):
    jaxckpt.save(tmp_path / "c", {"w": np.zeros(4)})

    def eio(path):
        raise OSError(errno.EIO, "Input/output error", str(path))

    monkeypatch.setattr(local_commit, "syncfs", eio)
    h = jaxckpt.save_async(tmp_path / "c", {"w": np.ones(4)}, overwrite=True)
    for _ in range(2):  # the same error at every wait()
        with pytest.raises(jaxckpt.CheckpointError, match=f"{tmp_path / 'c'}.*Input/output") as e:
            h.wait()
        assert isinstance(e.value.__cause__, OSError) and e.value.__cause__.errno == errno.EIO
    monkeypatch.undo()
    np.testing.assert_array_equal(jaxckpt.restore(tmp_path / "c")["w"], np.zeros(4))


def test_eio_from_fsync_after_the_rename_says_the_checkpoint_is_in_place(tmp_path, monkeypatch):
    real = os.fsync

    def eio(fd):
        if os.path.samefile(f"/proc/self/fd/{fd}", tmp_path):
            raise OSError(errno.EIO, "Input/output error")
        return real(fd)

    monkeypatch.setattr(os, "fsync", eio)
    h = jaxckpt.save_async(tmp_path / "c", {"w": np.ones(4)})
    with pytest.raises(jaxckpt.CheckpointError, match="is in place.*save again") as e:
        h.wait()
    assert isinstance(e.value.__cause__, OSError)


def _proxied_s3(monkeypatch, rule) -> Proxy:
    proxy = Proxy(os.environ["AWS_ENDPOINT_URL"], rule)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    return proxy


def test_a_failed_clean_up_after_the_commit_is_not_a_failed_save(s3, monkeypatch, caplog):  # noqa: F811
    url = f"s3://{BUCKET}/rel-{uuid.uuid4().hex[:8]}"
    jaxckpt.save(url, {"w": np.zeros(4)})
    committed = {"yes": False}

    def rule(method, path):
        if "manifest.json" in path and method == "PUT":
            committed["yes"] = True
        return 403 if committed["yes"] and method in ("DELETE", "POST") else "pass"

    proxy = _proxied_s3(monkeypatch, rule)
    try:
        caplog.set_level(logging.WARNING, logger="jaxckpt")
        jaxckpt.save(url, {"w": np.ones(4)}, overwrite=True)  # no error: it is committed
        settle()  # the clean-up runs after the commit, in the background
    finally:
        proxy.stop()
    np.testing.assert_array_equal(jaxckpt.restore(url)["w"], np.ones(4))
    assert any(url in r.getMessage() and "is committed" in r.getMessage() for r in caplog.records)


def test_a_foreign_object_under_an_old_generation_stays(store):
    path = f"{store}/c"
    jaxckpt.save(path, {"w": np.zeros(4)})
    jaxckpt.save(path, {"w": np.ones(4)}, overwrite=True)  # into a generation gXXXXXXXX/
    gen = jaxckpt.metadata(path).entries["w"].path.split("/")[0]
    kv = _kv(path)
    wrote = threading.Event()

    class Drop(jaxckpt.DefaultSavePlanner):
        def resolve_data(self, item):
            if not wrote.is_set():  # someone else's object appears during the save
                kv.write(f"{gen}/notes.txt", b"mine").result()
                wrote.set()
            return super().resolve_data(item)

    jaxckpt.save(path, {"w": np.full(4, 2.0)}, overwrite=True, planner=Drop())
    np.testing.assert_array_equal(jaxckpt.restore(path)["w"], np.full(4, 2.0))
    assert kv.read(f"{gen}/notes.txt").result().value == b"mine"


def _kv(path: str):
    from jaxckpt._storage.location import kvstore

    loc = Location(path)
    return kvstore(loc.kvstore, loc)
