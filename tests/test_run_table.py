"""A run at a glance: ``jaxckpt.run_table`` and ``jaxckpt ls RUN`` (status, tiers, save time,
size and bytes added, metrics, best and pinned marks), on local disks and on moto S3."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from helpers import HtmlTable, one_array_per_leaf  # noqa: F401 (autouse)
from test_s3 import BUCKET, keys, prefix, s3  # noqa: F401  (fixtures: the moto server)

import jaxckpt
from jaxckpt._cli.main import main

FROZEN = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)  # 256 KiB


def state(step: int) -> dict:
    return {"frozen": FROZEN, "adapter": np.full((16, 16), step, np.float32), "step": step}


def _run(directory, steps=(1, 2, 3), **kwargs):
    with jaxckpt.CheckpointManager(directory, async_save=False, **kwargs) as mgr:
        for s in steps:
            mgr.save(s, state(s), metrics={"loss": 1.0 / s, "acc": s / 10})
    return directory


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_rows_carry_status_metrics_time_and_bytes(tmp_path):
    t0 = time.time()
    d = _run(tmp_path / "run")
    (tmp_path / "run" / "00000004" / "arrays").mkdir(parents=True)  # a save that died
    table = jaxckpt.run_table(tmp_path / "run")
    assert [(r.name, r.step, r.status) for r in table.rows] == [
        ("00000001", 1, "committed"),
        ("00000002", 2, "committed"),
        ("00000003", 3, "committed"),
        ("00000004", 4, "incomplete"),
    ]
    r2 = table.row(2)
    assert r2.metrics == {"acc": 0.2, "loss": 0.5} and r2.tiers == ("persistent",)
    assert t0 - 5 <= r2.saved <= time.time() + 5
    on_disk = sum(f.stat().st_size for f in (d / "00000002").rglob("*") if f.is_file())
    assert r2.nbytes == r2.added == on_disk  # not incremental: nothing shared
    assert table.total_bytes == sum(r.added for r in table.rows)
    assert table.steps == [1, 2, 3] and not any(r.best or r.pinned for r in table.rows)
    with pytest.raises(KeyError, match="step 9 is not in"):
        table.row(9)


def test_incremental_steps_count_shared_bytes_once(tmp_path):
    d = _run(tmp_path / "run", incremental=True)
    table = jaxckpt.run_table(d)
    r1, r2, r3 = table.rows
    assert r2.base == "00000001" and r2.reused_bytes >= FROZEN.nbytes
    assert r1.added >= FROZEN.nbytes > r2.added and r2.added < FROZEN.nbytes
    assert r1.nbytes == r1.added and r2.nbytes > r2.added  # it holds, but does not add, FROZEN
    on_disk = {}  # every file once, by inode
    for f in d.rglob("*"):
        if f.is_file() and f.name != "metrics.json":
            on_disk[f.stat().st_ino] = f.stat().st_size
    assert table.total_bytes == sum(on_disk.values())


def test_best_and_pinned_marks(tmp_path):
    d = _run(tmp_path / "run")
    with jaxckpt.CheckpointManager(d) as mgr:
        mgr.pin(1)
    table = jaxckpt.run_table(d, best="loss")
    assert [(r.step, r.best, r.pinned) for r in table.rows] == [
        (1, False, True),
        (2, False, False),
        (3, True, False),
    ]
    assert jaxckpt.run_table(d, best="acc", best_mode="max").row(3).best
    assert jaxckpt.run_table(d, best=lambda m: -m["acc"]).row(3).best  # min of -acc
    with pytest.raises(
        jaxckpt.InvalidArgumentError,
        match="best='nosuchmetric': no committed step of the run has a metric 'nosuchmetric' "
        "to rank by; their metrics are 'acc', 'loss': name one of those",
    ):
        jaxckpt.run_table(d, best="nosuchmetric")
    with pytest.raises(ValueError, match="best_mode must be 'min' or 'max', got 'median'"):
        jaxckpt.run_table(d, best="loss", best_mode="median")


def test_ls_best_with_a_metric_no_step_has_says_so(tmp_path, capsys):
    d = _run(tmp_path / "run")
    code, out, err = run(capsys, "ls", d, "--best", "los")
    assert code == 2 and not out
    assert "error: --best los: no committed step of the run has a metric 'los'" in err
    assert "their metrics are 'acc', 'loss'" in err
    with jaxckpt.CheckpointManager(tmp_path / "bare") as mgr:
        mgr.save(1, {"w": np.zeros(2)})
    code, _, err = run(capsys, "ls", tmp_path / "bare", "--best", "loss")
    assert code == 2 and "none was saved with metrics" in err


def test_ls_prints_the_table_and_a_total_line(tmp_path, capsys):
    d = _run(tmp_path / "run", incremental=True)
    code, out, _ = run(capsys, "ls", d, "--best", "loss")
    lines = out.splitlines()
    assert code == 0
    assert lines[0].split() == [
        "NAME", "STATUS", "SIZE", "ADDED", "SAVED", "TIERS", "MARKS", "TOOK", "BLOCKED", "METRICS",
        "BASE",
    ]  # fmt: skip
    assert "best" in lines[3] and "acc=0.3 loss=0.3333" in lines[3]
    assert "00000002 (" in lines[3] and "reused)" in lines[3]
    assert lines[-1].startswith("total: 3 entries (3 committed), ") and "stored" in lines[-1]
    code, out, _ = run(capsys, "ls", "--json", "--best", "acc:max", d)
    doc = json.loads(out)
    rows = {e["name"]: e for e in doc["entries"]}
    assert rows["00000003"]["best"] is True and rows["00000001"]["metrics"]["loss"] == 1.0
    assert rows["00000002"]["tiers"] == ["persistent"] and rows["00000002"]["base"] == "00000001"
    assert rows["00000002"]["saved_utc"].endswith("Z")
    assert doc["total_bytes"] == sum(e["added"] for e in doc["entries"])


def test_ls_errors_name_the_flag(tmp_path, capsys):
    d = _run(tmp_path / "run", steps=(1,))
    code, _, err = run(capsys, "ls", d, "--best", "loss:median")
    assert code == 2 and "--best loss:median: say NAME, NAME:min or NAME:max" in err
    code, _, err = run(capsys, "ls", d / "00000001")
    assert code == 2 and "is itself a checkpoint" in err and "jaxckpt inspect" in err
    with pytest.raises(jaxckpt.CheckpointError, match=r"itself a checkpoint.*jaxckpt\.metadata"):
        jaxckpt.run_table(d / "00000001")
    with pytest.raises(jaxckpt.CheckpointNotFoundError, match="is not a directory"):
        jaxckpt.run_table(tmp_path / "absent")


def test_local_tier_is_shown_when_its_directory_is_given(tmp_path, capsys):
    d = tmp_path / "run"
    with jaxckpt.CheckpointManager(
        d, async_save=False, local_directory=tmp_path / "local", save_interval_steps=2,
        local_save_interval_steps=1,
    ) as mgr:  # fmt: skip
        for s in (1, 2, 3, 4):
            mgr.save(s, state(s))
    table = jaxckpt.run_table(d, local_directory=tmp_path / "local")
    tiers = {r.step: r.tiers for r in table.rows}  # the local tier keeps 2 steps: 3 and 4
    assert tiers == {2: ("persistent",), 3: ("local",), 4: ("persistent", "local")}
    assert [r.status for r in table.rows] == ["committed"] * 3
    assert jaxckpt.run_table(d).row(4).tiers == ("persistent",)
    assert [r.step for r in jaxckpt.run_table(d).rows] == [2, 4]
    code, out, _ = run(capsys, "ls", d, "--local", tmp_path / "local")
    assert code == 0 and "persistent,local" in out
    code, _, err = run(capsys, "ls", d, "--local", tmp_path / "nolocal")
    assert code == 2 and f"--local {tmp_path / 'nolocal'} is not a directory" in err
    with pytest.raises(jaxckpt.CheckpointNotFoundError, match="local_directory '.*nolocal'"):
        jaxckpt.run_table(d, local_directory=tmp_path / "nolocal")


def test_notebook_view_is_a_parsed_table_and_repr_is_short(tmp_path):
    d = _run(tmp_path / "run")
    table = jaxckpt.run_table(d, best="loss")
    p = HtmlTable(table._repr_html_())
    assert p.rows[0][:3] == ["NAME", "STATUS", "SIZE"]
    assert [r[0] for r in p.rows[1:]] == ["00000001", "00000002", "00000003"]
    assert "best" in p.rows[3]
    text = repr(table)
    assert "\n" not in text and "3 committed steps, latest 3, best 00000003" in text
    assert str(table).splitlines()[-1].startswith("total:")


# object stores: retired steps -------------------------------------------------------------------


def test_s3_retired_step_is_listed_as_retired_with_its_holders(s3, prefix, capsys):  # noqa: F811
    url = f"s3://{BUCKET}/{prefix}"
    with jaxckpt.CheckpointManager(url, max_to_keep=2, incremental=True) as mgr:
        for step in range(1, 5):
            mgr.save(step, state(step), metrics={"loss": 1.0 / step})
            mgr.wait()
    stored = keys(s3, prefix)
    assert "00000001/manifest.json" not in stored  # retention deleted it, arrays held
    table = jaxckpt.run_table(url)
    rows = {r.name: r for r in table.rows}
    assert set(rows) == {"00000001", "00000003", "00000004"}
    r1 = rows["00000001"]
    assert r1.status == "retired" and r1.held_by == ("00000003", "00000004")
    assert r1.added == r1.nbytes == FROZEN.nbytes  # what the others reference, once
    r4 = rows["00000004"]
    assert r4.needs == ("00000001",) and r4.nbytes - r4.added == FROZEN.nbytes
    assert table.total_bytes == sum(r.added for r in table.rows)
    code, out, _ = run(capsys, "ls", url)
    line = next(x for x in out.splitlines() if x.startswith("00000001"))
    assert code == 0 and "retired (arrays held by 00000003, 00000004)" in line
    assert "incomplete" not in out
    # diff: what both read from the same held arrays is equal without a read
    d = jaxckpt.diff(f"{url}/00000003", f"{url}/00000004")
    assert d.arrays["frozen"].equal and d.arrays["frozen"].skipped == d.arrays["frozen"].chunks
    assert not d.arrays["adapter"].equal and d.values == {"step": (3, 4)}


def test_s3_unfinished_save_is_still_incomplete(s3, prefix, capsys):  # noqa: F811
    url = f"s3://{BUCKET}/{prefix}"
    jaxckpt.save(f"{url}/00000001", state(1))
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}/00000002/arrays/adapter/zarr.json", Body=b"{}")
    rows = jaxckpt.run_table(url).rows
    assert [(r.name, r.status, r.nbytes) for r in rows][1] == ("00000002", "incomplete", None)
