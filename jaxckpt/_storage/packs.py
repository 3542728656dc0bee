"""Reading packed arrays back (format v2): each needed pack once, sliced into its members.

A pack is a plain 1-D zarr array; its members' manifest entries name it (``pack``) and their
element ``offset`` in it. ``jaxckpt._planning.packing`` decides the packing on save.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import numpy.typing as npt

from jaxckpt._errors import CorruptChunkError
from jaxckpt._format.manifest import PackEntry, dtype_from_name
from jaxckpt._format.plan import ReadItem

# What ``groups`` returns per pack (``jaxckpt._storage.reader.Group``, named there).
_Group = tuple[int, Callable[[], Callable[[], Iterable[tuple[ReadItem, npt.NDArray[Any]]]]]]


def split(
    entries: dict[str, Any], items: Iterable[ReadItem]
) -> tuple[list[ReadItem], list[ReadItem]]:
    """``items`` as (unpacked, packed), each in the given order."""
    plain: list[ReadItem] = []
    packed: list[ReadItem] = []
    for item in items:
        (packed if getattr(entries[item.key], "pack", None) is not None else plain).append(item)
    return plain, packed


def groups(reader: Any, entries: dict[str, Any], items: list[ReadItem]) -> list[_Group]:
    """One group per needed pack (``jaxckpt._storage.reader.Group``): its bytes (the span of it
    the items need), and the call that starts its read and returns the call yielding
    ``(item, data)`` for the items it holds. Each pack is read once.

    ``reader`` is a ``jaxckpt._storage.reader.CheckpointReader``: a pack is read as its plain 1-D array.
    """
    by_pack: dict[str, list[ReadItem]] = {}
    for item in items:
        by_pack.setdefault(entries[item.key].path, []).append(item)
    out: list[_Group] = []
    for mine in by_pack.values():
        pack = entries[mine[0].key].pack
        lo = min(entries[i.key].offset for i in mine)
        hi = max(entries[i.key].offset + entries[i.key].size for i in mine)
        n = (hi - lo) * dtype_from_name(pack.storage_dtype).itemsize
        out.append((n, functools.partial(_start, reader, entries, pack, mine, lo, hi)))
    return out


def _start(
    reader: Any, entries: dict[str, Any], pack: PackEntry, mine: list[ReadItem], lo: int, hi: int
) -> Callable[[], Iterable[tuple[ReadItem, npt.NDArray[Any]]]]:
    try:  # opening lists the pack's chunks first: a missing one is reported here
        array = pack.as_array()  # read like any array: in place from local files
        fut = reader.start(array, ReadItem(array.key, (lo,), (hi - lo,))) if hi > lo else None
    except CorruptChunkError as e:
        raise _corrupt(reader, pack, [i.key for i in mine], e) from e
    return functools.partial(_slices, reader, entries, pack, mine, lo, fut)


def _slices(
    reader: Any,
    entries: dict[str, Any],
    pack: PackEntry,
    items: list[ReadItem],
    lo: int,
    fut: Callable[[], npt.NDArray[Any]] | None,
) -> Iterator[tuple[ReadItem, npt.NDArray[Any]]]:
    data = np.empty(0, dtype_from_name(pack.storage_dtype))
    if fut is not None:
        try:
            data = fut()
        except CorruptChunkError as err:
            raise _corrupt(reader, pack, [i.key for i in items], err) from err
    for item in items:
        e = entries[item.key]
        a = data[e.offset - lo : e.offset - lo + e.size].reshape(e.shape)
        if item.sizes != e.shape:
            a = a[tuple(slice(o, o + s) for o, s in zip(item.offsets, item.sizes))]
        if e.storage_dtype != e.dtype:
            a = a.view(dtype_from_name(e.dtype))
        yield item, a


def _corrupt(reader: Any, pack: PackEntry, keys: list[str], e: Exception) -> CorruptChunkError:
    msg = str(e)
    gone = "NOT_FOUND" in msg or "is missing" in msg  # a read, or the listing before it
    bad = (
        "igest" in msg or "checksum" in msg
    )  # tensorstore's words, or jaxckpt._storage.chunkfile's
    what = "is missing" if gone else "fails its checksum" if bad else "cannot be read"
    others = sorted(set(keys) - {keys[0]})
    also = f" (and {len(others)} more keys packed with it: {others[:3]!r})" if others else ""
    return CorruptChunkError(
        f"Key {keys[0]!r}{also}: pack {pack.path} in {reader.loc}, which holds these keys, "
        f"{what} ({msg}). The checkpoint is damaged: restore an earlier one; `jaxckpt verify "
        f"PATH` lists every bad chunk and the keys in it."
    )
