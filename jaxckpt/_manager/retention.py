"""Which steps a CheckpointManager keeps, and the metrics it ranks them by (JSON, never pickle).

The policy is a free function, :func:`steps_to_delete`, so it can be read and tested alone;
:class:`Policy` binds a manager's arguments to it and :func:`apply` carries it out.
Metrics live in one small file, ``DIR/metrics.json``::

    {"format": 1, "steps": {"100": {"loss": 0.31}, "200": {"loss": 0.27}},
     "committed": {"100": 1767225600.5, "200": 1767229200.25}}

written whole (a temporary file renamed over it) by the primary process after each commit.
``committed`` holds each step's commit time (seconds since the Unix epoch), recorded when the
manager has ``keep_every_n_secs``; older jaxckpt read only ``steps`` and ignore it.

The rule, in one place (:func:`steps_to_delete`): steps kept for good are the multiples of
``keep_every_n_steps`` and, with ``keep_every_n_secs=T``, the first step committed in each
T-second window of the clock (windows start at multiples of T seconds since the Unix epoch; a
step without a recorded time is in none). They do not count toward ``max_to_keep``, which
keeps that many of the other steps: the newest, or the best by ``best_fn``. The newest step is
always kept.
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
    CheckpointError,
    CheckpointNotFoundError,
    InvalidArgumentError,
    ManifestError,
    UnsupportedLeafError,
)
from jaxckpt._format.manifest import Manifest
from jaxckpt._format.names import step_name
from jaxckpt._storage import catalog as _catalog
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
) -> list[int]:
    """The steps retention deletes: all but the newest (or best) ``max_to_keep`` of those
    not kept for good (the module's docstring states the rule).

    Args:
      steps: the committed steps.
      max_to_keep: how many to keep (``None``: all), not counting the steps kept for good:
        the multiples of ``keep_every_n_steps`` and the first step committed in each
        ``keep_every_n_secs`` window.
      score: ``step -> float | None``, higher is better; ``None`` ranks last. Without it the
        newest steps are kept. The newest step is kept whatever its score.
      committed: each step's commit time, in seconds since the Unix epoch; steps missing
        from it are in no ``keep_every_n_secs`` window.

    Returns:
      The steps to delete, ascending.

    Example:
      >>> steps_to_delete([1, 2, 3, 4, 5], max_to_keep=1, keep_every_n_steps=2)
      [1, 3]
      >>> times = {1: 0.0, 2: 30.0, 3: 61.0, 4: 65.0, 5: 130.0}  # windows of 60 s
      >>> steps_to_delete([1, 2, 3, 4, 5], max_to_keep=1, keep_every_n_secs=60, committed=times)
      [2]
    """
    if max_to_keep is None or not steps:
        return []
    forever = {s for s in steps if keep_every_n_steps and s % keep_every_n_steps == 0}
    forever |= first_in_windows(steps, keep_every_n_secs, committed or {})
    candidates = sorted(s for s in steps if s not in forever)
    if score is not None:
        scores = {s: score(s) for s in candidates}
        candidates.sort(key=lambda s: (scores[s] is not None, scores[s] or 0.0, s))
    keep = set(candidates[-max_to_keep:]) | {max(steps)}
    return sorted(s for s in candidates if s not in keep)


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
        """Higher is better; ``None`` (ranked last) without metrics or a usable value."""
        if record is None or self.best_fn is None:
            return None
        try:
            value = float(self.best_fn(record))
        except Exception:
            return None
        return None if math.isnan(value) else (-value if self.best_mode == "min" else value)

    def doomed(
        self, steps: list[int], metrics: Mapping[str, Any], committed: Mapping[str, float]
    ) -> list[int]:
        """The steps of ``steps`` retention deletes, given every step's ``metrics`` and
        commit time (``committed``, by step as a string, as ``metrics.json`` holds them)."""
        score = None if self.best_fn is None else lambda s: self.score(metrics.get(str(s)))
        times = {int(s): t for s, t in committed.items()}
        return steps_to_delete(
            sorted(steps),
            max_to_keep=self.max_to_keep,
            keep_every_n_steps=self.keep_every_n_steps,
            score=score,
            keep_every_n_secs=self.keep_every_n_secs,
            committed=times,
        )

    def refuse_doomed(
        self,
        step: int,
        steps: list[int],
        metrics: dict[str, Any],
        directory: str,
        committed: Mapping[str, float],
    ) -> None:
        """Refuse to save ``step`` if retention would delete it as soon as it is committed:
        a step older than the ones kept (a rollback that forgot the newer steps).

        Raises:
          CheckpointError: naming the kept steps and how to roll back.
        """
        if self.max_to_keep is None or not steps or step > max(steps):
            return  # a step newer than every other one is always kept
        if step in self.doomed([*steps, step], metrics, {**committed, str(step): time.time()}):
            raise CheckpointError(
                f"Step {step} is older than the steps kept in {directory} ({steps}): with "
                f"max_to_keep={self.max_to_keep} retention would delete it as soon as it is "
                f"committed, so it is not saved. To go on from an older step (a rollback), "
                f"delete the newer steps first (CheckpointManager.delete(step)); or save a "
                f"later step."
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
) -> list[int]:
    """Delete the steps ``policy`` dooms among the committed ``steps`` of ``run``, after
    writing ``metrics`` and ``committed`` without them (``changed``: write them even if none
    goes).

    Metrics go first: a crash before the deletes leaves doomed steps without metrics, which
    rank last and go at the next save; never a kept step without its metrics. What the kept
    steps reference (object stores) is read before either: if it cannot be, nothing changes.

    Returns:
      The steps deleted.
    """
    doomed = policy.doomed(steps, metrics, committed)
    keep = referenced(run, [step_name(s) for s in steps if s not in doomed]) if doomed else {}
    gone = {str(s) for s in doomed} & (set(metrics) | set(committed))
    if gone or changed:
        metrics_file.write(
            {k: v for k, v in metrics.items() if k not in gone},
            {k: t for k, t in committed.items() if k not in gone},
        )
    deleted = []
    for step in doomed:
        if _catalog.delete(run.join(step_name(step)), keep=keep.get(step_name(step), ())):
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
) -> list[int]:
    """(primary) Once ``step`` is committed: record its metrics and, with
    ``keep_every_n_secs``, its commit time (now), then :func:`apply` the policy.

    Returns:
      The steps deleted.
    """
    metrics, committed = metrics_file.read_all()
    if record is not None:
        metrics[str(step)] = record
    timed = policy.keep_every_n_secs is not None
    if timed:
        committed[str(step)] = time.time()
    changed = record is not None or timed
    return apply(run, policy, metrics_file, metrics, steps, changed=changed, committed=committed)


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
    """``metrics.json`` of a checkpoint directory: ``{step: {name: value}}``."""

    def __init__(self, loc: _location.Location) -> None:
        self.loc = loc

    def read(self) -> dict[str, Any]:
        """Every step's metrics, keyed by the step as a string; ``{}`` if none are stored."""
        return self.read_all()[0]

    def read_all(self) -> tuple[dict[str, Any], dict[str, float]]:
        """Every step's metrics and every recorded commit time (seconds since the epoch),
        both keyed by the step as a string."""
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
            return {}, {}
        try:
            doc = json.loads(raw)
            steps, committed = doc["steps"], doc.get("committed", {})
        except (ValueError, KeyError, TypeError, AttributeError):
            steps = committed = None
        if not isinstance(steps, dict):
            logger.warning("%s/%s is not a jaxckpt metrics file; ignoring it", self.loc, METRICS)
            return {}, {}
        times = committed if isinstance(committed, dict) else {}
        return steps, {k: float(t) for k, t in times.items() if _is_time(k, t)}

    def write(self, steps: Mapping[str, Any], committed: Mapping[str, float] | None = None) -> None:
        """Replace the file with ``steps`` and the commit times ``committed`` (atomically on a
        local disk)."""
        doc: dict[str, Any] = {"format": 1, "steps": dict(steps)}
        if committed:
            doc["committed"] = dict(committed)
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
