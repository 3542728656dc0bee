"""jaxckpt's ``jax.monitoring`` events: their names (the one table of them; docs/observability.md
prints it) and the calls that record them, and a save's per-process timings.

Durations go to ``jax.monitoring.record_event_duration_secs``, bytes to ``record_scalar`` and a
straggler to ``record_event``, each with the same attributes in the same order (jax asks for
that): ``store`` (``local``, ``gs``, ``s3``, ``memory``) and, for saves, ``call`` (``save`` or
``save_async``). Nothing is built or recorded while no listener of the kind is registered
(:func:`listening`): a look at jax's listener lists is all a call pays then.

A save's timings (``SaveHandle.timings``), in seconds: ``plan`` (planning, agreeing on the
plan, opening the writer), ``stage`` (copying off the caller's buffers), ``write`` (creating
arrays, writing, flushing), ``commit`` (the manifest and what follows it), each without the time
this process spent ``wait``-ing for the other processes, which is a phase of its own;
``blocking`` (until the call returned) and ``total`` (until committed). A blocking save's
phases add up to its ``total``; an async save's ``plan`` and ``stage`` and the waits between
them add up to its ``blocking`` part.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import jax

PREFIX = "/jax/jaxckpt"
SAVE_PHASES = ("plan", "stage", "write", "wait", "commit")
SAVE_DURATIONS = {
    phase: f"{PREFIX}/save/{phase}_duration_secs" for phase in (*SAVE_PHASES, "blocking", "total")
}
SAVE_BYTES = {"written": f"{PREFIX}/save/bytes_written", "reused": f"{PREFIX}/save/bytes_reused"}
SAVE_STRAGGLER = f"{PREFIX}/save/straggler"  # an event: process, phase, seconds (ms), median
RESTORE_PHASES = ("open", "read", "place")
RESTORE_DURATIONS = {
    phase: f"{PREFIX}/restore/{phase}_duration_secs" for phase in (*RESTORE_PHASES, "total")
}
RESTORE_BYTES = f"{PREFIX}/restore/bytes_read"
METADATA_DURATION = f"{PREFIX}/metadata/duration_secs"
MANAGER_DURATIONS = {
    "save": f"{PREFIX}/manager/save_duration_secs",  # what CheckpointManager.save blocked
    "restore": f"{PREFIX}/manager/restore_duration_secs",
    "wait": f"{PREFIX}/manager/wait_duration_secs",
}

# A process is a straggler in a phase when it took more than STRAGGLER_RATIO times the median
# of the other processes and STRAGGLER_SECONDS more than it.
STRAGGLER_RATIO = 2.0
STRAGGLER_SECONDS = 1.0


def all_names() -> list[str]:
    """Every event name jaxckpt records (the table of docs/observability.md)."""
    return [
        *SAVE_DURATIONS.values(),
        *SAVE_BYTES.values(),
        SAVE_STRAGGLER,
        *RESTORE_DURATIONS.values(),
        RESTORE_BYTES,
        METADATA_DURATION,
        *MANAGER_DURATIONS.values(),
    ]


def _listener_lists() -> Callable[[], tuple[int, int, int]]:
    """How many duration, scalar and plain-event listeners jax has (all counted as present
    where this jax keeps them elsewhere: then every event is recorded)."""
    try:
        from jax._src import monitoring
    except ImportError:  # pragma: no cover - every supported jax has it
        return lambda: (1, 1, 1)
    getters = ("get_event_duration_listeners", "get_scalar_listeners", "get_event_listeners")
    if not all(hasattr(monitoring, g) for g in getters):  # pragma: no cover
        return lambda: (1, 1, 1)
    return lambda: (
        len(monitoring.get_event_duration_listeners()),
        len(monitoring.get_scalar_listeners()),
        len(monitoring.get_event_listeners()),
    )


_counts = _listener_lists()


def listening() -> bool:
    """Whether any ``jax.monitoring`` listener that jaxckpt's events reach is registered."""
    return any(_counts())


class Where(Protocol):
    """What :func:`store_kind` reads of a location (``_storage.location.Location``)."""

    local: Any  # a Path for a local directory, else None
    kvstore: dict[str, Any]


def store_kind(loc: Where) -> str:
    """``local``, ``gs``, ``s3``, ``memory`` (or the kvstore driver) of a location."""
    driver = str(loc.kvstore.get("driver"))
    return "local" if loc.local is not None else {"gcs": "gs", "file": "local"}.get(driver, driver)


def record_save(
    timings: Mapping[str, float],
    *,
    store: str,
    call: str,
    written: int | None = None,
    reused: int | None = None,
) -> None:
    """A save's durations (those of ``timings`` with an event) and, once it is done, its
    bytes (``written``, ``reused``: this process's)."""
    durations, scalars, _ = _counts()
    if durations:
        for phase, secs in timings.items():
            if phase in SAVE_DURATIONS:
                jax.monitoring.record_event_duration_secs(
                    SAVE_DURATIONS[phase], secs, store=store, call=call
                )
    for what, n in (("written", written), ("reused", reused)):
        if scalars and n is not None:
            jax.monitoring.record_scalar(SAVE_BYTES[what], n, store=store, call=call)


def record_restore(timings: Mapping[str, float], nbytes: int, *, store: str) -> None:
    """A finished restore's durations and the bytes it read."""
    durations, scalars, _ = _counts()
    if durations:
        for phase, secs in timings.items():
            jax.monitoring.record_event_duration_secs(RESTORE_DURATIONS[phase], secs, store=store)
    if scalars:
        jax.monitoring.record_scalar(RESTORE_BYTES, nbytes, store=store)


def record_duration(name: str, secs: float, *, store: str) -> None:
    """One duration event (``metadata``, the manager's steps)."""
    if _counts()[0]:
        jax.monitoring.record_event_duration_secs(name, secs, store=store)


class Clock:
    """One thread's phases, each without the waits for other processes in it (``waited``:
    the seconds this thread has waited so far), added into ``into``."""

    def __init__(self, into: dict[str, float], waited: Callable[[], float]) -> None:
        self.into = into
        self._waited = waited
        self.start = self._t = time.perf_counter()
        self._w = waited()

    def mark(self, phase: str) -> None:
        """Add the time since the last mark (or the start), less its waits, to ``phase``."""
        t, w = time.perf_counter(), self._waited()
        self.into[phase] = self.into.get(phase, 0.0) + max(0.0, (t - self._t) - (w - self._w))
        self._t, self._w = t, w


# -- a save's timings across processes ------------------------------------------------------


def payload(mine: Mapping[str, float], rest: str) -> str:
    """What a process sends at the "written" barrier: its phase timings (and bytes), a
    newline, ``rest``."""
    return json.dumps({k: round(v, 6) for k, v in mine.items()}) + "\n" + rest


def split(payloads: Mapping[int, str]) -> tuple[dict[int, dict[str, float]], dict[int, str]]:
    """(coordinator) Every process's timings and the rest of each payload."""
    timings: dict[int, dict[str, float]] = {}
    rest: dict[int, str] = {}
    for p, text in payloads.items():
        head, _, rest[p] = text.partition("\n")
        got = json.loads(head)
        timings[p] = {k: float(v) for k, v in got.items()} if isinstance(got, dict) else {}
    return timings, rest


def slowest(by_process: Mapping[int, Mapping[str, float]]) -> dict[str, list[Any]]:
    """``{phase: [process, seconds]}``: the process that took longest in each phase."""
    out: dict[str, list[Any]] = {}
    for phase in SAVE_PHASES:
        times = {p: t[phase] for p, t in by_process.items() if phase in t}
        if times:
            p = max(sorted(times), key=lambda q: times[q])
            out[phase] = [p, round(times[p], 6)]
    return out


def stragglers(
    by_process: Mapping[int, Mapping[str, float]],
) -> list[tuple[str, int, float, float]]:
    """``(phase, process, seconds, median of the others)`` of each process that took more than
    ``STRAGGLER_RATIO`` times the others' median and ``STRAGGLER_SECONDS`` more in a phase of
    its own (``wait`` is not one: the others wait *for* a straggler)."""
    found = []
    for phase in ("plan", "stage", "write"):
        times = {p: t[phase] for p, t in by_process.items() if phase in t}
        if len(times) < 2:
            continue
        p = max(sorted(times), key=lambda q: times[q])
        median = statistics.median(t for q, t in times.items() if q != p)
        if times[p] > STRAGGLER_RATIO * median and times[p] - median > STRAGGLER_SECONDS:
            found.append((phase, p, times[p], median))
    return found


def record_straggler(phase: str, process: int, secs: float, median: float, *, store: str) -> None:
    """The event of one straggler (milliseconds: jax's attributes are ``str`` or ``int``)."""
    if _counts()[2]:
        jax.monitoring.record_event(
            SAVE_STRAGGLER,
            store=store,
            phase=phase,
            process=process,
            ms=round(secs * 1000),
            median_ms=round(median * 1000),
        )
