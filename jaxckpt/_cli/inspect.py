"""``jaxckpt inspect`` and ``jaxckpt ls``: what a checkpoint, or a directory of them, holds."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from jaxckpt._cli.text import UsageError, json_text
from jaxckpt._format.manifest import ArrayEntry, Manifest, ValueEntry
from jaxckpt._manager.table import run_table
from jaxckpt._planning import display as _display
from jaxckpt._sources import detect as _sources
from jaxckpt._storage import location as _location


def metadata(path: str) -> Manifest:
    """What ``jaxckpt.metadata(path)`` holds, read without jax where the manifest has no PRNG
    key arrays (their implementations are checked by jax)."""
    loc = _location.Location(path, one_operation=True)
    manifest, _ = _sources.open_source(loc, listing=False)
    if any(isinstance(e, ArrayEntry) and e.prng_impl for e in manifest.entries.values()):
        from jaxckpt._planning.mismatch import check_prng_keys

        check_prng_keys(manifest, f"{loc}/manifest.json")
    return manifest


def _entry_json(e: ArrayEntry | ValueEntry) -> dict[str, Any]:
    if isinstance(e, ValueEntry):
        v = e.value  # a complex number as [real, imag], as the manifest holds it
        return {
            "key": e.key,
            "kind": "value",
            "value": [v.real, v.imag] if type(v) is complex else v,
        }
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
        "compression": e.codec,
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
        print(json_text(doc))
        return 0
    print(f"{args.path}: {_display.summary(m)}")
    for line in _display.text(m, verbose=args.verbose):
        print(line)
    for name, it in m.iterators.items():
        kinds = ", ".join(sorted({r.kind for r in it.states.values()}))
        count = it.process_count
        each = "1 process" if count == 1 else f"each of {count} processes"
        print(f"iterator {name!r}: the position of {each} ({kinds}; --json shows it)")
    return 0


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
        print(json_text(table.to_json()))
        return 0
    if not table.rows:
        print(f"{args.path}: no checkpoints (no sub-directories)", file=sys.stderr)
        return 0
    for line in table.lines():
        print(line)
    return 0
