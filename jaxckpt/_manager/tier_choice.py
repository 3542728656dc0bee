"""The restore decision of a tiered ``CheckpointManager``: a pure function of what each process
holds, computed by process 0 and followed by all (``jaxckpt._manager.tiers`` posts and carries
it out). Which tier and step, and which process sends which local part to whom.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class RestoredFrom:
    """Where ``CheckpointManager.restore()`` found the step it returned.

    Attributes:
      tier: ``"local"`` (the processes' local parts) or ``"persistent"``.
      step: the step restored.
      from_peers: the processes whose local part came from a peer's replica.
    """

    tier: str
    step: int
    from_peers: tuple[int, ...] = ()


def choose(
    count: int, posted: Mapping[int, Mapping[str, Any]], *, step: int | None = None
) -> dict[str, Any]:
    """The restore every process makes: which tier and step, and who sends which part to whom.

    Args:
      count: the number of processes.
      posted: per process ``{"parts": [[step, part, save, layout], ...], "target": layout or
        None, "persistent": [steps]}`` (the persistent steps as process 0 sees them count).
      step: only this step (``None``: the newest).

    Returns:
      ``{"tier": "local" | "persistent" | None, "step", "save", "fetch": {part: holder},
      "fallback": persistent step or None, "local_steps": [complete local steps], "why"}``.
      A local step counts with its newest save only (the greatest save id any process posts
      for it): if that save is not complete, neither is the step, whole older saves of it
      or not. A local step wins when it is at least as new as the newest persistent step: it
      is the faster copy.

    Example:
      >>> posted = {0: {"parts": [[5, 0, "a", "L"], [5, 1, "a", "L"]], "target": "L",
      ...               "persistent": [0]},
      ...           1: {"parts": [], "target": "L", "persistent": [0]}}
      >>> c = choose(2, posted); c["tier"], c["step"], c["fetch"]
      ('local', 5, {'1': 0})
    """
    holders = _holders(count, posted)
    targets = {posted[p]["target"] for p in posted}
    target = targets.pop() if len(targets) == 1 else None
    complete = sorted(k for k, parts in holders.items() if len(parts) == count)
    usable = [k for k in complete if k[2] == target and step in (None, k[0])]
    persistent = [s for s in posted[0]["persistent"] if step in (None, s)]
    newest = max(persistent, default=None)
    out: dict[str, Any] = {
        "tier": None,
        "fetch": {},
        "fallback": newest,
        "local_steps": sorted({k[0] for k in complete}),
    }
    if not usable:
        why = "no complete local step" if not complete else "no complete local step fits"
        if complete and target is None:
            why += " (the target has no shardings, or keys=/planner= were given)"
        out["why"] = why
    elif newest is not None and newest > usable[-1][0]:
        out["why"] = f"persistent step {newest} is newer than local step {usable[-1][0]}"
    else:
        s, save, layout = usable[-1]
        out.update(tier="local", step=s, save=save, fetch=_senders(holders[usable[-1]]))
        return out
    if newest is not None:
        out.update(tier="persistent", step=newest)
    return out


def _holders(
    count: int, posted: Mapping[int, Mapping[str, Any]]
) -> dict[tuple[int, str, str], dict[int, list[int]]]:
    """``{(step, save, layout): {part: [holders]}}`` of each step's newest save only."""
    newest: dict[int, str] = {}
    for p in posted:
        for s, q, save, _ in posted[p]["parts"]:
            if 0 <= q < count:
                newest[s] = max(save, newest.get(s, save))  # later saves' ids sort later
    holders: dict[tuple[int, str, str], dict[int, list[int]]] = {}
    for p in sorted(posted):
        for s, q, save, layout in posted[p]["parts"]:
            if 0 <= q < count and save == newest[s]:
                holders.setdefault((s, save, layout), {}).setdefault(q, []).append(p)
    return holders


def _senders(parts: dict[int, list[int]]) -> dict[str, int]:
    """For each part its owner lacks, the holder that sends it (the least busy one)."""
    busy: dict[int, int] = {}
    fetch = {}
    for q in sorted(parts):
        if q in parts[q]:
            continue
        h = min(parts[q], key=lambda p: (busy.get(p, 0), p))
        busy[h] = busy.get(h, 0) + 1
        fetch[str(q)] = h
    return fetch
