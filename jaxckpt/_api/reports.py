"""What a save or restore reports when it ends: its log line on the ``jaxckpt`` logger, its
``jax.monitoring`` events (``jaxckpt._runtime.events`` names them) and, on the coordinator of a
multi-process save, every process's timings with the stragglers named (docs/observability.md).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from jaxckpt._runtime import events as _events

logger = logging.getLogger("jaxckpt")


def blocked(timings: dict[str, float], blocking: float, attrs: tuple[str, str]) -> None:
    """The end of a save call's blocking part: ``blocking`` seconds, the events of its phases."""
    timings["blocking"] = blocking
    if _events.listening():
        phases = {k: timings.get(k, 0.0) for k in ("plan", "stage", "blocking")}
        _events.record_save(phases, store=attrs[0], call=attrs[1])


def own(timings: Mapping[str, float], waited: float, nbytes: int) -> dict[str, float]:
    """This process's phases so far, its waits and the bytes it wrote (for the coordinator)."""
    mine = {k: timings.get(k, 0.0) for k in ("plan", "stage", "write")}
    return {**mine, "wait": waited, "bytes": float(nbytes)}


def gathered(
    where: str, payloads: Mapping[int, str], store: str
) -> tuple[dict[int, dict[str, float]], dict[str, list[Any]], dict[int, str]]:
    """(coordinator) Every process's timings, the slowest process of each phase (with more
    than one process), the rest of each payload; each straggler logged and recorded."""
    processes, rest = _events.split(payloads)
    if len(processes) < 2:
        return processes, {}, rest
    for phase, process, secs, median in _events.stragglers(processes):
        logger.warning(
            "save to %s: process %d is a straggler: %s took it %.1f s, the other processes "
            "%.1f s (median); look at that host (its disk, network, load)",
            where,
            process,
            phase,
            secs,
            median,
        )
        _events.record_straggler(phase, process, secs, median, store=store)
    return processes, _events.slowest(processes), rest


def saved(
    where: str, timings: Mapping[str, float], nbytes: int, reused: int, gbps: float,
    attrs: tuple[str, str],
) -> None:  # fmt: skip
    """A committed save's log line and the events of its completion."""
    shown = dict(timings)  # a copy: an async call's thread may be adding "blocking" now
    logger.info(
        "saved %s: %.1f MB at %.2f GB/s (%.1f MB reused), %s",
        where,
        nbytes / 1e6,
        gbps,
        reused / 1e6,
        {k: round(v, 3) for k, v in shown.items()},
    )
    if _events.listening():
        done = {k: timings[k] for k in ("write", "wait", "commit", "total")}
        _events.record_save(done, store=attrs[0], call=attrs[1], written=nbytes, reused=reused)


def restored(where: _events.Where, timings: Mapping[str, float], nbytes: int) -> None:
    """A restore's log line (as a save's) and its events."""
    read = timings["read"] + timings["place"]
    logger.info(
        "restored %s: %.1f MB at %.2f GB/s, %s",
        where,
        nbytes / 1e6,
        nbytes / read / 1e9 if read else 0.0,
        {k: round(v, 3) for k, v in timings.items()},
    )
    if _events.listening():
        _events.record_restore(timings, nbytes, store=_events.store_kind(where))
