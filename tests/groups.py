"""Real ``jax.distributed`` process groups on 127.0.0.1 for the multi-host tests.

Each worker script takes ``STAGE PROCESS COUNT PORT WORKDIR``, runs its stage as one process of
the group and writes its record to ``WORKDIR/STAGE-PROCESS.json``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_group(worker: Path, stage: str, n: int, work: Path, timeout_s: float) -> list[dict]:
    """Run ``n`` processes of ``worker``'s ``stage`` (4 CPU devices each); their records.

    A group that has not ended after ``timeout_s`` is killed and the test fails with the tail
    of every process's log.
    """
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    root = str(Path(__file__).resolve().parent.parent)
    env.update(
        XLA_FLAGS="--xla_force_host_platform_device_count=4",
        JAX_PLATFORMS="cpu",
        JAXCKPT_SYNC_TIMEOUT="60",  # a hang becomes an error long before timeout_s
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p),
    )
    port = free_port()
    procs, logs = [], []
    for i in range(n):
        log = open(work / f"{stage}-{i}.log", "wb")  # noqa: SIM115 - closed below
        logs.append(log)
        cmd = [sys.executable, str(worker), stage, str(i), str(n), str(port), str(work)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            p.wait(timeout=max(deadline - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
                p.wait()
        pytest.fail(f"group {stage} hung; logs:\n{tails(stage, n, work)}")
    finally:
        for log in logs:
            log.close()
    records = []
    for i in range(n):
        path = work / f"{stage}-{i}.json"
        if not path.exists():
            pytest.fail(f"process {i} of {stage} wrote no record; logs:\n{tails(stage, n, work)}")
        records.append(json.loads(path.read_text()))
    return records


def tails(stage: str, n: int, work: Path) -> str:
    return "\n".join(
        f"--- {stage} process {i}:\n" + (work / f"{stage}-{i}.log").read_text()[-3000:]
        for i in range(n)
    )


def join(pid: int, n: int, port: int) -> None:
    """In a worker: become process ``pid`` of ``n`` (gloo CPU collectives).

    Recoverability (jax >= 0.7.1) keeps JAX from terminating every process once one dies
    (docs/multihost.md); older jax (the floor) has neither it nor the timeouts (>= 0.7.0).
    """
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    timeouts = {}
    if "jax_enable_recoverability" in jax.config.values:
        jax.config.update("jax_enable_recoverability", True)
        timeouts = dict(heartbeat_timeout_seconds=60, shutdown_timeout_seconds=10)
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        coordinator_bind_address=f"127.0.0.1:{port}",
        num_processes=n,
        process_id=pid,
        initialization_timeout=60,
        **timeouts,
    )
