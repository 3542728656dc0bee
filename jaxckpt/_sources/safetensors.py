"""safetensors weights as a read-only source: one file, a folder, or a Hugging Face index.

A ``.safetensors`` file is an 8-byte little-endian header length, a JSON header
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`` and the
raw little-endian bytes of each tensor (C order) after it. The header is parsed here (never
by code from the file), bounded and checked: dtypes against a fixed list, offsets inside the
data, no two tensors sharing bytes, and each tensor's byte length equal to dtype x shape.

Reads take only the bytes a box needs: a box of a C-order tensor is read as whole rows of
its leading dimension when those rows hold at most 10% more than the box (a row-sharded
target: one read per box), else one level down, row by row (a column-sharded target: one
read per row of the box, exactly the bytes it needs). ``SafetensorsReader.bytes_read`` counts them.

On object stores (``s3://``, ``gs://``) name the ``.safetensors`` file or the index: a
folder there is not listed. Tensor names are the keys, as in the file (``model.layers.0.self_attn.q_proj.weight``);
they contain no ``/``, so a safetensors source is one flat level of keys.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import threading
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt
import tensorstore as ts

from jaxckpt._errors import CorruptChunkError, ManifestError
from jaxckpt._format.entries import Entry
from jaxckpt._format.manifest import ArrayEntry, Manifest, dtype_from_name
from jaxckpt._format.plan import ReadItem
from jaxckpt._storage import location as _location
from jaxckpt._storage.location import read_small
from jaxckpt._storage.reader import Reader

INDEX = "model.safetensors.index.json"
MAX_HEADER = 100 << 20  # larger headers are treated as damage, not allocated
_MAX_INDEX = 100 << 20
_SLACK = 1.1  # read whole rows when they hold at most this much more than the box
# One read of a box: (begin, end, slot in the box, (rows shape, slice of the rows))
_Run = tuple[int, int, tuple[int, ...], tuple[tuple[int, ...], tuple[slice, ...]]]
DTYPES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "U16": "uint16", "I16": "int16",
    "U32": "uint32", "I32": "int32", "U64": "uint64", "I64": "int64", "F16": "float16",
    "BF16": "bfloat16", "F32": "float32", "F64": "float64", "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}  # fmt: skip
_FILE_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,250}\.safetensors")  # fullmatch


class _Tensor:
    __slots__ = ("file", "begin", "end", "dtype", "shape")

    def __init__(self, file: str, begin: int, end: int, dtype: str, shape: tuple[int, ...]):
        self.file, self.begin, self.end, self.dtype, self.shape = file, begin, end, dtype, shape


def open_source(loc: _location.Location) -> tuple[Manifest, SafetensorsReader] | None:
    """The manifest and reader for safetensors at ``loc``, or ``None`` if there are none."""
    url = str(loc).rstrip("/")
    if loc.local is not None and loc.local.is_file() and not _claims_safetensors(loc.local):
        return None  # another kind of file (a script, an .npz): not weights to read
    if loc.local is not None and loc.local.is_file() or url.endswith((".safetensors", ".json")):
        folder, _, name = url.rpartition("/")
        kv = _location.kvstore(_location.Location(folder or ".").kvstore)
        if name.endswith(".json"):
            return _from_index(loc, kv, name)
        return _build(loc, kv, [name])
    kv = _location.kvstore(loc.kvstore)
    if (
        loc.local is not None
        and (loc.local / INDEX).is_file()
        or (loc.local is None and _location.wait(kv.read(INDEX), loc, INDEX).state == "value")
    ):
        return _from_index(loc, kv, INDEX)
    names = _list(loc, kv)
    return _build(loc, kv, names) if names else None


def _claims_safetensors(path: os.PathLike[str]) -> bool:
    """Whether a local file says it is safetensors: by its name (``*.safetensors``, an
    ``*.index.json``), or by its first bytes (a header length that fits the file, then
    ``{``); a file that claims to be and is damaged is reported as damaged, any other is
    no weights at all."""
    name = os.fspath(path)
    if name.endswith((".safetensors", ".index.json")):
        return True
    try:
        with open(path, "rb") as f:
            head = f.read(9)
            size = os.fstat(f.fileno()).st_size
    except OSError:
        return False
    if len(head) < 9:
        return False
    n = int.from_bytes(head[:8], "little")
    return n <= MAX_HEADER and 8 + n <= size and head[8:9] == b"{"


def _list(loc: _location.Location, kv: ts.KvStore) -> list[str]:
    if loc.local is not None:
        try:
            return sorted(n for n in os.listdir(loc.local) if _FILE_RE.fullmatch(n))
        except OSError:
            return []
    return []  # object stores: no (recursive, costly) listing; name the file or the index


def _read(
    loc: _location.Location, kv: ts.KvStore, name: str, begin: int, end: int | None
) -> bytes | None:
    try:
        reading = kv.read(name, byte_range=slice(begin, end))
        got = _location.wait(reading, loc, f"reading {name}", (end or begin) - begin)
    except ValueError as e:
        if "OUT_OF_RANGE" in str(e):
            return b""
        raise
    return got.value if got.state == "value" else None


def _from_index(
    loc: _location.Location, kv: ts.KvStore, name: str
) -> tuple[Manifest, SafetensorsReader]:
    is_file = str(loc).endswith(".json")
    where = f"{loc}" if is_file else f"{loc}/{name}"
    raw = read_small(
        kv, _location.Location(str(loc).rpartition("/")[0]) if is_file else loc, name, _MAX_INDEX
    )
    if raw is None:
        raise ManifestError(f"{where} is missing.")
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        doc = None
    wmap = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wmap, dict) or not all(isinstance(v, str) for v in wmap.values()):
        raise ManifestError(
            f'{where} is not a safetensors index (JSON with a "weight_map" of tensor name -> '
            f"file name, at most {_MAX_INDEX >> 20} MiB). Re-download it, or restore the "
            f".safetensors files' folder without it."
        )
    files = list(dict.fromkeys(wmap.values()))
    for f in files:
        if not _FILE_RE.fullmatch(f) or ".." in f:
            raise ManifestError(
                f"{where} names file {f!r}, which is not a .safetensors file beside the index; "
                f"refusing to read outside the folder."
            )
    manifest, reader = _build(loc, kv, files)
    for tensor, f in wmap.items():
        t = reader.tensors.get(tensor)
        if t is None or t.file != f:
            raise ManifestError(
                f"{where} maps tensor {tensor!r} to {f}, which does not hold it. The index and "
                f"the files do not match: re-download them together."
            )
    return manifest, reader


def _build(
    loc: _location.Location, kv: ts.KvStore, files: list[str]
) -> tuple[Manifest, SafetensorsReader]:
    tensors: dict[str, _Tensor] = {}
    sizes: dict[str, int | None] = {}
    for f in files:
        head = _read(loc, kv, f, 0, 8)
        if head is None:
            raise ManifestError(f"{loc}: safetensors file {f} is missing.")
        t, sizes[f] = _parse(loc, kv, f, head)
        for name, tensor in t.items():
            if name in tensors:
                raise ManifestError(
                    f"{loc}: tensor {name!r} is in both {tensors[name].file} and {f}. Keep one "
                    f"copy, or restore one file at a time."
                )
            tensors[name] = tensor
    entries: dict[str, Entry] = {
        name: _Entry(
            key=name,
            shape=t.shape,
            dtype=t.dtype,
            storage_dtype=t.dtype,
            chunks=tuple(max(1, s) for s in t.shape),
            path=t.file,
            checksum="none",
        )
        for name, t in tensors.items()
    }
    tree = {
        "type": "dict",
        "keys": list(entries),
        "children": [{"type": "leaf", "key": k} for k in entries],
    }
    created = {"source": "safetensors", "files": files}
    return Manifest(tree=tree, entries=entries, created=created), SafetensorsReader(
        loc, kv, tensors, sizes
    )


def _file_size(loc: _location.Location, kv: ts.KvStore, f: str) -> int | None:
    if loc.local is None:
        return None
    path = (loc.local.parent if loc.local.is_file() else loc.local) / f
    try:
        return os.stat(path).st_size
    except OSError:
        return None


def _parse(
    loc: _location.Location, kv: ts.KvStore, f: str, head: bytes
) -> tuple[dict[str, _Tensor], int | None]:
    where = str(loc) if str(loc).endswith(f) else f"{loc}/{f}"
    size = _file_size(loc, kv, f)
    if len(head) < 8:
        raise ManifestError(f"{where} is truncated: shorter than the 8-byte header length.")
    n = int.from_bytes(head, "little")
    if n > MAX_HEADER or (size is not None and 8 + n > size):
        found = f"the file holds {size} bytes" if size is not None else f"limit {MAX_HEADER}"
        raise ManifestError(
            f"{where}: the header claims {n} bytes ({found}). The file is truncated or not "
            f"safetensors: re-download it."
        )
    raw = _read(loc, kv, f, 8, 8 + n) or b""
    try:
        if len(raw) != n:
            raise ValueError(f"read {len(raw)} of {n} header bytes")
        doc = json.loads(raw)
        if not isinstance(doc, dict):
            raise ValueError("not a JSON object")
    except (ValueError, UnicodeDecodeError) as e:
        raise ManifestError(f"{where}: the header is not valid JSON ({e}). Re-download it.") from e
    tensors: dict[str, _Tensor] = {}
    for name, d in doc.items():
        if name == "__metadata__":
            continue
        tensors[name] = _tensor(where, f, name, d, 8 + n)
    spans = sorted((t.begin, t.end, k) for k, t in tensors.items() if t.end > t.begin)
    for (_, end_a, a), (begin_b, _, b) in zip(spans, spans[1:]):
        if begin_b < end_a:
            raise ManifestError(
                f"{where}: tensors {a!r} and {b!r} share bytes (overlapping data_offsets). "
                f"The header is damaged: re-download the file."
            )
    return tensors, size


def _tensor(where: str, f: str, name: str, d: Any, base: int) -> _Tensor:
    def bad(what: str) -> ManifestError:
        return ManifestError(
            f"{where}: tensor {name!r} {what}. The header is damaged: re-download."
        )

    if not isinstance(d, dict):
        raise bad("is not an object")
    dtype = DTYPES.get(text) if isinstance(text := d.get("dtype"), str) else None
    if dtype is None:
        raise ManifestError(
            f"{where}: tensor {name!r} has dtype {d.get('dtype')!r}, which jaxckpt does not read "
            f"(it reads {', '.join(DTYPES)}). Convert the tensor, or restore keys=[...] without it."
        )
    shape, offs = d.get("shape"), d.get("data_offsets")
    if (
        not isinstance(shape, list)
        or len(shape) > 64
        or not all(type(s) is int and s >= 0 for s in shape)
    ):
        raise bad(f"has an invalid shape {shape!r}")
    if not (
        isinstance(offs, list)
        and len(offs) == 2
        and all(type(o) is int for o in offs)
        and 0 <= offs[0] <= offs[1]
    ):
        raise bad(f"has invalid data_offsets {offs!r}")
    need = math.prod(shape) * dtype_from_name(dtype).itemsize
    if offs[1] - offs[0] != need:
        raise bad(
            f"has {offs[1] - offs[0]} bytes in data_offsets {offs}, but {d['dtype']}{shape} "
            f"needs {need}"
        )
    return _Tensor(f, base + offs[0], base + offs[1], dtype, tuple(shape))


@dataclasses.dataclass(frozen=True)
class _Entry(ArrayEntry):
    """A tensor's manifest entry: any byte range of it is read alone (no chunks, no checksum)."""

    partial_reads: ClassVar[bool] = True


class SafetensorsReader(Reader):
    """Reads boxes of safetensors tensors as byte ranges; ``bytes_read`` counts them."""

    kind = "safetensors"

    def __init__(
        self,
        loc: _location.Location,
        kv: ts.KvStore,
        tensors: dict[str, _Tensor],
        sizes: dict[str, int | None],
    ) -> None:
        self.loc, self.kv, self.tensors, self.sizes = loc, kv, tensors, sizes
        self.bytes_read = 0
        self._lock = threading.Lock()

    def start(self, entry: Any, item: ReadItem) -> Callable[[], npt.NDArray[Any]]:
        """The call that waits for ``item``'s box; reading only the byte ranges its box needs."""
        t = self.tensors[item.key]
        where = f"{self.loc}: tensor {item.key!r} in {t.file}"
        size = self.sizes.get(t.file)
        if size is not None and t.end > size:
            raise CorruptChunkError(
                f"{where} needs bytes up to {t.end}, but the file holds {size}: it is truncated. "
                f"Re-download it, or restore keys=[...] without this tensor."
            )
        dtype = dtype_from_name(t.dtype)
        reads = list(_runs(t.shape, item.offsets, item.sizes, dtype.itemsize))
        futures = [
            self.kv.read(t.file, byte_range=slice(t.begin + lo, t.begin + hi))
            for lo, hi, _, _ in reads
        ]
        with self._lock:
            self.bytes_read += sum(hi - lo for lo, hi, _, _ in reads)

        def result() -> npt.NDArray[Any]:
            out = np.empty(item.sizes, dtype)
            for (lo, hi, dest, view), fut in zip(reads, futures):
                try:
                    got = _location.wait(fut, self.loc, where, hi - lo)
                    ok = got.state == "value" and len(got.value) == hi - lo
                except ValueError:
                    ok = False
                if not ok:
                    raise CorruptChunkError(
                        f"{where}: bytes {t.begin + lo}..{t.begin + hi} cannot be read (the file "
                        f"is truncated or unreadable). Re-download it."
                    )
                rows = np.frombuffer(got.value, dtype).reshape(view[0])
                out[dest] = rows[view[1]]
            return out

        return result


def _runs(
    shape: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...], itemsize: int
) -> Iterator[_Run]:
    """Byte ranges covering a box: ``(begin, end, slot in the box, (rows shape, slice))``.

    At the first dimension where whole rows (of all later dimensions) hold at most ``_SLACK``
    times the box's bytes, the rows are one read; before it, one read per leading index.
    """
    if 0 in sizes:
        return
    strides = [math.prod(shape[i + 1 :]) * itemsize for i in range(len(shape))]

    def walk(dim: int, base: int, prefix: tuple[int, ...]) -> Iterator[_Run]:
        if dim == len(shape):  # a scalar
            yield base, base + itemsize, prefix, ((), ())
            return
        rows = sizes[dim] * math.prod(shape[dim + 1 :])
        if rows <= _SLACK * math.prod(sizes[dim:]) or dim == len(shape) - 1:
            lo = base + offsets[dim] * strides[dim]
            inner = tuple(slice(o, o + s) for o, s in zip(offsets[dim + 1 :], sizes[dim + 1 :]))
            view = ((sizes[dim], *shape[dim + 1 :]), (slice(None), *inner))
            yield lo, lo + sizes[dim] * strides[dim], prefix, view
            return
        for i in range(sizes[dim]):
            yield from walk(dim + 1, base + (offsets[dim] + i) * strides[dim], (*prefix, i))

    yield from walk(0, 0, ())
