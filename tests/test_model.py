"""A model-based search of the operations users and operators run on a checkpoint directory.

A ``hypothesis`` state machine drives random sequences of saves (blocking, async, incremental
against a base, overwrites), manager saves under a random retention policy (``max_to_keep``,
``keep_every_n_steps``, best-N), rollbacks (restore an older step, delete the newer ones, save
on), deletions by hand (``rm -rf`` of a step, deleting its objects), a second manager (read-only
or not) opened while a save is in flight, failures injected at the writer's tripwires (the user's
planner raising mid-write, the commit's rename or flush failing, the store refusing the
commit), on a local directory, ``memory://`` and S3 (moto on 127.0.0.1). After every step:

* each step the manager lists restores bit-exactly to the state last committed under it;
* a committed step disappears only by retention (the documented policy) or by hand;
* every error the library raises is a ``CheckpointError`` (the user's own exception passes
  through as it is).

CI runs a few short sequences per store (:data:`EXAMPLES`, of up to ``JAXCKPT_MODEL_STEPS``
= 14 steps: about half a minute in all); ``make soak`` runs many more
(``JAXCKPT_MODEL_EXAMPLES`` per store; docs/manager.md, *Testing*).
"""

from __future__ import annotations

import collections
import errno
import os
import shutil
import threading
import uuid
from pathlib import Path

import numpy as np
import pytest
from helpers import assert_tree_equal
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from test_s3 import BUCKET, s3  # noqa: F401 (fixture)

import jaxckpt
from jaxckpt._manager.retention import steps_to_delete
from jaxckpt._storage import local_commit
from jaxckpt._storage.location import Location, kvstore

# Sequences per store: CI's few (about half a minute in all), or JAXCKPT_MODEL_EXAMPLES each.
EXAMPLES = {"local": 30, "memory": 30, "s3": 8}
if os.environ.get("JAXCKPT_MODEL_EXAMPLES"):
    EXAMPLES = dict.fromkeys(EXAMPLES, int(os.environ["JAXCKPT_MODEL_EXAMPLES"]))
STATS: collections.Counter = collections.Counter()  # what ran: sequences, and each rule
STEPS = int(os.environ.get("JAXCKPT_MODEL_STEPS", "14"))
FROZEN = 70_000  # float32 elements: above the packing threshold, so it is its own array


def state(v: int) -> dict:
    """The state saved with value ``v``: ``frozen`` changes every 4 values (incremental saves
    link or reference it), the rest every time."""
    return {
        "frozen": np.arange(FROZEN, dtype=np.float32) + np.float32(v // 4),
        "w": np.full(64, v, np.float32),
        "small": [np.arange(8, dtype=np.int32) * v, np.int64(v)],
        "v": v,
    }


def loss(v: int) -> float:
    return float((v * 7) % 11)


class Trip(jaxckpt.DefaultSavePlanner):
    """The user's planner failing mid-write (its own error passes through)."""

    def resolve_data(self, item):
        raise RuntimeError("tripwire: the planner failed")


class Pause(jaxckpt.DefaultSavePlanner):
    """Holds a save in the middle of its writes until ``go`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.reached, self.go = threading.Event(), threading.Event()

    def resolve_data(self, item):
        self.reached.set()
        assert self.go.wait(60)
        return super().resolve_data(item)


class CheckpointModel(RuleBasedStateMachine):
    """One run directory and a few plain checkpoints beside it, against a model of what was
    committed under each name."""

    root = ""  # set per store by the tests below

    def __init__(self) -> None:
        super().__init__()
        STATS["sequences"] += 1
        self.base = f"{self.root}/{uuid.uuid4().hex[:8]}"
        self.run = f"{self.base}/run"
        self.steps: dict[int, int] = {}  # step -> value last committed
        self.scored: set[int] = set()  # steps saved with metrics (best-N ranks the rest last)
        self.broken: set[int] = set()  # steps a deletion by hand may have broken
        self.plain: dict[str, int] = {}
        self.plain_broken: set[str] = set()
        self.mgr: jaxckpt.CheckpointManager | None = None

    @initialize(
        max_to_keep=st.sampled_from([None, 1, 2, 3]),
        every=st.sampled_from([None, 2, 3]),
        best=st.booleans(),
        incremental=st.booleans(),
        async_save=st.booleans(),
    )
    def open_manager(self, max_to_keep, every, best, incremental, async_save):
        self.policy = {"max_to_keep": max_to_keep, "keep_every_n_steps": every}
        self.best = best and max_to_keep is not None
        self.mgr = jaxckpt.CheckpointManager(
            self.run,
            **self.policy,
            best_fn=(lambda m: m["loss"]) if self.best else None,
            incremental=incremental,
            async_save=async_save,
        )

    # -- the manager ----------------------------------------------------------------------------

    def _doomed(self, steps: list[int], values: dict[int, int], scored: set[int]) -> list[int]:
        def score(s: int) -> float | None:
            return -loss(values[s]) if s in scored else None

        return steps_to_delete(sorted(steps), **self.policy, score=score if self.best else None)

    @rule(step=st.integers(0, 6), v=st.integers(0, 7))
    def manager_save(self, step, v):
        STATS["manager_save"] += 1
        values, scored = {**self.steps, step: v}, self.scored | {step}
        immediately = step not in self.steps and step in self._doomed(list(values), values, scored)
        try:
            self.mgr.save(step, state(v), metrics={"loss": loss(v)}, force=True)
            self.mgr.wait()
        except jaxckpt.CheckpointExistsError:
            assert step in self.steps
            return
        except jaxckpt.CheckpointError as e:
            assert immediately, e  # refused: retention would delete it at once
            return
        assert step not in self.steps and not immediately
        self.steps[step] = v
        self.scored.add(step)
        self.broken.discard(step)
        for gone in self._doomed(list(self.steps), self.steps, self.scored):
            del self.steps[gone]
            self.broken.discard(gone)
            self.scored.discard(gone)

    @precondition(lambda self: self.steps)
    @rule(data=st.data())
    def rollback(self, data):
        """Restore an older step, delete every newer one, save on from it."""
        STATS["rollback"] += 1
        step = data.draw(st.sampled_from(sorted(self.steps)))
        if step not in self.broken:
            assert_tree_equal(self.mgr.restore(step), state(self.steps[step]))
        for newer in [s for s in self.steps if s > step]:
            self.mgr.delete(newer)
            del self.steps[newer]
            self.scored.discard(newer)
        self.broken -= {s for s in self.broken if s > step}

    @precondition(lambda self: self.steps)
    @rule(data=st.data())
    def delete_a_step(self, data):
        """``CheckpointManager.delete``: the step goes, what other steps reference stays."""
        STATS["delete_a_step"] += 1
        step = data.draw(st.sampled_from(sorted(self.steps)))
        self.mgr.delete(step)
        del self.steps[step]
        self.scored.discard(step)

    @precondition(lambda self: self.steps)
    @rule(data=st.data())
    def delete_a_step_by_hand(self, data):
        STATS["delete_a_step_by_hand"] += 1
        step = data.draw(st.sampled_from(sorted(self.steps)))
        name = f"{self.run}/{step:08d}"
        self.broken |= self._referencing(step)
        _remove_by_hand(name)
        del self.steps[step]
        self.scored.discard(step)

    def _referencing(self, step: int) -> set[int]:
        """The committed steps whose arrays live (partly) in ``step`` (object stores)."""
        out = set()
        for s in self.steps:
            refs = jaxckpt.metadata(f"{self.run}/{s:08d}").refs.values()
            if any(t.startswith(f"../{step:08d}/") for t in refs):
                out.add(s)
        return out

    @rule(read_only=st.booleans(), step=st.integers(10, 14), v=st.integers(0, 7))
    def second_manager_during_a_save(self, read_only, step, v):
        """Another process's save into the run is in flight when a manager opens the run."""
        STATS["second_manager_during_a_save"] += 1
        if step in self.steps:
            return
        pause, errors = Pause(), []

        def save() -> None:
            try:
                jaxckpt.save(f"{self.run}/{step:08d}", state(v), planner=pause)
            except BaseException as e:  # noqa: BLE001 - checked below
                errors.append(e)

        thread = threading.Thread(target=save)
        thread.start()
        while not pause.reached.wait(0.05) and thread.is_alive():
            pass
        assert errors == [], errors
        other = jaxckpt.CheckpointManager(self.run, read_only=read_only)
        assert step not in other.all_steps()
        pause.go.set()
        thread.join()
        assert errors == [], errors
        self.steps[step] = v  # saved beside the manager: retention applies at its next save

    @rule(v=st.integers(0, 7), trip=st.sampled_from(["planner", "commit", "flush"]))
    def failing_save(self, v, trip):
        STATS["failing_save"] += 1
        step = 20 + v % 5
        path = f"{self.run}/{step:08d}"
        if step in self.steps:
            return
        with _tripwire(trip, self.run) as expected:
            with pytest.raises(expected):
                jaxckpt.save(path, state(v), planner=Trip() if trip == "planner" else None)
        assert not _exists(path)

    # -- plain checkpoints beside the run ----------------------------------------------------------

    @rule(
        name=st.sampled_from(["a", "b", "c"]),
        v=st.integers(0, 7),
        overwrite=st.booleans(),
        use_async=st.booleans(),
        base=st.sampled_from([None, "a", "b", "c"]),
    )
    def plain_save(self, name, v, overwrite, use_async, base):
        STATS["plain_save"] += 1
        path = f"{self.base}/plain/{name}"
        base_path = None if base is None or base not in self.plain else f"{self.base}/plain/{base}"
        if base_path is not None and base in self.plain_broken:
            base_path = None
        try:
            if use_async:
                jaxckpt.save_async(path, state(v), overwrite=overwrite, base=base_path).wait()
            else:
                jaxckpt.save(path, state(v), overwrite=overwrite, base=base_path)
        except jaxckpt.CheckpointExistsError:
            assert name in self.plain and not overwrite
            return
        assert overwrite or name not in self.plain
        self.plain[name] = v
        self.plain_broken.discard(name)

    @precondition(lambda self: self.plain)
    @rule(data=st.data())
    def delete_a_plain_checkpoint_by_hand(self, data):
        STATS["delete_a_plain_checkpoint_by_hand"] += 1
        name = data.draw(st.sampled_from(sorted(self.plain)))
        for other in self.plain:
            refs = jaxckpt.metadata(f"{self.base}/plain/{other}").refs.values()
            if any(t.startswith(f"../{name}/") for t in refs):
                self.plain_broken.add(other)
        _remove_by_hand(f"{self.base}/plain/{name}")
        del self.plain[name]

    # -- what must hold after every step ---------------------------------------------------------

    @invariant()
    def every_listed_step_restores_to_what_was_committed(self):
        if self.mgr is None:
            return
        assert self.mgr.all_steps() == sorted(self.steps)
        for step, v in self.steps.items():
            _restores(lambda s=step: self.mgr.restore(s), state(v), step in self.broken)
        for name, v in self.plain.items():
            path = f"{self.base}/plain/{name}"
            _restores(lambda p=path: jaxckpt.restore(p), state(v), name in self.plain_broken)

    def teardown(self):
        if self.mgr is not None:
            self.mgr.close()


def _restores(fn, want: dict, broken: bool) -> None:
    """``fn()`` returns ``want`` bit-exactly; where a deletion by hand broke it, it may instead
    raise a ``CheckpointError`` that says so."""
    try:
        got = fn()
    except jaxckpt.CheckpointError:
        if broken:
            return
        raise
    assert_tree_equal(got, want)


def _remove_by_hand(path: str) -> None:
    loc = Location(path)
    if loc.local is not None:
        shutil.rmtree(loc.local)
        return
    kv = kvstore(loc.kvstore, loc)
    kv.delete_range(kv.KeyRange()).result()


def _exists(path: str) -> bool:
    try:
        jaxckpt.metadata(path)
        return True
    except jaxckpt.CheckpointNotFoundError:
        return False


class _tripwire:
    """Make one of the writer's calls fail for one save; yields the error the save raises."""

    def __init__(self, trip: str, run: str) -> None:
        self.trip, self.local = trip, Location(run).local is not None
        self.undo: list = []

    def __enter__(self):
        if self.trip == "planner":
            return RuntimeError
        if self.local and self.trip == "commit":
            self._patch(local_commit, "rename_noreplace", _fail(errno.ENOSPC))
        elif self.local:
            self._patch(local_commit, "syncfs", _fail(errno.EIO))
        else:  # the object store refuses the commit's write (or its markers)
            import tensorstore as ts

            real = ts.KvStore.write

            def refuse(kv, key, *args, **kwargs):
                if (key.decode() if isinstance(key, bytes) else key).endswith("manifest.json"):
                    raise ValueError("PERMISSION_DENIED: injected by the test's tripwire")
                return real(kv, key, *args, **kwargs)

            self._patch(ts.KvStore, "write", refuse)
        return jaxckpt.CheckpointError

    def _patch(self, owner, name, value) -> None:
        # vars(), not getattr(): a class's pybind11 method must go back as the descriptor
        self.undo.append((owner, name, vars(owner)[name]))
        setattr(owner, name, value)

    def __exit__(self, *exc) -> None:
        for owner, name, value in reversed(self.undo):
            setattr(owner, name, value)


def _fail(code: int):
    def fail(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    return fail


def _run(root: str, store: str) -> None:
    STATS.clear()
    machine = type("Model", (CheckpointModel,), {"root": root})
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=EXAMPLES[store],
            stateful_step_count=STEPS,
            deadline=None,
            suppress_health_check=list(HealthCheck),
        ),
    )
    print(f"{root.split(':')[0]}: {dict(STATS)}")  # shown with -s (make soak)


def test_model_local(tmp_path: Path):
    _run(str(tmp_path), "local")


def test_model_memory():
    _run(f"memory://model-{uuid.uuid4().hex[:8]}", "memory")


def test_model_s3(s3):  # noqa: F811
    _run(f"s3://{BUCKET}/model-{uuid.uuid4().hex[:8]}", "s3")
