"""The ``tiers`` workload of compare.py: local vs persistent saves and recoveries, 4 processes.

A real ``jax.distributed`` group of 4 processes on 127.0.0.1 (gloo, 4 CPU devices each, one
(4, 4) mesh) holds a state of ``JAXCKPT_TIERS_MIB`` MiB (default 256): FSDP x TP matrices
and a replicated eighth. Each process has its own local directory; all share the persistent
one; everything is on this machine's one disk, so local and persistent saves write to the same
device and differ only in what they do. Measured on every process (the table shows the
slowest, which is what the training loop waits for):

* blocking time (``save()`` returns) and total time (``wait()`` returns) of a persistent save,
  of a local save without replicas, and of one with ``local_replicas=1``;
* recovery time: from the own local parts, with one process's local directory wiped (its part
  comes from its peer's replica), and from the persistent tier;
* elastic recovery (issue 46): a local step saved by the 4 processes with ``local_replicas=2``
  restored by a new group of 2 processes on the disks of processes 0 and 1, onto a (2, 8)
  mesh; beside it the same 2 processes restoring the persistent step; the bytes each moved and
  its peak RSS growth beyond the state it restores (VmHWM, reset before the restore);
* the elastic agreement's planning (``elastic_restore.plan_shares``, what process 0 computes)
  on simulated jobs of up to 1,000 processes x 1,000 leaves: its time, memory and the bytes
  through the coordinator (``simulate_plan``).

Then the expected work lost per failure, computed from the intervals (see docs/tiers.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _procfs import reset_peak, vm

N = 4
M = 2  # the elastic restart's process count


def _state(mib: int):
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()).reshape(N, -1), ("fsdp", "tp"))
    rows = max(64, int((mib << 20) / (7.125 * 4096)) // 64 * 64)
    leaves = {}
    for i in range(8):  # seven (rows, 1024) float32 over both axes, one eighth as big replicated
        spec = P() if i == 7 else P("fsdp", "tp")
        shape = (rows // 8 if i == 7 else rows, 1024)

        def box(idx, shape=shape, i=i):
            return np.full([len(range(*sl.indices(d))) for sl, d in zip(idx, shape)], i, np.float32)

        leaves[f"w{i}"] = jax.make_array_from_callback(shape, NamedSharding(mesh, spec), box)
    return leaves


def _abstract(state):
    import jax

    return {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in state.items()
    }


def _timed_saves(mgr, state, first: int, runs: int) -> dict:
    blocking, total = [], []
    for step in range(first, first + runs + 1):  # the first call is cold: not counted
        t0 = time.perf_counter()
        mgr.save(step, state)
        t1 = time.perf_counter()
        mgr.wait()
        t2 = time.perf_counter()
        if step > first:
            blocking.append(t1 - t0)
            total.append(t2 - t0)
    return {"blocking": statistics.median(blocking), "total": statistics.median(total)}


def worker(pid: int, port: int, work: Path, mib: int, runs: int) -> dict:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", N, pid, initialization_timeout=120)
    import logging

    import jaxckpt

    logging.basicConfig(level=logging.INFO)
    state, out = _state(mib), {}
    never = 10**9
    local = work / "local" / f"p{pid}"
    with jaxckpt.CheckpointManager(work / "persistent", max_to_keep=2) as mgr:
        out["persistent"] = _timed_saves(mgr, state, 0, runs)
    for name, replicas in (("local, no replica", 0), ("local + 1 replica", 1)):
        kw = dict(local_directory=local, local_replicas=replicas, local_max_to_keep=2)
        with jaxckpt.CheckpointManager(
            work / f"p-{replicas}", save_interval_steps=never, **kw
        ) as m:
            m.save(0, state)  # the persistent step 0 (due at any interval), not timed
            out[name] = _timed_saves(m, state, 1, runs)
    out["part_bytes"] = max(
        (
            sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
            for d in local.rglob(f"part-{pid}-of-{N}")
        ),
        default=0,
    )
    if pid == 0:  # the first local run done: its persistent steps go
        shutil.rmtree(work / "p-0", ignore_errors=True)
    kw = dict(local_directory=local, local_replicas=1, save_interval_steps=never)
    recovery = {}
    for name in ("local (own parts)", "local (one part from its peer)"):
        if name.startswith("local (one") and pid == 1:
            shutil.rmtree(local)
        t0 = time.perf_counter()
        with jaxckpt.CheckpointManager(work / "p-1", **kw) as m:
            m.restore(target=_abstract(state))
            assert m.restored_from.tier == "local", m.restored_from
        recovery[name] = time.perf_counter() - t0
    t0 = time.perf_counter()
    with jaxckpt.CheckpointManager(work / "persistent") as m:
        m.restore(target=_abstract(state))
    recovery["persistent"] = time.perf_counter() - t0
    out["recovery"] = recovery
    # Last (the recoveries above wipe process 1's disk): the step the elastic group restores.
    kw = dict(local_directory=local, local_replicas=2, local_max_to_keep=2)
    with jaxckpt.CheckpointManager(work / "p-2", save_interval_steps=never, **kw) as m:
        m.save(0, state)  # the persistent step 0, for the elastic phase to compare
        out["local + 2 replicas"] = _timed_saves(m, state, 1, runs)
    out["bytes"] = sum(x.nbytes for x in state.values())
    return out


def elastic_worker(pid: int, port: int, work: Path, mib: int) -> dict:
    """One of the M processes restarted on the disks of processes 0..M-1: the newest local step
    of ``p-2`` (saved by N) resharded onto an (M, 8) mesh, then the persistent step."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", M, pid, initialization_timeout=120)
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxckpt

    mesh = Mesh(np.array(jax.devices()).reshape(M, -1), ("fsdp", "tp"))
    shapes = {k: v.shape for k, v in _abstract_shapes(mib).items()}
    target = {
        k: jax.ShapeDtypeStruct(
            shape, np.float32, sharding=NamedSharding(mesh, P() if k == "w7" else P("fsdp", "tp"))
        )
        for k, shape in shapes.items()
    }
    out: dict = {}
    kw = dict(local_directory=work / "local" / f"p{pid}", local_replicas=2)
    for name, directory, tier in (("elastic", "p-2", "local"), ("persistent", "p-2", None)):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        base = vm("VmRSS")
        t0 = time.perf_counter()
        with jaxckpt.CheckpointManager(work / directory, **(kw if tier else {})) as m:
            got = m.restore(target=target)
            assert m.restored_from.tier == (tier or "persistent"), m.restored_from
            stats = m._local.last_elastic if tier else None
        out[name] = time.perf_counter() - t0
        mine = sum(s.data.nbytes for v in got.values() for s in v.addressable_shards)
        out[f"{name}_growth"] = [vm("VmHWM") - base, mine]
        for k, v in got.items():
            assert all(float(np.asarray(s.data).max()) == int(k[1:]) for s in v.addressable_shards)
        if stats is not None:
            out["moved"] = {"sent": stats.sent_bytes, "received": stats.received_bytes}
            out["moved"]["read_here"] = stats.read_bytes
        del got
    return out


def _abstract_shapes(mib: int) -> dict:
    rows = max(64, int((mib << 20) / (7.125 * 4096)) // 64 * 64)
    import jax
    import numpy as np

    return {
        f"w{i}": jax.ShapeDtypeStruct((rows // 8 if i == 7 else rows, 1024), np.float32)
        for i in range(8)
    }


def _group(n: int, work: Path, extra: list[str], name: str) -> list[dict]:
    """Start ``n`` processes of this script with ``extra`` arguments; their results."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={16 // n}"}
    env["JAX_PLATFORMS"] = "cpu"
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    logs = [open(work.parent / f"{name}-{i}.log", "w") for i in range(n)]  # noqa: SIM115
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(i), str(port), str(work), *extra],
            env=env,
            stdout=subprocess.PIPE,
            stderr=logs[i],
            text=True,
        )
        for i in range(n)
    ]
    results = []
    for i, p in enumerate(procs):
        out, _ = p.communicate(timeout=1800)
        logs[i].close()
        line = [x for x in out.splitlines() if x.startswith("RESULT ")]
        if p.returncode or not line:
            raise RuntimeError(
                f"tiers benchmark process {i} failed (exit {p.returncode}): see {logs[i].name}"
            )
        results.append(json.loads(line[-1][len("RESULT ") :]))
    return results


def run(work: Path, runs: int) -> list[dict]:
    mib = int(os.environ.get("JAXCKPT_TIERS_MIB", "256"))
    results = _group(N, work, [str(mib), str(runs)], "tiers-bench")
    elastic = _group(M, work, [str(mib), "0", "--elastic"], "tiers-elastic")
    for r in results:
        r["elastic"] = elastic
    return results


def lost_seconds(step_s: float, interval: int, save_total_s: float, recover_s: float) -> float:
    """Expected seconds of work lost per failure when restarting from a tier saved every
    ``interval`` steps: failures uniform in time land on average half an interval after the
    newest save; that save counts only once committed (``save_total_s`` later); the restart
    then spends ``recover_s`` restoring (docs/tiers.md, "Sizing the intervals")."""
    return interval * step_s / 2 + save_total_s + recover_s


def report(results: list[dict], runs: int) -> str:
    worst = {
        k: {m: max(r[k][m] for r in results) for m in ("blocking", "total")}
        for k in ("persistent", "local, no replica", "local + 1 replica", "local + 2 replicas")
    }
    mib = results[0]["bytes"] / 2**20
    lines = [
        f"### `tiers`: {N} processes x 4 CPU devices, {mib:.0f} MiB state, median of {runs}",
        "",
        "| save | blocking (s) | total (s) |",
        "|---|---:|---:|",
    ]
    lines += [f"| {k} | {v['blocking']:.3f} | {v['total']:.2f} |" for k, v in worst.items()]
    lines += ["", "| recovery from | time (s) |", "|---|---:|"]
    for k in results[0]["recovery"]:
        lines.append(f"| {k} | {max(r['recovery'][k] for r in results):.2f} |")
    rec = {k: max(r["recovery"][k] for r in results) for k in results[0]["recovery"]}
    lines += _elastic_report(results[0]["elastic"])
    local_total = worst["local + 1 replica"]["total"]
    part = max(r.get("part_bytes", 0) for r in results) / 2**20
    repl = local_total - worst["local, no replica"]["total"]
    peer = rec["local (one part from its peer)"] - rec["local (own parts)"]
    if part and repl > 0 and peer > 0:
        lines += [
            "",
            f"Replication, derived (total with a replica minus without): {N} parts of "
            f"{part:.0f} MiB at once in {repl:.2f} s, {N * part / repl:.0f} MiB/s in all; a peer "
            f"recovery's one part (from its peer minus own parts) at {part / peer:.0f} MiB/s.",
        ]
    lines += [
        "",
        "Expected work lost per failure, step time 1 s (local every k, persistent every n):",
    ]
    lines += ["", "| k | n | from local (s) | local lost too: from persistent (s) |"]
    lines += ["|---:|---:|---:|---:|"]
    for k, n in ((1, 100), (10, 100), (10, 1000)):
        a = lost_seconds(1, k, local_total, rec["local (one part from its peer)"])
        b = lost_seconds(1, n, worst["persistent"]["total"], rec["persistent"])
        lines.append(f"| {k} | {n} | {a:.1f} | {b:.0f} |")
    return "\n".join(lines) + "\n"


def _elastic_report(elastic: list[dict]) -> list[str]:
    """The elastic rows. Peak RSS growth is measured for the elastic restore only, the first
    thing its processes do: the persistent restore after it reuses the memory it freed."""
    mib = 1 << 20
    sent = " / ".join(f"{r['moved']['sent'] / mib:.0f}" for r in elastic)
    growth = " / ".join(
        f"{g / mib:.0f} ({s / mib:.0f})" for g, s in (r["elastic_growth"] for r in elastic)
    )
    return [
        "",
        f"Elastic recovery: the local step of the {N} processes (`local_replicas=2`) restored by "
        f"{M} processes on the disks of processes 0..{M - 1}, onto an ({M}, {16 // M}) mesh:",
        "",
        "| recovery, 4 -> 2 processes | time (s) |",
        "|---|---:|",
        f"| local, resharded | {max(r['elastic'] for r in elastic):.2f} |",
        f"| persistent | {max(r['persistent'] for r in elastic):.2f} |",
        "",
        f"Per process: MiB sent {sent}; peak RSS growth of the elastic restore, MiB (the state "
        f"it restored, counted per device): {growth}.",
    ]


def simulate_plan(n_old: int, n_new: int, leaves: int, devices: int = 8, layouts: int = 10) -> dict:
    """The elastic agreement's planning on a simulated job: ``leaves`` FSDP leaves (of
    ``layouts`` distinct widths, as a model's layers share a few shapes) saved by ``n_old``
    processes x ``devices`` and restored onto ``n_new`` (each part held by its owner and the
    next process, the old processes 0..n_new-1 surviving).

    Timed, each with its peak RSS growth: what process 0 computes
    (``elastic_restore.plan_shares``: the descriptions merged, the leaves grouped into
    layouts, the plan, every share), and what the last process computes of the plan: its
    description of one part (``part_description``) and its share expanded to its leaves
    (``elastic_moves.share_of``). The other holders' descriptions are built directly (the
    same JSON). Returns seconds, bytes through the coordinator per process and in all."""
    from jaxckpt._runtime import collector
    from jaxckpt._tiers import elastic_moves, elastic_restore

    rows = n_old * n_new * devices  # one row per box on both sides at least
    per_old, per_new = rows // (n_old * devices), rows // (n_new * devices)
    width = [256 * (1 + t) for t in range(layouts)]

    def boxes(t: int, first: int, per: int) -> list:
        return [
            ((r * per, 0), (per, width[t])) for r in range(first * devices, (first + 1) * devices)
        ]

    holders = {q: [h for h in (q, (q + 1) % n_old) if h < n_new] for q in range(n_old)}
    holders = {q: h or [q % n_new] for q, h in holders.items()}  # the rest: on some survivor
    of = [i % layouts for i in range(leaves)]
    of_posted = elastic_restore.part_description(  # the group numbers, as posted
        [[((t,), (1,))] for t in of], dict.fromkeys(range(leaves), ("float32", ()))
    )["of"]
    described: dict[int, dict] = {}
    for q in range(n_old):
        groups = [
            [[list(map(list, b)) for b in boxes(t, q, per_old)], "float32", []]
            for t in range(layouts)
        ]
        described.setdefault(holders[q][0], {"parts": {}})["parts"][str(q)] = {
            "groups": groups,
            "of": of_posted,
        }
    described[holders[0][0]]["leaves"] = [
        [f"layer{i // layouts}/w{i % layouts}", "array", [rows, width[i % layouts]], "float32", ""]
        for i in range(leaves)
    ]
    posted = {p: json.dumps(described.get(p, {"parts": {}})) for p in range(n_new)}
    del described

    def wanted(got):
        return of, [{p: boxes(t, p, per_new) for p in range(n_new)} for t in range(layouts)]

    def plan() -> tuple:  # as elastic_restore.decide calls it: the collector paused
        with collector.paused():
            return elastic_restore.plan_shares(posted, holders, wanted, n_new)

    zero = _measured(plan)
    common, own = zero.pop("result")
    assert "fallback" not in common, common
    last = n_new - 1
    data = dict.fromkeys(range(leaves), ("float32", ()))
    describe = _measured(
        lambda: elastic_restore.part_description(
            [boxes(i % layouts, last, per_old) for i in range(leaves)], data
        )
    )
    share = _measured(lambda: elastic_moves.share_of(json.loads(common), own[last]))
    through = [len(posted[p]) + len(common) + len(own[p]) for p in range(n_new)]
    return {
        "seconds": zero["seconds"],
        "cpu_s": zero["cpu"],  # what the plan costs, less the waits of a shared machine
        "growth": zero["growth"],
        "other_s": describe["seconds"] + share["seconds"],
        "other_growth": max(describe["growth"], share["growth"]),
        "per_process": max(through),
        "share_bytes": max(len(v) for v in own.values()),
        "common_bytes": len(common),
        "posted_bytes": max(len(v) for v in posted.values()),
        "total_bytes": sum(through),
        "reads": len(share["result"][1].reads),
    }


def _measured(fn) -> dict:
    """``fn()``'s result, seconds (wall and this process's CPU) and peak RSS growth (VmHWM
    reset first)."""
    import gc

    gc.collect()
    reset_peak()
    base = vm("VmRSS")
    t0, c0 = time.perf_counter(), time.process_time()
    result = fn()
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"result": result, "seconds": seconds, "cpu": cpu, "growth": max(vm("VmHWM") - base, 0)}


PLAN_SCALES = ((4, 2), (64, 32), (256, 128), (1000, 500))


def plan_report(leaves: int = 1000, layouts: int = 10) -> str:
    lines = [
        f"Elastic plan on simulated jobs (process 0's work: {leaves} leaves of {layouts} layouts, "
        "8 devices per process, every part on 2 disks):",
        "",
        "| processes old -> new | saved boxes | plan (s) | of it CPU (s) | process 0 peak RSS growth (MiB) "
        "| per process through the coordinator (KiB) | of it: posted / verdict / share (KiB) "
        "| in all (MiB) | last process (s) | its peak RSS growth (MiB) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    kib, mib = 1024, 1 << 20
    for n_old, n_new in PLAN_SCALES:
        got = simulate_plan(n_old, n_new, leaves, layouts=layouts)
        lines.append(
            f"| {n_old} -> {n_new} | {n_old * 8 * leaves:,} | {got['seconds']:.2f} | "
            f"{got['cpu_s']:.2f} | "
            f"{got['growth'] / mib:.0f} | {got['per_process'] / kib:.0f} | "
            f"{got['posted_bytes'] / kib:.0f} / {got['common_bytes'] / kib:.0f} / "
            f"{got['share_bytes'] / kib:.0f} | {got['total_bytes'] / mib:.1f} | "
            f"{got['other_s']:.3f} | {got['other_growth'] / mib:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main(args) -> str:
    work = Path(args.dir or "/tmp") / "tiers-bench"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        text = report(run(work, max(1, args.runs)), max(1, args.runs)) + "\n" + plan_report()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(text)
    return text


if __name__ == "__main__":
    ap = argparse.ArgumentParser(
        description="One process of the tiers benchmark; run() starts all of them. For the "
        "whole benchmark run `python benchmarks/compare.py --workload tiers`."
    )
    ap.add_argument("pid", type=int, help=f"this process's index, 0 to {N - 1}")
    ap.add_argument("port", type=int, help="the jax.distributed coordinator's port")
    ap.add_argument("work", type=Path, help="the folder the checkpoints go under")
    ap.add_argument("mib", type=int, help="the state's size in MiB")
    ap.add_argument("runs", type=int, help="timed saves per kind")
    ap.add_argument("--elastic", action="store_true", help=f"be one of the {M} restarted ones")
    a = ap.parse_args()
    if a.elastic:
        result = elastic_worker(a.pid, a.port, a.work, a.mib)
    else:
        result = worker(a.pid, a.port, a.work, a.mib, a.runs)
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)
