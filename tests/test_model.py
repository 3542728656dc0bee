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
import math
import os
import shutil
import tempfile
import threading
import uuid
from pathlib import Path

import jax
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
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from test_s3 import BUCKET, s3  # noqa: F401 (fixture)

import jaxckpt
from jaxckpt._format.names import step_name
from jaxckpt._manager import run_index
from jaxckpt._manager.retention import MetricsFile, first_at_or_after_multiples, steps_to_delete
from jaxckpt._runtime import agreement
from jaxckpt._storage import local_commit
from jaxckpt._storage.location import Location, kvstore

# Sequences per store: CI's few (about half a minute in all), or JAXCKPT_MODEL_EXAMPLES each.
EXAMPLES = {"local": 30, "memory": 30, "s3": 8}
RUN_EXAMPLES = {"local": 12, "memory": 10, "s3": 4}  # RunModel's (each sequence does more)
if os.environ.get("JAXCKPT_MODEL_EXAMPLES"):
    EXAMPLES = dict.fromkeys(EXAMPLES, int(os.environ["JAXCKPT_MODEL_EXAMPLES"]))
    RUN_EXAMPLES = dict(EXAMPLES)
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
    """The loss saved with value ``v``: a number, or NaN or an infinity (a diverged run)."""
    r = (v * 7) % 11
    return {3: float("nan"), 5: float("inf"), 9: -float("inf")}.get(r, float(r))


def rank(v: int) -> float:
    """How best-N ranks the loss of ``v`` (higher is better): NaN and infinities worst."""
    return -loss(v) if math.isfinite(loss(v)) else -math.inf


class Trip(jaxckpt.DefaultSavePlanner):
    """The user's planner failing mid-write (its own error passes through)."""

    def resolve_data(self, item):
        raise RuntimeError("tripwire: the planner failed")


class Throttled(jaxckpt.DefaultSavePlanner):
    """Storage failing a save partway: the items before the ``n + 1``-th are written."""

    def __init__(self, n: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.n = n

    def resolve_data(self, item):
        self.n -= 1
        if self.n < 0:
            raise jaxckpt.CheckpointError("throttled: injected by the model")
        return super().resolve_data(item)


class Pause(jaxckpt.DefaultSavePlanner):
    """Holds a save in the middle of its writes until ``go`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.reached, self.go = threading.Event(), threading.Event()

    def resolve_data(self, item):
        self.reached.set()
        assert self.go.wait(60)
        return super().resolve_data(item)


TIMING_TOL = 0.05  # seconds: the statements between two phases' clocks on a loaded machine


def state_bytes(v: int) -> int:
    """The bytes of ``state(v)``'s arrays."""
    return sum(x.nbytes for x in jax.tree.leaves(state(v)) if hasattr(x, "nbytes"))


def check_timings(t: dict, nbytes: int | None) -> None:
    """A committed save's timings are there and sane: no phase negative, the call within the
    save, the phases adding up to the whole (a blocking save's; an async save's call holds its
    plan and stage, its write and commit run after the call began), its bytes all written or
    reused (a manager's step: every process's, here one)."""
    phases = ("plan", "stage", "write", "wait", "commit")
    assert all(t[k] >= 0 for k in (*phases, "blocking", "total")), t
    assert t["blocking"] <= t["total"] + 1e-9, t
    if t["blocking"] == t["total"]:  # a blocking save
        assert abs(sum(t[k] for k in phases) - t["total"]) < TIMING_TOL, t
    else:
        assert t["plan"] + t["stage"] <= t["blocking"] + TIMING_TOL, t
        assert t["write"] + t["commit"] <= t["total"] + TIMING_TOL, t
    assert t["bytes_written"] + t.get("bytes_reused", 0) >= (nbytes or 0), t


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
        self.gone: set[str] = set()  # the names of the steps deleted by hand
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
            return rank(values[s]) if s in scored else None

        return steps_to_delete(
            sorted(steps), **self.policy, score=score if self.best else None, keep_unscored=True
        )

    @rule(ahead=st.integers(-1, 2), v=st.integers(0, 7))
    def manager_save(self, ahead, v):
        """A save of a step near the newest one: after it (saved), at or before it (refused:
        steps grow in the order of saves, whatever retention would do)."""
        STATS["manager_save"] += 1
        step = max(self.steps, default=0) + ahead
        if step < 0:
            return
        try:
            self.mgr.save(step, state(v), metrics={"loss": loss(v)}, force=True)
            self.mgr.wait()
        except jaxckpt.CheckpointExistsError:
            assert self.steps and step <= max(self.steps)
            return
        assert not self.steps or step > max(self.steps)
        check_timings(MetricsFile(Location(self.run)).timings()[str(step)], state_bytes(v))
        self.steps[step] = v
        self.scored.add(step)
        self.broken.discard(step)
        self.gone.discard(f"{step:08d}")
        refs = jaxckpt.metadata(f"{self.run}/{step:08d}").refs.values()
        if any(t.split("/")[1] in self.gone for t in refs):  # a broken base's references
            self.broken.add(step)
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
        newer = sorted(s for s in self.steps if s > step)
        if data.draw(st.booleans()):
            assert self.mgr.rollback(step) == newer
        for s in newer:
            if s in self.mgr.all_steps():
                self.mgr.delete(s)
            del self.steps[s]
            self.scored.discard(s)
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
        self.gone.add(f"{step:08d}")
        _remove_by_hand(name)
        loc = Location(self.run)
        if loc.local is None:  # and its marker (docs/manager.md, *Steps on object stores*)
            kvstore(loc.kvstore, loc).write(f".steps/{step:08d}", None).result()
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
        if Location(self.run).local is None and step < max(self.steps, default=-1):
            return  # unindexed, below the index's newest: not seen (run_index's docstring)
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
        layout=st.sampled_from(["auto", "chunks", "objects"]),
    )
    def plain_save(self, name, v, overwrite, use_async, base, layout):
        STATS["plain_save"] += 1
        # The default ("auto"): format v5's data objects on object stores, a file per chunk
        # elsewhere and with a base (whose own layout may be either); "objects" in small ones.
        planner = jaxckpt.DefaultSavePlanner(layout=layout, object_bytes=64 << 10)
        kw = {"planner": planner} if layout != "auto" else {}
        path = f"{self.base}/plain/{name}"
        base_path = None if base is None or base not in self.plain else f"{self.base}/plain/{base}"
        if base_path is not None and base in self.plain_broken:
            base_path = None
        try:
            if use_async:
                h = jaxckpt.save_async(path, state(v), overwrite=overwrite, base=base_path, **kw)
                h.wait()
                check_timings({**h.timings, "bytes_written": h.nbytes + h.reused_bytes}, None)
            else:
                jaxckpt.save(path, state(v), overwrite=overwrite, base=base_path, **kw)
        except jaxckpt.CheckpointExistsError:
            assert name in self.plain and not overwrite
            return
        assert overwrite or name not in self.plain
        self.plain[name] = v
        self.plain_broken.discard(name)

    @rule(
        name=st.sampled_from(["a", "b", "c"]),
        v=st.integers(0, 7),
        w=st.integers(0, 7),
        written=st.integers(0, 1),
        objects=st.booleans(),
    )
    def resumed_save(self, name, v, w, written, objects):
        """A save that storage fails after ``written`` items, then its retry with the data of
        ``w`` (the same or changed): the failure changes nothing committed; the retry commits
        ``w`` whole, keeping what the failed save wrote where it is the same. ``objects``:
        both into format v5's data objects of a record each (object stores; a file per chunk
        elsewhere), so that an item written makes an object whole; else both an object or
        file per chunk (``layout="chunks"``; the default writes data objects on object stores)."""
        STATS["resumed_save"] += 1
        path = f"{self.base}/plain/{name}"
        overwrite = name in self.plain
        kw = {"layout": "objects", "object_bytes": 1} if objects else {"layout": "chunks"}
        with pytest.raises(jaxckpt.CheckpointError, match="throttled"):
            jaxckpt.save(path, state(v), overwrite=overwrite, planner=Throttled(written, **kw))
        if name in self.plain:
            want = state(self.plain[name])
            _restores(lambda: jaxckpt.restore(path), want, name in self.plain_broken)
        planner = jaxckpt.DefaultSavePlanner(**kw)
        handle = jaxckpt.save_async(path, state(w), overwrite=overwrite, planner=planner)
        handle.wait()
        if written and v == w:
            assert handle.resumed_bytes > 0
        self.plain[name] = w
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
        _index_matches(self.run, set(self.steps))
        for step, v in self.steps.items():
            _restores(lambda s=step: self.mgr.restore(s), state(v), step in self.broken)
        for name, v in self.plain.items():
            path = f"{self.base}/plain/{name}"
            _restores(lambda p=path: jaxckpt.restore(p), state(v), name in self.plain_broken)

    def teardown(self):
        if self.mgr is not None:
            self.mgr.close()


class Counter:
    """A data iterator whose state is its position."""

    def __init__(self, position: int = 0) -> None:
        self.position = position

    def get_state(self) -> dict:
        return {"position": self.position}

    def set_state(self, saved: dict) -> None:
        self.position = saved["position"]


SHARDING = NamedSharding(Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b")), P("a", "b"))


def tiered_state(v: int) -> dict:
    """A run's state: a sharded array (the local tier rebuilds it), an array that changes
    every 4 values (incremental steps reference or link it), a Python value."""
    return {
        "w": jax.device_put(np.full((8, 4), v, np.float32), SHARDING),
        "frozen": np.arange(FROZEN, dtype=np.float32) + np.float32(v // 4),
        "v": v,
    }


TARGET = {
    "w": jax.ShapeDtypeStruct((8, 4), np.float32, sharding=SHARDING),
    "frozen": None,
    "v": None,
}


class RunModel(RuleBasedStateMachine):
    """A training run through one ``CheckpointManager`` and its restarts: both tiers,
    data iterators, step/time/continuous schedules under a fake clock, best-N with and without
    metrics (NaN and infinite losses among them), deletes, rollbacks (and forgotten ones), a
    wiped local disk, read-only readers (one kept open that calls ``reload()``), and steps
    saved by hand into the run (below or after the newest) followed by ``reload()``.

    The model: the persistent steps and the local steps (each with its value and the order it
    was saved in), and the iterator position saved with each step. After every rule: every
    listed step restores what was saved under it (from the tier the model says holds it),
    ``restore()`` returns the newest step, and neither the directory nor the local disk holds
    anything the model does not (the leak invariant, by listing)."""

    root = ""

    def __init__(self) -> None:
        super().__init__()
        STATS["run sequences"] += 1
        self.run = f"{self.root}/{uuid.uuid4().hex[:8]}/run"
        self.local_dir = Path(tempfile.mkdtemp(prefix="jaxckpt-model-"))
        self.persistent: dict[int, int] = {}  # step -> value
        self.local: dict[int, tuple[int, int]] = {}  # step -> (value, save order)
        self.scored: set[int] = set()
        self.positions: dict[int, int] = {}  # step -> iterator position saved with it
        self.order, self.now = 0, 0.0
        self.floor: int | None = None  # the ledger's newest: a lost step counts until re-read
        self.mgr: jaxckpt.CheckpointManager | None = None
        self.evaluator: jaxckpt.CheckpointManager | None = None  # a reader kept open
        self.evaluated: set[int] = set()  # the steps it listed last

    @initialize(
        local=st.booleans(),
        every=st.sampled_from([1, 2, 3]),
        local_every=st.sampled_from([1, 2]),
        local_keep=st.sampled_from([1, 2]),
        max_to_keep=st.sampled_from([None, 1, 2, 3]),
        best=st.sampled_from([None, "all", "some"]),
        secs=st.sampled_from([None, 0.0, 10.0]),
        incremental=st.booleans(),
        keep_every=st.sampled_from([None, 2, 3]),
        unscored=st.booleans(),
        compression=st.sampled_from([None, "zstd", "lz4"]),
    )
    def open_run(
        self,
        local,
        every,
        local_every,
        local_keep,
        max_to_keep,
        best,
        secs,
        incremental,
        keep_every,
        unscored,
        compression,
    ):
        schedule = [(0, 1), (4, every)] if every == 3 else every  # one that changes at step 4
        self.cfg = dict(
            max_to_keep=max_to_keep,
            keep_every_n_steps=keep_every,
            save_interval_steps=schedule if secs is None else None,
            save_interval_secs=secs,
            best_fn=(lambda m: m["loss"]) if best else None,
            keep_checkpoints_without_metrics=unscored,
            incremental=incremental,
            async_save=secs is None,  # a time-based decision waits on no background commit
            compression=compression,
        )
        self.codecs: dict[int, str | None] = {}  # step -> the compression it was saved with
        self.pinned: set[int] = set()
        self.released: set[int] = set()  # unpinned since the last retention (kept until it)
        self.unretained: set[int] = set()  # saved by hand since: no retention counted them yet
        if local:
            self.cfg.update(
                local_directory=self.local_dir,
                local_save_interval_steps=local_every,
                local_max_to_keep=local_keep,
            )
        self.best, self.local_on = best, local
        self._open()

    def _open(self) -> None:
        self.floor = self._newest()  # read when the manager opens
        self.mgr = jaxckpt.CheckpointManager(self.run, **self.cfg)
        self.mgr._schedule.clock = lambda: self.now  # the fake clock of the time policies
        self.mgr._schedule.last_start = self.now

    def _newest(self) -> int | None:
        return max({*self.persistent, *self.local}, default=None)

    # -- the loop --------------------------------------------------------------------------------

    @rule(n=st.integers(1, 3), v=st.integers(0, 7), dt=st.sampled_from([0.0, 4.0, 11.0]))
    def train(self, n, v, dt):
        """A training loop asking ``should_save`` and calling ``save`` at every step."""
        STATS["train"] += 1
        it = Counter()
        top = max(self.floor, self._newest() or 0) if self.floor is not None else self._newest()
        for step in range((top or 0) + 1, (top or 0) + 1 + n):
            self.now += dt
            it.position = 10 * step + v
            want = self.mgr.should_save(step)
            before = self.mgr.last_save
            with_metrics = self.best == "all" or (self.best == "some" and step % 2 == 0)
            metrics = {"loss": loss(v + step)} if with_metrics else None
            saved = self.mgr.save(
                step, tiered_state(v + step), metrics=metrics, iterators={"it": it}
            )
            assert saved == want, (step, saved, want)  # should_save is exactly save's answer
            self.mgr.wait()
            if self.mgr.last_save is not before:
                check_timings(MetricsFile(Location(self.run)).timings()[str(step)], None)
                self._persistent_saved(step, v + step, with_metrics)
            if self.local_on and step % self.cfg["local_save_interval_steps"] == 0:
                self._local_saved(step, v + step)
            if saved:
                self.positions[step] = it.position
                self.floor = step

    def _persistent_saved(self, step: int, v: int, scored: bool) -> None:
        self.persistent[step] = v
        self.released.clear()
        if self.unretained:
            STATS["retention over hand-saved steps"] += 1
        self.unretained.clear()
        self.codecs[step] = self.cfg["compression"]
        if scored:
            self.scored.add(step)
        score = (
            (lambda s: rank(self.persistent[s]) if s in self.scored else None)
            if self.best
            else None
        )
        for gone in steps_to_delete(
            sorted(self.persistent),
            max_to_keep=self.cfg["max_to_keep"],
            keep_every_n_steps=self.cfg["keep_every_n_steps"],
            score=score,
            pinned=self.pinned,
            keep_unscored=self.cfg["keep_checkpoints_without_metrics"],
        ):
            del self.persistent[gone]
            self.scored.discard(gone)

    def _local_saved(self, step: int, v: int) -> None:
        self.order += 1
        self.local[step] = (v, self.order)
        keep = sorted(self.local, key=lambda s: self.local[s][1])[-self.cfg["local_max_to_keep"] :]
        self.local = {s: self.local[s] for s in keep}

    @precondition(lambda self: self.persistent or self.local)
    @rule(data=st.data(), forget=st.booleans())
    def roll_back(self, data, forget):
        """Restore an older step and go on from it: with ``rollback()``, or forgetting it
        (then the next save is refused and nothing changes)."""
        STATS["roll_back"] += 1
        step = data.draw(st.sampled_from(sorted({*self.persistent, *self.local})))
        self._check_step(step)
        newer = sorted(s for s in {*self.persistent, *self.local} if s > step)
        if forget and newer:
            with pytest.raises(jaxckpt.CheckpointExistsError, match="rollback"):
                self.mgr.save(step + 1, tiered_state(0), force=True)
            assert not self.mgr.should_save(step + 1)
            return
        assert self.mgr.rollback(step) == newer
        self._forget(newer)
        self.floor = self._newest()

    @precondition(lambda self: self.persistent or self.local)
    @rule(data=st.data())
    def delete_a_step(self, data):
        STATS["run_delete"] += 1
        step = data.draw(st.sampled_from(sorted({*self.persistent, *self.local})))
        self.mgr.delete(step)
        self._forget([step])
        self.floor = self._newest()

    def _forget(self, steps: list[int]) -> None:
        for s in steps:
            self.persistent.pop(s, None)
            self.local.pop(s, None)
            self.scored.discard(s)
            self.pinned.discard(s)
            self.unretained.discard(s)

    @precondition(lambda self: self.persistent)
    @rule(data=st.data(), pin=st.booleans())
    def pin(self, data, pin):
        """Pin a step (no retention deletes it) or give it back to the policy."""
        STATS["pin"] += 1
        step = data.draw(st.sampled_from(sorted(self.persistent)))
        if pin:
            self.mgr.pin(step)
            self.pinned.add(step)
        else:
            self.mgr.unpin(step)
            if step in self.pinned:
                self.released.add(step)
            self.pinned.discard(step)

    @precondition(lambda self: self.local_on)
    @rule()
    def wipe_the_local_disk(self):
        STATS["wipe_local"] += 1
        shutil.rmtree(self.local_dir, ignore_errors=True)
        self.local.clear()

    @rule(compression=st.sampled_from([None, "zstd", "lz4"]))
    def restart(self, compression):
        """The job restarts: a new manager on the same directories, maybe compressing otherwise
        (an incremental step then rewrites what its base stored another way)."""
        STATS["restart"] += 1
        self.mgr.close()
        self.cfg["compression"] = compression
        self._open()

    @rule(secs=st.sampled_from([0.0, 100.0]))
    def reader(self, secs):
        """An evaluator beside the trainer: lists and restores, never saves."""
        STATS["reader"] += 1
        reader = jaxckpt.CheckpointManager(self.run, read_only=True, save_interval_secs=secs)
        assert reader.all_steps() == sorted(self.persistent)
        assert not reader.should_save(10**6)
        if self.persistent:
            assert reader.restore()["v"] == self.persistent[max(self.persistent)]
        reader.close()

    @rule(above=st.booleans(), v=st.integers(0, 7), data=st.data())
    def hand_save(self, above, v, data):
        """An operator saves a step into the run by hand (``jaxckpt.save`` to its step path,
        with an iterator position), after the newest step or into a gap below it, then calls
        ``reload()``. Documented (``CheckpointManager.reload``; docs/manager.md, *Steps on
        object stores*): before ``reload()``, a step below the newest is listed on a local
        directory, not on an object store; after it, the manager and any reader list it,
        without metrics (best-N ranks it last, or keeps it for good with
        ``keep_checkpoints_without_metrics``); retention counts it from the next commit; one
        after the newest becomes the newest (``save`` and ``should_save`` refuse it)."""
        STATS["hand_save"] += 1
        top = max(self.floor or 0, self._newest() or 0)
        if above:
            step = top + data.draw(st.integers(1, 2), label="after the newest by")
        else:
            held = {*self.persistent, *self.local}
            free = [s for s in range(top) if s not in held]
            if not free:
                return
            step = data.draw(st.sampled_from(free), label="step")
        it = Counter(10 * step + v)
        jaxckpt.save(f"{self.run}/{step_name(step)}", tiered_state(v), iterators={"it": it})
        # Unindexed below the newest indexed step (every step the manager saved is indexed).
        hidden = Location(self.run).local is None and step < max(self.persistent, default=-1)
        assert (step in self.mgr.all_steps("persistent")) != hidden, (step, hidden)
        self.mgr.reload()
        STATS["hand_save below" if step < top else "hand_save after"] += 1
        self.persistent[step], self.positions[step], self.codecs[step] = v, it.position, None
        self.unretained.add(step)
        if self.floor is None or step > self.floor:
            self.floor = step
        assert self.mgr.metrics(step) is None
        assert not self.mgr.should_save(step)  # saved: save(step) refuses it

    @rule()
    def evaluator_reloads(self):
        """An evaluator kept open beside the trainer calls ``reload()`` (the writer saved,
        deleted, rolled back or saved by hand since): it lists the persistent steps and
        restores the newest."""
        STATS["evaluator_reloads"] += 1
        if self.evaluator is None:
            self.evaluator = jaxckpt.CheckpointManager(self.run, read_only=True)
        else:
            self.evaluator.reload()
        steps = self.evaluator.all_steps()
        assert steps == sorted(self.persistent), (steps, sorted(self.persistent))
        if set(steps) - self.evaluated:
            STATS["evaluator saw new steps"] += 1
        self.evaluated = set(steps)
        if steps:
            assert self.evaluator.restore()["v"] == self.persistent[max(steps)]

    # -- what must hold after every rule ------------------------------------------------------------

    def _check_step(self, step: int) -> None:
        """``step`` restores what was saved, from the tier the model says holds it."""
        it = Counter(-1)
        got = self.mgr.restore(step, TARGET, iterators={"it": it})
        v = self.local[step][0] if step in self.local else self.persistent[step]
        assert got["v"] == v and float(np.asarray(got["w"])[0, 0]) == v, (step, got["v"], v)
        assert_tree_equal(np.asarray(got["frozen"]), tiered_state(v)["frozen"])
        assert self.mgr.restored_from.tier == ("local" if step in self.local else "persistent")
        assert it.position == self.positions[step]
        self.floor = self._newest()  # a restore reads the ledger again
        if step in self.persistent:  # stored as the manager that saved it said, every array
            m = jaxckpt.metadata(f"{self.run}/{step:08d}")
            codecs = {e.codec for e in m.entries.values() if isinstance(e, jaxckpt.ArrayEntry)}
            assert codecs == {self.codecs[step]}, (step, codecs, self.codecs[step])

    @invariant()
    def one_view_of_the_run(self):
        if self.mgr is None:
            return
        steps = sorted({*self.persistent, *self.local})
        with _alone():  # listings ask no other process, local tier or not (issue 60.3)
            assert self.mgr.all_steps() == steps
            assert self.mgr.all_steps("persistent") == sorted(self.persistent)
            if self.local_on:
                assert self.mgr.all_steps("local") == sorted(self.local)
            assert self.mgr.latest_step() == self._newest()
        assert self.mgr.pinned_steps() == sorted(self.pinned)
        for step in steps:
            self._check_step(step)
        if steps:  # restore() returns the newest save of the branch saved last
            assert self.mgr.restore(target=TARGET)["v"] == self._value(max(steps))
            assert self.mgr.restored_from.step == max(steps)

    def _value(self, step: int) -> int:
        return self.local[step][0] if step in self.local else self.persistent[step]

    @invariant()
    def best_n_stays_bounded_and_ranks_nan_and_infinities_worst(self):
        """Steps saved with NaN or infinite losses are not kept as steps without metrics: the
        steps retention may delete number at most ``max_to_keep`` and the newest; and one of
        them kept with a NaN or an infinite loss (but the newest) means that fewer than
        ``max_to_keep`` steps with a finite loss are left to keep."""
        n = self.cfg["max_to_keep"]
        steps = set(self.persistent) - self.unretained  # as the last retention saw them
        if self.mgr is None or not self.best or n is None or not steps:
            return
        forever = first_at_or_after_multiples(steps, self.cfg["keep_every_n_steps"])
        candidates = steps - forever - self.pinned - self.released
        if self.cfg["keep_checkpoints_without_metrics"]:
            candidates &= self.scored
        assert len(candidates) <= n + 1, (sorted(candidates), n)
        others = candidates & self.scored - {max(steps)}
        finite = {s for s in others if math.isfinite(loss(self.persistent[s]))}
        if others - finite:
            assert len(finite) < n, (sorted(finite), sorted(others - finite), n)

    @invariant()
    def nothing_leaks(self):
        if self.mgr is None:
            return
        self.mgr.wait()
        kept = {f"{s:08d}" for s in self.persistent}
        for s in self.persistent:  # arrays of other steps that listed steps reference
            for t in jaxckpt.metadata(f"{self.run}/{s:08d}").refs.values():
                kept.add(t.split("/")[1])
        _index_matches(self.run, set(self.persistent))
        found = _top_level(self.run)
        extra = found - kept - {"metrics.json", "local-tier.json", ".steps"}
        assert not extra, f"{self.run} holds {sorted(extra)} beyond steps {sorted(kept)}"
        for name in (
            found
            - {f"{s:08d}" for s in self.persistent}
            - {"metrics.json", "local-tier.json", ".steps"}
        ):
            assert not _exists(f"{self.run}/{name}")  # kept arrays only, no checkpoint
        if self.local_on:
            held = {int(p.name) for p in self.local_dir.glob("jaxckpt-*/p0/*") if p.name.isdigit()}
            assert held <= set(self.local), (held, self.local)
            temporaries = list(self.local_dir.glob("jaxckpt-*/p0/*/.*"))
            assert not temporaries, temporaries

    def teardown(self):
        if self.mgr is not None:
            self.mgr.close()
        if self.evaluator is not None:
            self.evaluator.close()
        shutil.rmtree(self.local_dir, ignore_errors=True)


class _alone:
    """Inside: any agreement among the processes fails the model (a call that must not wait
    for the others made one)."""

    def __enter__(self) -> None:
        def refused(name, *args, **kwargs):
            raise AssertionError(f"a listing made the agreement {name!r}")

        self.decide, agreement.decide = agreement.decide, refused

    def __exit__(self, *exc) -> None:
        agreement.decide = self.decide


def _index_matches(run: str, steps: set[int]) -> None:
    """Object stores: the run's index names the committed ``steps`` (no tombstone left, no
    marker of a step gone), but for the newest ones a process saved unmarked."""
    loc = Location(run)
    if loc.local is not None:
        return
    found = run_index.survey(loc)
    assert not found.deleting, sorted(found.deleting)
    assert set(found.marked) | set(found.unmarked) == steps, (found, sorted(steps))
    assert all(s > max(found.marked, default=-1) for s in found.unmarked), found


def _top_level(run: str) -> set[str]:
    """The names directly in the run directory (local) or its first key parts (object store)."""
    loc = Location(run)
    if loc.local is not None:
        return {p.name for p in loc.local.iterdir()} if loc.local.exists() else set()
    kv = kvstore(loc.kvstore, loc)
    return {k.decode().split("/", 1)[0] for k in kv.list().result()}


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


def _run(root: str, store: str, model: type = CheckpointModel) -> None:
    STATS.clear()
    machine = type("Model", (model,), {"root": root})
    examples = EXAMPLES[store] if model is CheckpointModel else RUN_EXAMPLES[store]
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=examples,
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


def test_run_model_local(tmp_path: Path):
    _run(str(tmp_path), "local", RunModel)


def test_run_model_memory():
    _run(f"memory://run-model-{uuid.uuid4().hex[:8]}", "memory", RunModel)


def test_run_model_s3(s3):  # noqa: F811
    _run(f"s3://{BUCKET}/run-model-{uuid.uuid4().hex[:8]}", "s3", RunModel)
