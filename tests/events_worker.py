"""One process of a 2-process JAX group for tests/test_events.py (run as a script).

    python tests/events_worker.py STAGE PROCESS_ID NUM_PROCESSES PORT WORKDIR

Stage ``straggler``: process 1 sleeps in its planner's first step, so it is the save's
straggler in ``plan``; each process records what it saw (its handle's timings, the
coordinator's per-process view, the events its listeners heard, the ``jaxckpt`` log) into
``WORKDIR/STAGE-PID.json``; then a ``CheckpointManager`` step, whose ``metrics.json`` record the
test reads.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

import groups
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt

SLEEP_S = 1.5


class SlowPlanner(jaxckpt.DefaultSavePlanner):
    """Process 1's planner: its first step takes ``SLEEP_S`` longer."""

    def set_up_planner(self, tree, *, process_index, process_count):  # type: ignore[override]
        time.sleep(SLEEP_S)
        super().set_up_planner(tree, process_index=process_index, process_count=process_count)


class Heard(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def state() -> dict:
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))
    x = jnp.arange(8 * 1024, dtype=jnp.float32).reshape(8, 1024)
    sharded = jax.make_array_from_callback(x.shape, NamedSharding(mesh, P("d")), lambda i: x[i])
    return {"w": sharded, "step": 3}


def main(argv: list[str]) -> None:
    stage, pid, n, port, work = argv[0], int(argv[1]), int(argv[2]), int(argv[3]), Path(argv[4])
    groups.join(pid, n, port)
    events: list[list] = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, secs, **kw: events.append([name, secs, kw]) if "jaxckpt" in name else None
    )
    jax.monitoring.register_event_listener(
        lambda name, **kw: events.append([name, None, kw]) if "jaxckpt" in name else None
    )
    heard = Heard()
    logger = logging.getLogger("jaxckpt")
    logger.addHandler(heard)
    logger.setLevel(logging.INFO)
    planner = SlowPlanner() if pid == 1 else None
    h = jaxckpt.save_async(str(work / "ckpt"), state(), planner=planner)
    h.wait()
    run = work / "run"
    with jaxckpt.CheckpointManager(str(run)) as mgr:
        mgr.save(1, state())
    record = {
        "timings": h.timings,
        "nbytes": h.nbytes,
        "processes": {str(p): t for p, t in h.processes.items()},
        "slowest": h.slowest,
        "events": events,
        "log": heard.lines,
    }
    (work / f"{stage}-{pid}.json").write_text(json.dumps(record))
    try:  # process 0 hosts the coordination service: nobody exits before the others
        from jax._src import distributed

        distributed.global_state.client.wait_at_barrier("end", 60_000)
    except Exception:  # noqa: BLE001 - a process that never came: its record says why
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
