"""A training loop over a real Grain pipeline, killed with SIGKILL mid-run and resumed from its
latest step, trains on exactly the batches of an uninterrupted run (tests/resume_worker.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import resume_worker

WORKER = Path(__file__).parent / "resume_worker.py"
STEPS = 60


def _env() -> dict:
    root = str(Path(__file__).resolve().parent.parent)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def _lines(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines() if line.endswith("}")]


def _committed(run: Path) -> list[int]:
    return sorted(int(n) for n in os.listdir(run) if n.isdigit()) if run.exists() else []


def test_killed_run_resumes_on_the_same_batches(tmp_path):
    run, log = tmp_path / "run", tmp_path / "log.jsonl"
    cmd = [sys.executable, str(WORKER), str(run), str(log), str(STEPS)]
    first = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300  # generous: the machine may be loaded
    while time.monotonic() < deadline and first.poll() is None:
        steps = [r["step"] for r in _lines(log) if "step" in r] if log.exists() else []
        if len(steps) >= STEPS // 3 and _committed(run):
            break
        time.sleep(0.05)
    assert first.poll() is None, first.stdout.read().decode()[-3000:]
    os.kill(first.pid, signal.SIGKILL)  # mid-run: no chance to finish a save or close
    first.wait()
    first.stdout.close()
    killed = [r for r in _lines(log) if "step" in r]
    assert killed[-1]["step"] < STEPS  # it was stopped before the end

    done = subprocess.run(cmd, env=_env(), capture_output=True, timeout=300)
    assert done.returncode == 0, done.stdout.decode()[-3000:] + done.stderr.decode()[-3000:]
    records = _lines(log)
    starts = [i for i, r in enumerate(records) if "resumed_from" in r]
    assert len(starts) == 2
    resumed_from = records[starts[1]]["resumed_from"]
    assert 0 < resumed_from <= killed[-1]["step"]  # from a committed step, not from scratch
    second = [r for r in records[starts[1] :] if "step" in r]
    assert second[0]["step"] == resumed_from + 1 and second[-1]["step"] == STEPS

    # The uninterrupted run, here: one pipeline, never restored.
    it, state, reference = resume_worker.pipeline(), resume_worker.fresh(), []
    for _ in range(STEPS):
        batch = next(it)
        reference.append(batch.tolist())
        state = resume_worker.train(state, batch)
    redone = {r["step"]: r["batch"] for r in second}
    for r in killed:  # steps trained before the kill and again after it: the same batches
        if r["step"] in redone:
            assert redone[r["step"]] == r["batch"], r["step"]
    trained = [r["batch"] for r in killed if r["step"] <= resumed_from] + [
        r["batch"] for r in second
    ]
    assert trained == reference  # batch contents, in order, exactly
    final = records[-1]
    assert final["final_h"] == state["h"]
    assert np.array_equal(np.float32(final["final_w"]), np.asarray(state["w"]))
