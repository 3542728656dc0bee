"""Which steps a CheckpointManager keeps, and the metrics it ranks them by (JSON, never pickle).

The policy is a free function, :func:`steps_to_delete`, so it can be read and tested alone;
:class:`Policy` binds a manager's arguments to it and :func:`apply` carries it out.
Metrics live in one small file, ``DIR/metrics.json``::

    {"format": 1, "steps": {"100": {"loss": 0.31}, "200": {"loss": 0.27}},
     "committed": {"100": 1767225600.5, "200": 1767229200.25}, "pinned": [100],
     "timings": {"100": {"plan": 0.01, "blocking": 0.2, "total": 3.1, "bytes_written": 8192, ...}}}

written whole (a temporary file renamed over it) by the primary process after each commit.
``committed`` holds each step's commit time (seconds since the Unix epoch), recorded when the
manager has ``keep_every_n_secs`` (``jaxckpt ls`` shows it where it is there); ``pinned`` the steps ``CheckpointManager.pin`` keeps from
retention; ``timings`` each step's save: the seconds of its phases, of the call (``blocking``)
and of the whole save (``total``), its bytes written (every process's) and reused, and on
several processes the slowest process of each phase (``slowest``: ``{phase: [process,
seconds]}``; docs/observability.md). Older jaxckpt read only ``steps`` and ignore the rest.

The rule, in one place (:func:`steps_to_delete`): steps kept for good are, for each multiple
of ``keep_every_n_steps``, the first step at or after it (the multiple itself where it was
saved); with ``keep_every_n_secs=T``, the first step committed in each T-second window of the
clock (windows start at multiples of T seconds since the Unix epoch; a step without a recorded
time is in none); the pinned steps; and with ``best_fn``, unless
``keep_checkpoints_without_metrics=False``, the steps saved without metrics. They do not count
toward ``max_to_keep``, which keeps that many of the other steps: the newest, or the best by
``best_fn``, where NaN and infinities rank worst (a step saved with metrics is never one
without them, so a diverged run's steps go like any others). The newest step is always kept.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

import numpy as np

from jaxckpt._errors import (
    CheckpointNotFoundError,
    InvalidArgumentError,
    ManifestError,
    UnsupportedLeafError,
)
from jaxckpt._format.manifest import Manifest
from jaxckpt._format.names import step_name
from jaxckpt._manager import run_index as _index
from jaxckpt._storage import lease as _lease
from jaxckpt._storage import location as _location

logger = logging.getLogger("jaxckpt")
METRICS = "metrics.json"


def steps_to_delete(
    steps: list[int],
    *,
    max_to_keep: int | None,
    keep_every_n_steps: int | None = None,
    score: Callable[[int], float | None] | None = None,
    keep_every_n_secs: float | None = None,
    committed: Mapping[int, float] | None = None,
    pinned: Iterable[int] = (),
    keep_unscored: bool = False,
) -> list[int]:
    """The steps retention deletes: all but the newest (or best) ``max_to_keep`` of those
    not kept for good (the module's docstring states the rule).

    Args:
      steps: the committed steps.
      max_to_keep: how many to keep (``None``: all), not counting the steps kept for good:
        for each multiple of ``keep_every_n_steps``, the first step at or after it; the first
        step committed in each ``keep_every_n_secs`` window; the ``pinned`` steps; and with
        ``keep_unscored``, the steps ``score`` has no value for.
      score: ``step -> float | None``, higher is better; ``None`` (a step without metrics)
        ranks last (or, with ``keep_unscored``, is kept); ``-inf`` (NaN and infinite metrics,
        see :meth:`Policy.score`) ranks worst of the scored steps, newest first, and is never
        kept as unscored. Without it the newest steps are kept. The newest step is kept
        whatever its score.
      committed: each step's commit time, in seconds since the Unix epoch; steps missing
        from it are in no ``keep_every_n_secs`` window.
      pinned: steps no retention deletes (``CheckpointManager.pin``).
      keep_unscored: keep the steps without a score (Orbax's and t5x's default,
        ``keep_checkpoints_without_metrics=True``).

    Returns:
      The steps to delete, ascending.

    Example:
      >>> steps_to_delete([1, 2, 3, 4, 5], max_to_keep=1, keep_every_n_steps=2)
      [1, 3]
      >>> steps_to_delete([1, 3, 7, 8, 9], max_to_keep=1, keep_every_n_steps=5)  # 5: 7
      [1, 3, 8]
      >>> times = {1: 0.0, 2: 30.0, 3: 61.0, 4: 65.0, 5: 130.0}  # windows of 60 s
      >>> steps_to_delete([1, 2, 3, 4, 5], max_to_keep=1, keep_every_n_secs=60, committed=times)
      [2]
    """
    if max_to_keep is None or not steps:
        return []
    forever = first_at_or_after_multiples(steps, keep_every_n_steps) | set(pinned)
    forever |= first_in_windows(steps, keep_every_n_secs, committed or {})
    candidates = sorted(s for s in steps if s not in forever)
    if score is not None:
        scores = {s: score(s) for s in candidates}
        if keep_unscored:
            candidates = [s for s in candidates if scores[s] is not None]
        candidates.sort(key=lambda s: (scores[s] is not None, scores[s] or 0.0, s))
    keep = set(candidates[-max_to_keep:]) | {max(steps)}
    return sorted(s for s in candidates if s not in keep)


def _number(value: Any) -> float | None:
    """``value`` as a float if it is a number (a bool, str or ``None`` is not)."""
    if value is None or isinstance(value, (str, bytes, bool)):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def first_at_or_after_multiples(steps: Iterable[int], n: int | None) -> set[int]:
    """For each multiple of ``n``, the first of ``steps`` at or after it (before the next
    step): the multiples themselves where they were saved, one step per ``n``-step span for
    continuous or time-based saves, which rarely land on a multiple.

    Example:
      >>> sorted(first_at_or_after_multiples([0, 3, 5, 6, 12, 13], 5))
      [0, 5, 12]
      >>> sorted(first_at_or_after_multiples([1, 2, 3, 4], 2))  # 0 was not saved
      [2, 4]
    """
    if not n:
        return set()
    out, previous = set(), None
    for s in sorted(steps):
        # A multiple lies in (previous, s]; before the first step: step 0, or one of n or more.
        if (s // n > previous // n) if previous is not None else (s == 0 or s >= n):
            out.add(s)
        previous = s
    return out


def first_in_windows(
    steps: Iterable[int], secs: float | None, committed: Mapping[int, float]
) -> set[int]:
    """The first step committed (the lowest, on a tie) in each ``secs``-second window.

    Example:
      >>> sorted(first_in_windows([1, 2, 3], 10, {1: 12.0, 2: 19.5, 3: 20.0}))
      [1, 3]
    """
    if not secs:
        return set()
    first: dict[int, tuple[float, int]] = {}
    for s in steps:
        t = committed.get(s)
        if t is not None:
            w = math.floor(t / secs)
            first[w] = min(first.get(w, (t, s)), (t, s))
    return {s for _, s in first.values()}


@dataclasses.dataclass(frozen=True)
class Policy:
    """A manager's retention arguments (see ``CheckpointManager``), bound to
    :func:`steps_to_delete`."""

    max_to_keep: int | None = None
    keep_every_n_steps: int | None = None
    best_fn: Callable[[Mapping[str, Any]], float] | None = None
    best_mode: Literal["min", "max"] = "min"
    keep_every_n_secs: float | None = None
    keep_without_metrics: bool = True

    def __post_init__(self) -> None:
        secs = self.keep_every_n_secs
        if secs is not None and (
            isinstance(secs, bool)
            or not isinstance(secs, (int, float))
            or not (math.isfinite(secs) and secs > 0)
        ):
            raise InvalidArgumentError(
                f"keep_every_n_secs must be a positive number or None, got {secs!r}"
            )

    def score(self, record: Mapping[str, Any] | None) -> float | None:
        """Higher is better; ``None`` (ranked last, or kept with ``keep_without_metrics``)
        only for a step saved without metrics. A step saved with metrics always has a score:
        ``-inf``, the worst, where ``best_fn`` gives NaN or an infinity (a diverged run) or
        cannot score them (metrics stored before ``best_fn`` changed; :meth:`check` refuses
        such metrics at the save)."""
        if record is None or self.best_fn is None:
            return None
        try:
            value = _number(self.best_fn(record))
        except Exception:  # noqa: BLE001 - the user's function: any failure is "unscorable"
            value = None
        if value is None or not math.isfinite(value):
            return -math.inf
        return -value if self.best_mode == "min" else value

    def check(self, step: int, record: Mapping[str, Any]) -> None:
        """Refuse metrics ``best_fn`` cannot score, when ``step`` is saved with them.

        Raises:
          InvalidArgumentError: ``best_fn`` raised, or gave no number; names ``best_fn``, the
            step, its metrics and why.
        """
        if self.best_fn is None:
            return
        cause: Exception | None = None
        try:
            got = self.best_fn(record)
        except Exception as e:  # noqa: BLE001 - the user's function: named in the message
            why, cause = f"it raised {type(e).__name__}: {e}", e
        else:
            if _number(got) is not None:
                return
            why, cause = f"it returned {got!r}, not a number", None
        raise InvalidArgumentError(
            f"best_fn cannot score the metrics of step {step}, {dict(record)!r}: {why}. "
            f"best_fn must give a number for every step saved with metrics (NaN and infinities "
            f"are numbers: they rank worst). Pass the metric it reads as a number (e.g. "
            f"metrics={{'loss': float(loss)}}), or save the step without metrics. Nothing "
            f"was saved."
        ) from cause

    def doomed(
        self,
        steps: list[int],
        metrics: Mapping[str, Any],
        committed: Mapping[str, float],
        pinned: Iterable[int] = (),
    ) -> list[int]:
        """The steps of ``steps`` retention deletes, given every step's ``metrics`` and
        commit time (``committed``, by step as a string, as ``metrics.json`` holds them) and
        the ``pinned`` steps."""
        score = None if self.best_fn is None else lambda s: self.score(metrics.get(str(s)))
        times = {int(s): t for s, t in committed.items()}
        return steps_to_delete(
            sorted(steps),
            max_to_keep=self.max_to_keep,
            keep_every_n_steps=self.keep_every_n_steps,
            score=score,
            keep_every_n_secs=self.keep_every_n_secs,
            committed=times,
            pinned=pinned,
            keep_unscored=self.keep_without_metrics,
        )


def apply(
    run: _location.Location,
    policy: Policy,
    metrics_file: MetricsFile,
    metrics: dict[str, Any],
    steps: list[int],
    *,
    changed: bool,
    committed: dict[str, float],
    timings: dict[str, Any] | None = None,
    pinned: list[int] | None = None,
) -> list[int]:
    """Delete the steps ``policy`` dooms among the committed ``steps`` of ``run``, after
    writing ``metrics``, ``committed`` and ``timings`` (``None``: those stored) without them
    (``changed``: write them even if none goes); ``pinned``: the pinned steps, if read already.

    Metrics go first: a crash before the deletes leaves doomed steps without metrics, which
    rank last and go at the next save; never a kept step without its metrics. What the kept
    steps reference (object stores) is read before either: if it cannot be, nothing changes.

    Returns:
      The steps deleted.
    """
    pinned = metrics_file.pinned() if pinned is None else pinned
    doomed = policy.doomed(steps, metrics, committed, pinned)
    keep = referenced(run, [step_name(s) for s in steps if s not in doomed]) if doomed else {}
    timings = metrics_file.timings() if timings is None else timings
    gone = {str(s) for s in doomed} & (set(metrics) | set(committed) | set(timings))
    if gone or changed:
        metrics_file.write(
            {k: v for k, v in metrics.items() if k not in gone},
            {k: t for k, t in committed.items() if k not in gone},
            pinned,
            {k: t for k, t in timings.items() if k not in gone},
        )
    deleted = []
    for step in doomed:
        if _index.delete_step(run, step, keep=keep.get(step_name(step), ())):
            logger.info("deleted step %d from %s (retention)", step, run)
            deleted.append(step)
    return deleted


def after_commit(
    run: _location.Location,
    policy: Policy,
    metrics_file: MetricsFile,
    step: int,
    record: dict[str, Any] | None,
    steps: list[int],
    timings: dict[str, Any] | None = None,
    at: float | None = None,
) -> list[int]:
    """(primary) Once ``step`` is committed: record its metrics, its save's ``timings`` and,
    with ``keep_every_n_secs``, its commit time (``at``, from :func:`now` when it committed;
    default now), then :func:`apply` the policy.

    Returns:
      The steps deleted.
    """
    doc = metrics_file.doc()  # one read of metrics.json for all of it
    metrics, committed = metrics_file.read_all(doc)
    if record is not None:
        metrics[str(step)] = record
    timed = policy.keep_every_n_secs is not None
    if timed:
        committed[str(step)] = now() if at is None else at
    stored = metrics_file.timings(doc)
    if timings is not None:
        stored[str(step)] = timings
    changed = record is not None or timed or timings is not None
    return apply(
        run,
        policy,
        metrics_file,
        metrics,
        steps,
        changed=changed,
        committed=committed,
        timings=stored,
        pinned=metrics_file.pinned(doc),
    )


def now() -> float:
    """The time a commit is recorded at: seconds since the Unix epoch."""
    return time.time()


def _is_time(step: str, t: Any) -> bool:
    """Whether ``step: t`` of a (possibly damaged) metrics file is a step's commit time."""
    name_ok = step.isascii() and step.isdecimal() and len(step) < 19
    return name_ok and type(t) in (int, float) and math.isfinite(t)


def json_metrics(step: int, metrics: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """``metrics`` as plain JSON values (jax/numpy scalars become Python numbers).

    Raises:
      UnsupportedLeafError: a key is not a string or a value not a scalar; names the metric.
    """
    if metrics is None:
        return None
    out: dict[str, Any] = {}
    for key, value in metrics.items():
        if hasattr(value, "shape") and np.ndim(value) == 0 and hasattr(value, "item"):
            value = value.item()  # a jax or numpy scalar
        if not isinstance(key, str) or not (
            value is None or isinstance(value, (bool, int, float, str))
        ):
            raise UnsupportedLeafError(
                f"Metric {key!r} of step {step} is a {type(value).__name__}; metrics are stored "
                f"as JSON, so each must be a str key with a number, string, bool or None value "
                f"(e.g. float(loss))."
            )
        out[key] = value
    return out


class MetricsFile:
    """``metrics.json`` of a checkpoint directory: ``{step: {name: value}}``, commit times and
    pinned steps (see the module's docstring)."""

    def __init__(self, loc: _location.Location) -> None:
        self.loc = loc

    def read(self) -> dict[str, Any]:
        """Every step's metrics, keyed by the step as a string; ``{}`` if none are stored."""
        return self.read_all()[0]

    def read_all(
        self, doc: dict[str, Any] | None = None
    ) -> tuple[dict[str, Any], dict[str, float]]:
        """Every step's metrics and every recorded commit time (seconds since the epoch),
        both keyed by the step as a string (of ``doc``, what :meth:`doc` read, if given)."""
        doc = self.doc() if doc is None else doc
        steps, committed = doc.get("steps", {}), doc.get("committed", {})
        times = committed if isinstance(committed, dict) else {}
        return steps, {k: float(t) for k, t in times.items() if _is_time(k, t)}

    def timings(self, doc: dict[str, Any] | None = None) -> dict[str, Any]:
        """Every step's save timings (see the module's docstring), keyed by the step as a
        string; ``{}`` if none are stored (of ``doc``, if given)."""
        got = (self.doc() if doc is None else doc).get("timings", {})
        return (
            {k: v for k, v in got.items() if isinstance(v, dict)} if isinstance(got, dict) else {}
        )

    def pinned(self, doc: dict[str, Any] | None = None) -> list[int]:
        """The pinned steps, ascending (of ``doc``, if given)."""
        pins = (self.doc() if doc is None else doc).get("pinned", [])
        ok = isinstance(pins, list) and all(type(p) is int and p >= 0 for p in pins)
        return sorted(set(pins)) if ok else []

    def doc(self) -> dict[str, Any]:
        """The file's JSON object (``{}`` if absent or not a jaxckpt metrics file): one read,
        which the other readers take so as not to read it again."""
        if self.loc.local is not None:
            path = self.loc.local / METRICS
            raw = path.read_bytes() if path.is_file() else None
        else:
            got = _location.wait(
                _location.kvstore(self.loc.kvstore, self.loc).read(METRICS),
                self.loc,
                f"reading {METRICS}",
            )
            raw = got.value if got.state == "value" else None
        if raw is None:
            return {}
        try:
            doc = json.loads(raw)
            ok = isinstance(doc, dict) and isinstance(doc["steps"], dict)
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            logger.warning("%s/%s is not a jaxckpt metrics file; ignoring it", self.loc, METRICS)
            return {}
        result: dict[str, Any] = doc
        return result

    def write(
        self,
        steps: Mapping[str, Any],
        committed: Mapping[str, float] | None = None,
        pinned: Iterable[int] | None = None,
        timings: Mapping[str, Any] | None = None,
    ) -> None:
        """Replace the file with ``steps``, the commit times ``committed``, the ``pinned``
        steps (``None``: those pinned now) and the save ``timings`` (``None``: those stored
        now), atomically on a local disk."""
        doc: dict[str, Any] = {"format": 1, "steps": dict(steps)}
        if committed:
            doc["committed"] = dict(committed)
        pins = sorted(set(self.pinned() if pinned is None else pinned))
        if pins:
            doc["pinned"] = pins
        timed = self.timings() if timings is None else timings
        if timed:
            doc["timings"] = dict(timed)
        raw = json.dumps(doc, indent=1, sort_keys=True).encode()
        if self.loc.local is None:
            _location.wait(
                _location.kvstore(self.loc.kvstore, self.loc).write(METRICS, raw),
                self.loc,
                f"writing {METRICS}",
            )
            return
        tmp = self.loc.local / f".{METRICS}.tmp-{uuid.uuid4().hex[:8]}"
        with _lease.locked_file(tmp) as f:  # a clean-up leaves it alone while it is written
            f.write(raw)
            f.flush()
            os.replace(tmp, self.loc.local / METRICS)


def referenced(run: _location.Location, steps: Iterable[str]) -> dict[str, set[str]]:
    """The arrays of each step (by name) that the committed ``steps`` of ``run`` reference:
    ``{held_by: {storage path in it}}`` (incremental steps on object stores; empty elsewhere:
    local incremental steps hold hard links, not references). The ``held-by`` markers say
    the same for steps saved since they exist; this also covers older ones.

    One manifest read per step. A step whose manifest is damaged (or gone since the listing)
    references nothing here: what it referenced is not kept for it.

    Raises:
      CheckpointError: a manifest could not be read (e.g. past the deadline): what that step
        references is unknown, so the caller must delete nothing.
    """
    out: dict[str, set[str]] = {}
    if run.local is not None:
        return out
    for name in steps:
        try:
            m = Manifest.from_json(_location.read_manifest(run.join(name)))
        except (ManifestError, CheckpointNotFoundError):
            continue
        for target in m.refs.values():
            _, held_by, path = target.split("/", 2)
            out.setdefault(held_by, set()).add(path)
    return out
