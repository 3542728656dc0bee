"""Observing checkpoints (docs/observability.md): the ``jax.monitoring`` events of saves,
restores, ``metadata`` and manager steps, each step's timings kept in ``metrics.json`` and shown
by ``run_table`` and ``jaxckpt ls``, the restore's log line, and on a real 2-process group the
per-process timings the coordinator gathers and the straggler it names."""

from __future__ import annotations

import contextlib
import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from groups import run_group

import jaxckpt
from jaxckpt._cli.main import main
from jaxckpt._runtime import events

DOC = Path(__file__).resolve().parent.parent / "docs" / "observability.md"
SAVE = events.SAVE_DURATIONS
TOL = 0.02  # seconds: the few statements between two phases' clocks


@contextlib.contextmanager
def listening() -> Iterator[list[tuple[str, float | None, dict]]]:
    """Every jaxckpt event heard while inside: ``(name, seconds or value or None, attributes)``."""
    from jax._src import monitoring

    heard: list[tuple[str, float | None, dict]] = []

    def duration(name: str, secs: float, **kw: object) -> None:
        if name.startswith(events.PREFIX):
            heard.append((name, secs, kw))

    def plain(name: str, **kw: object) -> None:
        if name.startswith(events.PREFIX):
            heard.append((name, None, kw))

    jax.monitoring.register_event_duration_secs_listener(duration)
    jax.monitoring.register_scalar_listener(duration)
    jax.monitoring.register_event_listener(plain)
    try:
        yield heard
    finally:  # unregistering is public from jax 0.7, private before
        for kind, fn in (("event_duration", duration), ("scalar", duration), ("event", plain)):
            public = getattr(jax.monitoring, f"unregister_{kind}_listener", None)
            if public is not None:
                public(fn)
            else:
                getattr(monitoring, f"_unregister_{kind}_listener_by_callback")(fn)


def _by_name(heard: list) -> dict[str, float]:
    return {name: value for name, value, _ in heard}


def test_a_blocking_save_records_every_phase_and_they_add_up(tmp_path):
    with listening() as heard:
        jaxckpt.save(tmp_path / "c", {"w": jnp.ones((256, 256)), "step": 1})
    got = _by_name(heard)
    assert set(SAVE.values()) | set(events.SAVE_BYTES.values()) == set(got)
    assert all(v is not None and v >= 0 for v in got.values())
    phases = sum(got[SAVE[p]] for p in events.SAVE_PHASES)
    assert abs(phases - got[SAVE["total"]]) < TOL
    assert got[SAVE["blocking"]] == got[SAVE["total"]]
    assert got[events.SAVE_BYTES["written"]] == 256 * 256 * 4  # arrays only
    assert {kw["store"] for _, _, kw in heard} == {"local"}
    assert {kw["call"] for _, _, kw in heard} == {"save"}


def test_save_async_records_its_blocking_part_and_its_completion(tmp_path):
    with listening() as heard:
        h = jaxckpt.save_async("memory://events/c", {"w": jnp.ones((256, 256))})
        h.wait()
    got = _by_name(heard)
    assert set(SAVE.values()) <= set(got)
    t = h.timings
    assert got[SAVE["blocking"]] == t["blocking"] and got[SAVE["total"]] == t["total"]
    assert abs(t["plan"] + t["stage"] + t["wait"] - t["blocking"]) < TOL  # one process: no wait
    assert t["blocking"] <= t["total"] and t["write"] + t["commit"] <= t["total"]
    assert {kw["store"] for _, _, kw in heard} == {"memory"}
    assert {kw["call"] for _, _, kw in heard} == {"save_async"}


def test_restore_records_reading_and_placing_and_logs_one_line(tmp_path, caplog):
    w = np.arange(4096, dtype=np.float32)
    jaxckpt.save(tmp_path / "c", {"w": w})
    caplog.set_level(logging.INFO, logger="jaxckpt")
    with listening() as heard:
        s = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        out = jaxckpt.restore(tmp_path / "c", {"w": s})
        jaxckpt.metadata(tmp_path / "c")
    np.testing.assert_array_equal(out["w"], w)
    got = _by_name(heard)
    r = events.RESTORE_DURATIONS
    assert set(r.values()) | {events.RESTORE_BYTES, events.METADATA_DURATION} == set(got)
    parts = sum(got[r[p]] for p in events.RESTORE_PHASES)
    assert parts <= got[r["total"]] + 1e-6 and got[r["total"]] - parts < TOL
    assert got[events.RESTORE_BYTES] == w.nbytes
    lines = [m.getMessage() for m in caplog.records if m.getMessage().startswith("restored")]
    assert len(lines) == 1 and "'read'" in lines[0] and "'place'" in lines[0]


def test_manager_steps_record_events_and_keep_their_timings(tmp_path, capsys):
    d = tmp_path / "run"
    with listening() as heard, jaxckpt.CheckpointManager(d, max_to_keep=2) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"w": np.full(1024, step, np.float32)}, metrics={"loss": 1 / step})
        mgr.wait()
        mgr.restore()
    names = {name for name, _, _ in heard}
    assert set(events.MANAGER_DURATIONS.values()) <= names
    stored = json.loads((d / "metrics.json").read_text())["timings"]
    assert sorted(stored) == ["2", "3"]  # step 1's went with the step
    for record in stored.values():
        assert record["bytes_written"] == 4096 and record["bytes_reused"] == 0
        assert 0 <= record["blocking"] <= record["total"]
    table = jaxckpt.run_table(d)
    assert table.row(3).timings == stored["3"]
    assert table.to_json()["entries"][-1]["timings"] == stored["3"]
    assert main(["ls", str(d)]) == 0
    head, *rows = capsys.readouterr().out.splitlines()
    assert "TOOK" in head.split() and "BLOCKED" in head.split()
    assert re.search(r"\d+\.\d{3}s\s+\d+\.\d{3}s", rows[0])
    with jaxckpt.CheckpointManager(d) as mgr:
        mgr.pin(3)
        mgr.delete(2)
    assert sorted(json.loads((d / "metrics.json").read_text())["timings"]) == ["3"]


def test_nothing_is_recorded_without_a_listener():
    from jax._src import monitoring

    lists = ("get_event_duration_listeners", "get_scalar_listeners", "get_event_listeners")
    others = any(getattr(monitoring, g)() for g in lists)  # jax registers none by default
    assert events.listening() == others
    with listening():
        assert events.listening()
    assert events.listening() == others


def test_the_page_lists_every_event_name():
    written = set(re.findall(r"`(/jax/jaxckpt/[a-z_/]+)`", DOC.read_text()))
    assert written == set(events.all_names())


def test_stragglers_need_a_clear_margin():
    even = {0: {"write": 1.0}, 1: {"write": 1.2}, 2: {"write": 1.1}}
    assert events.stragglers(even) == []
    close = {0: {"write": 0.1}, 1: {"write": 0.9}, 2: {"write": 0.1}}  # 9x, but < 1 s more
    assert events.stragglers(close) == []
    slow = {0: {"write": 1.0}, 1: {"write": 4.0}, 2: {"write": 1.2}}
    assert events.stragglers(slow) == [("write", 1, 4.0, 1.1)]
    assert events.slowest(slow) == {"write": [1, 4.0]}


def test_two_processes_gather_their_timings_and_name_the_straggler(tmp_path):
    worker = Path(__file__).resolve().parent / "events_worker.py"
    zero, one = run_group(worker, "straggler", 2, tmp_path, 240)
    # Process 0 waited for process 1 while it planned: its waiting is not its planning.
    assert zero["timings"]["wait"] >= 1.0 and zero["timings"]["plan"] < 1.0
    assert one["timings"]["plan"] >= 1.5
    assert zero["slowest"]["plan"][0] == 1 and set(zero["processes"]) == {"0", "1"}
    assert one["processes"] == {} and one["slowest"] == {}  # only the coordinator gathers
    assert zero["processes"]["1"]["bytes"] == one["nbytes"]
    assert any("process 1 is a straggler: plan took it" in line for line in zero["log"])
    straggler = [kw for name, _, kw in zero["events"] if name == events.SAVE_STRAGGLER]
    assert straggler and straggler[0]["process"] == 1 and straggler[0]["phase"] == "plan"
    stored = json.loads((tmp_path / "run" / "metrics.json").read_text())["timings"]["1"]
    assert stored["bytes_written"] == 8 * 1024 * 4  # every process's, each byte once
    assert set(stored["slowest"]) >= {"plan", "stage", "write", "wait"}
