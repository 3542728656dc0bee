"""save_async within a host-memory budget: blocking time, total time and peak host RSS
against ``max_host_bytes`` and the state's size, each save in a fresh process (8 CPU devices).

    python benchmarks/host_budget.py --out /tmp/budget.md     # ~3-5 min on a 2-core machine

Each cell is the median of ``--runs`` fresh processes (the range in brackets); a process makes
a state of (rows, 1024) float32 arrays sharded over a (4, 2) mesh (4 MiB chunks at 256 MiB),
warms up with a small save, resets its peak RSS (VmHWM, through /proc/self/clear_refs) and
times one ``save_async``: until it returns ("blocks") and until ``wait()`` returns ("total").
Right after the call a jitted step donates every array and a numpy leaf is changed in place;
the restored checkpoint must equal the state at the call ("exact"). "peak RSS growth" is
VmHWM over the RSS before the call; "kept" is the RSS still held after the commit (the pool's
spare arena, for the next save) and "released" after the pool's idle release (shortened to
0.5 s here from its 10 s).

The worker (``--worker DIR MIB BUDGET|none``) prints one line ``RESULT {json}``;
tests/test_host_budget.py runs it to check the bound.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's

import jax  # noqa: E402
import numpy as np  # noqa: E402
from _procfs import reset_peak, vm  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxckpt  # noqa: E402
from jaxckpt._runtime import staging  # noqa: E402
from jaxckpt._storage import directwrite  # noqa: E402

RELEASE_AFTER_S = 0.5  # the pool's idle release, shortened from its default (10 s)


def make_state(mib: int) -> dict:
    """8 float32 arrays of (rows, 1024) sharded over 8 devices (4 MiB chunks at 256 MiB), made
    on the devices, plus small leaves (packed) and a numpy leaf."""
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    rows = mib * 2**20 // (8 * 1024 * 4)
    make = jax.jit(
        lambda k: jax.random.uniform(k, (rows, 1024), dtype=np.float32),
        out_shardings=NamedSharding(mesh, P("data", "model")),
    )
    keys = jax.random.split(jax.random.key(0), 8)
    state = {f"w{i}": make(keys[i]) for i in range(8)}
    state["bias"] = jax.device_put(np.arange(4096, dtype=np.float32), NamedSharding(mesh, P()))
    state["host"] = np.arange(1024, dtype=np.int64)
    return jax.block_until_ready(state)


def host(x) -> np.ndarray:
    """``x`` on the host, assembled from its shards: ``np.asarray`` of a sharded array would
    keep a host copy on the array (its RSS would then fall when the array goes)."""
    if not isinstance(x, jax.Array):
        return np.asarray(x)
    out = np.empty(x.shape, x.dtype)
    for shard in x.addressable_shards:
        out[shard.index] = np.asarray(shard.data)
    return out


def digests(tree: dict) -> dict:
    return {k: hashlib.blake2b(host(v).tobytes()).hexdigest() for k, v in tree.items()}


def worker(root: str, mib: int, budget: int | None) -> dict:
    """One save_async of a ``mib`` MiB state within ``budget`` host bytes (``None``: none)."""
    staging.POOL.release_after = RELEASE_AFTER_S
    directwrite.RELEASE_AFTER_S = RELEASE_AFTER_S  # its write buffers (unbudgeted saves)
    state = make_state(mib)
    expected = digests(state)
    arrays = [k for k in state if k != "host"]
    clobber = jax.jit(lambda s: jax.tree.map(lambda x: x * 0 - 7, s), donate_argnums=0)
    clobber({k: state[k] + 0 for k in arrays})  # compiled now, run right after save_async
    small = {"x": state["bias"] + 1}  # warm up: imports, threads, plans, compilation
    jaxckpt.save_async(f"{root}/warm", small, max_host_bytes=budget).wait()
    staging.POOL.clear()
    gc.collect()
    time.sleep(0.2)
    reset = reset_peak()
    rss0, hwm0 = vm("VmRSS"), vm("VmHWM")
    t0 = time.perf_counter()
    handle = jaxckpt.save_async(f"{root}/c", state, max_host_bytes=budget)
    blocked = time.perf_counter() - t0
    done = clobber({k: state.pop(k) for k in arrays})  # donated: the same buffers, rewritten
    state["host"][:] = -1  # and the numpy leaf changed in place
    handle.wait()
    total = time.perf_counter() - t0
    peak = vm("VmHWM") - (rss0 if reset else max(rss0, hwm0))
    kept = vm("VmRSS") - rss0
    released = kept
    for _ in range(5):  # until it settles: on a loaded machine the idle release runs late
        time.sleep(RELEASE_AFTER_S + 1.0)
        gc.collect()
        before, released = released, vm("VmRSS") - rss0
        if before - released < 1 << 20:
            break
    jax.block_until_ready(done)
    exact = digests(jaxckpt.restore(f"{root}/c")) == expected
    return {
        "blocked_s": blocked,
        "total_s": total,
        "state_bytes": int(sum(v.nbytes for v in done.values()) + 1024 * 8),
        "peak_growth": peak,
        "peak_reset": reset,
        "rss_kept": kept,
        "rss_released": released,
        "exact": exact,
        "stage_s": handle.timings["stage"],
    }


def _spawn(root: str, mib: int, budget: int | None) -> dict:
    arg = "none" if budget is None else str(budget)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", root, str(mib), arg]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    shutil.rmtree(root, ignore_errors=True)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[len("RESULT ") :]))
    raise RuntimeError(f"worker failed: {proc.stderr[-2000:]}")


def _cell(xs: list[float], fmt: str = "{:.3f}") -> str:
    m = fmt.format(statistics.median(xs))
    return m + (f" ({fmt.format(min(xs))}-{fmt.format(max(xs))})" if len(xs) > 1 else "")


COLUMNS = (
    "state, MiB",
    "max_host_bytes, MiB",
    "save_async blocks, s",
    "total, s",
    "peak RSS growth, MiB",
    "kept after commit / released, MiB",
    "exact",
)


def _row(mib: int, budget: int | None, got: list[dict]) -> str:
    col = lambda k: [g[k] for g in got]  # noqa: E731
    mb = [x / 2**20 for x in col("peak_growth")]
    kept = statistics.median(col("rss_kept")) / 2**20
    released = statistics.median(col("rss_released")) / 2**20
    cells = [
        str(mib),
        "none" if budget is None else str(budget >> 20),
        _cell(col("blocked_s")),
        _cell(col("total_s")),
        _cell(mb, "{:.0f}"),
        f"{kept:.0f} / {released:.0f}",
        "yes" if all(col("exact")) else "**no**",
    ]
    return "| " + " | ".join(cells) + " |"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--mib", default="256", help="comma list of state sizes in MiB")
    p.add_argument(
        "--budgets", default="none,512,256,128,64,32,16", help="comma list of MiB, or none"
    )
    p.add_argument("--scaling-mib", default="128,512", help="more state sizes, at --scaling-n")
    p.add_argument("--scaling-n", default="64", help="the budget (MiB) of the scaling rows")
    p.add_argument("--runs", type=int, default=3, help="fresh processes per cell")
    p.add_argument("--out", help="also write the table to this markdown file")
    p.add_argument("--worker", nargs=3, metavar=("DIR", "MIB", "BUDGET"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        root, mib, budget = args.worker
        got = worker(root, int(mib), None if budget == "none" else int(budget))
        print("RESULT " + json.dumps(got), flush=True)
        return 0
    mb = lambda x: None if x == "none" else int(x) << 20  # noqa: E731
    cells = [(int(m), mb(b)) for m in args.mib.split(",") for b in args.budgets.split(",")]
    cells += [(int(m), mb(args.scaling_n)) for m in args.scaling_mib.split(",") if m]
    lines = ["| " + " | ".join(COLUMNS) + " |", "|---" * len(COLUMNS) + "|"]
    root = tempfile.mkdtemp(prefix="jaxckpt-budget-")
    for mib, budget in cells:
        got = [_spawn(f"{root}/{r}", mib, budget) for r in range(args.runs)]
        lines.append(_row(mib, budget, got))
        print(lines[-1], file=sys.stderr)
    shutil.rmtree(root, ignore_errors=True)
    cmd = "python benchmarks/host_budget.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = f"Command: `{cmd.strip()}`, {time.strftime('%Y-%m-%d %H:%M')}  \n\n" + "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
