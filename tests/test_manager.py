"""CheckpointManager: steps, intervals, retention, metrics, restore, clean-up, preemption, and a
real sharded training loop that resumes with the uninterrupted loss."""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_tree_equal, mesh, put

import jaxckpt


def _state(step: int) -> dict:
    return {"w": np.full((4, 3), step, np.float32), "step": step}


def _dirs(d) -> list[str]:
    return sorted(n for n in os.listdir(d) if n != "metrics.json")


def test_saves_due_steps_into_zero_padded_directories(tmp_path):
    with jaxckpt.CheckpointManager(tmp_path, save_interval_steps=5) as mgr:
        saved = [s for s in range(0, 23) if mgr.save(s, _state(s))]
        assert mgr.save(23, _state(23), force=True)
    assert saved == [0, 5, 10, 15, 20]
    assert _dirs(tmp_path) == [
        "00000000",
        "00000005",
        "00000010",
        "00000015",
        "00000020",
        "00000023",
    ]
    mgr = jaxckpt.CheckpointManager(tmp_path)
    assert mgr.all_steps() == [0, 5, 10, 15, 20, 23]
    assert mgr.latest_step() == 23
    assert_tree_equal(mgr.restore(), _state(23))
    assert_tree_equal(mgr.restore(10), _state(10))
    assert_tree_equal(jaxckpt.restore(tmp_path / "00000015"), _state(15))  # a plain checkpoint


def test_keeps_the_newest_and_every_nth(tmp_path):
    with jaxckpt.CheckpointManager(tmp_path, max_to_keep=2, keep_every_n_steps=4) as mgr:
        for s in range(1, 11):
            mgr.save(s, _state(s))
            mgr.wait()
            assert mgr.latest_step() == s  # the newest is never deleted
    assert mgr.all_steps() == [4, 8, 9, 10]


@pytest.mark.parametrize("mode", ["min", "max"])
def test_keeps_the_best_by_a_metric_and_the_newest(tmp_path, mode):
    losses = {1: 0.5, 2: 0.1, 3: 0.9, 4: 0.3, 5: 0.7, 6: 0.8}
    with jaxckpt.CheckpointManager(
        tmp_path, max_to_keep=2, best_fn=lambda m: m["loss"], best_mode=mode
    ) as mgr:
        for s, loss in losses.items():
            mgr.save(s, _state(s), metrics={"loss": jnp.float32(loss)})
        mgr.save(7, _state(7))  # no metrics: ranks last, but is the newest
    assert mgr.all_steps() == ([2, 4, 7] if mode == "min" else [3, 6, 7])
    assert mgr.metrics(2 if mode == "min" else 3) == {
        "loss": pytest.approx(losses[2 if mode == "min" else 3])
    }


def test_metrics_are_plain_json_and_must_be_scalars(tmp_path):
    mgr = jaxckpt.CheckpointManager(tmp_path)
    mgr.save(1, _state(1), metrics={"loss": jnp.float32(0.25), "acc": np.int64(3), "tag": "a"})
    mgr.wait()
    on_disk = json.loads((tmp_path / "metrics.json").read_text())
    assert on_disk["format"] == 1 and set(on_disk) == {"format", "steps", "timings"}
    assert on_disk["steps"] == {"1": {"acc": 3, "loss": 0.25, "tag": "a"}}
    assert mgr.metrics(1) == {"acc": 3, "loss": 0.25, "tag": "a"} and mgr.metrics(5) is None
    with pytest.raises(
        jaxckpt.UnsupportedLeafError, match=r"Metric 'loss' of step 2 is a .*float\(loss\)"
    ):
        mgr.save(2, _state(2), metrics={"loss": jnp.ones(3)})
    assert mgr.all_steps() == [1]


def test_errors_say_what_to_do(tmp_path):
    mgr = jaxckpt.CheckpointManager(tmp_path / "run")
    with pytest.raises(jaxckpt.CheckpointNotFoundError, match="No committed step in .*run"):
        mgr.restore()
    mgr.save(3, _state(3))
    with pytest.raises(
        jaxckpt.CheckpointExistsError, match="Step 3 is already saved in .*later step"
    ):
        mgr.save(3, _state(3))
    with pytest.raises(
        jaxckpt.CheckpointNotFoundError, match=r"Step 4 is not in .*committed steps: \[3\]"
    ):
        mgr.restore(4)
    mgr.close()
    with pytest.raises(jaxckpt.CheckpointError, match="is closed; create a new one"):
        mgr.save(5, _state(5))
    with pytest.raises(ValueError, match="max_to_keep must be a positive int"):
        jaxckpt.CheckpointManager(tmp_path, max_to_keep=0)
    with pytest.raises(ValueError, match="best_mode must be 'min' or 'max'"):
        jaxckpt.CheckpointManager(tmp_path, best_mode="lowest")


def test_synchronous_mode_commits_before_returning(tmp_path):
    mgr = jaxckpt.CheckpointManager(tmp_path, async_save=False, max_to_keep=1)
    for s in range(3):
        assert mgr.save(s, _state(s))
        assert mgr.all_steps() == [s]


def test_ignores_and_cleans_up_what_crashes_leave(tmp_path):
    with jaxckpt.CheckpointManager(tmp_path) as mgr:
        mgr.save(4, _state(4))
        mgr.save(6, _state(6))
    # A save killed before its rename, a delete killed after it, a metrics file half written,
    # and an overwrite killed between its two renames (the old step moved aside).
    (tmp_path / ".00000008.tmp-0123abcd" / "arrays").mkdir(parents=True)
    (tmp_path / ".00000008.tmp-0123abcd" / "manifest.json").write_text("{}")
    os.rename(tmp_path / "00000004", tmp_path / ".00000004.tmp-89abcdef-deleted")
    (tmp_path / ".metrics.json.tmp-00ff00ff").write_text("{")
    os.rename(tmp_path / "00000006", tmp_path / ".00000006.tmp-deadbeef-old")
    (tmp_path / "00000009").mkdir()  # not ours: no manifest, left alone but never listed
    (tmp_path / "notes.txt").write_text("mine")
    mgr = jaxckpt.CheckpointManager(tmp_path)
    assert mgr.all_steps() == [6] and mgr.latest_step() == 6
    assert_tree_equal(mgr.restore(), _state(6))
    assert sorted(os.listdir(tmp_path)) == ["00000006", "00000009", "metrics.json", "notes.txt"]


def test_object_store_directory(tmp_path):
    url = f"memory://mgr-{tmp_path.name}"
    with jaxckpt.CheckpointManager(url, max_to_keep=2) as mgr:
        for s in range(1, 5):
            mgr.save(s, _state(s), metrics={"loss": 1.0 / s})
    mgr = jaxckpt.CheckpointManager(url)
    assert mgr.all_steps() == [3, 4]
    assert_tree_equal(mgr.restore(3), _state(3))
    assert mgr.metrics(4) == {"loss": 0.25} and mgr.metrics(1) is None


def test_sigterm_saves_this_step_at_once(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    mgr = jaxckpt.CheckpointManager(tmp_path, save_interval_steps=100, save_on_preemption=True)
    assert not mgr.save(7, _state(7)) and not mgr.reached_preemption(7)
    os.kill(os.getpid(), signal.SIGTERM)
    assert mgr.save(8, _state(8))  # not due, but preempted: saved and committed now
    assert mgr.all_steps() == [8] and mgr.reached_preemption(8)
    mgr.close()
    assert signal.getsignal(signal.SIGTERM) == before


# -- a real sharded training loop ---------------------------------------------------------------


def _model(m):
    k1, k2 = jax.random.split(jax.random.key(0))
    params = {
        "w1": put(jax.random.normal(k1, (16, 32)) / 4, m, None, "model"),
        "w2": put(jax.random.normal(k2, (32, 4)) / 6, m, "model", None),
    }
    opt = optax.adam(1e-2)
    # Adam's step count is made on the default device; place it on the mesh like the rest, so
    # that the restored state (whose leaves are committed to the target's devices) fits jit.
    opt_state = jax.tree.map(lambda x: put(x, m) if x.ndim == 0 else x, opt.init(params))
    return {"params": params, "opt": opt_state}, opt


def _train_step(opt):
    def loss_fn(params, x, y):
        return jnp.mean((jnp.tanh(x @ params["w1"]) @ params["w2"] - y) ** 2)

    def step(state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], x, y)
        updates, opt_state = opt.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt_state}, loss

    return jax.jit(step, donate_argnums=0)  # the saved buffers are donated right after save()


def _batch(m, step):
    x = jax.random.normal(jax.random.fold_in(jax.random.key(1), step), (32, 16))
    return put(x, m, "data", None), put(jnp.sin(x[:, :4] * 3), m, "data", None)


def test_sharded_training_resumes_with_the_uninterrupted_loss(tmp_path):
    m = mesh((4, 2), ("data", "model"))
    state, opt = _model(m)
    step_fn = _train_step(opt)
    uninterrupted = []
    for s in range(12):
        state, loss = step_fn(state, *_batch(m, s))
        uninterrupted.append(float(loss))

    state, _ = _model(m)
    with jaxckpt.CheckpointManager(tmp_path, save_interval_steps=3, max_to_keep=2) as mgr:
        for s in range(8):  # "crashes" after step 8, between checkpoints
            state, loss = step_fn(state, *_batch(m, s))
            assert float(loss) == uninterrupted[s]
            mgr.save(s + 1, state)
    del state

    fresh, _ = _model(m)  # a new process: a fresh state as the target of the restore
    mgr = jaxckpt.CheckpointManager(tmp_path, save_interval_steps=3, max_to_keep=2)
    start = mgr.latest_step()
    assert start == 6
    state = mgr.restore(target=fresh)
    resumed = []
    for s in range(start, 12):
        state, loss = step_fn(state, *_batch(m, s))
        resumed.append(float(loss))
    assert resumed == uninterrupted[start:]


DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_a_saved_step_is_never_replaced_force_included_as_the_faq_says(tmp_path):
    # faq.md said "without force=True", but force only skips save_interval_steps (31.9).
    with jaxckpt.CheckpointManager(tmp_path, save_interval_steps=2, async_save=False) as mgr:
        assert mgr.save(3, _state(3), force=True)
        with pytest.raises(
            jaxckpt.CheckpointExistsError,
            match=r"Step 3 is already saved .*never replaced, force=True included.*"
            r"save_interval_steps",
        ):
            mgr.save(3, _state(4), force=True)
    assert int(mgr.restore(3)["step"]) == 3
    faq = " ".join((DOCS / "faq.md").read_text().split())
    assert "saved twice without `force=True`" not in faq
    assert "saved twice, with or without `force=True`" in faq


def test_manager_md_retention_table_holds_for_jaxckpt_and_orbax(tmp_path):
    # keep_every_n_steps steps do not count toward max_to_keep; Orbax's keep_period steps do
    # (31.9). The table's example row is run against both libraries.
    ocp = pytest.importorskip("orbax.checkpoint")
    doc = (DOCS / "manager.md").read_text()
    assert "**Steps kept by `keep_every_n_steps` do not count toward `max_to_keep`.**" in doc
    example = r"^\| steps 2, 4, …, 12 saved, `max_to_keep=3`, K = 10 \| (.*) \| (.*) \|$"
    row = re.search(example, doc, re.M)
    ours, orbax = ([int(s) for s in cell.split(", ")] for cell in row.groups())
    kw = {"max_to_keep": 3, "save_interval_steps": 2}
    with jaxckpt.CheckpointManager(tmp_path / "j", keep_every_n_steps=10, **kw) as mgr:
        for s in range(1, 13):
            mgr.save(s, _state(s))
    assert mgr.all_steps() == ours == [6, 8, 10, 12]
    opts = ocp.CheckpointManagerOptions(keep_period=10, **kw)
    with ocp.CheckpointManager(tmp_path / "o", options=opts) as om:
        for s in range(1, 13):
            om.save(s, args=ocp.args.StandardSave({"w": np.zeros(2)}))
        om.wait_until_finished()
        assert om.all_steps() == orbax == [8, 10, 12]
        with pytest.raises(ocp.checkpoint_manager.StepAlreadyExistsError):  # as the FAQ says
            om.save(12, args=ocp.args.StandardSave({"w": np.zeros(2)}), force=True)
