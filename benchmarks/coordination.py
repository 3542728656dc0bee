"""The coordination service's load per save: store operations per process, by group size.

    python benchmarks/coordination.py [--processes 2 4 8] [--leaves 3 300] [--saves 5]

For each group size, a real ``jax.distributed`` group on 127.0.0.1 (gloo, CPU devices) saves a
small state of each leaf count ``--saves`` times (each save to a new path, as a manager does),
after a barrier of jax's own (not counted). Each process counts the key-value store operations
jaxckpt makes (``jaxckpt._runtime.kvstore.operations``) during each save. The table shows, per
group and leaf count, the median operations per save of process 0 and the largest of the
other processes', and the median seconds of a save (this machine's, not a claim).

What the count should show: the others' operations do not grow with processes or leaves;
process 0's grow by one per process (its answer to each at the save's first step).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path


def worker(pid: int, n: int, port: int, work: Path, leaves: list[int], saves: int) -> dict:
    import jax
    import numpy as np
    from jax._src import distributed
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    import jaxckpt
    from jaxckpt._runtime import kvstore

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", n, pid, initialization_timeout=120)
    sharding = NamedSharding(Mesh(np.array(jax.devices()), ("d",)), PartitionSpec("d"))
    size = len(jax.devices()) * 4
    out: dict = {}
    for count in leaves:
        tree = {
            f"w{i}": jax.make_array_from_callback(
                (size,), sharding, lambda idx: np.zeros(size, np.float32)[idx]
            )
            for i in range(count)
        }
        ops, secs = [], []
        for k in range(saves):
            distributed.global_state.client.wait_at_barrier(f"bench {count} {k}", 120_000)
            before, t0 = kvstore.operations()["total"], time.perf_counter()
            jaxckpt.save(work / f"l{count}" / f"s{k}", tree)
            secs.append(time.perf_counter() - t0)
            ops.append(kvstore.operations()["total"] - before)
        out[str(count)] = {"ops": ops, "seconds": secs}
    return out


def group(n: int, work: Path, leaves: list[int], saves: int) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    env["JAX_PLATFORMS"] = "cpu"
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    args = [str(n), str(port), str(work / f"n{n}"), json.dumps(leaves), str(saves)]
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", str(i), *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for i in range(n)
    ]
    results = []
    for i, p in enumerate(procs):
        out, _ = p.communicate(timeout=1800)
        line = [x for x in out.splitlines() if x.startswith("RESULT ")]
        if not line:
            raise RuntimeError(f"process {i} of the group of {n} failed (exit {p.returncode})")
        results.append(json.loads(line[-1][len("RESULT ") :]))
    return results


def report(by_n: dict[int, list[dict]], leaves: list[int]) -> str:
    lines = [
        "| processes | leaves | ops per save, process 0 | ops per save, others (max) | save (s) |",
        "|---|---|---|---|---|",
    ]
    for n, results in by_n.items():
        for count in leaves:
            mine = [r[str(count)] for r in results]
            zero = statistics.median(mine[0]["ops"])
            others = max(max(m["ops"]) for m in mine[1:])
            secs = statistics.median(s for m in mine for s in m["seconds"])
            lines.append(f"| {n} | {count} | {zero:g} | {others} | {secs:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--leaves", type=int, nargs="+", default=[3, 300])
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--worker", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        pid, n, port, work, leaves, saves = args.worker
        got = worker(int(pid), int(n), int(port), Path(work), json.loads(leaves), int(saves))
        print("RESULT " + json.dumps(got), flush=True)
        import jax

        jax.distributed.shutdown()  # together: none is left waiting for a dead coordinator
        return
    import tempfile

    work = args.work or Path(tempfile.mkdtemp(prefix="jaxckpt-coordination-"))
    by_n = {n: group(n, work, args.leaves, args.saves) for n in args.processes}
    print(report(by_n, args.leaves))


if __name__ == "__main__":
    main()
