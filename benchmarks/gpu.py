"""jaxckpt and Orbax on whatever backend jax finds (a GPU on a lent machine): one table.

Per library, in a fresh process each: how long ``save_async`` blocks against the
device-to-host floor (``jax.device_get`` of fresh copies of the same arrays) and the state's
bytes ÷ that time (the rate at which it comes off the devices), blocking and async save GB/s,
restore GB/s onto the saving mesh and onto a resharded one, and peak host RSS growth. Then
jaxckpt's ``save_async(..., max_host_bytes=N)`` for each ``--budget-mib`` (default: an eighth
of the state; chunks of at most a quarter of it), in a fresh process each: its blocking time,
that rate, the whole save and the peak host RSS growth, which the budget bounds (docs/manager.md, "Asynchronous saves"). Medians
of ``--runs`` calls after a first (cold) one, the range in brackets.

    python benchmarks/gpu.py --out docs/gpu-h100.md        # a lent GPU: ~2 GiB, 3 runs, N=256 MiB
    python benchmarks/gpu.py                               # CPU: short mode, a smoke test

On the CPU backend it runs in a short mode (16 MiB, 1 run, 8 simulated devices): the table's
shape is what ``tests/test_gpu_bench.py`` checks, its times mean nothing. Orbax may be
missing (a device machine has no package registry): its row then says "orbax: not installed".
State: 16 float32 leaves of (rows, 1024) with random contents, made on the devices, sharded by
rows over all devices (mesh (n, 1)); the resharded restore targets mesh (1, n), so every
target shard straddles every saved one (needs n > 1).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from _procfs import reset_peak, vm

os.environ["XLA_FLAGS"] = (  # CPU only: 8 simulated devices, as the test suite has
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
LIBS = ("jaxckpt", "orbax")
LEAVES, COLS = 16, 1024
SHORT_MIB = 16


# --- worker: one library in one process ------------------------------------------------------


def _state(mib: int):
    """``LEAVES`` random float32 arrays of (rows, COLS) made on the devices; the meshes."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    devs = np.array(jax.devices())
    n = devs.size
    rows = max(n, mib * 2**20 // (LEAVES * COLS * 4) // n * n)
    meshes = {"save": Mesh(devs.reshape(n, 1), ("a", "b"))}
    if n > 1 and COLS % n == 0:
        meshes["reshard"] = Mesh(devs.reshape(1, n), ("a", "b"))
    shard = {k: NamedSharding(m, P("a", "b")) for k, m in meshes.items()}
    make = jax.jit(
        lambda key: jax.random.uniform(key, (rows, COLS), dtype=np.float32),
        out_shardings=shard["save"],
    )
    keys = jax.random.split(jax.random.key(0), LEAVES)
    state = {f"w{i:02d}": make(keys[i]) for i in range(LEAVES)}
    targets = {
        k: {name: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s) for name, x in state.items()}
        for k, s in shard.items()
    }
    return jax.block_until_ready(state), targets


class _Peak:
    """Peak RSS growth of a phase: VmHWM reset through /proc/self/clear_refs where allowed
    (else the peak since start, which can hide a phase's growth: then ``reset`` is False)."""

    def __enter__(self):
        self.reset = reset_peak()
        self.base = vm("VmRSS")
        return self

    def __exit__(self, *exc) -> None:
        self.growth = max(vm("VmHWM") - self.base, 0)


def _timed(fn, runs: int) -> list[float]:
    """Seconds of ``runs`` + 1 calls of ``fn(r)``; the first is the cold one."""
    times = []
    for r in range(runs + 1):
        t = time.perf_counter()
        fn(r)
        times.append(time.perf_counter() - t)
    return times


def _saves(lib, state, root: str, runs: int, budget: int | None = None) -> dict:
    """Blocking saves, then async ones (only these, within ``budget`` host bytes, if given)."""
    out, blocked = {}, []

    def save(r: int) -> None:
        shutil.rmtree(f"{root}/save", ignore_errors=True)
        lib.save(f"{root}/save", state)

    def save_async(r: int) -> None:
        t = time.perf_counter()
        if budget is None:
            wait = lib.save_async(f"{root}/async-{r}", state)
        else:
            # chunks of at most a quarter of the budget: a few in the ring at once, so that
            # copies off the devices overlap the writes (docs/manager.md)
            planner = lib.mod.DefaultSavePlanner(max_chunk_bytes=min(64 << 20, budget // 4))
            path = f"{root}/async-{r}"
            wait = lib.mod.save_async(path, state, planner=planner, max_host_bytes=budget).wait
        blocked.append(time.perf_counter() - t)
        wait()
        shutil.rmtree(f"{root}/async-{r}")

    if budget is None:
        with _Peak() as p:
            out["save"] = _timed(save, runs)
        out["rss_save"] = p.growth
    with _Peak() as p:
        out["async_total"] = _timed(save_async, runs)
    out["async_blocks"], out["rss_async"], out["rss_reset"] = blocked, p.growth, p.reset
    return out


def _check(name: str, kind: str, got: dict, state: dict, target: dict) -> None:
    """Raise unless ``got`` holds ``state``'s values with ``target``'s shardings (not timed)."""
    import jax.numpy as jnp

    for key, x in got.items():
        same = x.sharding.is_equivalent_to(target[key].sharding, x.ndim)
        if not same or not bool(jnp.array_equal(x, state[key])):
            raise AssertionError(f"{name}: {kind} restore of {key} differs")


def _restores(lib, state, targets: dict, root: str, runs: int) -> dict:
    """Restore the last blocking save onto each target; the first call is checked."""
    import jax

    out = {}
    for kind, target in targets.items():
        times = []
        with _Peak() as p:
            for r in range(runs + 1):
                t = time.perf_counter()
                got = jax.block_until_ready(lib.restore(f"{root}/save", target))
                times.append(time.perf_counter() - t)
                if r == 0:
                    _check(lib.name, kind, got, state, target)
                del got
        out[f"restore_{kind}"], out[f"rss_restore_{kind}"] = times, p.growth
    return out


def _device_get(state, runs: int) -> list[float]:
    """The device-to-host floor: ``jax.device_get`` of fresh copies (an Array caches its host
    value after one device_get, so each call gets new ones)."""
    import jax

    times = []
    for _ in range(runs + 1):
        fresh = jax.block_until_ready(jax.tree_util.tree_map(lambda a: a.copy(), state))
        t = time.perf_counter()
        jax.device_get(fresh)
        times.append(time.perf_counter() - t)
        del fresh
    return times


def worker(spec: dict) -> dict:
    """Measure ``spec["lib"]`` on ``spec["mib"]`` MiB (``None``: by backend)."""
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    sys.path.append(os.path.dirname(here))  # this checkout's jaxckpt, unless one is installed
    import _libs
    import jax

    backend = jax.default_backend()
    short = spec["short"] or backend == "cpu"
    mib = spec["mib"] or (SHORT_MIB if short else 2048)
    runs = 1 if short and not spec["runs"] else spec["runs"] or 3
    try:
        lib = _libs.LIBS[spec["lib"]]()
    except ImportError as e:
        return {"missing": f"{spec['lib']}: not installed ({e})", "mib": mib, "runs": runs}
    state, targets = _state(mib)
    root = spec["root"]
    os.makedirs(root, exist_ok=True)
    out = {"mib": mib, "runs": runs, "short": short, "backend": backend}
    out["devices"] = f"{jax.device_count()} × {jax.devices()[0].device_kind}"
    out["bytes"] = sum(x.nbytes for x in state.values())
    budget = spec.get("budget_mib")
    if budget:  # save_async within a host budget only: the rest is the row without one
        out.update(_saves(lib, state, root, runs, budget=budget * 2**20))
        out["rss_peak"] = vm("VmHWM")
        shutil.rmtree(root, ignore_errors=True)
        return out
    if spec["lib"] == "jaxckpt":
        out["device_get"] = _device_get(state, runs)
    out.update(_saves(lib, state, root, runs))
    out.update(_restores(lib, state, targets, root, runs))
    out["rss_peak"] = vm("VmHWM")
    shutil.rmtree(root, ignore_errors=True)
    return out


# --- parent: spawn, then one table -----------------------------------------------------------


def _spawn(spec: dict) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)]
    os.sync()  # no library inherits another's write-back
    proc = subprocess.run(cmd, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
    return {"failed": f"{spec['lib']}: failed: {tail}"}


def _t(xs: list[float]) -> str:
    """Median seconds of the warm calls (the range in brackets)."""
    w = xs[1:] or xs
    m = statistics.median(w)
    return f"{m:.3f}" + (f" ({min(w):.3f}-{max(w):.3f})" if len(w) > 1 else "")


def _gbps(nbytes: int, xs: list[float] | None) -> str:
    """GB/s of the median warm call (the range in brackets); — where not measured."""
    if not xs:
        return "—"
    w = xs[1:] or xs
    rate = lambda t: f"{nbytes / t / 1e9:.2f}"  # noqa: E731
    m = rate(statistics.median(w))
    return m + (f" ({rate(max(w))}-{rate(min(w))})" if len(w) > 1 else "")


COLUMNS = (
    "library",
    "save_async blocks, s",
    "÷ device_get floor",
    "state ÷ blocking time, GB/s",
    "save GB/s",
    "save_async GB/s (whole save)",
    "restore GB/s",
    "resharded restore GB/s",
    "peak host RSS growth, MiB: save / save_async / restore",
    "first save / restore, s",
)


def _row(lib: str, r: dict, floor: float | None) -> str:
    b, mib = r["bytes"], 2**20
    blocks = statistics.median(r["async_blocks"][1:] or r["async_blocks"])
    keys = ("rss_save", "rss_async", "rss_restore_save")
    rss = " / ".join(f"{r[k] / mib:.0f}" if k in r else "—" for k in keys) + (
        "" if r["rss_reset"] else " (peak since start)"
    )
    first = " / ".join(f"{r[k][0]:.3f}" if k in r else "—" for k in ("save", "restore_save"))
    cells = [
        lib,
        _t(r["async_blocks"]),
        f"{blocks / floor:.2f}" if floor else "—",
        _gbps(b, r["async_blocks"]),
        _gbps(b, r.get("save")),
        _gbps(b, r["async_total"]),
        _gbps(b, r.get("restore_save")),
        _gbps(b, r.get("restore_reshard")),
        rss,
        first,
    ]
    return "| " + " | ".join(cells) + " |"


def _versions() -> str:
    out = []
    for pkg in ("jax", "jaxlib", "tensorstore", "orbax-checkpoint"):
        try:
            out.append(f"{pkg} {importlib.metadata.version(pkg)}")
        except importlib.metadata.PackageNotFoundError:
            out.append(f"{pkg} not installed")
    return ", ".join(out)


def table(results: dict, command: str) -> str:
    """The markdown report: a header, the table (one row per library, then the floor)."""
    done = [r for r in results.values() if "bytes" in r]
    head = done[0] if done else next(iter(results.values()))
    lines = [f"Command: `{command}`  "]
    if done:
        lines.append(
            f"Device: {head['devices']} ({head['backend']}); state {head['bytes'] / 2**20:.0f} "
            f"MiB in {LEAVES} leaves; {head['runs']} warm call(s) after a cold one, medians "
            f"(range); {platform.python_version()}, {_versions()}; "
            f"{time.strftime('%Y-%m-%d %H:%M')}.  "
        )
    if done and head["short"]:
        lines.append("**Short mode (CPU backend): a smoke test, the times mean nothing.**  ")
    lines += ["", "| " + " | ".join(COLUMNS) + " |", "|---" * len(COLUMNS) + "|"]
    floor = results.get("jaxckpt", {}).get("device_get")
    floor_s = statistics.median(floor[1:] or floor) if floor else None
    for lib, r in results.items():
        if "bytes" in r:
            lines.append(_row(lib, r, floor_s))
    if floor:
        cells = ["`jax.device_get` of fresh copies (floor)", _t(floor), "1.00"]
        cells += [_gbps(head["bytes"], floor)] * 2 + ["—"] * (len(COLUMNS) - 5)
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines += [r.get("missing") or r["failed"] for r in results.values() if "bytes" not in r]
    if not done:
        lines.insert(1, "No library ran.  ")
    return "\n".join(lines).rstrip() + "\n"


def _budgets(arg: str | None, state_mib: int) -> list[int]:
    """The budgets of ``--budget-mib`` in MiB (default: an eighth of ``state_mib``)."""
    if arg is None:
        return [max(1, state_mib // 8)]
    return [int(x) for x in arg.split(",") if x and int(x) > 0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--mib", type=int, help="state size (default: 2048, or 16 on CPU)")
    p.add_argument("--runs", type=int, help="warm calls per measurement (default: 3, 1 on CPU)")
    p.add_argument("--short", action="store_true", help="short mode on any backend")
    p.add_argument("--libs", default=",".join(LIBS), help=f"comma list of {', '.join(LIBS)}")
    p.add_argument(
        "--budget-mib",
        help="comma list of save_async(max_host_bytes=...) budgets in MiB, a row each "
        "(default: an eighth of the state; 0: none)",
    )
    p.add_argument("--dir", help="where checkpoints go (default: a new temporary folder)")
    p.add_argument("--out", help="also write the table to this markdown file")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print("RESULT " + json.dumps(worker(json.loads(args.worker))), flush=True)
        return 0
    libs = [x for x in args.libs.split(",") if x]
    if not libs or set(libs) - set(LIBS):
        p.error(f"--libs: a comma list of {', '.join(LIBS)}, got {args.libs!r}")
    root = args.dir or tempfile.mkdtemp(prefix="jaxckpt-gpu-bench-")
    spec = {"mib": args.mib, "runs": args.runs, "short": args.short}
    results = {}
    try:
        for lib in libs:
            results[lib] = _spawn({**spec, "lib": lib, "root": f"{root}/{lib}"})
            print(f"  {lib}: done", file=sys.stderr)
            spec.update({k: results[lib][k] for k in ("mib", "runs") if k in results[lib]})
        for mib in _budgets(args.budget_mib, spec["mib"]) if "jaxckpt" in libs else []:
            name = f"jaxckpt, max_host_bytes={mib} MiB"
            run = {**spec, "lib": "jaxckpt", "budget_mib": mib, "root": f"{root}/budget-{mib}"}
            results[name] = _spawn(run)
            print(f"  {name}: done", file=sys.stderr)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    cmd = "python benchmarks/gpu.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = table(results, cmd.strip())
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 1 if any("failed" in r for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
