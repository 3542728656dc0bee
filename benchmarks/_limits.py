"""Limit anchors: what the disk and JAX allow for a workload's bytes, measured in the same run.

Three limits, each the median of ``runs`` calls after one warm-up, in a fresh process
(``run(spec)``, the ``limits`` task of ``compare.py``'s worker):

- **durable write**: the workload's unique shard bytes written with ``O_DIRECT`` from aligned
  buffers (no page-cache copy), by ``threads`` threads in parallel, each file ``fsync``ed, then
  the folder and its parent. Files as the checkpoint has them: one per unique shard, shards
  under 256 KiB (jaxckpt's default ``pack_bytes``) concatenated into one file.
- **cold read**: those files read back with ``O_DIRECT`` into aligned buffers, by the same
  threads, after ``_evict.evict`` dropped them from the page cache (and ``mincore`` found no
  page left). On a VM the host may still cache the disk: "cold" means this kernel's cache.
- **placement**: one batched ``jax.device_put`` of the already-read host arrays (whole leaves,
  assembled from the read buffers, not timed) onto the target shardings, until ready: on the
  saving mesh, and for ``big`` on the resharded mesh too.

``report`` renders them and each library's time as a multiple of the matching limit. jax is
imported inside the worker functions only, so ``compare.py``'s parent process can report
without it.
"""

from __future__ import annotations

import mmap
import os
import shutil
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import _evict

ALIGN = 4096  # O_DIRECT needs offsets, lengths and buffer addresses aligned to the block size
PACK_BYTES = 256 * 1024  # jaxckpt's DEFAULT_PACK_BYTES: smaller shards share one file


def _unique_shards(state) -> list[tuple[int, tuple, bytes]]:
    """(leaf number, box as slices, bytes) of each distinct shard, in leaf order."""
    import jax
    import numpy as np

    out = []
    for i, leaf in enumerate(jax.tree_util.tree_leaves(state)):
        seen = set()
        for shard in leaf.addressable_shards:
            box = tuple(s.indices(n)[:2] for s, n in zip(shard.index, leaf.shape))
            if box not in seen:
                seen.add(box)
                out.append((i, tuple(slice(a, b) for a, b in box), np.asarray(shard.data)))
    return out


def _files(shards: list) -> list[list[int]]:
    """Shard numbers per file: one file per shard, the small ones together in one file."""
    big = [[k] for k, (_, _, a) in enumerate(shards) if a.nbytes >= PACK_BYTES]
    small = [k for k, (_, _, a) in enumerate(shards) if a.nbytes < PACK_BYTES]
    return big + ([small] if small else [])


def _aligned(nbytes: int) -> mmap.mmap:
    """A page-aligned anonymous buffer of ``nbytes`` rounded up to ``ALIGN``."""
    return mmap.mmap(-1, max(ALIGN, -(-nbytes // ALIGN) * ALIGN))


def _fill(shards: list, groups: list[list[int]]) -> list[tuple[mmap.mmap, int]]:
    """Each file's aligned buffer holding its shards' bytes back to back, and its true size."""
    out = []
    for group in groups:
        parts = [shards[k][2].tobytes() for k in group]
        size = sum(len(p) for p in parts)
        buf = _aligned(size)
        buf.write(b"".join(parts))
        out.append((buf, size))
    return out


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_direct(folder: str, buffers: list, pool: ThreadPoolExecutor) -> float:
    """Seconds to write ``buffers`` as files 0..n-1 of a new ``folder``, durably."""

    def one(k: int) -> None:
        buf, size = buffers[k]
        fd = os.open(f"{folder}/{k}", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o644)
        try:
            if os.write(fd, buf) != len(buf):
                raise OSError(f"short O_DIRECT write of {folder}/{k}")
            if size != len(buf):
                os.ftruncate(fd, size)  # the padding to ALIGN goes again
            os.fsync(fd)
        finally:
            os.close(fd)

    t = time.perf_counter()
    os.makedirs(folder)
    list(pool.map(one, range(len(buffers))))
    _fsync_path(folder)
    _fsync_path(os.path.dirname(os.path.abspath(folder)))
    return time.perf_counter() - t


def read_direct(folder: str, into: list, pool: ThreadPoolExecutor) -> float:
    """Seconds to read files 0..n-1 of ``folder`` with ``O_DIRECT`` into the ``into`` buffers."""

    def one(k: int) -> None:
        buf, size = into[k]
        fd = os.open(f"{folder}/{k}", os.O_RDONLY | os.O_DIRECT)
        try:
            if os.readv(fd, [buf]) != size:
                raise OSError(f"short O_DIRECT read of {folder}/{k}")
        finally:
            os.close(fd)

    t = time.perf_counter()
    list(pool.map(one, range(len(into))))
    return time.perf_counter() - t


def _host_leaves(state, shards: list, groups: list, buffers: list) -> list:
    """Whole host arrays rebuilt from the read buffers (what a reader has before placing)."""
    import jax
    import numpy as np

    leaves = [np.empty(x.shape, x.dtype) for x in jax.tree_util.tree_leaves(state)]
    for group, (buf, _) in zip(groups, buffers):
        at = 0
        for k in group:
            i, box, a = shards[k]
            view = np.frombuffer(buf, a.dtype, a.size, at).reshape(a.shape)
            leaves[i][box] = view
            at += a.nbytes
    return leaves


def placement(host: list, shardings: list, runs: int) -> list[float]:
    """Seconds of ``runs`` batched ``device_put``s of ``host`` onto ``shardings`` (+1 warm-up)."""
    import jax

    times = []
    for _ in range(runs + 1):
        t = time.perf_counter()
        out = jax.block_until_ready(jax.device_put(host, shardings))
        times.append(time.perf_counter() - t)
        del out
    return times[1:]


def _disk(spec: dict, shards: list, groups: list) -> dict:
    """Write, evict, read ``runs`` + 1 times; the first call of each is the warm-up."""
    buffers = _fill(shards, groups)
    into = [(_aligned(size), size) for _, size in buffers]
    writes, reads, left = [], [], 0
    with ThreadPoolExecutor(spec["threads"]) as pool:
        for r in range(spec["runs"] + 1):
            folder = f"{spec['root']}/limit-{r}"
            writes.append(write_direct(folder, buffers, pool))
            left = max(left, _evict.evict(folder)["resident_pages"])
            reads.append(read_direct(folder, into, pool))
            shutil.rmtree(folder)
    return {"write": writes[1:], "read": reads[1:], "resident_pages": left, "into": into}


def run(spec: dict) -> dict:
    """The ``limits`` worker task: ``{"workload", "runs", "threads", "root", "reshard"}``."""
    import _state
    import jax

    state = _state.build(spec["workload"])
    shards = _unique_shards(state)
    groups = _files(shards)
    os.makedirs(spec["root"], exist_ok=True)
    disk = _disk(spec, shards, groups)
    host = _host_leaves(state, shards, groups, disk.pop("into"))
    for a, b in zip(host, jax.tree_util.tree_leaves(state)):  # the bytes came back intact
        if not (a == jax.device_get(b)).all():
            raise AssertionError("O_DIRECT read-back differs from the state")
    meshes = {"place": _state.SAVE_MESH}
    if spec.get("reshard"):
        meshes["place_reshard"] = _state.RESHARD_MESH
    del state
    for key, mesh in meshes.items():
        target = jax.tree_util.tree_leaves(_state.abstract(spec["workload"], mesh))
        disk[key] = placement(host, [x.sharding for x in target], spec["runs"])
    disk.update(files=len(groups), bytes=sum(a.nbytes for _, _, a in shards))
    disk["threads"] = spec["threads"]
    return disk


# --- report (no jax) ------------------------------------------------------------------------

KINDS = {
    "write": "durable write (`O_DIRECT` + fsync)",
    "read": "cold read (`O_DIRECT`, evicted)",
    "place": "placement (`device_put`), same mesh",
    "place_reshard": "placement (`device_put`), resharded",
}


def merge(passes: list[dict]) -> dict:
    """One workload's limit passes (start and end of the run) as one: times pooled, and the
    median of each pass kept so drift over the run shows."""
    out = {k: v for k, v in passes[0].items() if k not in KINDS}
    out["resident_pages"] = max(p["resident_pages"] for p in passes)
    for k in KINDS:
        if k in passes[0]:
            out[k] = [t for p in passes for t in p[k]]
            out[k + "_passes"] = [statistics.median(p[k]) for p in passes]
    return out


def _spread(xs: list[float]) -> str:
    m = statistics.median(xs)
    return f"{m:.3f} ({min(xs):.3f}-{max(xs):.3f}, n={len(xs)})"


def limits_table(limits: dict, add) -> None:
    """The limits themselves: median (min-max, n), GB/s, and each pass's median."""
    add("\n### Limits: what the disk and JAX allow, measured in this run\n")
    add(
        "Median of all calls (min-max, n) over the passes at the start and at the end of the "
        "run; `start / end`: each pass's median. The cold read found "
        "`resident pages` of its files still cached after eviction (0: fully evicted).\n"
    )
    add("| workload | limit | seconds | GB/s | start / end | files, threads | resident pages |")
    add("|---|---|---|---|---|---|---|")
    for w, lim in limits.items():
        for k, name in KINDS.items():
            if k not in lim:
                continue
            m = statistics.median(lim[k])
            passes = " / ".join(f"{x:.3f}" for x in lim[k + "_passes"])
            files = f"{lim['files']}, {lim['threads']}" if k in ("write", "read") else ""
            left = str(lim["resident_pages"]) if k == "read" else ""
            gbps = lim["bytes"] / m / 1e9
            add(f"| {w} | {name} | {_spread(lim[k])} | {gbps:.2f} | {passes} | {files} | {left} |")


def _times(res: dict, lib: str, w: str) -> dict:
    """The library's times matched to a limit: ``row name -> (seconds or None, limit keys)``;
    a cold-cache restore must read and place, so its limit is the sum of the two (a reader
    that overlaps them perfectly could come down to the larger one)."""
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    sv, rs, cold = (res[k].get((lib, w)) or {} for k in ("save", "restore", "cold"))
    rows = {
        f"{w} save warm ÷ durable write": (med(sv.get("warm")), ("write",)),
        f"{w} save cold ÷ durable write": (sv.get("cold"), ("write",)),
        f"{w} restore warm ÷ placement": (med(rs.get("warm")), ("place",)),
        f"{w} restore, cold cache ÷ (cold read + placement)": (
            med(cold.get("warm")),
            ("read", "place"),
        ),
    }
    if w == "big":
        rr = (res["reshard"].get(lib) or {}).get("times")
        rows["reshard warm ÷ placement (resharded)"] = (med(rr), ("place_reshard",))
        rows["reshard, cold cache ÷ (cold read + placement)"] = (
            med(cold.get("reshard")),
            ("read", "place_reshard"),
        )
    return rows


def _cached(cold: dict | None) -> bool:
    """Whether the warm-process cold-cache restores read under 5% of their bytes from files."""
    return bool(cold) and cold["bytes_read"][-1] < 0.05 * cold["bytes_needed"]


def ratio_table(res: dict, libs: tuple[str, ...], add) -> None:
    """Each library's time ÷ the matching limit's (1.00 = at the limit; lower is better)."""
    rows: dict[str, list[str]] = {}
    for w, lim in res["limits"].items():
        for lib in libs:
            for name, (t, keys) in _times(res, lib, w).items():
                ok = t is not None and all(k in lim for k in keys)
                limit = sum(statistics.median(lim[k]) for k in keys) if ok else 0
                cell = f"{t / limit:.2f}" if ok else "—"
                if ok and "cold cache" in name and _cached(res["cold"].get((lib, w))):
                    cell += " *cached*"  # its cold-cache calls read from its own cache
                rows.setdefault(name, []).append(cell)
    rows = {k: v for k, v in rows.items() if any(c != "—" for c in v)}
    if not rows:
        return
    add("\n### Against the limits: library time ÷ limit time (1.00 = at the limit)\n")
    add(
        "Warm saves and restores are medians of the warm calls; *cold cache*: the median of the "
        "restores whose files were evicted just before (in a process that had restored once). "
        "A save under 1.00 did not reach the disk (no fsync); a warm restore reads from the "
        "page cache, so its limit is placement alone; a cold-cache restore's is the cold read "
        "plus placement (one that overlaps the two could get below 1.00).\n"
    )
    add("| | " + " | ".join(libs) + " |")
    add("|---" * (len(libs) + 1) + "|")
    for name, cells in rows.items():
        add(f"| {name} | " + " | ".join(cells) + " |")
