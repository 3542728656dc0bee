"""The data-object layout (format version 5): each process's chunks as records in a few objects.

On object stores a save may write, instead of one object per chunk, each process's chunks as
records into a few large objects ``<folder>/<process>.<k>``. A record is the chunk's raw
little-endian bytes in C order (clipped at the array's edge), then the 4-byte little-endian
CRC-32C of those bytes where the entry's checksum is ``crc32c``. A process's records follow the
order of :attr:`DataObjects.owners` (its arrays), each array's chunks in C order of its grid; a
new object starts where the running size would pass :attr:`DataObjects.target` (a record never
spans objects). Record sizes follow from the manifest alone, so every process and every reader
computes every record's ``(object, offset, length)`` without gathering anything, and the
manifest stays O(arrays): per array, only which process wrote each chunk, run-length encoded.

Imports numpy only (``jaxckpt._format``'s rule); storage writes and reads the records
(``jaxckpt._storage.objects``).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from jaxckpt._errors import ManifestError
from jaxckpt._format.dtypes import dtype_from_name
from jaxckpt._format.entries import ArrayEntry
from jaxckpt._format.grid import grid_shape
from jaxckpt._format.names import DATA

VERSION = 5  # the format version that adds "objects"
DEFAULT_TARGET = 128 << 20  # bytes per data object at most (docs/architecture.md says why)
# A process's bytes are spread over at least SPREAD objects of at least MIN_OBJECT bytes, so
# that its writes and reads run as that many requests at once (a request's rate is bounded).
SPREAD = 16
MIN_OBJECT = 4 << 20
MAX_RECORDS = 1 << 24  # records a manifest may declare: the offset table is ~40 B per record
MAX_PROCESSES = 1 << 20
MAX_TARGET = 1 << 40
FOLDER = DATA

Runs = tuple[tuple[int, int], ...]  # (process, chunks) runs in grid C order


@dataclasses.dataclass(frozen=True)
class DataObjects:
    """Where a v5 checkpoint's chunks are: who wrote each, and the object size target.

    ``owners`` maps each stored array's storage path (an array, or a pack) to the process that
    wrote each of its chunks, run-length encoded in grid C order; its order is the records'.
    ``folder`` holds the objects (``data``, under the save's generation on object stores).
    """

    folder: str
    processes: int
    target: int
    owners: dict[str, Runs]

    def name(self, process: int, k: int) -> str:
        """The key of process ``process``'s ``k``-th data object, below the checkpoint."""
        return f"{self.folder}/{process}.{k}"

    def to_json(self) -> dict[str, Any]:
        return {
            "folder": self.folder,
            "processes": self.processes,
            "target": self.target,
            "owners": {p: [list(r) for r in runs] for p, runs in self.owners.items()},
        }


def from_plans(
    plans: Iterable[tuple[ArrayEntry, npt.NDArray[Any], npt.NDArray[Any]]],
    processes: int,
    target: int = DEFAULT_TARGET,
) -> DataObjects:
    """The layout of a save from its array plans: ``(entry, box corners, box writers)`` per
    stored array (one row per box, each box whole chunks of ``entry``'s grid).

    The objects' size is ``target`` at most, and less where the busiest process would
    otherwise write fewer than ``SPREAD`` objects (but at least ``MIN_OBJECT``)."""
    owners: dict[str, Runs] = {}
    load = np.zeros(processes, np.int64)  # bytes of records each process writes
    for entry, offsets, process in plans:
        grid = grid_shape(entry.shape, entry.chunks)
        who = np.full(grid, -1, np.int64)
        if len(offsets) and not grid:  # a 0-d array: one chunk, one box
            who[()] = np.asarray(process, np.int64).reshape(-1)[0]
        elif len(offsets) and who.size:  # an empty array has no chunks
            chunks = np.array(entry.chunks, np.int64)
            corner = np.asarray(offsets, np.int64).reshape(len(offsets), -1) // np.maximum(
                chunks, 1
            )
            who[tuple(corner.T)] = process  # each box's first chunk
            if (who < 0).any():  # boxes of several chunks: fill each box whole
                box = _box_chunks(entry, offsets)
                for c, p in zip(corner, process):
                    who[tuple(slice(a, a + b) for a, b in zip(c, box))] = p
        owners[entry.path] = _runs(who.ravel())
        np.add.at(load, who.ravel(), record_lengths(entry))
    size = min(target, max(MIN_OBJECT, -(-int(load.max(initial=0)) // SPREAD)))
    return DataObjects(FOLDER, processes, size, owners)


def _box_chunks(entry: ArrayEntry, offsets: npt.NDArray[Any]) -> tuple[int, ...]:
    """Chunks per box along each axis (boxes are a regular grid of whole chunks)."""
    o = np.asarray(offsets, np.int64).reshape(len(offsets), -1)
    out = []
    for d, c in enumerate(entry.chunks):
        starts = np.unique(o[:, d])
        step = int(starts[1] - starts[0]) if len(starts) > 1 else entry.shape[d]
        out.append(max(1, -(-step // max(c, 1))))
    return tuple(out)


def _runs(who: npt.NDArray[Any]) -> Runs:
    if not len(who):
        return ()
    cut = np.flatnonzero(np.diff(who)) + 1
    starts = np.concatenate(([0], cut))
    counts = np.diff(np.concatenate((starts, [len(who)])))
    return tuple((int(who[s]), int(n)) for s, n in zip(starts, counts))


def record_lengths(entry: ArrayEntry) -> npt.NDArray[np.int64]:
    """Each chunk's record length in grid C order: its stored bytes plus the checksum."""
    itemsize = dtype_from_name(entry.storage_dtype).itemsize
    grid = grid_shape(entry.shape, entry.chunks)
    n = np.ones((), np.int64)
    for size, c, g in zip(entry.shape, entry.chunks, grid):
        along = np.minimum(c, size - np.arange(g, dtype=np.int64) * c)
        n = np.multiply.outer(n, along)
    out: npt.NDArray[np.int64] = n.ravel() * itemsize + (4 if entry.checksum == "crc32c" else 0)
    return out


@dataclasses.dataclass(frozen=True)
class Table:
    """Every record's place, by array path: ``(object index, offset, length)`` per chunk in
    grid C order; ``names[object index]`` is the object's key."""

    names: list[str]
    where: dict[str, tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]]


def table(objects: DataObjects, entries: Mapping[str, ArrayEntry]) -> Table:
    """Rebuild the offset table from the manifest (``entries`` by storage path), vectorized:
    O(records) memory, bounded by ``MAX_RECORDS`` (checked when the manifest was read)."""
    paths = list(objects.owners)
    lengths = [record_lengths(entries[p]) for p in paths]
    owner = [np.repeat(*np.array(objects.owners[p], np.int64).reshape(-1, 2).T) for p in paths]
    length = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
    proc = np.concatenate(owner) if owner else np.zeros(0, np.int64)
    obj = np.zeros(len(length), np.int64)
    offset = np.zeros(len(length), np.int64)
    names: list[str] = []
    for p in np.unique(proc):
        rows = np.flatnonzero(proc == p)
        cum = np.cumsum(length[rows])
        i, k = 0, 0
        while i < len(rows):
            base = cum[i - 1] if i else 0
            j = max(int(np.searchsorted(cum, base + objects.target, side="right")), i + 1)
            obj[rows[i:j]] = len(names)
            offset[rows[i:j]] = cum[i:j] - length[rows[i:j]] - base
            names.append(objects.name(int(p), k))
            i, k = j, k + 1
    where = {}
    start = 0
    for path, n in zip(paths, map(len, lengths)):
        where[path] = (obj[start : start + n], offset[start : start + n], length[start : start + n])
        start += n
    return Table(names, where)


def from_json(raw: Any, stored: Mapping[str, ArrayEntry], where: str) -> DataObjects:
    """Check the untrusted ``"objects"`` field against the stored arrays (by path): every
    stored array has runs whose counts sum to its chunks, writers below ``processes``, sizes
    bounded, and the whole at most ``MAX_RECORDS`` records."""

    def bad(what: str) -> ManifestError:
        return ManifestError(
            f'{where}: "objects" {what}. The manifest is damaged or hostile: restore an earlier '
            f"checkpoint, or re-save."
        )

    if not isinstance(raw, dict) or set(raw) != {"folder", "processes", "target", "owners"}:
        raise bad("must be an object of folder, processes, target and owners")
    folder, processes, target, owners = (
        raw[k] for k in ("folder", "processes", "target", "owners")
    )
    if not isinstance(folder, str) or not _folder_ok(folder):
        raise bad(f"has folder {folder!r}; expected data or gXXXXXXXX/data")
    for name, v, top in (("processes", processes, MAX_PROCESSES), ("target", target, MAX_TARGET)):
        if type(v) is not int or not 0 < v <= top:
            raise bad(f"has {name} {v!r}; expected an int in 1..{top}")
    if not isinstance(owners, dict) or set(owners) != set(stored):
        raise bad("must list exactly the stored arrays and packs under owners")
    total = 0
    out: dict[str, Runs] = {}
    for path, runs in owners.items():
        if not isinstance(runs, list) or not all(_run_ok(r, processes) for r in runs):
            raise bad(f"has bad runs for {path} (expected [[process, count], ...])")
        count = sum(r[1] for r in runs)
        total += count
        if total > MAX_RECORDS:
            raise bad(f"declares over {MAX_RECORDS} records")
        want = math.prod(grid_shape(stored[path].shape, stored[path].chunks))
        if count != want:
            raise bad(f"declares {count} chunks for {path}, whose grid has {want}")
        out[path] = tuple((r[0], r[1]) for r in runs)
    return DataObjects(folder, processes, target, out)


def _run_ok(r: Any, processes: int) -> bool:
    return (
        isinstance(r, list)
        and len(r) == 2
        and all(type(x) is int for x in r)
        and 0 <= r[0] < processes
        and 0 < r[1] <= MAX_RECORDS
    )


def _folder_ok(folder: str) -> bool:
    return re.fullmatch(rf"(g[0-9a-f]{{8}}/)?{FOLDER}", folder) is not None
