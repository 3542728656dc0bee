"""A run at a glance: each step's status, tiers, save time, size, the bytes it adds, metrics and
marks, read from what the run already stores (nothing here writes). The rows and how they
print are ``jaxckpt._manager.run_view``'s.

:func:`run_table` lists the steps of a run directory (``jaxckpt ls RUN`` prints the same), from
one listing of the directory, one manifest read per committed step, the manager's
``metrics.json`` (``jaxckpt._manager.retention.MetricsFile``: metrics, each step's save
timings and, where recorded, commit times) and, when given, the local tier's directory
(``jaxckpt._tiers.local_tier``' layout).

Bytes: ``nbytes`` is what a step holds; ``added`` what it stores itself, so that summing
``added`` over the steps counts shared bytes once: on a local disk the files of the step not
hard-linked from an earlier step (each file counted once, by inode, in step order); on object
stores the arrays it does not reference in another step. A step that retention deleted while
later incremental steps still reference its arrays (object stores) is ``retired``: its
manifest is gone, the arrays those steps hold stay, and it lists the steps holding them.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

from jaxckpt._errors import CheckpointError, CheckpointNotFoundError, InvalidArgumentError
from jaxckpt._format.manifest import Manifest, storage_entries
from jaxckpt._format.names import MANIFEST, parse_part, parse_step, step_name
from jaxckpt._manager.retention import MetricsFile, Policy
from jaxckpt._manager.run_view import RunTable, StepRow
from jaxckpt._sources import orbax_step as _orbax_step
from jaxckpt._storage import catalog as _catalog
from jaxckpt._storage import holds as _holds
from jaxckpt._storage import location as _location
from jaxckpt._tiers import local_run as _local_run


def run_table(
    directory: str | Any,
    *,
    local_directory: str | Path | None = None,
    best: str | Callable[[Mapping[str, Any]], float] | None = None,
    best_mode: Literal["min", "max"] = "min",
    hidden: bool = False,
) -> RunTable:
    """The steps of the run directory ``directory``, as ``jaxckpt ls`` shows them.

    Reads only what the run stores: a listing, the manifests, the manager's ``metrics.json``
    (metrics, commit times, the steps ``CheckpointManager.pin`` pinned).

    Args:
      directory: the run directory (a ``CheckpointManager``'s), a path or URL.
      local_directory: the manager's ``local_directory``: steps this disk holds get ``local``
        in their tiers.
      best: the metric name (or a function of a step's metrics, as the manager's
        ``best_fn``) that ranks steps; the best committed one is marked. ``None``: no mark.
      best_mode: ``"min"`` or ``"max"``: which end of ``best`` is best.
      hidden: include hidden sub-directories (a local save's ``.NAME.tmp-XXXX``).

    Returns:
      A :class:`RunTable` (``rows``, oldest first): prints as a table, HTML in a notebook.

    Raises:
      CheckpointNotFoundError: ``directory`` or ``local_directory`` is not a directory.
      CheckpointError: ``directory`` is itself a checkpoint.
      InvalidArgumentError: ``best`` names a metric no committed step has (names theirs).

    Example:
      >>> import numpy as np, jaxckpt, tempfile
      >>> d = tempfile.mkdtemp()
      >>> with jaxckpt.CheckpointManager(d, async_save=False) as mgr:
      ...     for step in (1, 2):
      ...         _ = mgr.save(step, {"w": np.full(4, step)}, metrics={"loss": 1 / step})
      >>> t = jaxckpt.run_table(d, best="loss")
      >>> [(r.step, r.status, r.best, r.metrics) for r in t.rows]
      [(1, 'committed', False, {'loss': 1.0}), (2, 'committed', True, {'loss': 0.5})]
    """
    loc = _location.Location(directory)
    listed = _listed(loc, hidden)
    stored = MetricsFile(loc)
    doc = stored.doc()
    metrics, committed_at = stored.read_all(doc)
    timings = stored.timings(doc)
    local = _local_steps(loc, local_directory)
    pins = set(stored.pinned(doc))
    rows = []
    for row in _stored_rows(loc, listed):
        step = row.step
        rows.append(
            dataclasses.replace(
                row,
                tiers=row.tiers + ((local[step],) if step is not None and step in local else ()),
                metrics=metrics.get(str(step)) if step is not None else None,
                pinned=step in pins,
                saved=committed_at.get(str(step), row.saved),
                timings=timings.get(str(step)) if step is not None else None,
            )
        )
    rows = _with_local_only(rows, local, metrics, pins)
    return RunTable(str(directory), tuple(_mark_best(rows, best, best_mode)))


def _with_local_only(
    rows: list[StepRow], local: dict[int, str], metrics: dict[str, Any], pins: set[int]
) -> list[StepRow]:
    """``rows`` and the steps only the local tier holds, in step order."""
    only_local = sorted(set(local) - {r.step for r in rows})
    for step in only_local:
        row = StepRow(step_name(step), step, "committed", "jaxckpt", (local[step],))
        rows.append(dataclasses.replace(row, metrics=metrics.get(str(step)), pinned=step in pins))
    if only_local:
        rows.sort(key=lambda r: (r.step is None, r.step or 0))
    return rows


def _stored_rows(loc: _location.Location, listed: dict[str, list[str]]) -> list[StepRow]:
    """The rows of what the run directory holds, in listing order (no metrics or marks)."""
    manifests = {n: _manifest(loc.join(n)) for n, keys in listed.items() if MANIFEST in keys}
    held = _held_arrays(manifests)
    seen_inodes: set[tuple[int, int]] = set()  # step order: a file counts in its first step
    return [
        _row(loc, n, parse_step(n), keys, manifests.get(n), held.get(n, {}), seen_inodes)
        for n, keys in listed.items()
    ]


def _listed(loc: _location.Location, hidden: bool) -> dict[str, list[str]]:
    """Each sub-directory's keys (object stores), or ``[MANIFEST]``/``[]`` (local).

    Raises:
      CheckpointError: ``loc`` is itself a checkpoint.
    """
    if _location.exists(loc):
        raise CheckpointError(
            f"{loc} is itself a checkpoint, not a run directory of steps: "
            f"jaxckpt.metadata({str(loc)!r}) shows what it holds."
        )
    if loc.local is None:  # one listing of the whole run: steps by number, then other names
        found = _catalog.listing(loc)
        order = sorted(found, key=lambda n: (parse_step(n) is None, parse_step(n) or 0, n))
        return {n: found[n] for n in order if hidden or not n.startswith(".")}
    return {
        n: [MANIFEST] if ok else []
        for n, ok in _catalog.children(loc)
        if hidden or not n.startswith(".")
    }


def _manifest(loc: _location.Location) -> Manifest | None:
    try:
        return Manifest.from_json(_location.read_manifest(loc), where=f"{loc}/{MANIFEST}")
    except CheckpointError:
        return None


def _held_arrays(manifests: Mapping[str, Manifest | None]) -> dict[str, dict[str, int]]:
    """``{held step: {storage path: bytes}}`` of the arrays other steps reference."""
    out: dict[str, dict[str, int]] = {}
    for m in manifests.values():
        if m is None:
            continue
        stored = {e.path: e.nbytes for e in storage_entries(m).values()}
        for path, target in m.refs.items():
            _, step, held_path = target.split("/", 2)
            out.setdefault(step, {})[held_path] = stored.get(path, 0)
    return out


def _row(
    loc: _location.Location,
    name: str,
    step: int | None,
    keys: list[str],
    m: Manifest | None,
    held: dict[str, int],
    seen_inodes: set[tuple[int, int]],
) -> StepRow:
    child = loc.join(name)
    if MANIFEST not in keys:
        if child.local is None and _holds.referrers(keys):
            paths = sum(held.values()) if held else None
            by = tuple(sorted(_holds.referrers(keys)))
            return StepRow(name, step, "retired", nbytes=paths, added=paths, held_by=by)
        if _orbax_step.is_committed_step(child):
            size, added, saved = _local_bytes(child.local, seen_inodes)
            return StepRow(name, step, "committed", "orbax", ("persistent",), saved, size, added)
        size, added, _ = _local_bytes(child.local, seen_inodes)
        return StepRow(name, step, "incomplete", nbytes=size, added=added)
    if child.local is not None:
        size, added, saved = _local_bytes(child.local, seen_inodes)
    else:
        saved = None
        stored = storage_entries(m).values() if m is not None else ()
        size = sum(e.nbytes for e in stored) if m is not None else None
        added = sum(e.nbytes for e in stored if e.path not in m.refs) if m is not None else None
    base = None if m is None or "base" not in m.created else str(m.created["base"])
    reused = m.created.get("reused_bytes") if m is not None and base else None
    needs = tuple(sorted({t.split("/")[1] for t in m.refs.values()})) if m is not None else ()
    return StepRow(
        name,
        step,
        "committed",
        "jaxckpt",
        ("persistent",),
        saved,
        size,
        added,
        base=base,
        reused_bytes=reused if isinstance(reused, int) else None,
        needs=needs,
    )


def _local_bytes(
    path: Path | None, seen: set[tuple[int, int]]
) -> tuple[int | None, int | None, float | None]:
    """(bytes on disk, bytes of files not seen before by inode, the manifest's mtime)."""
    if path is None:
        return None, None, None
    size = added = 0
    for f in path.rglob("*"):
        st = f.lstat()
        if not f.is_file() or f.is_symlink():
            continue
        size += st.st_size
        if (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            added += st.st_size
    manifest = path / MANIFEST
    saved = manifest.lstat().st_mtime if manifest.is_file() else None
    return size, added, saved


def _local_steps(loc: _location.Location, local_directory: str | Path | None) -> dict[int, str]:
    """``{step: "local" or "local (k of N parts)"}`` of what the local tier's disk holds."""
    if local_directory is None:
        return {}
    if not Path(local_directory).expanduser().is_dir():
        raise CheckpointNotFoundError(
            f"local_directory {str(local_directory)!r} is not a directory. Pass the "
            f"local_directory the run's CheckpointManager was given (or None)."
        )
    raw = _location.read_small(_location.kvstore(loc.kvstore, loc), loc, _local_run.RUN_FILE, 4096)
    try:
        run = json.loads(raw or b"")["run"]
    except (ValueError, KeyError, TypeError):
        return {}  # no local tier was ever made for this run
    root = Path(local_directory).expanduser() / f"jaxckpt-{run}"
    parts: dict[int, tuple[set[int], int]] = {}
    for step_dir in root.glob("p*/*"):
        step = parse_step(step_dir.name)
        for pd in step_dir.iterdir() if step is not None and step_dir.is_dir() else ():
            got = parse_part(pd.name)
            if step is not None and got is not None and (pd / MANIFEST).is_file():
                have, _ = parts.get(step, (set(), got[1]))
                parts[step] = (have | {got[0]}, got[1])
    return {
        s: "local" if len(have) >= n else f"local ({len(have)} of {n} parts)"
        for s, (have, n) in parts.items()
    }


def _check_metric(rows: list[StepRow], name: str) -> None:
    """Refuse to rank by a metric no committed step has (a misspelt ``--best``)."""
    committed = [r for r in rows if r.status == "committed"]
    if not committed or any(name in (r.metrics or {}) for r in committed):
        return
    have = sorted({k for r in committed for k in r.metrics or {}})
    if have:
        there = f"their metrics are {', '.join(map(repr, have))}: name one of those"
    else:
        there = "none was saved with metrics (CheckpointManager.save(..., metrics=...))"
    raise InvalidArgumentError(
        f"best={name!r}: no committed step of the run has a metric {name!r} to rank by; {there}."
    )


def _mark_best(
    rows: list[StepRow],
    best: str | Callable[[Mapping[str, Any]], float] | None,
    mode: Literal["min", "max"],
) -> list[StepRow]:
    if best is None:
        return rows
    if mode not in ("min", "max"):
        raise ValueError(f"best_mode must be 'min' or 'max', got {mode!r}")
    if isinstance(best, str):
        _check_metric(rows, best)
    fn = (lambda m: m[best]) if isinstance(best, str) else best
    policy = Policy(best_fn=fn, best_mode=mode)  # its score: higher is better, None last
    scored = [
        (score, i)
        for i, r in enumerate(rows)
        if r.status == "committed" and (score := policy.score(r.metrics)) is not None
        and math.isfinite(score)
    ]  # fmt: skip
    if not scored:
        return rows
    _, i = max(scored)
    rows[i] = dataclasses.replace(rows[i], best=True)
    return rows
