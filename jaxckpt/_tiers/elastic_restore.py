"""An elastic restore: a local step's boxes moved between processes and resharded.

When ``tier_choice.choose`` picks a local step saved by another process count or for another
layout (``"elastic"``), ``jaxckpt._tiers.local_tier`` carries it out with these calls, in order:

1. (the holder ``describe`` names for each part) :func:`describe`: posts the part's distinct
   groups of boxes once each and one group number per leaf (:func:`part_description`); the
   describer of the lowest part also the leaves (keys, kinds, shapes, dtypes, key data) and
   the Python values;
2. (process 0) :func:`decide`: checks the target against the leaves, computes the target
   boxes once per distinct shape and sharding, groups the leaves into layouts (the same
   saved groups in every part, target boxes and element size) and plans each layout once:
   who reads which box and sends which piece to whom (``jaxckpt._tiers.elastic``); each
   process gets its own share, per layout (``agreement.decide_each``), or all of them the
   reason to fall back;
3. (every process) ``elastic_moves.carry_out``: expands its share to its leaves, reads the
   boxes its plan lists from its own disk, slab by slab, sends the pieces others need over
   one stream per receiver (``jaxckpt._runtime.streams``: peer to peer, as replicas go),
   receives its own pieces on one thread per sender, and puts each leaf on its devices as
   soon as its boxes are whole.

Through all three each process beats (``jaxckpt._runtime.heartbeat``, every few seconds,
``failed`` if it gives up): a peer waiting for a process that died or gave up stops within
that process's I/O deadline (``JAXCKPT_IO_TIMEOUT``), not ``JAXCKPT_SYNC_TIMEOUT``. Then
every process reports whether it succeeded, and all fall back to the persistent tier if one
did not (``local_tier``; process 0 does not wait for a process whose heartbeat stopped). What is
trusted: the parts on this host's disk are read with the checks of any checkpoint read
(checksums, sizes, confinement); a description posted by another host is checked (group
numbers within the part's groups, boxes inside their arrays, tiling each array exactly once)
before it is planned with; bytes from another host are checked by length and crc32 (damage,
not an attacker: the job's network is trusted, as for replication), and every target box
must be filled exactly.

What grows with what (docs/tiers.md, "Elastic recovery"): each holder posts its parts' groups
(layouts x its devices' boxes) and one number per leaf; process 0 merges them (parts x
leaves small integers, in numpy) and plans layouts x saved boxes; each process gets the
verdict (the leaves' keys, kinds and dtypes: grows with the leaves, once per process) and its
share (its layouts' reads and pieces).
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
import numpy.typing as npt

from jaxckpt._api.restoring import metadata
from jaxckpt._errors import CheckpointError
from jaxckpt._format.entries import ArrayEntry, ValueEntry
from jaxckpt._format.plan import Box, index_to_box
from jaxckpt._planning import tree as _tree
from jaxckpt._runtime import agreement as _agreement
from jaxckpt._runtime import collector as _collector
from jaxckpt._runtime import heartbeat as _heartbeat
from jaxckpt._runtime import streams as _streams
from jaxckpt._storage import location as _location
from jaxckpt._tiers import elastic as _elastic
from jaxckpt._tiers import local_part as _part
from jaxckpt._tiers.elastic_moves import Leaf, Stats, carry_out, sharding_of


def restore(
    choice: Mapping[str, Any],
    target: Any,
    paths: Mapping[int, Path],
    prefix: str,
    process: int,
    count: int,
) -> tuple[Any, Stats | None, str]:
    """Steps 1 to 3 on this process: the tree and what it did, or why not (``""`` when it
    succeeded; a reason for all of them is given on process 0 only). ``paths``: the parts of
    the chosen step this process holds.

    Raises:
      DistributedError: process 0 did not answer in the agreement (1., 2.); a process that
        did not post in time is left out of it, and every other one falls back.
    """
    mine = sorted(int(q) for q, h in choice["describe"].items() if h == process)
    first = min(int(q) for q in choice["describe"])
    agreed = False
    try:
        # Beating (posting "failed" if this raises), so that the peers of a process that dies
        # or gives up stop waiting for it within its I/O deadline.
        with _heartbeat.beating(prefix, _location.io_timeout()):
            verdict, own = _agreement.decide_each(
                "elastic",
                describe(paths, mine, first),
                lambda posted: decide(posted, target, choice, count),
                survivors=True,  # a process dead by now makes every other one fall back
                scope=_agreement.scope_of(prefix),  # the restore's, alike on every process
            )
            agreed, common = True, json.loads(verdict)
            if "fallback" in common:
                return None, None, f"no plan: {common['fallback']}" if process == 0 else ""
            tree, stats = carry_out(common, own, target, paths, prefix, process)
            return tree, stats, ""
    except Exception as e:  # every process hears of it and falls back together
        if not agreed:
            raise
        return None, None, f"process {process}: {type(e).__name__}: {e}"


# -- 1. and 2.: the agreement ------------------------------------------------------------------


def target_digest(target: Any) -> str | None:
    """The digest every process posts to agree on the target of an elastic restore, or
    ``None`` if it cannot have one: every leaf must be a ``jax.Array``, a
    ``jax.ShapeDtypeStruct`` with a sharding, a bare ``Sharding`` (shape and dtype from the
    step) or ``None`` (a saved value)."""
    if target is None:
        return None
    keys, leaves, _ = _tree.flatten_with_treedef(target)
    h = hashlib.sha256()
    for key, leaf in zip(keys, leaves):
        if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)) and leaf.sharding is not None:
            what = [list(leaf.shape), str(leaf.dtype), *_sharding_id(leaf.sharding)]
        elif isinstance(leaf, jax.sharding.Sharding):
            what = _sharding_id(leaf)
        elif leaf is None:
            what = []
        else:
            return None
        h.update(json.dumps([key, *what]).encode())
    return h.hexdigest()[:32]


def _sharding_id(sharding: Any) -> list[Any]:
    return [repr(sharding), sorted(d.id for d in sharding.device_set)]


def describe(paths: Mapping[int, Path], which: Sequence[int], first: int) -> str:
    """What this process posts about the parts ``which`` it describes (1.): per part its
    groups of boxes (:func:`part_description`); for part ``first`` also the leaves."""
    out: dict[str, Any] = {"parts": {}}
    try:
        for q in which:
            info = _part.read_info(paths[q])
            if info is None:
                raise CheckpointError(f"{paths[q]} is not a committed local part")
            entries = metadata(str(paths[q])).entries
            data = {}
            for i, li in enumerate(info.leaves):
                e = entries.get(f"boxes/{i}/0")
                if li.boxes and isinstance(e, ArrayEntry):
                    data[i] = (e.dtype, tuple(e.shape[len(li.shape) :]))
            out["parts"][str(q)] = part_description([li.boxes for li in info.leaves], data)
            if q == first:
                out["leaves"] = [_leaf_json(i, li, entries) for i, li in enumerate(info.leaves)]
    except Exception as e:  # process 0 hears why, and every process falls back
        out = {"error": f"{type(e).__name__}: {e}"}
    return json.dumps(out)


def part_description(
    boxes: Sequence[Sequence[Box]], data: Mapping[int, tuple[str, tuple[int, ...]]]
) -> dict[str, Any]:
    """A part's description as posted: its distinct *groups* (a leaf's boxes in the part,
    with their stored dtype and the key data's trailing dimensions) once each, and per leaf
    its group's number (-1: the part holds no box of it), as little-endian int32 in base64
    (4 bytes a leaf, read by numpy at once). Leaves of one layout share a group, so the boxes
    posted grow with the layouts, not the leaves.

    Example:
      >>> row = [((0,), (4,))]
      >>> d = part_description([row, [], row], {0: ("float32", ()), 2: ("float32", ())})
      >>> d["groups"], group_numbers(d["of"]).tolist()
      ([[[[[0], [4]]], 'float32', []]], [0, -1, 0])
    """
    number: dict[Any, int] = {}
    groups: list[Any] = []
    of = []
    for i, leaf_boxes in enumerate(boxes):
        if not leaf_boxes:
            of.append(-1)
            continue
        stored, trailing = data.get(i, ("", ()))
        key = (tuple(leaf_boxes), stored, trailing)
        if key not in number:
            number[key] = len(groups)
            groups.append([[list(map(list, b)) for b in leaf_boxes], stored, list(trailing)])
        of.append(number[key])
    return {"groups": groups, "of": base64.b64encode(np.array(of, "<i4").tobytes()).decode()}


def group_numbers(of: Any) -> npt.NDArray[np.int32]:
    """Per leaf, its group's number in a part's description (``part_description``'s ``of``).

    Raises:
      CheckpointError: ``of`` is not what ``part_description`` writes.
    """
    try:
        return np.frombuffer(base64.b64decode(str(of), validate=True), "<i4")
    except ValueError:
        raise CheckpointError("a part's description is not what jaxckpt posts") from None


def _leaf_json(i: int, li: _part.LeafInfo, entries: Mapping[str, Any]) -> list[Any]:
    if li.kind != "value":
        return [li.key, li.kind, list(li.shape), li.dtype, li.prng]
    e = entries[f"values/{i}"]
    if isinstance(e, ValueEntry):
        return [li.key, "value", [], "", "", "", [], e.value]
    return [li.key, "host", list(e.shape), e.dtype, "", e.dtype, []]


# Per leaf its target layout's number (None: a value), and per target layout the distinct
# target boxes of each process that needs some: what process 0 computes from the target.
Wanted = tuple[list[int | None], list[dict[int, list[Box]]]]


def decide(
    posted: Mapping[int, str], target: Any, choice: Mapping[str, Any], count: int
) -> tuple[str, dict[int, str]]:
    """(process 0) The verdict for all (the leaves, their layouts, the slab size, or
    ``{"fallback": why}``) and each process's share of the plan (2.)."""
    holders = {int(q): list(h) for q, h in choice["holders"].items()}
    if missing := sorted(set(range(count)) - set(posted)):
        return json.dumps({"fallback": f"processes {missing} did not answer (dead?)"}), {}
    try:
        keys, targets, _ = _tree.flatten_with_treedef(target)

        def wanted(leaves: list[Leaf]) -> Wanted:
            _check_target(leaves, keys, targets)
            return _wanted(leaves, targets, count)

        with _collector.paused():  # many small objects, no cycles: a full collection each time
            return plan_shares(posted, holders, wanted, count)
    except (CheckpointError, ValueError, KeyError, TypeError, IndexError) as e:
        return json.dumps({"fallback": f"{type(e).__name__}: {e}"}), {}


def plan_shares(
    posted: Mapping[int, str],
    holders: Mapping[int, list[int]],
    wanted: Callable[[list[Leaf]], Wanted],
    count: int,
) -> tuple[str, dict[int, str]]:
    """The verdict and the shares of :func:`decide` from what the describers ``posted`` and
    the target's layouts (``wanted`` of the leaves): the leaves grouped into layouts (their
    target layout, element size and saved boxes in every part alike), planned once per
    layout (``elastic.plan_layouts``). Pure: benchmarks/_tiers_bench.py times it.

    Raises:
      CheckpointError, ValueError: the descriptions or the target do not fit a plan.
    """
    leaves, saved_of, saved = _merge(posted, holders)
    target_of, needs = wanted(leaves)
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, leaf in enumerate(leaves):
        t = target_of[i]
        if t is not None:
            key = ("host" if leaf.kind == "host" else saved_of[i], t, leaf.itemsize)
            groups.setdefault(key, []).append(i)
    layouts = []
    for (s, t, itemsize), members in groups.items():
        shape = leaves[members[0]].shape
        boxes = {q: [((0,) * len(shape), shape)] for q in holders} if s == "host" else saved[s]
        layouts.append(_elastic.Layout(shape, itemsize, boxes, needs[t], tuple(members)))
    plans = _elastic.plan_layouts(layouts, holders)
    common = {
        "leaves": [leaf.to_json() for leaf in leaves],
        "layouts": [layout.leaves for layout in layouts],
        "slab": _streams.chunk_bytes(),
    }
    own = {
        p: _compact(
            {
                "plan": plans.get(p, _elastic.Plan()).to_json(),
                "needs": {
                    str(n): layout.needs[p] for n, layout in enumerate(layouts) if p in layout.needs
                },
            }
        )
        for p in range(count)
    }
    return _compact(common), own


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def _merge(
    posted: Mapping[int, str], holders: Mapping[int, list[int]]
) -> tuple[list[Leaf], list[int], list[dict[int, list[Box]]]]:
    """The leaves, per leaf the number of its saved layout (its groups in every part alike)
    and per saved layout every part's boxes, from what the describers posted."""
    parts: dict[int, Any] = {}
    described: list[Any] | None = None
    for p in sorted(posted):
        got = json.loads(posted[p])
        if "error" in got:
            raise CheckpointError(f"process {p} cannot describe its parts: {got['error']}")
        parts.update((int(q), d) for q, d in got["parts"].items())
        described = got.get("leaves", described)
    if described is None or set(parts) != set(holders):
        raise CheckpointError(f"parts {sorted(set(holders) - set(parts))} were not described")
    qs = sorted(parts)
    table = np.empty((len(qs), len(described)), np.int64)
    for row, q in enumerate(qs):
        of = group_numbers(parts[q]["of"])
        if len(of) != len(described):
            raise CheckpointError(f"part {q} describes {len(of)} leaves, not {len(described)}")
        if len(of) and (of.min() < -1 or of.max() >= len(parts[q]["groups"])):
            raise CheckpointError(f"part {q}'s description names groups it does not have")
        table[row] = of
    columns, saved_of = np.unique(table.T, axis=0, return_inverse=True)
    saved = [
        {q: [_elastic.box_of(b) for b in parts[q]["groups"][g][0]] for q, g in zip(qs, c) if g >= 0}
        for c in columns.tolist()
    ]
    data: list[Any] = [  # per saved layout: the stored dtype and trailing dims, from a part
        next((parts[q]["groups"][g][1:] for q, g in zip(qs, c) if g >= 0), ["", []])
        for c in columns.tolist()
    ]
    saved_of = saved_of.reshape(-1)
    leaves = []
    for i, raw in enumerate(described):
        key, kind, shape, dtype, prng, *more = raw
        stored, trailing = more[:2] if more else data[int(saved_of[i])]
        value = more[2] if len(more) > 2 else None
        leaf = Leaf(str(key), str(kind), tuple(shape), str(dtype), str(prng), str(stored))
        leaves.append(dataclasses.replace(leaf, trailing=tuple(trailing), value=value))
    return leaves, saved_of.tolist(), saved


def _check_target(leaves: list[Leaf], keys: list[str], targets: list[Any]) -> None:
    if keys != [leaf.key for leaf in leaves]:
        missing = sorted(set(leaf.key for leaf in leaves) - set(keys))
        extra = sorted(set(keys) - set(leaf.key for leaf in leaves))
        raise CheckpointError(
            f"the target's keys are not the local step's (missing {missing[:5]}, unexpected "
            f"{extra[:5]})"
        )
    for leaf, t in zip(leaves, targets):
        if (t is None) != (leaf.kind in ("value", "host")):
            raise CheckpointError(
                f"key {leaf.key!r}: the target has {type(t).__name__}, the local step a {leaf.kind}"
            )
        if isinstance(t, (jax.Array, jax.ShapeDtypeStruct)):
            if tuple(t.shape) != leaf.shape or str(t.dtype) != leaf.dtype:
                raise CheckpointError(
                    f"key {leaf.key!r}: the target is {t.dtype}{list(t.shape)}, the local step "
                    f"{leaf.dtype}{list(leaf.shape)}"
                )


def _wanted(leaves: list[Leaf], targets: list[Any], count: int) -> Wanted:
    """Per leaf its target layout, and per target layout each process's distinct target
    boxes: computed once per distinct shape and sharding, not per leaf."""
    number: dict[Any, int] = {}
    needs: list[dict[int, list[Box]]] = []
    target_of: list[int | None] = []
    for leaf, t in zip(leaves, targets):
        if leaf.kind == "value":
            target_of.append(None)
            continue
        key = ("host", leaf.shape) if leaf.kind == "host" else (leaf.shape, sharding_of(t))
        if key not in number:
            number[key] = len(needs)
            needs.append(_target_boxes(leaf, t, count))
        target_of.append(number[key])
    return target_of, needs


def _target_boxes(leaf: Leaf, t: Any, count: int) -> dict[int, list[Box]]:
    if leaf.kind == "host":
        return {p: [((0,) * len(leaf.shape), leaf.shape)] for p in range(count)}
    out: dict[int, list[Box]] = {}
    for device, index in sharding_of(t).devices_indices_map(leaf.shape).items():
        boxes = out.setdefault(device.process_index, [])
        box = index_to_box(index, leaf.shape)
        if box not in boxes:
            boxes.append(box)
    return out
