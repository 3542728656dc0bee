"""``jaxckpt inspect`` and ``jaxckpt ls``: what a checkpoint, or a directory of them, holds."""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterator
from typing import Any

from jaxckpt._api import metadata
from jaxckpt._cli.text import UsageError, human_bytes, plural
from jaxckpt._format.manifest import ArrayEntry, Manifest, ValueEntry
from jaxckpt._format.names import SEP
from jaxckpt._manager.table import run_table
from jaxckpt._planning.abstract import leaf_struct
from jaxckpt._storage import location as _location


def _entry_json(e: ArrayEntry | ValueEntry) -> dict[str, Any]:
    if isinstance(e, ValueEntry):
        return {"key": e.key, "kind": "value", "value": e.value}
    return {
        "key": e.key,
        "kind": "array",
        "shape": list(e.shape),
        "dtype": e.dtype,
        "storage_dtype": e.storage_dtype,
        "chunks": list(e.chunks),
        "grid": list(e.grid),
        "nbytes": e.nbytes,
        "path": e.path,
        "checksum": e.checksum,
        "prng_impl": e.prng_impl,
        "sharding": e.sharding,
        **({"offset": e.offset} if e.pack else {}),
    }


def run_inspect(args: argparse.Namespace) -> int:
    m = metadata(args.path)
    arrays = [e for e in m.entries.values() if isinstance(e, ArrayEntry)]
    total = sum(e.nbytes for e in arrays)
    if args.json:
        doc = {
            "path": args.path,
            "version": m.version,
            "created": m.created,
            "arrays": len(arrays),
            "values": len(m.entries) - len(arrays),
            "nbytes": total,
            "entries": [_entry_json(e) for e in m.entries.values()],
        }
        if m.iterators:  # the saved positions of data iterators, as in the manifest
            doc["iterators"] = {n: it.to_json() for n, it in m.iterators.items()}
        print(json.dumps(doc, indent=1))
        return 0
    n_values = len(m.entries) - len(arrays)
    print(
        f"{args.path}: {plural(len(arrays), 'array')} ({human_bytes(total)}), "
        f"{plural(n_values, 'value')}, format v{m.version}"
    )
    rows = list(_tree_rows(m, args.verbose))
    width = max((len(r[0]) for r in rows), default=0)
    for name, cols in rows:
        print(f"{name:<{width}}  {cols}".rstrip() if cols else name)
    for name, it in m.iterators.items():
        kinds = ", ".join(sorted({r.kind for r in it.states.values()}))
        count = it.process_count
        each = "1 process" if count == 1 else f"each of {count} processes"
        print(f"iterator {name!r}: the position of {each} ({kinds}; --json shows it)")
    return 0


def _tree_rows(m: Manifest, verbose: bool = False) -> Iterator[tuple[str, str]]:
    """(indented name, description) for each directory and entry, in saved order."""
    shown: tuple[str, ...] = ()
    for key, e in m.entries.items():
        parts = key.split(SEP) if key else ["<root>"]
        parents = tuple(parts[:-1])
        common = 0
        while common < min(len(shown), len(parents)) and shown[common] == parents[common]:
            common += 1
        for depth in range(common, len(parents)):
            yield "  " * depth + parents[depth] + "/", ""
        shown = parents
        yield "  " * len(parents) + parts[-1], _describe(e, verbose)


def _describe(e: ArrayEntry | ValueEntry, verbose: bool = False) -> str:
    if isinstance(e, ValueEntry):
        return f"= {e.value!r}"
    shape = ",".join(map(str, e.shape))
    grid = "x".join(map(str, e.grid)) or "1"
    chunk = ",".join(map(str, e.chunks))
    what = f"{e.dtype}[{shape}]"
    if e.prng_impl:  # as restore returns it: keys of the key array's shape
        keys = ",".join(map(str, leaf_struct(e).shape))
        what = f"key<{e.prng_impl}>[{keys}] (key data {what})"
    where = f"chunks {grid} of [{chunk}]"
    if e.pack:  # where in its pack is storage detail: only asked for (--verbose, --json)
        where = f"packed in {e.path} at {e.offset}" if verbose else "packed"
    cols = [what, where, human_bytes(e.nbytes)]
    if e.sharding:  # drop what is the same for nearly every array
        cols.append(re.sub(r", (memory_kind=device|axis_types=\([^)]*\))", "", e.sharding))
    return "  ".join(cols)


def run_ls(args: argparse.Namespace) -> int:
    loc = _location.Location(args.path)
    if _location.exists(loc):
        raise UsageError(
            f"{args.path} is itself a checkpoint, not a directory of them: "
            f"`jaxckpt inspect {args.path}` shows what it holds."
        )
    best, _, mode = (args.best or "").partition(":")
    if mode not in ("", "min", "max"):
        raise UsageError(f"--best {args.best}: say NAME, NAME:min or NAME:max (e.g. --best loss).")
    table = run_table(
        args.path,
        local_directory=args.local,
        best=best or None,
        best_mode="max" if mode == "max" else "min",
        hidden=args.all,
    )
    if args.json:
        print(json.dumps(table.to_json(), indent=1))
        return 0
    if not table.rows:
        print(f"{args.path}: no checkpoints (no sub-directories)", file=sys.stderr)
        return 0
    for line in table.lines():
        print(line)
    return 0
