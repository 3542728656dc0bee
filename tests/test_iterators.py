"""Data iterators saved with a step (``iterators=``): Grain's, round trips, capture at the call,
bytes and JSON states, hostile records, another process count, the local tier."""

from __future__ import annotations

import json

import grain
import jax.numpy as jnp
import numpy as np
import pytest

import jaxckpt
from jaxckpt._format import iterators as records


def _dataset_iter():
    """A grain DatasetIterator: shuffled, mapped, batched (its state is a dict)."""
    ds = grain.MapDataset.range(64).shuffle(seed=7).map(lambda x: x * 3).batch(4)
    return iter(ds.to_iter_dataset())


def _loader(seed: int = 5):
    """A grain DataLoader over a list (its iterator's state is JSON as bytes)."""
    sampler = grain.samplers.IndexSampler(
        40, grain.sharding.NoSharding(), shuffle=True, seed=seed, num_epochs=2
    )
    return grain.DataLoader(
        data_source=[np.full(3, i) for i in range(40)],
        sampler=sampler,
        operations=[grain.transforms.Batch(batch_size=2)],
        worker_count=0,
    )


def _take(it, n: int) -> list:
    return [np.asarray(next(it)).tolist() for _ in range(n)]


def test_grain_iterators_resume_where_saved(tmp_path):
    ds, dl = _dataset_iter(), iter(_loader())
    _take(ds, 3), _take(dl, 5)
    jaxckpt.save(tmp_path / "c", {"w": jnp.ones(3)}, iterators={"ds": ds, "dl": dl})
    expected = _take(ds, 4), _take(dl, 6)  # what comes after the save
    ds2, dl2 = _dataset_iter(), iter(_loader())
    out = jaxckpt.restore(tmp_path / "c", iterators={"ds": ds2, "dl": dl2})
    assert (_take(ds2, 4), _take(dl2, 6)) == expected  # the same batches, not just as many
    assert out["w"].tolist() == [1, 1, 1]
    saved = jaxckpt.metadata(tmp_path / "c").iterators
    assert saved["ds"].states[0].kind == "json" and saved["dl"].states[0].kind == "utf8"
    assert jaxckpt.restore(tmp_path / "c")["w"].tolist() == [1, 1, 1]  # iterators are optional


def test_manager_captures_the_position_at_save_not_at_the_commit(tmp_path):
    class Live:
        """Its get_state() hands out its own (mutable) dict, as a careless iterator might."""

        def __init__(self):
            self.pos = {"i": 0, "seen": []}

        def get_state(self):
            return self.pos

        def set_state(self, state):
            self.pos = state

    it = Live()
    with jaxckpt.CheckpointManager(tmp_path) as mgr:
        for step in range(1, 4):
            it.pos["i"] = step
            it.pos["seen"].append(step)
            mgr.save(step, {"w": np.full(4, step)}, iterators={"train": it})
            it.pos["i"] = 100  # the loop moves on while the save is in flight
            it.pos["seen"].append(-1)
        mgr.wait()
        fresh = Live()
        mgr.restore(2, iterators={"train": fresh})
        assert fresh.pos == {"i": 2, "seen": [1, -1, 2]}


def test_bytes_states_round_trip_as_bytes(tmp_path):
    raw, text = bytes(range(256)), "position 7 ✓".encode()
    jaxckpt.save(tmp_path / "c", {"x": 1}, iterators={"raw": _State(raw), "text": _State(text)})
    saved = jaxckpt.metadata(tmp_path / "c").iterators
    assert saved["raw"].states[0].kind == "base64" and saved["text"].states[0].kind == "utf8"
    a, b = _State(None), _State(None)
    jaxckpt.restore(tmp_path / "c", iterators={"raw": a, "text": b})
    assert a.state == raw and b.state == text and type(a.state) is bytes


class _State:
    def __init__(self, state):
        self.state = state

    def get_state(self):
        return self.state

    def set_state(self, state):
        self.state = state


@pytest.mark.parametrize(
    ("state", "match"),
    [
        ({"a": object()}, r"Iterator 'it': get_state\(\) returned a object at state\['a'\]"),
        ({1: 2}, r"a dict key 1 of type int \(JSON keys are str\)"),
        ([1.0, float("nan")], r"nan \(JSON has no nan or inf\) at state\[1\]"),
        (b"x" * (2 << 20), r"at most 1048576 per iterator and process"),
    ],
)
def test_states_that_are_neither_json_nor_bytes_are_refused(tmp_path, state, match):
    with pytest.raises(jaxckpt.UnsupportedLeafError, match=match):
        jaxckpt.save(tmp_path / "c", {"x": 1}, iterators={"it": _State(state)})
    assert not (tmp_path / "c").exists()


def test_a_loader_instead_of_its_iterator_is_a_type_error(tmp_path):
    with pytest.raises(TypeError, match=r"Iterator 'train' is a DataLoader.*iter\(data_loader\)"):
        jaxckpt.save(tmp_path / "c", {"x": 1}, iterators={"train": _loader()})
    with pytest.raises(TypeError, match="maps names to iterators"):
        jaxckpt.save(tmp_path / "c", {"x": 1}, iterators=[iter(_loader())])


def test_restore_errors_name_the_iterator(tmp_path):
    dl = iter(_loader(seed=5))
    _take(dl, 2)
    jaxckpt.save(tmp_path / "c", {"x": 1}, iterators={"train": dl})
    with pytest.raises(jaxckpt.KeyMismatchError, match=r"no state of iterator 'eval'.*'train'"):
        jaxckpt.restore(tmp_path / "c", iterators={"eval": iter(_loader())})
    # Another sampler (seed): Grain's DataLoader refuses the state; the error says what to do.
    with pytest.raises(jaxckpt.CheckpointError, match=r"set_state refused.*Sampler in checkpoint"):
        jaxckpt.restore(tmp_path / "c", iterators={"train": iter(_loader(seed=6))})


def _edit_iterators(path, edit):
    manifest = path / "manifest.json"
    doc = json.loads(manifest.read_text())
    edit(doc)
    manifest.write_text(json.dumps(doc))


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda d: d.update(iterators=[]), r'"iterators" must be an object'),
        (lambda d: d["iterators"]["it"].update(process_count=0), "positive process_count"),
        (
            lambda d: d["iterators"]["it"]["states"].update({"3": {"json": 1}}),
            r"state for process '3', outside 0..0",
        ),
        (
            lambda d: d["iterators"]["it"]["states"].update({"0": {"pickle": "gASVAA=="}}),
            r"iterator 'it' of process 0 is not one of",
        ),
        (
            lambda d: d["iterators"]["it"]["states"].update({"0": {"base64": "%%%"}}),
            r"iterator 'it' of process 0 is not base64",
        ),
        (
            lambda d: d["iterators"]["it"]["states"].update({"0": {"utf8": 3}}),
            r"iterator 'it' of process 0 is not one of",
        ),
    ],
)
def test_hostile_records_are_manifest_errors(tmp_path, edit, match):
    jaxckpt.save(tmp_path / "c", {"x": 1}, iterators={"it": _State({"i": 1})})
    _edit_iterators(tmp_path / "c", edit)
    with pytest.raises(jaxckpt.ManifestError, match=match) as info:
        jaxckpt.restore(tmp_path / "c", iterators={"it": _State(None)})
    assert "manifest.json" in str(info.value)  # names the checkpoint's manifest


def test_another_process_count_is_refused_unless_every_process_saved_alike(tmp_path):
    jaxckpt.save(tmp_path / "c", {"x": 1}, iterators={"it": _State({"i": 1})})

    def two_processes(states):
        def edit(doc):
            doc["iterators"]["it"] = {"process_count": 2, "states": states}

        return edit

    _edit_iterators(tmp_path / "c", two_processes({"0": {"json": 4}, "1": {"json": 5}}))
    with pytest.raises(jaxckpt.CheckpointError, match=r"saved by 2 processes.*this job has 1"):
        jaxckpt.restore(tmp_path / "c", iterators={"it": _State(None)})
    # A pipeline every process iterated alike (the same state everywhere) fits any count.
    _edit_iterators(tmp_path / "c", two_processes({"0": {"json": 4}, "1": {"json": 4}}))
    it = _State(None)
    jaxckpt.restore(tmp_path / "c", iterators={"it": it})
    assert it.state == 4


def test_a_reader_ignores_manifest_fields_it_does_not_know(tmp_path):
    """What lets older jaxckpt (which reads no "iterators") restore a step that has them."""
    jaxckpt.save(tmp_path / "c", {"x": np.arange(3)}, iterators={"it": _State({"i": 1})})
    _edit_iterators(tmp_path / "c", lambda d: d.update(some_later_field={"a": 1}))
    assert jaxckpt.restore(tmp_path / "c")["x"].tolist() == [0, 1, 2]


def test_encode_is_plain_json_and_never_pickles():
    assert records.encode("a", (1, [2.5, None], {"k": True})).to_json() == {
        "json": [1, [2.5, None], {"k": True}]
    }
    assert records.encode("a", b"\xff").to_json() == {"base64": "/w=="}
    assert records.encode("a", bytearray(b"{}")).state() == b"{}"


def test_local_tier_keeps_the_iterator_with_its_part(tmp_path):
    kw = dict(save_interval_steps=100, local_directory=tmp_path / "local")
    dl = iter(_loader())
    with jaxckpt.CheckpointManager(tmp_path / "run", **kw) as mgr:
        for step in range(1, 4):
            batch = np.asarray(next(dl), np.int32)
            mgr.save(step, {"w": jnp.asarray(batch)}, iterators={"train": dl})
        mgr.wait()
        expected = _take(dl, 3)
    with jaxckpt.CheckpointManager(tmp_path / "run", **kw) as mgr:
        dl2 = iter(_loader())
        target = {"w": jnp.zeros((2, 3), jnp.int32)}
        mgr.restore(target=target, iterators={"train": dl2})
        assert mgr.restored_from.tier == "local" and mgr.restored_from.step == 3
        assert _take(dl2, 3) == expected


def test_two_processes_each_resume_their_own_shard(loops_group):
    records, work = loops_group
    mine = [r["iterators"] for r in records]
    for r in mine:
        assert r["got"] == r["expected"], r  # each process's next batches, after the restore
        assert r["saved"] == [2, [0, 1]]  # one state per process in the step's manifest
    assert mine[0]["expected"] != mine[1]["expected"]  # the shards differ
    assert "different iterators= names" in mine[0]["mismatch"], mine[0]["mismatch"]
    assert mine[1]["mismatch"].startswith("DistributedError"), mine[1]["mismatch"]
    # Here, one process: no saved position fits, and the error says why.
    with pytest.raises(jaxckpt.CheckpointError, match=r"saved by 2 processes, each at its own"):
        jaxckpt.restore(work / "iterators" / "00000006", iterators={"train": iter(_loader())})
