"""The restore decision of a tiered ``CheckpointManager``: a pure function of what each process
holds, computed by process 0 and followed by all (``jaxckpt._tiers.local_tier`` posts and carries
it out). Which tier and step, and how the local step is restored: on the layout it was saved
for (``"same"``: which process sends which whole part to whom), or resharded onto another
process count or mesh (``"elastic"``: then ``jaxckpt._tiers.elastic`` plans the boxes).
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
      resharded_from: for a local step saved by another process count or for another layout,
        the number of processes that saved it (its boxes were moved and resharded); else
        ``None``.
    """

    tier: str
    step: int
    from_peers: tuple[int, ...] = ()
    resharded_from: int | None = None


def choose(
    count: int, posted: Mapping[int, Mapping[str, Any]], *, step: int | None = None
) -> dict[str, Any]:
    """The restore every process makes: which tier and step, and how the local step is read.

    Args:
      count: the number of processes now.
      posted: per process ``{"parts": [[step, part, count, save, layout], ...], "target":
        layout or None, "elastic": target digest or None, "persistent": [steps]}``: the
        committed parts on its disk (own, replicas, parts of another process count), the
        layout digest of the restore target for ``count`` processes (``None`` if it has none),
        the digest of the target for an elastic restore (``None`` if it cannot have one), and
        the persistent steps (as process 0 sees them: only process 0's count).
      step: only this step (``None``: the newest).

    Returns:
      ``{"tier": "local" | "persistent" | None, "step", "save", "mode": "same" | "elastic",
      "fetch": {part: holder}, "count", "holders": {part: [holders]}, "describe": {part:
      holder}, "fallback": persistent step or None, "local_steps": [complete local steps],
      "why"}``. A local step counts with its newest save only (the greatest save id any
      process posts for it): if that save is not complete (every part of its process count
      held by some process), neither is the step, whole older saves of it or not. A complete
      step saved by ``count`` processes for the target's layout is restored part by part
      (``"same"``: ``fetch`` says which holder sends a part its owner lacks); any other
      complete step is resharded (``"elastic"``, if every process's target allows it:
      ``holders`` of each part, and ``describe``, the holder that describes each part's
      boxes). A local step wins when it is at least as new as the newest persistent step: it
      is the faster copy.

    Example:
      >>> posted = {0: {"parts": [[5, 0, 2, "a", "L"], [5, 1, 2, "a", "L"]], "target": "L",
      ...               "elastic": "T", "persistent": [0]},
      ...           1: {"parts": [], "target": "L", "elastic": "T", "persistent": [0]}}
      >>> c = choose(2, posted); c["tier"], c["step"], c["mode"], c["fetch"]
      ('local', 5, 'same', {'1': 0})
      >>> c = choose(3, posted); c["mode"], c["count"], c["holders"], c["describe"]
      ('elastic', 2, {'0': [0], '1': [0]}, {'0': 0, '1': 0})
    """
    holders = _holders(posted)
    target = _agreed(posted, "target")
    form = _agreed(posted, "elastic")
    complete = sorted(k for k, parts in holders.items() if len(parts) == k[2])
    usable = []
    for k in complete:
        same = k[2] == count and target is not None and k[3] == target
        if step in (None, k[0]) and (same or form is not None):
            usable.append((k, "same" if same else "elastic"))
    newest = max((s for s in posted[0]["persistent"] if step in (None, s)), default=None)
    out: dict[str, Any] = {"tier": None, "fetch": {}, "fallback": newest}
    out["local_steps"] = sorted({k[0] for k in complete})
    if not usable:
        out["why"] = _why_not(holders, complete, step, posted)
    elif newest is not None and newest > usable[-1][0][0]:
        out["why"] = f"persistent step {newest} is newer than local step {usable[-1][0][0]}"
    else:
        return {**out, **_local(*usable[-1], holders[usable[-1][0]])}
    if newest is not None:
        out.update(tier="persistent", step=newest)
    return out


def _local(
    key: tuple[int, str, int, str], mode: str, parts: dict[int, list[int]]
) -> dict[str, Any]:
    """The decision to restore the local step ``key`` in ``mode``, its parts held by
    ``parts``: which holder sends or describes each part."""
    s, save, n, _ = key
    out: dict[str, Any] = {"tier": "local", "step": s, "save": save, "mode": mode, "count": n}
    if mode == "same":
        lacking = [q for q in sorted(parts) if q not in parts[q]]
        out["fetch"] = {str(q): h for q, h in _spread(parts, lacking).items()}
    else:
        out["holders"] = {str(q): parts[q] for q in sorted(parts)}
        out["describe"] = {str(q): h for q, h in _spread(parts, list(parts)).items()}
    return out


def _agreed(posted: Mapping[int, Mapping[str, Any]], field: str) -> Any:
    """The value every process posted for ``field``; ``None`` where they differ."""
    values = {posted[p].get(field) for p in posted}
    return values.pop() if len(values) == 1 else None


def _why_not(
    holders: dict[tuple[int, str, int, str], dict[int, list[int]]],
    complete: list[tuple[int, str, int, str]],
    step: int | None,
    posted: Mapping[int, Mapping[str, Any]],
) -> str:
    """Why no local step can be restored, for the log: the one condition that failed."""
    if complete and any(step in (None, k[0]) for k in complete):
        said = sorted({str(posted[p].get("why") or "") for p in posted} - {""})
        if len({posted[p].get("target") for p in posted}) > 1:
            return "no complete local step fits: the processes' restore targets differ"
        if said and said != ["iterators= were given"]:
            return f"no complete local step fits: {'; '.join(said)}"
        if all(posted[p].get("target") is None for p in posted):
            return "no complete local step fits: the target has no shardings"
        if said:
            return (
                "no complete local step fits: iterators= were given and the local step was "
                "saved for another layout (a position belongs to the process that saved it)"
            )
        return "no complete local step fits: it was saved for another layout"
    wanted = sorted(k for k in holders if step in (None, k[0]))
    if not wanted:
        return "no complete local step"
    s, _, n, _ = wanted[-1]
    missing = sorted(set(range(n)) - set(holders[wanted[-1]]))
    return (
        f"no complete local step: the parts of processes {missing} of local step {s} (saved "
        f"by {n}) are held by no process"
    )


def _holders(
    posted: Mapping[int, Mapping[str, Any]],
) -> dict[tuple[int, str, int, str], dict[int, list[int]]]:
    """``{(step, save, count, layout): {part: [holders]}}`` of each step's newest save only."""
    newest: dict[int, str] = {}
    for p in posted:
        for s, q, n, save, _ in posted[p]["parts"]:
            if 0 <= q < n:
                newest[s] = max(save, newest.get(s, save))  # later saves' ids sort later
    holders: dict[tuple[int, str, int, str], dict[int, list[int]]] = {}
    for p in sorted(posted):
        for s, q, n, save, layout in posted[p]["parts"]:
            if 0 <= q < n and save == newest[s]:
                held = holders.setdefault((s, save, n, layout), {}).setdefault(q, [])
                if p not in held:  # two copies on one disk count once
                    held.append(p)
    return holders


def _spread(parts: dict[int, list[int]], which: list[int]) -> dict[int, int]:
    """For each part of ``which``, one of its holders, the least busy so far."""
    busy: dict[int, int] = {}
    out = {}
    for q in sorted(which):
        h = min(parts[q], key=lambda p: (busy.get(p, 0), p))
        busy[h] = busy.get(h, 0) + 1
        out[q] = h
    return out
