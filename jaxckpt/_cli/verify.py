"""``jaxckpt verify``: read every chunk, check every checksum, name what is damaged."""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import math
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any, TypeVar

import numpy as np
import tensorstore as ts

from jaxckpt._cli.text import human_bytes, json_text, one_line, plural, progress_arg
from jaxckpt._errors import CorruptChunkError
from jaxckpt._format.dtypes import dtype_from_name
from jaxckpt._format.grid import chunk_key, grid_indices
from jaxckpt._format.manifest import ArrayEntry, storage_entries
from jaxckpt._format.objects import Table, table
from jaxckpt._format.plan import ReadItem
from jaxckpt._planning.mismatch import check_prng_keys
from jaxckpt._runtime.progress import Progress
from jaxckpt._sources import detect as _sources
from jaxckpt._storage import location as _location
from jaxckpt._storage.reader import CheckpointReader, Reader
from jaxckpt._storage.zarr_spec import array_spec

_VERIFY_THREADS = 8
J = TypeVar("J")
R = TypeVar("R")


def _chunk_items(e: ArrayEntry) -> Iterator[tuple[tuple[int, ...], ReadItem]]:
    if 0 in e.shape:  # a zero-size array has no chunks
        return
    for idx in grid_indices(e.grid):  # lazily: a declared grid may be huge
        offsets = tuple(i * c for i, c in zip(idx, e.chunks))
        sizes = tuple(min(c, s - o) for o, s, c in zip(offsets, e.shape, e.chunks))
        yield idx, ReadItem(e.key, offsets, sizes)


_VERIFY_SLACK = 4096  # missing chunks verify names one by one; more: the array is summarised


def run_verify(args: argparse.Namespace) -> int:
    loc = _location.Location(args.path)
    m, reader = _sources.open_source(loc)  # a damaged manifest raises ManifestError: exit 1
    check_prng_keys(m, f"{loc}/manifest.json")
    foreign = reader.kind != "jaxckpt"  # no checksums: every byte is read
    arrays = [e for e in m.entries.values() if isinstance(e, ArrayEntry)]
    stored = storage_entries(m)  # what has files: unpacked arrays and packs
    members: dict[str, list[str]] = {}  # pack key -> the keys packed in it
    for e in arrays:
        if e.pack is not None:
            members.setdefault(e.pack.key, []).append(e.key)
    missing = {} if foreign else _listed_missing(reader, stored)  # also bounds the jobs
    checked = [e for e in stored.values() if e.key not in missing]
    n_jobs = sum(math.prod(e.grid) for e in checked)
    jobs = ((e, idx, item) for e in checked for idx, item in _chunk_items(e))  # lazily
    records = None if m.objects is None else table(m.objects, {e.path: e for e in checked})
    progress = Progress("verify", sum(e.nbytes for e in checked), progress_arg(args.progress))

    def check(job: tuple[ArrayEntry, tuple[int, ...], ReadItem]) -> str | None:
        try:
            for _ in reader.read(stored, [job[2]]):
                pass
        except CorruptChunkError as err:
            msg = one_line(err)
            return next((w for w in ("fails its checksum", "is missing") if w in msg), msg)
        return None

    problems: list[str] | None = [] if getattr(args, "json", False) else None
    say = print if problems is None else problems.append  # --json: one document at the end
    damaged: dict[str, list[str]] = {}
    bad_chunks = 0
    for key, msg in missing.items():
        say(f"DAMAGED {_who(stored[key], members)}: {msg}")
        for k in members.get(key, [key]):
            damaged[k] = ["missing chunks"]
        bad_chunks += 1
    with concurrent.futures.ThreadPoolExecutor(_VERIFY_THREADS) as pool:
        # v5 data objects have no zarr.json: the records carry the checksums
        files = [] if foreign or m.objects is not None else list(stored.values())
        held = {e.key: _held(reader, e.path) for e in files}
        for e, problem in zip(
            files, pool.map(lambda e: _zarr_json_problem(*held[e.key], e), files)
        ):
            if problem is not None:
                where = _where(reader, e.path)
                say(f"DAMAGED {_who(e, members)} metadata at {where}/zarr.json: {problem}")
                for k in members.get(e.key, [e.key]):
                    damaged.setdefault(k, []).append("zarr.json")
        for (e, idx, job_item), problem in _bounded_map(pool, check, jobs):
            progress.add(math.prod(job_item.sizes) * dtype_from_name(e.dtype).itemsize)
            if problem is not None:
                chunk = ",".join(map(str, idx))
                where = _place(reader, e, idx, foreign, records)
                say(f"DAMAGED {_who(e, members)} chunk ({chunk}) {where}: {problem}")
                for k in members.get(e.key, [e.key]):
                    damaged.setdefault(k, []).append(f"({chunk})" if k == e.key else e.path)
                bad_chunks += 1
    progress.close()
    return _summary(args.path, reader.kind, arrays, n_jobs, damaged, bad_chunks, problems)


def _summary(
    path: str,
    kind: str,
    arrays: list[ArrayEntry],
    n_jobs: int,
    damaged: dict[str, list[str]],
    bad_chunks: int,
    problems: list[str] | None,
) -> int:
    """Print the last line of ``jaxckpt verify`` (with ``problems``, the lines found: the
    ``--json`` document instead); the exit code (0: undamaged)."""
    nbytes = sum(e.nbytes for e in arrays)
    if not damaged:
        what = f"every chunk readable ({kind} stores no checksums)"
        line = (
            f"OK: {path}: {plural(len(arrays), 'array')}, {plural(n_jobs, 'chunk')}, "
            f"{human_bytes(nbytes)} read, "
            + (what if kind != "jaxckpt" else "every checksum matches")
        )
    else:
        bad = "; ".join(
            f"{k} ({' '.join(v[:20])}{' ...' if len(v) > 20 else ''})" for k, v in damaged.items()
        )
        line = (
            f"DAMAGED: {path}: {bad_chunks} of {plural(n_jobs, 'chunk')} bad, "
            f"{len(damaged)} of {plural(len(arrays), 'array')} affected: {bad}. Restore an "
            f"earlier checkpoint, or restore the undamaged keys with "
            f"jaxckpt.restore(..., keys=[...])."
        )
    if problems is None:
        print(line)
    else:
        doc = {"path": path, "format": kind, "ok": not damaged, "arrays": len(arrays)}
        doc |= {"chunks": n_jobs, "bad_chunks": bad_chunks, "nbytes": nbytes}
        print(json_text(doc | {"damaged": damaged, "problems": problems, "summary": line}))
    return 1 if damaged else 0


def _listed_missing(reader: Reader, stored: dict[str, ArrayEntry]) -> dict[str, str]:
    """Why each array lacks chunk files, by key: found by listing, before any read (the
    chunk files of jaxckpt's own checkpoints)."""
    missing: dict[str, str] = {}
    if not isinstance(reader, CheckpointReader):
        return missing
    for e in stored.values():
        try:
            reader.check_chunks(e, slack=_VERIFY_SLACK)
        except CorruptChunkError as err:
            missing[e.key] = one_line(err)
    return missing


def _bounded_map(
    pool: concurrent.futures.Executor, fn: Callable[[J], R], jobs: Iterator[J]
) -> Iterator[tuple[J, R]]:
    """``(job, fn(job))`` in order, with at most a few jobs per thread queued (Executor.map
    would submit every job at once: a hostile grid of 2**30 chunks must not become 2**30
    futures)."""
    pending: collections.deque[tuple[J, Future[R]]] = collections.deque()
    for job in jobs:
        pending.append((job, pool.submit(fn, job)))
        if len(pending) >= 4 * _VERIFY_THREADS:
            job, fut = pending.popleft()
            yield job, fut.result()
    for job, fut in pending:
        yield job, fut.result()


def _who(e: ArrayEntry, members: dict[str, list[str]]) -> str:
    keys = members.get(e.key)
    if keys is None:
        return e.key
    more = f" and {len(keys) - 5} more" if len(keys) > 5 else ""
    return f"{', '.join(keys[:5])}{more} (packed in {e.path})"


def _held(reader: Any, path: str) -> tuple[_location.Location, str]:
    """Where the array at ``path`` lives: here, or in the step an incremental step references."""
    return reader.holder(path) if hasattr(reader, "holder") else (reader.loc, path)


def _where(reader: Any, path: str) -> str:
    loc, held = _held(reader, path)
    if loc is reader.loc:
        return path
    return f"{loc}/{held} (an array this incremental step references)"


def _place(
    reader: Any, e: ArrayEntry, idx: tuple[int, ...], foreign: bool, records: Table | None
) -> str:
    """Where chunk ``idx`` of ``e`` is stored, for a message: its file (``at PATH``), or its
    record's data object in a format v5 checkpoint (``in data object data/P.K``)."""
    if foreign:
        return f"at {e.path}"
    if records is not None and e.path in records.where:
        flat = int(np.ravel_multi_index(idx, e.grid)) if idx else 0
        return f"in data object {records.names[records.where[e.path][0][flat]]}"
    return f"at {_where(reader, e.path)}/{chunk_key(idx)}"


def _zarr_json_problem(loc: _location.Location, path: str, e: ArrayEntry) -> str | None:
    """Why other zarr readers could not open ``e`` (jaxckpt itself reads by the manifest)."""
    try:
        _location.wait(
            ts.open(array_spec(loc.child(path), e), open=True, context=_location.context()),
            loc,
            f"opening {path}/zarr.json",
        )
    except ValueError as err:
        msg = str(err)
        if "NOT_FOUND" in msg:
            return "is missing"
        for tail in (" [tensorstore_spec=", " [source locations=", " [http_"):
            msg = msg.split(tail, 1)[0]
        return f"does not match the manifest ({' '.join(msg.split())})"
    return None
