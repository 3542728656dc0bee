"""Lost work per failure in each save mode, measured with the demo's training loop.

    .venv/bin/python benchmarks/lost_work.py --steps 200

It trains the demo's model (examples/demo.py: a small transformer over a (4, 2) mesh of 8
simulated CPU devices, batches from its Grain pipeline) once per mode, saving through a
``CheckpointManager`` with the pipeline's position (``iterators=``), and after every step asks
what a failure *at that instant* would cost: the steps trained since the newest committed step
(a step counts as committed once its save handle is done: its manifest is written), and the
seconds since that step's training ended. A failure strikes anywhere, so the table gives the
mean over all step boundaries (the expected loss) and the worst one. Modes:

- ``every 10 steps``: ``save_interval_steps=10`` (asynchronous saves);
- ``every step``: ``save_interval_steps=1`` (each save waits for the one before it);
- ``every 1 s``: ``save_interval_secs=1``;
- ``continuous``: ``save_interval_secs=0``, a save whenever the last one has committed.

``steps/s`` is the loop's rate with that mode (saves that wait for a previous one slow it).
A failure inside a step also loses that step's partial work, the same in every mode. Numbers
depend on the machine: the demo's step and save times set them. docs/manager.md cites a run.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

DEMO = Path(__file__).resolve().parent.parent / "examples" / "demo.py"
MODES: dict[str, dict[str, Any]] = {
    "every 10 steps": {"save_interval_steps": 10},
    "every step": {"save_interval_steps": 1},
    "every 1 s": {"save_interval_secs": 1.0},
    "continuous": {"save_interval_secs": 0},
}


def _demo() -> Any:
    """examples/demo.py as a module (it sets the 8 CPU devices before importing jax)."""
    spec = importlib.util.spec_from_file_location("jaxckpt_demo", DEMO)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def measure(demo: Any, kwargs: dict[str, Any], steps: int, warmup: int) -> dict[str, float]:
    """One mode: the demo's loop for ``steps`` steps; lost work sampled after each step."""
    import jaxckpt

    directory = tempfile.mkdtemp(prefix="jaxckpt-lost-")
    layout = demo.Layout("4x2")
    state, data = demo.initial_state(layout), demo.batches()
    fn = demo.step_fn(layout, state)
    handles: list[tuple[int, Any]] = []  # (step, its save handle), oldest first
    trained_at = {0: time.perf_counter()}  # step -> when its training ended
    lost_steps, lost_secs, committed, saves = [], [], 0, 0
    t0 = 0.0
    with jaxckpt.CheckpointManager(directory, max_to_keep=2, **kwargs) as mgr:
        for step in range(1, steps + 1):
            if step == warmup + 1:
                t0 = time.perf_counter()
            state, loss = fn(state, *demo.split(next(data), layout))
            float(loss)  # the step is done
            trained_at[step] = time.perf_counter()
            if mgr.save(step, state, iterators={"train": data}):
                handles.append((step, mgr.last_save))
                saves += 1
            while handles and handles[0][1].done():
                committed = handles.pop(0)[0]
            if step > warmup:  # a failure now would lose this much
                lost_steps.append(step - committed)
                lost_secs.append(time.perf_counter() - trained_at.get(committed, trained_at[0]))
        elapsed = time.perf_counter() - t0
    shutil.rmtree(directory, ignore_errors=True)
    n = len(lost_steps)
    return {
        "steps/s": n / elapsed,
        "saves": saves,
        "mean steps": sum(lost_steps) / n,
        "max steps": max(lost_steps),
        "mean s": sum(lost_secs) / n,
        "max s": max(lost_secs),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200, help="training steps per mode (200)")
    ap.add_argument("--warmup", type=int, default=10, help="steps not sampled (compiling)")
    ap.add_argument(
        "--modes", default=",".join(MODES), help="comma-separated, from: " + ", ".join(MODES)
    )
    args = ap.parse_args(argv)
    demo = _demo()
    print(f"{'mode':<16} {'steps/s':>8} {'saves':>6} {'lost steps: mean':>17} {'max':>4} "
          f"{'lost s: mean':>13} {'max':>6}")  # fmt: skip
    for name in args.modes.split(","):
        r = measure(demo, MODES[name], args.steps, args.warmup)
        print(f"{name:<16} {r['steps/s']:8.1f} {r['saves']:6.0f} {r['mean steps']:17.2f} "
              f"{r['max steps']:4.0f} {r['mean s']:13.3f} {r['max s']:6.3f}", flush=True)  # fmt: skip
    print(f"(python {sys.version.split()[0]}, {os.cpu_count()} CPUs, {args.steps} steps per mode)")


if __name__ == "__main__":
    main()
