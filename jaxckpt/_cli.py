"""The ``jaxckpt`` command line: inspect, verify, ls and export checkpoints.

A thin layer over :func:`jaxckpt.metadata` and storage reading; it never touches a device.
Exit status: 0 success, 1 damage found (``verify``, or a bad chunk met while exporting),
2 a usage error or a path that holds no checkpoint (one line on stderr, no traceback)::

    jaxckpt inspect PATH [--json]          keys, shapes, dtypes, chunk grids, bytes
    jaxckpt verify PATH                    read every chunk, check every checksum
    jaxckpt ls DIR [--all] [--json]        the checkpoints (steps) in a directory
    jaxckpt export PATH OUT.safetensors    host-side copy (or OUT.npz); --keys to pick
    jaxckpt convert SRC DST                Orbax / safetensors / jaxckpt -> a jaxckpt checkpoint

PATH and SRC may also be an Orbax checkpoint or safetensors weights (see docs/migration.md).
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import math
import os
import re
import sys
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import tensorstore as ts

from jaxckpt import _catalog, _location, _pack, _reader, _safetensors, _sources, _storage, _tree
from jaxckpt import _convert as _convert_mod
from jaxckpt._api import metadata
from jaxckpt._errors import CheckpointError, CorruptChunkError, ManifestError
from jaxckpt._manifest import MANIFEST, ArrayEntry, Manifest, ValueEntry, dtype_from_name
from jaxckpt._plan import ReadItem

# safetensors dtype names (the reader's table, inverted); other dtypes are skipped with a message.
_SAFETENSORS = {v: k for k, v in _safetensors.DTYPES.items()}
_VERIFY_THREADS = 8


class UsageError(Exception):
    """A mistake on the command line: exit status 2, the message on one line."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status.

    Example:
      >>> import jax.numpy as jnp, jaxckpt, tempfile
      >>> d = tempfile.mkdtemp() + "/c"
      >>> jaxckpt.save(d, {"w": jnp.zeros((4, 2))})
      >>> from jaxckpt._cli import main
      >>> main(["verify", d])  # doctest: +ELLIPSIS
      OK: ...
      0
    """
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, or argparse's own usage error (already printed)
        return int(e.code or 0)
    try:
        return args.run(args)
    except (UsageError, CheckpointError, OSError) as e:
        code = 1 if isinstance(e, (CorruptChunkError, ManifestError)) else 2
        print(f"jaxckpt {args.command}: error: {_one_line(e)}", file=sys.stderr)
        return code
    except KeyboardInterrupt:
        print(f"jaxckpt {args.command}: interrupted", file=sys.stderr)
        return 130


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jaxckpt",
        description="Inspect, verify, list and export jaxckpt checkpoints. PATH may be a local "
        "directory or a file://, memory://, s3:// or gs:// URL.",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    c = sub.add_parser("inspect", help="keys, shapes, dtypes, chunk grids and bytes")
    c.add_argument("path", metavar="PATH")
    c.add_argument("--json", action="store_true", help="print the listing as JSON")
    c.set_defaults(run=_inspect)
    c = sub.add_parser("verify", help="read every chunk and check its checksum")
    c.add_argument("path", metavar="PATH")
    c.add_argument("--progress", action="store_true", help="show progress on stderr")
    c.set_defaults(run=_verify)
    c = sub.add_parser("ls", help="the checkpoints (e.g. steps) in a directory")
    c.add_argument("path", metavar="DIR")
    c.add_argument("--all", action="store_true", help="include hidden (temporary) directories")
    c.add_argument("--json", action="store_true", help="print the listing as JSON")
    c.set_defaults(run=_ls)
    c = sub.add_parser("export", help="copy arrays to OUT.safetensors or OUT.npz on this host")
    c.add_argument("path", metavar="PATH")
    c.add_argument("out", metavar="OUT", type=Path)
    c.add_argument("--keys", nargs="+", metavar="KEY", help="only these keys or key prefixes")
    c.add_argument("--force", action="store_true", help="replace OUT if it exists")
    c.add_argument("--progress", action="store_true", help="show progress on stderr")
    c.set_defaults(run=_export)
    c = sub.add_parser("convert", help="write an Orbax / safetensors / jaxckpt source as jaxckpt")
    c.add_argument("src", metavar="SRC")
    c.add_argument("dst", metavar="DST")
    c.add_argument("--overwrite", action="store_true", help="replace a checkpoint at DST")
    c.add_argument("--progress", action="store_true", help="show progress on stderr from the start")
    c.set_defaults(run=_convert)
    return p


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _plural(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError  # unreachable


class _Progress:
    """``\\r``-updated status on stderr, when it is a terminal or asked for."""

    def __init__(self, label: str, total: int, enabled: bool, stream: TextIO) -> None:
        self.label, self.total, self.done, self.stream = label, total, 0, stream
        self.enabled = enabled or stream.isatty()

    def step(self, what: str = "") -> None:
        self.done += 1
        if self.enabled:
            self.stream.write(f"\r{self.label}: {self.done}/{self.total} {what}"[:120].ljust(60))
            self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")


# inspect ------------------------------------------------------------------------------------


def _entry_json(e: ArrayEntry | ValueEntry) -> dict:
    if isinstance(e, ValueEntry):
        return {"key": e.key, "kind": "value", "value": e.value}
    return {"key": e.key, "kind": "array", "shape": list(e.shape), "dtype": e.dtype,
            "storage_dtype": e.storage_dtype, "chunks": list(e.chunks), "grid": list(e.grid),
            "nbytes": e.nbytes, "path": e.path, "checksum": e.checksum,
            "prng_impl": e.prng_impl, "sharding": e.sharding,
            **({"offset": e.offset} if e.pack else {})}  # fmt: skip


def _inspect(args: argparse.Namespace) -> int:
    m = metadata(args.path)
    arrays = [e for e in m.entries.values() if isinstance(e, ArrayEntry)]
    total = sum(e.nbytes for e in arrays)
    if args.json:
        doc = {"path": args.path, "version": m.version, "created": m.created,
               "arrays": len(arrays), "values": len(m.entries) - len(arrays), "nbytes": total,
               "entries": [_entry_json(e) for e in m.entries.values()]}  # fmt: skip
        print(json.dumps(doc, indent=1))
        return 0
    n_values = len(m.entries) - len(arrays)
    print(f"{args.path}: {_plural(len(arrays), 'array')} ({_bytes(total)}), "
          f"{_plural(n_values, 'value')}, format v{m.version}")  # fmt: skip
    rows = list(_tree_rows(m))
    width = max((len(r[0]) for r in rows), default=0)
    for name, cols in rows:
        print(f"{name:<{width}}  {cols}".rstrip() if cols else name)
    return 0


def _tree_rows(m: Manifest) -> Iterator[tuple[str, str]]:
    """(indented name, description) for each directory and entry, in saved order."""
    shown: tuple[str, ...] = ()
    for key, e in m.entries.items():
        parts = key.split(_tree.SEP) if key else ["<root>"]
        parents = tuple(parts[:-1])
        common = 0
        while common < min(len(shown), len(parents)) and shown[common] == parents[common]:
            common += 1
        for depth in range(common, len(parents)):
            yield "  " * depth + parents[depth] + "/", ""
        shown = parents
        yield "  " * len(parents) + parts[-1], _describe(e)


def _describe(e: ArrayEntry | ValueEntry) -> str:
    if isinstance(e, ValueEntry):
        return f"= {e.value!r}"
    shape = ",".join(map(str, e.shape))
    grid = "x".join(map(str, e.grid)) or "1"
    chunk = ",".join(map(str, e.chunks))
    dtype = f"key<{e.prng_impl}>:{e.dtype}" if e.prng_impl else e.dtype
    where = f"packed in {e.path} at {e.offset}" if e.pack else f"chunks {grid} of [{chunk}]"
    cols = [f"{dtype}[{shape}]", where, _bytes(e.nbytes)]
    if e.sharding:  # drop what is the same for nearly every array
        cols.append(re.sub(r", (memory_kind=device|axis_types=\([^)]*\))", "", e.sharding))
    return "  ".join(cols)


# verify -------------------------------------------------------------------------------------


def _chunk_items(e: ArrayEntry) -> Iterator[tuple[tuple[int, ...], ReadItem]]:
    if 0 in e.shape:  # a zero-size array has no chunks
        return
    grid = [-(-s // c) for s, c in zip(e.shape, e.chunks)]
    for idx in _reader.grid_indices(grid):  # lazily: a declared grid may be huge
        offsets = tuple(i * c for i, c in zip(idx, e.chunks))
        sizes = tuple(min(c, s - o) for o, s, c in zip(offsets, e.shape, e.chunks))
        yield idx, ReadItem(e.key, offsets, sizes)


_VERIFY_SLACK = 4096  # missing chunks verify names one by one; more: the array is summarised


def _verify(args: argparse.Namespace) -> int:
    loc = _location.Location(args.path)
    m, reader = _sources.open_source(loc)  # a damaged manifest raises ManifestError: exit 1
    foreign = _sources.source_kind(reader) != "jaxckpt"  # no checksums: every byte is read
    arrays = [e for e in m.entries.values() if isinstance(e, ArrayEntry)]
    stored = _pack.storage_entries(m)  # what has files: unpacked arrays and packs
    members: dict[str, list[str]] = {}  # pack key -> the keys packed in it
    for e in arrays:
        if e.pack is not None:
            members.setdefault(e.pack.key, []).append(e.key)
    missing: dict[str, str] = {}  # found by listing, before any read: also bounds the jobs
    for e in [] if foreign else stored.values():
        try:
            reader.check_chunks(e, slack=_VERIFY_SLACK)
        except CorruptChunkError as err:
            missing[e.key] = _one_line(err)
    checked = [e for e in stored.values() if e.key not in missing]
    n_jobs = sum(math.prod(-(-s // c) for s, c in zip(e.shape, e.chunks)) for e in checked)
    jobs = ((e, idx, item) for e in checked for idx, item in _chunk_items(e))  # lazily
    progress = _Progress("verify", n_jobs, args.progress, sys.stderr)

    def check(job: tuple[ArrayEntry, tuple[int, ...], ReadItem]) -> str | None:
        try:
            for _ in reader.read(stored, [job[2]]):
                pass
        except CorruptChunkError as err:
            msg = _one_line(err)
            return next((w for w in ("fails its checksum", "is missing") if w in msg), msg)
        return None

    damaged: dict[str, list[str]] = {}
    bad_chunks = 0
    for key, msg in missing.items():
        print(f"DAMAGED {_who(stored[key], members)}: {msg}")
        for k in members.get(key, [key]):
            damaged[k] = ["missing chunks"]
        bad_chunks += 1
    with concurrent.futures.ThreadPoolExecutor(_VERIFY_THREADS) as pool:
        files = [] if foreign else list(stored.values())
        for e, problem in zip(files, pool.map(lambda e: _zarr_json_problem(loc, e), files)):
            if problem is not None:
                print(f"DAMAGED {_who(e, members)} metadata at {e.path}/zarr.json: {problem}")
                for k in members.get(e.key, [e.key]):
                    damaged.setdefault(k, []).append("zarr.json")
        for (e, idx, _), problem in _bounded_map(pool, check, jobs):
            progress.step(e.key)
            if problem is not None:
                chunk = ",".join(map(str, idx))
                where = e.path if foreign else f"{e.path}/" + "/".join(["c", *map(str, idx)])
                print(f"DAMAGED {_who(e, members)} chunk ({chunk}) at {where}: {problem}")
                for k in members.get(e.key, [e.key]):
                    damaged.setdefault(k, []).append(f"({chunk})" if k == e.key else e.path)
                bad_chunks += 1
    progress.close()
    nbytes = sum(e.nbytes for e in arrays)
    if not damaged:
        print(f"OK: {args.path}: {_plural(len(arrays), 'array')}, {_plural(n_jobs, 'chunk')}, "
              f"{_bytes(nbytes)} read, " + (f"every chunk readable ({_sources.source_kind(reader)} "
              f"stores no checksums)" if foreign else "every checksum matches"))  # fmt: skip
        return 0
    bad = "; ".join(f"{k} ({' '.join(v[:20])}{' ...' if len(v) > 20 else ''})"
                    for k, v in damaged.items())  # fmt: skip
    print(f"DAMAGED: {args.path}: {bad_chunks} of {_plural(n_jobs, 'chunk')} bad, "
          f"{len(damaged)} of {_plural(len(arrays), 'array')} affected: {bad}. Restore an "
          f"earlier checkpoint, or restore the undamaged keys with "
          f"jaxckpt.restore(..., keys=[...]).")  # fmt: skip
    return 1


def _bounded_map(pool: concurrent.futures.Executor, fn: Any, jobs: Iterator) -> Iterator[tuple]:
    """``(job, fn(job))`` in order, with at most a few jobs per thread queued (Executor.map
    would submit every job at once: a hostile grid of 2**30 chunks must not become 2**30
    futures)."""
    pending: collections.deque = collections.deque()
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


def _zarr_json_problem(loc: _location.Location, e: ArrayEntry) -> str | None:
    """Why other zarr readers could not open ``e`` (jaxckpt itself reads by the manifest)."""
    try:
        ts.open(
            _storage._spec(loc.child(e.path), e), open=True, context=_location._CONTEXT
        ).result()
    except ValueError as err:
        msg = str(err)
        if "NOT_FOUND" in msg:
            return "is missing"
        for tail in (" [tensorstore_spec=", " [source locations=", " [http_"):
            msg = msg.split(tail, 1)[0]
        return f"does not match the manifest ({' '.join(msg.split())})"
    return None


# ls -----------------------------------------------------------------------------------------


def _ls(args: argparse.Namespace) -> int:
    loc = _location.Location(args.path)
    if _location.exists(loc):
        raise UsageError(f"{args.path} is itself a checkpoint, not a directory of them: "
                         f"`jaxckpt inspect {args.path}` shows what it holds.")  # fmt: skip
    found = [(n, ok) for n, ok in _catalog.children(loc) if args.all or not n.startswith(".")]
    rows = []
    for name, committed in found:
        child = loc.join(name)
        rows.append({"name": name, "committed": committed, "nbytes": _size(child, committed)})
    if args.json:
        print(json.dumps({"path": args.path, "entries": rows}, indent=1))
        return 0
    if not rows:
        print(f"{args.path}: no checkpoints (no sub-directories)", file=sys.stderr)
        return 0
    width = max(4, *(len(r["name"]) for r in rows))
    print(f"{'NAME':<{width}}  {'STATUS':<10}  SIZE")
    for r in rows:
        status = "committed" if r["committed"] else "incomplete"
        size = "?" if r["nbytes"] is None else _bytes(r["nbytes"])
        print(f"{r['name']:<{width}}  {status:<10}  {size}")
    return 0


def _size(loc: _location.Location, committed: bool) -> int | None:
    """Bytes on disk (local), or the arrays' bytes from the manifest (object stores)."""
    if loc.local is not None:
        return sum(f.stat().st_size for f in loc.local.rglob("*") if f.is_file())
    if not committed:
        return None
    m = Manifest.from_json(_location.read_manifest(loc), where=f"{loc}/{MANIFEST}")
    return sum(e.nbytes for e in m.entries.values() if isinstance(e, ArrayEntry))


# export -------------------------------------------------------------------------------------


def _export(args: argparse.Namespace) -> int:
    out: Path = args.out
    kind = out.suffix.lower()
    if kind not in (".safetensors", ".npz"):
        raise UsageError(f"{out}: OUT must end in .safetensors or .npz (the format to write).")
    if out.exists() and not args.force:
        raise UsageError(f"{out} exists: pass --force to replace it, or choose another name.")
    if not out.parent.is_dir():
        raise UsageError(f"{out}: directory {out.parent} does not exist; create it first.")
    m, reader = _sources.open_source(_location.Location(args.path))
    keys = _tree.select(list(m.entries), args.keys)
    arrays, values, skipped = [], {}, []
    for k in keys:
        e = m.entries[k]
        if isinstance(e, ValueEntry):
            values[k] = e.value
        elif _exportable(e, kind):
            arrays.append(e)
        else:
            skipped.append(f"{k} ({e.dtype})")
    if skipped:
        hint = " (.safetensors holds bfloat16 and float8)" if kind == ".npz" else ""
        print(f"jaxckpt export: skipped {_plural(len(skipped), 'array')} {kind} cannot hold{hint}: "
              f"{', '.join(skipped)}", file=sys.stderr)  # fmt: skip
    progress = _Progress("export", len(arrays), args.progress, sys.stderr)

    def data() -> Iterator[tuple[ArrayEntry, np.ndarray]]:
        whole = {e.key: ReadItem(e.key, (0,) * len(e.shape), e.shape) for e in arrays}
        small = [whole[e.key] for e in arrays if e.pack is not None]  # each pack read once
        packed = {i.key: a for i, a in reader.read(m.entries, small)}
        for e in arrays:
            if e.key in packed:
                progress.step(e.key)
                yield e, packed.pop(e.key)
                continue
            for _, a in reader.read(m.entries, [whole[e.key]]):
                progress.step(e.key)
                yield e, a

    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        if kind == ".npz":
            _write_npz(tmp, data(), values)
        else:
            _write_safetensors(tmp, arrays, data(), values)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
        progress.close()
    print(f"wrote {out}: {_plural(len(arrays), 'array')}, {_bytes(sum(e.nbytes for e in arrays))}")
    return 0


def _exportable(e: ArrayEntry, kind: str) -> bool:
    if kind == ".safetensors":
        return e.dtype in _SAFETENSORS
    return dtype_from_name(e.dtype).kind in "biufc"  # bfloat16, float8, int4: kind "V"


def _write_safetensors(path: Path, arrays: list[ArrayEntry],
                       data: Iterator[tuple[ArrayEntry, np.ndarray]], values: dict) -> None:  # fmt: skip
    """safetensors: 8-byte little-endian header length, JSON header, raw little-endian bytes."""
    header: dict[str, Any] = {}
    offset = 0
    for e in arrays:
        header[e.key] = {"dtype": _SAFETENSORS[e.dtype], "shape": list(e.shape),
                         "data_offsets": [offset, offset + e.nbytes]}  # fmt: skip
        offset += e.nbytes
    meta = {"format": "pt", "jaxckpt": "1"}  # "pt" is what most readers expect to find
    meta.update({f"value:{k}": json.dumps(v) for k, v in values.items()})
    header["__metadata__"] = meta
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # align the data to 8 bytes
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for e, a in data:
            a = np.ascontiguousarray(a)
            if a.dtype.byteorder == ">":
                a = a.byteswap().view(a.dtype.newbyteorder("<"))
            if a.nbytes != e.nbytes:
                raise CorruptChunkError(
                    f"Key {e.key!r}: read {a.nbytes} bytes, expected {e.nbytes}."
                )
            f.write(memoryview(a.reshape(-1).view(np.uint8)))


def _write_npz(path: Path, data: Iterator[tuple[ArrayEntry, np.ndarray]], values: dict) -> None:
    """An uncompressed ``.npz`` written one array at a time; load with ``np.load(OUT)``."""
    with zipfile.ZipFile(path, "w", allowZip64=True) as z:
        for e, a in data:
            with z.open(e.key + ".npy", "w", force_zip64=True) as f:
                np.lib.format.write_array(f, np.asarray(a), allow_pickle=False)
        for k, v in values.items():
            if v is None:
                print(f"jaxckpt export: skipped value {k} (None has no .npz form)", file=sys.stderr)
                continue
            with z.open(k + ".npy", "w") as f:
                np.lib.format.write_array(f, np.asarray(v), allow_pickle=False)


# convert ------------------------------------------------------------------------------------


def _convert(args: argparse.Namespace) -> int:
    m = _convert_mod._convert(args.src, args.dst, overwrite=args.overwrite, stream=sys.stderr,
                              progress=True if args.progress else None)  # fmt: skip
    arrays = [e for e in m.entries.values() if isinstance(e, ArrayEntry)]
    print(f"wrote {args.dst}: {_plural(len(arrays), 'array')}, "
          f"{_plural(len(m.entries) - len(arrays), 'value')}, "
          f"{_bytes(sum(e.nbytes for e in arrays))} (from {m.created.get('converted_from')})")  # fmt: skip
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())


__all__ = ["main"]
