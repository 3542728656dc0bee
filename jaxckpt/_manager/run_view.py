"""How a run's table reads: its rows (:class:`StepRow`) and :class:`RunTable`, as text
(``jaxckpt ls``), JSON (``--json``) and HTML (a notebook). ``jaxckpt._manager.table`` builds
them from what the run stores."""

from __future__ import annotations

import dataclasses
import html
import time
from collections.abc import Callable, Iterable
from typing import Any, Literal

from jaxckpt._runtime.progress import human_bytes

Status = Literal["committed", "incomplete", "retired"]


@dataclasses.dataclass(frozen=True)
class StepRow:
    """One step (or other sub-directory) of a run, as :func:`run_table` found it."""

    name: str
    step: int | None  # None: a name that is not a step number
    status: Status
    format: str | None = None  # "jaxckpt", "orbax"; None where not committed
    tiers: tuple[str, ...] = ()  # "persistent", "local" or "local (k of N parts)"
    saved: float | None = None  # seconds since the epoch: commit time, or the manifest's mtime
    nbytes: int | None = None  # what the step holds (bytes on disk locally)
    added: int | None = None  # what it stores itself; shared bytes are counted in one step
    metrics: dict[str, Any] | None = None
    best: bool = False
    pinned: bool = False
    base: str | None = None  # the step an incremental step was saved against
    reused_bytes: int | None = None
    needs: tuple[str, ...] = ()  # steps holding arrays this one references (object stores)
    held_by: tuple[str, ...] = ()  # retired: the steps that still reference its arrays
    # The manager's record of the step's save: seconds per phase, "blocking", "total",
    # "bytes_written", "bytes_reused", "slowest" (jaxckpt._manager.retention.MetricsFile)
    timings: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        """The row as JSON (``saved`` also as ISO 8601 text, UTC)."""
        doc = dataclasses.asdict(self)
        doc["committed"] = self.status == "committed"
        doc["saved_utc"] = _iso(self.saved)
        return doc


@dataclasses.dataclass(frozen=True)
class RunTable:
    """The steps of a run directory, oldest first (see :func:`run_table`).

    ``total_bytes`` counts every stored byte once (the sum of the rows' ``added``).
    ``print(table)`` prints the table as ``jaxckpt ls`` does; in a notebook it is an HTML
    table.
    """

    directory: str
    rows: tuple[StepRow, ...]

    @property
    def total_bytes(self) -> int:
        """Every byte the run stores, counted once."""
        return sum(r.added or 0 for r in self.rows)

    @property
    def steps(self) -> list[int]:
        """The committed steps, ascending."""
        return [r.step for r in self.rows if r.status == "committed" and r.step is not None]

    def row(self, step: int) -> StepRow:
        """The row of ``step``.

        Raises:
          KeyError: no row for ``step``.
        """
        for r in self.rows:
            if r.step == step:
                return r
        raise KeyError(f"step {step} is not in {self.directory}; steps: {self.steps}")

    def to_json(self) -> dict[str, Any]:
        """The table as JSON (what ``jaxckpt ls --json`` prints)."""
        return {
            "path": self.directory,
            "entries": [r.to_json() for r in self.rows],
            "total_bytes": self.total_bytes,
        }

    def total_line(self) -> str:
        """``total: 3 steps (2 committed, 1 retired), 10.2 KiB stored``."""
        counts: dict[str, int] = {}
        for r in self.rows:
            counts[r.status] = counts.get(r.status, 0) + 1
        kinds = ", ".join(f"{n} {s}" for s, n in counts.items())
        n = len(self.rows)
        return (
            f"total: {n} {'entry' if n == 1 else 'entries'} ({kinds}), "
            f"{human_bytes(self.total_bytes)} stored"
        )

    def lines(self) -> list[str]:
        """The text table (a header, one line per row, the total line)."""
        columns = _columns(self.rows)
        cells = [[h for h, _ in columns]]
        cells += [[cell(r) for _, cell in columns] for r in self.rows]
        widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
        out = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
        return [*out, self.total_line()]

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def __repr__(self) -> str:
        best = next((r.name for r in self.rows if r.best), None)
        latest = self.steps[-1] if self.steps else None
        return (
            f"<RunTable {self.directory}: {len(self.steps)} committed steps, latest {latest}"
            + (f", best {best}" if best else "")
            + f"; {self.total_line()}>"
        )

    def _repr_html_(self) -> str:
        columns = _columns(self.rows)
        head = "".join(f"<th>{html.escape(h)}</th>" for h, _ in columns)
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(cell(r))}</td>" for _, cell in columns) + "</tr>"
            for r in self.rows
        )
        caption = html.escape(f"{self.directory}: {self.total_line()}")
        return (
            f"<table><caption>{caption}</caption><thead><tr>{head}</tr></thead>"
            f"<tbody>{body}</tbody></table>"
        )


def _iso(t: float | None) -> str | None:
    return None if t is None else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def _status(r: StepRow) -> str:
    if r.status == "retired":
        return f"retired (arrays held by {', '.join(r.held_by)})"
    return r.status


def _base(r: StepRow) -> str:
    if r.base is None:
        return "-"
    reused = f" ({human_bytes(r.reused_bytes)} reused)" if r.reused_bytes is not None else ""
    return f"{r.base}{reused}" + (f", needs {', '.join(r.needs)}" if r.needs else "")


def _metrics(r: StepRow) -> str:
    if not r.metrics:
        return "-"
    return " ".join(f"{k}={_number(v)}" for k, v in r.metrics.items())


def _seconds(r: StepRow, what: str) -> str:
    """A step's save time ``what`` (``total``, ``blocking``), e.g. ``1.25s``; ``-`` where the
    manager recorded none."""
    t = (r.timings or {}).get(what)
    if not isinstance(t, (int, float)):
        return "-"
    return f"{t:.3f}s" if t < 10 else f"{t:.1f}s"


def _number(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _columns(rows: Iterable[StepRow]) -> list[tuple[str, Callable[[StepRow], str]]]:
    """The columns of the text and HTML tables; those with nothing to say are left out."""
    rows = list(rows)

    def size(n: int | None) -> str:
        return "?" if n is None else human_bytes(n)

    cols: list[tuple[str, Callable[[StepRow], str]]] = [
        ("NAME", lambda r: r.name),
        ("STATUS", _status),
        ("SIZE", lambda r: size(r.nbytes)),
        ("ADDED", lambda r: size(r.added)),
        ("SAVED", lambda r: "-" if r.saved is None else time.strftime("%m-%d %H:%M:%S",
                                                                       time.localtime(r.saved))),
        ("TIERS", lambda r: ",".join(r.tiers) or "-"),
    ]  # fmt: skip
    if any(r.format == "orbax" for r in rows):
        cols.append(("FORMAT", lambda r: r.format or "-"))
    if any(r.best or r.pinned for r in rows):
        marks = ("best", "pinned")
        cols.append(("MARKS", lambda r: ",".join(m for m in marks if getattr(r, m)) or "-"))
    if any(r.timings for r in rows):
        cols.append(("TOOK", lambda r: _seconds(r, "total")))
        cols.append(("BLOCKED", lambda r: _seconds(r, "blocking")))
    if any(r.metrics for r in rows):
        cols.append(("METRICS", _metrics))
    if any(r.base for r in rows):
        cols.append(("BASE", _base))
    return cols
