"""``diff``: what differs between two checkpoints of any format jaxckpt reads, read in bounded
memory.

Keys are compared first (only in A, only in B, another shape, dtype or kind). Each array both
hold alike is then compared box by box over A's chunk grid (split into blocks of at most
``BLOCK_BYTES``), the same box read from B whatever its chunk grid (another mesh, another
format). What is known to be equal is not read: boxes whose content digests both manifests
record alike, and arrays that both read from the same stored bytes (an incremental step's
reference to its base, on object stores). Memory: at most ``BATCH_BYTES`` of A's boxes (plus
one box), B's reads in flight (two blocks) and the temporaries of ``SLICE`` elements.
"""

from __future__ import annotations

import dataclasses
import html
import json
import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import numpy.typing as npt

from jaxckpt._format.dtypes import dtype_from_name
from jaxckpt._format.grid import grid_indices
from jaxckpt._format.manifest import ArrayEntry, Manifest, ValueEntry
from jaxckpt._format.manifest_check import box_key
from jaxckpt._format.plan import ReadItem, chunk_boxes
from jaxckpt._runtime import progress as _progress
from jaxckpt._sources import detect as _sources
from jaxckpt._storage import location as _location
from jaxckpt._storage.reader import Reader

BLOCK_BYTES = 64 << 20  # the largest box read at once (a larger chunk is read in row blocks)
BATCH_BYTES = 128 << 20  # A's boxes held while B's same boxes stream past
SLICE = 1 << 20  # elements compared at once (float64 temporaries of a few MiB)


@dataclasses.dataclass(frozen=True)
class ArrayDiff:
    """How one array both checkpoints hold (same shape and dtype) differs.

    ``chunks``: A's chunks compared (``skipped`` of them known equal without a read);
    ``differing_chunks``: those with any element unequal; ``differing``: unequal elements;
    ``max_abs``/``max_rel``: the largest ``|a - b|`` and ``|a - b| / max(|a|, |b|)`` over them
    (0 where equal; NaN equals NaN).
    """

    key: str
    chunks: int
    differing_chunks: int = 0
    differing: int = 0
    max_abs: float = 0.0
    max_rel: float = 0.0
    skipped: int = 0

    @property
    def equal(self) -> bool:
        """Whether every element is equal."""
        return self.differing_chunks == 0


@dataclasses.dataclass(frozen=True)
class CheckpointDiff:
    """What :func:`diff` found; ``equal`` when nothing differs.

    ``only_a``/``only_b``: keys one side lacks; ``changed``: keys both hold as something else
    (``{key: (A's, B's)}``, e.g. ``("float32[8]", "bfloat16[8]")``); ``arrays``: each array
    both hold alike, compared (:class:`ArrayDiff`); ``values``: Python values that differ
    (``{key: (A's, B's)}``).
    """

    a: str
    b: str
    only_a: tuple[str, ...] = ()
    only_b: tuple[str, ...] = ()
    changed: dict[str, tuple[str, str]] = dataclasses.field(default_factory=dict)
    arrays: dict[str, ArrayDiff] = dataclasses.field(default_factory=dict)
    values: dict[str, tuple[Any, Any]] = dataclasses.field(default_factory=dict)

    @property
    def equal(self) -> bool:
        """Whether nothing differs: the same keys, kinds, shapes, dtypes, values and data."""
        return not (self.only_a or self.only_b or self.changed or self.values or self.differing)

    @property
    def differing(self) -> list[ArrayDiff]:
        """The compared arrays that differ, in A's key order."""
        return [d for d in self.arrays.values() if not d.equal]

    def __repr__(self) -> str:
        return f"<CheckpointDiff {self.a} vs {self.b}: {self.summary()}>"

    def summary(self) -> str:
        """One line: equal, or how many keys differ and how."""
        if self.equal:
            return f"equal ({len(self.arrays)} arrays compared)"
        parts = [
            f"{len(self.differing)} of {len(self.arrays)} arrays differ" if self.differing else "",
            f"{len(self.only_a)} only in A" if self.only_a else "",
            f"{len(self.only_b)} only in B" if self.only_b else "",
            f"{len(self.changed)} other shape or dtype" if self.changed else "",
            f"{len(self.values)} value{'s differ' if len(self.values) > 1 else ' differs'}"
            if self.values
            else "",
        ]
        return ", ".join(p for p in parts if p)

    def to_json(self) -> dict[str, Any]:
        """The same as a JSON object (what ``jaxckpt diff --json`` prints)."""
        return {
            "a": self.a,
            "b": self.b,
            "equal": self.equal,
            "only_a": list(self.only_a),
            "only_b": list(self.only_b),
            "changed": {k: {"a": a, "b": b} for k, (a, b) in self.changed.items()},
            "arrays": {
                k: dataclasses.asdict(d) | {"equal": d.equal} for k, d in self.arrays.items()
            },
            "values": {
                k: {"a": _json_safe(a), "b": _json_safe(b)} for k, (a, b) in self.values.items()
            },
        }

    def _repr_html_(self) -> str:
        rows = [(k, "only in A", "") for k in self.only_a]
        rows += [(k, "only in B", "") for k in self.only_b]
        rows += [(k, "changed", f"{a} → {b}") for k, (a, b) in self.changed.items()]
        rows += [(k, "value", f"{a!r} → {b!r}") for k, (a, b) in self.values.items()]
        rows += [
            (d.key, "differs", f"{d.differing_chunks}/{d.chunks} chunks, max abs {d.max_abs:.3g}, "
             f"max rel {d.max_rel:.3g}")
            for d in self.differing
        ]  # fmt: skip
        body = "".join(
            f"<tr><td>{html.escape(k)}</td><td>{w}</td><td>{html.escape(t)}</td></tr>"
            for k, w, t in rows
        )
        head = html.escape(f"{self.a} vs {self.b}: {self.summary()}")
        return f"<div><b>{head}</b><table>{body}</table></div>"


def _json_safe(v: Any) -> Any:
    try:
        json.dumps(v)
    except (TypeError, ValueError):
        return repr(v)
    return v


def same_value(a: Any, b: Any) -> bool:
    """Whether two saved Python values are equal: of one type and equal, NaN equal to NaN (in
    either part of a complex number), as arrays' elements are compared.

    Example:
      >>> nan = float("nan")
      >>> same_value(nan, nan), same_value(complex(nan, 1), complex(nan, 1)), same_value(1, 1.0)
      (True, True, False)
    """
    if type(a) is not type(b):
        return False
    if isinstance(a, complex):
        return same_value(a.real, b.real) and same_value(a.imag, b.imag)
    return bool(a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b)))


def describe(e: ArrayEntry | ValueEntry) -> str:
    """``float32[8,8]``, ``key<threefry2x32> (key data uint32[2])`` or ``value int``: what a
    key holds (as ``jaxckpt inspect`` says it, less the keys' shape, which takes jax)."""
    if isinstance(e, ValueEntry):
        return f"value {type(e.value).__name__}"
    what = f"{e.dtype}[{','.join(map(str, e.shape))}]"
    return f"key<{e.prng_impl}> (key data {what})" if e.prng_impl else what


def diff(a: str, b: str, *, progress: _progress.ProgressArg = None) -> CheckpointDiff:
    """Compare the checkpoints at ``a`` and ``b``: keys, shapes, dtypes, values and array data.

    Either may be a jaxckpt checkpoint, an Orbax checkpoint or safetensors weights, saved on
    any mesh: arrays are compared by content, box by box over A's chunk grid, in bounded memory.
    Boxes both manifests record the same digest for, and arrays both read from the same stored
    bytes (incremental references), are equal without being read.

    Args:
      a, b: the two checkpoints (paths or URLs).
      progress: ``True`` shows bytes compared, rate and time left on stderr; a callable
        ``fn(done_bytes, total_bytes)`` is called as it goes; ``None`` (default): quiet.

    Returns:
      A :class:`CheckpointDiff`: ``.equal``, ``.only_a``, ``.only_b``, ``.changed``,
      ``.arrays`` (per array: differing chunks, elements, max abs and rel difference).

    Raises:
      CheckpointNotFoundError: nothing jaxckpt reads is at ``a`` or ``b`` (names which).
      ManifestError, CorruptChunkError: a checkpoint is damaged (names the file, key, chunk).

    Example:
      >>> import numpy as np, jaxckpt, tempfile
      >>> d = tempfile.mkdtemp()
      >>> jaxckpt.save(d + "/a", {"w": np.zeros(4), "b": np.ones(2)})
      >>> jaxckpt.save(d + "/b", {"w": np.array([0, 0, 0.5, 0]), "b": np.ones(2), "n": 1})
      >>> r = jaxckpt.diff(d + "/a", d + "/b")
      >>> r.equal, r.only_b, r.arrays["w"].max_abs, r.arrays["b"].equal
      (False, ('n',), 0.5, True)
    """
    progress = _progress.check_arg(progress, "jaxckpt.diff")
    ma, ra = _sources.open_source(_location.Location(a))
    mb, rb = _sources.open_source(_location.Location(b))
    ka, kb = ma.entries, mb.entries
    out = CheckpointDiff(
        a=str(a),
        b=str(b),
        only_a=tuple(k for k in ka if k not in kb),
        only_b=tuple(k for k in kb if k not in ka),
    )
    common: list[ArrayEntry] = []
    for key in (k for k in ka if k in kb):
        ea, eb = ka[key], kb[key]
        if isinstance(ea, ValueEntry) and isinstance(eb, ValueEntry):
            if not same_value(ea.value, eb.value):
                out.values[key] = (ea.value, eb.value)
        elif describe(ea) != describe(eb):
            out.changed[key] = (describe(ea), describe(eb))
        else:
            assert isinstance(ea, ArrayEntry)
            common.append(ea)
    total = sum(e.nbytes for e in common)
    with _progress.Progress("diff", total, progress) as bar:
        for e in common:
            out.arrays[e.key] = _compare(e, (ma, ra), (mb, rb), bar)
        bar.finish()
    return out


Side = tuple[Manifest, Reader]


def _same_bytes(e: ArrayEntry, a: Side, b: Side) -> bool:
    """Whether both sides read ``e`` from the very same stored array (a reference)."""
    ea, eb = a[0].entries[e.key], b[0].entries[e.key]
    if not (isinstance(ea, ArrayEntry) and isinstance(eb, ArrayEntry)):
        return False
    if ea.pack is not None or eb.pack is not None or ea.chunks != eb.chunks:
        return False
    where_a, where_b = _held(a[1], ea.path), _held(b[1], eb.path)
    return where_a is not None and where_a == where_b


def _held(reader: Reader, path: str) -> tuple[str, str] | None:
    holder = getattr(reader, "holder", None)
    if holder is None:
        return None
    loc, held = holder(path)
    return str(loc), held


def _known_equal(e: ArrayEntry, a: Side, b: Side) -> set[str]:
    """Box keys (``box_key``) of A's chunks that both manifests' digests say are equal."""
    ea, eb = a[0].entries[e.key], b[0].entries[e.key]
    assert isinstance(ea, ArrayEntry) and isinstance(eb, ArrayEntry)
    if ea.pack is not None or eb.pack is not None:
        return set()
    da, db = a[0].digests.get(ea.path, {}), b[0].digests.get(eb.path, {})
    out: set[str] = set()
    for box, digest in da.items():
        if db.get(box) == digest:
            offsets, _, sizes = box.partition("+")
            off = tuple(int(x) for x in offsets.split(",") if x)
            size = tuple(int(x) for x in sizes.split(",") if x)
            out.update(box_key(o, s) for o, s in chunk_boxes(off, size, ea.chunks))
    return out


def _boxes(e: ArrayEntry) -> Iterator[tuple[int, list[tuple[tuple[int, ...], tuple[int, ...]]]]]:
    """(chunk number, its boxes of at most ``BLOCK_BYTES``) over A's chunk grid, lazily."""
    if 0 in e.shape:
        return
    if e.pack is not None:  # a small packed array: one box
        yield 0, [((0,) * len(e.shape), e.shape)]
        return
    itemsize = dtype_from_name(e.dtype).itemsize
    for n, (off, size) in enumerate(_chunks(e)):
        if math.prod(size) * itemsize <= BLOCK_BYTES or not size:
            yield n, [(off, size)]
            continue
        inner = math.prod(size[1:]) * itemsize
        rows = max(1, BLOCK_BYTES // max(1, inner))
        block = (min(rows, size[0]), *size[1:])
        yield n, chunk_boxes(off, size, block)


def _chunks(e: ArrayEntry) -> Iterator[tuple[tuple[int, ...], tuple[int, ...]]]:
    for idx in grid_indices(e.grid):
        off = tuple(i * c for i, c in zip(idx, e.chunks))
        yield off, tuple(min(c, s - o) for o, s, c in zip(off, e.shape, e.chunks))


def _compare(e: ArrayEntry, a: Side, b: Side, bar: _progress.Progress) -> ArrayDiff:
    """Compare one array both sides hold alike, in batches of at most ``BATCH_BYTES``."""
    chunks = 1 if e.pack is not None else math.prod(e.grid)
    if _same_bytes(e, a, b):
        bar.add(e.nbytes)
        return ArrayDiff(e.key, chunks, skipped=chunks)
    known = _known_equal(e, a, b)
    itemsize = dtype_from_name(e.dtype).itemsize
    acc = _Acc()
    batch: list[tuple[int, ReadItem]] = []
    held = 0
    for n, boxes in _boxes(e):
        if len(boxes) == 1 and box_key(*boxes[0]) in known:
            acc.skipped += 1
            bar.add(math.prod(boxes[0][1]) * itemsize)
            continue
        for off, size in boxes:
            batch.append((n, ReadItem(e.key, off, size)))
            held += math.prod(size) * itemsize
        if held >= BATCH_BYTES:
            _compare_batch(a, b, batch, acc, bar)
            batch, held = [], 0
    if batch:
        _compare_batch(a, b, batch, acc, bar)
    return ArrayDiff(
        e.key, chunks, len(acc.bad), acc.differing, acc.max_abs, acc.max_rel, acc.skipped
    )


@dataclasses.dataclass
class _Acc:
    bad: set[int] = dataclasses.field(default_factory=set)
    differing: int = 0
    max_abs: float = 0.0
    max_rel: float = 0.0
    skipped: int = 0


def _compare_batch(
    a: Side, b: Side, batch: list[tuple[int, ReadItem]], acc: _Acc, bar: _progress.Progress
) -> None:
    chunk_of = {(i.offsets, i.sizes): n for n, i in batch}
    items = [i for _, i in batch]
    held = {(i.offsets, i.sizes): x for i, x in a[1].read(a[0].entries, items)}
    for item, y in b[1].read(b[0].entries, items, max_inflight_bytes=2 * BLOCK_BYTES):
        x = held.pop((item.offsets, item.sizes))
        bar.add(x.nbytes)
        unequal, max_abs, max_rel = _differences(x, y)
        if unequal:
            acc.bad.add(chunk_of[(item.offsets, item.sizes)])
            acc.differing += unequal
            acc.max_abs = max(acc.max_abs, max_abs)
            acc.max_rel = max(acc.max_rel, max_rel)


def _differences(x: npt.NDArray[Any], y: npt.NDArray[Any]) -> tuple[int, float, float]:
    """(unequal elements, max ``|x - y|``, max ``|x - y| / max(|x|, |y|)``) of two boxes,
    compared ``SLICE`` elements at a time so that temporaries stay small."""
    xf, yf = np.ascontiguousarray(x).reshape(-1), np.ascontiguousarray(y).reshape(-1)
    unequal, max_abs, max_rel = 0, 0.0, 0.0
    for i in range(0, xf.size, SLICE):
        n, a, r = _slice_differences(xf[i : i + SLICE], yf[i : i + SLICE])
        unequal, max_abs, max_rel = unequal + n, max(max_abs, a), max(max_rel, r)
    return unequal, max_abs, max_rel


def _wide(dtype: np.dtype[Any]) -> str:
    """The dtype differences are computed in: float32 for floats of 4 bytes or fewer (and
    bfloat16, float8, int4), else float64 (complex128 for complex)."""
    if dtype.kind == "c":
        return "complex128"
    small = dtype.kind in "fV" or (dtype.kind in "iu" and dtype.itemsize <= 2)
    return "float32" if small and dtype.itemsize <= 4 else "float64"


def _slice_differences(x: npt.NDArray[Any], y: npt.NDArray[Any]) -> tuple[int, float, float]:
    if np.array_equal(x.view(np.uint8), y.view(np.uint8)):  # the common case: no arithmetic
        return 0, 0.0, 0.0
    if x.dtype.kind == "b":
        unequal = int(np.count_nonzero(x != y))
        return unequal, float(unequal > 0), float(unequal > 0)
    xf, yf = x.astype(_wide(x.dtype)), y.astype(_wide(x.dtype))
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        d = np.abs(xf - yf)  # NaN where either is NaN
        nan = np.isnan(d)
        if nan.any():  # NaN equals NaN, inf equals inf; a number against NaN: infinitely far
            xn, yn = xf[nan], yf[nan]
            d[nan] = np.where((xn == yn) | (np.isnan(xn) & np.isnan(yn)), 0.0, np.inf)
        # exact for integers, which float64 may round alike
        unequal = int(np.count_nonzero(d if x.dtype.kind in "fcV" else x != y))
        if not unequal:
            return 0, 0.0, 0.0
        scale = np.maximum(np.abs(xf), np.abs(yf))
        rel = np.divide(d, scale, out=np.zeros_like(d), where=scale > 0)
        rel[np.isnan(rel)] = np.inf  # inf / inf
    return unequal, float(d.max()), float(rel.max())
