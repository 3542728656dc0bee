"""``jaxckpt export`` and ``jaxckpt convert``: copy a checkpoint to another format."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from jaxckpt._cli.text import UsageError, human_bytes, plural, progress_arg
from jaxckpt._errors import CorruptChunkError
from jaxckpt._format.manifest import ArrayEntry, ValueEntry, dtype_from_name
from jaxckpt._format.plan import ReadItem
from jaxckpt._planning import tree as _tree
from jaxckpt._planning.mismatch import check_prng_keys
from jaxckpt._runtime.progress import Progress
from jaxckpt._sources import convert as _convert_mod
from jaxckpt._sources import detect as _sources
from jaxckpt._sources import safetensors as _safetensors
from jaxckpt._storage import location as _location

# safetensors dtype names (the reader's table, inverted); other dtypes are skipped with a message.
_SAFETENSORS = {v: k for k, v in _safetensors.DTYPES.items()}


def _out_path(args: argparse.Namespace) -> tuple[Path, str]:
    """``OUT`` and its kind (``.safetensors``, ``.npz``), or a ``UsageError`` saying why not."""
    out: Path = args.out.expanduser()  # a quoted "~/w.npz" reaches us as it is
    kind = out.suffix.lower()
    if kind not in (".safetensors", ".npz"):
        raise UsageError(f"{out}: OUT must end in .safetensors or .npz (the format to write).")
    if out.exists() and not args.force:
        raise UsageError(f"{out} exists: pass --force to replace it, or choose another name.")
    if not out.parent.is_dir():
        raise UsageError(f"{out}: directory {out.parent} does not exist; create it first.")
    return out, kind


def run_export(args: argparse.Namespace) -> int:
    out, kind = _out_path(args)
    loc = _location.Location(args.path)
    m, reader = _sources.open_source(loc)
    check_prng_keys(m, f"{loc}/manifest.json")
    keys = _tree.select(list(m.entries), args.keys)
    for k in keys:  # before anything is written
        _check_member_name(k, out)
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
        print(
            f"jaxckpt export: skipped {plural(len(skipped), 'array')} {kind} cannot hold{hint}: "
            f"{', '.join(skipped)}",
            file=sys.stderr,
        )
    progress = Progress(
        "export", sum(e.nbytes for e in arrays), progress_arg(args.progress), stream=sys.stderr
    )

    def data() -> Iterator[tuple[ArrayEntry, npt.NDArray[Any]]]:
        whole = {e.key: ReadItem(e.key, (0,) * len(e.shape), e.shape) for e in arrays}
        small = [whole[e.key] for e in arrays if e.pack is not None]  # each pack read once
        packed = {i.key: a for i, a in reader.read(m.entries, small)}
        for e in arrays:
            if e.key in packed:
                progress.add(e.nbytes)
                yield e, packed.pop(e.key)
                continue
            for _, a in reader.read(m.entries, [whole[e.key]]):
                progress.add(a.nbytes)
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
    print(
        f"wrote {out}: {plural(len(arrays), 'array')}, {human_bytes(sum(e.nbytes for e in arrays))}"
    )
    return 0


def _check_member_name(key: str, out: Path) -> None:
    """Refuse a key path that is not a safe relative name: it becomes an ``.npz`` member (a file
    name when extracted) or a ``.safetensors`` tensor name verbatim (zip-slip otherwise)."""
    parts = key.split("/")
    bad = (
        key.startswith("/")
        or "\\" in key
        or "\0" in key
        or re.match(r"[A-Za-z]:", key)
        or any(p in (".", "..") for p in parts)
    )
    if bad:
        raise UsageError(
            f"key {key!r} is not a safe name inside {out.name} (an absolute path, a drive, a '.' "
            f"or '..' part, a backslash or NUL could write outside the archive when it is "
            f"extracted); nothing was written. Leave it out with --keys, or restore the "
            f"checkpoint and save that leaf under another key."
        )


def _exportable(e: ArrayEntry, kind: str) -> bool:
    if kind == ".safetensors":
        return e.dtype in _SAFETENSORS
    return dtype_from_name(e.dtype).kind in "biufc"  # bfloat16, float8, int4: kind "V"


def _write_safetensors(
    path: Path,
    arrays: list[ArrayEntry],
    data: Iterator[tuple[ArrayEntry, npt.NDArray[Any]]],
    values: dict[str, Any],
) -> None:
    """safetensors: 8-byte little-endian header length, JSON header, raw little-endian bytes."""
    header: dict[str, Any] = {}
    offset = 0
    for e in arrays:
        header[e.key] = {
            "dtype": _SAFETENSORS[e.dtype],
            "shape": list(e.shape),
            "data_offsets": [offset, offset + e.nbytes],
        }
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
            f.write(a.reshape(-1).view(np.uint8).data)


def _write_npz(
    path: Path, data: Iterator[tuple[ArrayEntry, npt.NDArray[Any]]], values: dict[str, Any]
) -> None:
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


def run_convert(args: argparse.Namespace) -> int:
    m = _convert_mod.convert(
        args.src,
        args.dst,
        overwrite=args.overwrite,
        progress=progress_arg(args.progress),
        max_chunk_bytes=args.max_chunk_bytes,
    )
    arrays = [e for e in m.entries.values() if isinstance(e, ArrayEntry)]
    print(
        f"wrote {args.dst}: {plural(len(arrays), 'array')}, "
        f"{plural(len(m.entries) - len(arrays), 'value')}, "
        f"{human_bytes(sum(e.nbytes for e in arrays))} (from {m.created.get('converted_from')})"
    )
    return 0
