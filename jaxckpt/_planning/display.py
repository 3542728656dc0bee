"""How a checkpoint's manifest reads to people: the tree of keys with dtype, shape, storage,
bytes and sharding, as text (``jaxckpt inspect``, ``repr(jaxckpt.metadata(path))``) and as
HTML (a notebook's view of ``jaxckpt.metadata(path)``).

Here, not in the CLI, because both the command line and :class:`CheckpointMetadata` show it;
it needs jax for one thing: a PRNG key array reads as its keys (``key<impl>[shape]``), with
the stored key data beside it.
"""

from __future__ import annotations

import html
import re
from collections.abc import Iterator, Mapping

from jaxckpt._format.entries import ArrayEntry, ValueEntry
from jaxckpt._format.manifest import Manifest
from jaxckpt._format.names import SEP
from jaxckpt._runtime.progress import human_bytes


def plural(n: int, what: str) -> str:
    """``1 array``, ``2 arrays``.

    Example:
      >>> plural(1, "array"), plural(3, "chunk")
      ('1 array', '3 chunks')
    """
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


def summary(m: Manifest) -> str:
    """``3 arrays (2.0 MiB), 1 value, format v2``; ``..., format v4, zstd`` when compressed."""
    arrays = [e for e in m.entries.values() if isinstance(e, ArrayEntry)]
    total = sum(e.nbytes for e in arrays)
    codecs = sorted({e.codec for e in arrays if e.codec})
    return (
        f"{plural(len(arrays), 'array')} ({human_bytes(total)}), "
        f"{plural(len(m.entries) - len(arrays), 'value')}, format v{m.version}"
        + "".join(f", {c}" for c in codecs)
    )


def what(e: ArrayEntry) -> str:
    """``float32[8,8]``; a PRNG key array: ``key<threefry2x32>[] (key data uint32[2])``."""
    text = f"{e.dtype}[{','.join(map(str, e.shape))}]"
    if e.prng_impl:  # as restore returns it: keys of the key array's shape
        from jaxckpt._planning.structs import leaf_struct  # jax: for key arrays only

        keys = ",".join(map(str, leaf_struct(e).shape))
        text = f"key<{e.prng_impl}>[{keys}] (key data {text})"
    return text


def storage(e: ArrayEntry, verbose: bool = False) -> str:
    """``chunks 4x2 of [2,4]``, ``packed`` (``packed in PATH at OFFSET`` when ``verbose``),
    then the compression if any: ``chunks 2 of [4] zstd``."""
    codec = f" {e.codec}" if e.codec else ""
    if e.pack:  # where in its pack is storage detail: only asked for (--verbose, --json)
        return (f"packed in {e.path} at {e.offset}" if verbose else "packed") + codec
    grid = f"chunks {'x'.join(map(str, e.grid)) or '1'} of [{','.join(map(str, e.chunks))}]"
    return grid + codec


def sharding(e: ArrayEntry) -> str:
    """The saved sharding, less what is the same for nearly every array; ``""`` if none."""
    if not e.sharding:
        return ""
    return re.sub(r", (memory_kind=device|axis_types=\([^)]*\))", "", e.sharding)


def describe(e: ArrayEntry | ValueEntry, verbose: bool = False) -> str:
    """One entry's line of ``jaxckpt inspect``, after its name."""
    if isinstance(e, ValueEntry):
        return f"= {e.value!r}"
    cols = [what(e), storage(e, verbose), human_bytes(e.nbytes), sharding(e)]
    return "  ".join(c for c in cols if c)


Entries = Mapping[str, ArrayEntry | ValueEntry]


def tree_rows(entries: Entries) -> Iterator[tuple[int, str, ArrayEntry | ValueEntry | None]]:
    """``(depth, name, entry)`` for each directory (entry ``None``) and entry, in saved order."""
    shown: tuple[str, ...] = ()
    for key, e in entries.items():
        parts = key.split(SEP) if key else ["<root>"]
        parents = tuple(parts[:-1])
        common = 0
        while common < min(len(shown), len(parents)) and shown[common] == parents[common]:
            common += 1
        for depth in range(common, len(parents)):
            yield depth, parents[depth] + "/", None
        shown = parents
        yield len(parents), parts[-1], e


def text(m: Manifest, *, verbose: bool = False, limit: int | None = None) -> list[str]:
    """The tree as ``jaxckpt inspect`` prints it: every entry; with ``limit``, at most that
    many lines and one more: the largest arrays (then values), in saved order, and a line
    counting the others (:func:`largest`)."""
    lines = _lines(m.entries, verbose)
    if limit is None or len(lines) <= limit:
        return lines
    kept = largest(m.entries, limit - 1)
    rest = [e for k, e in m.entries.items() if k not in kept]
    arrays = [e for e in rest if isinstance(e, ArrayEntry)]
    counts = [plural(len(arrays), "other array"), plural(len(rest) - len(arrays), "value")]
    counts[0] += f" ({human_bytes(sum(e.nbytes for e in arrays))})" if arrays else ""
    return [
        *_lines(kept, verbose),
        f"... and {' and '.join(c for c in counts if not c.startswith('0 '))} not shown "
        f"(str() shows every entry; .entries has them all)",
    ]


def largest(entries: Entries, lines: int) -> dict[str, ArrayEntry | ValueEntry]:
    """The largest arrays (then the values), in saved order, whose tree fits in ``lines``
    lines, their directories' lines included.

    Example:
      >>> from jaxckpt._format.entries import ValueEntry
      >>> es = {"a/x": ValueEntry("a/x", 1), "b": ValueEntry("b", 2), "c": ValueEntry("c", 3)}
      >>> list(largest(es, 2))  # a/x takes 2 lines (a/ and x)
      ['a/x']
    """
    size = {k: e.nbytes if isinstance(e, ArrayEntry) else -1 for k, e in entries.items()}
    chosen: set[str] = set()
    dirs: set[tuple[str, ...]] = set()
    for key in sorted(entries, key=lambda k: -size[k]):  # stable: saved order among equals
        parts = key.split(SEP)
        parents = {tuple(parts[:i]) for i in range(1, len(parts))}
        if len(chosen) + len(dirs | parents) > lines - 1:
            break
        chosen.add(key)
        dirs |= parents
    return {k: e for k, e in entries.items() if k in chosen}


def _lines(entries: Entries, verbose: bool) -> list[str]:
    rows = [
        ("  " * d + name, "" if e is None else describe(e, verbose))
        for d, name, e in tree_rows(entries)
    ]
    width = max((len(r[0]) for r in rows), default=0)
    return [f"{name:<{width}}  {cols}".rstrip() if cols else name for name, cols in rows]


def html_table(m: Manifest) -> str:
    """The tree as a compact HTML table: key, type, storage, bytes, sharding."""
    head = "".join(f"<th>{h}</th>" for h in ("key", "type", "stored", "bytes", "sharding"))
    body = []
    for depth, name, e in tree_rows(m.entries):
        pad = f' style="padding-left:{1.2 * depth:.1f}em"'
        key = f"<td{pad}>{html.escape(name)}</td>"
        if e is None:
            cells = '<td colspan="4"></td>'
        elif isinstance(e, ValueEntry):
            cells = f'<td colspan="4">= {html.escape(repr(e.value))}</td>'
        else:
            cols = (what(e), storage(e), human_bytes(e.nbytes), sharding(e))
            cells = "".join(f"<td>{html.escape(c)}</td>" for c in cols)
        body.append(f"<tr>{key}{cells}</tr>")
    caption = html.escape(f"jaxckpt checkpoint: {summary(m)}")
    return (
        f"<table><caption>{caption}</caption><thead><tr>{head}</tr></thead>"
        f"<tbody>{''.join(body)}</tbody></table>"
    )
