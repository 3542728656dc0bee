"""The save-plan cache: the global plan of a tree's signature, reused by later saves.

A save of the same structure, shapes, dtypes, shardings and planner options as an earlier
one takes that save's plan instead of planning again (``DefaultSavePlanner.create_global_plan``;
a miss is a full planning pass). The most recently used :data:`SIZE` plans are kept.
"""

from __future__ import annotations

import collections
from typing import NamedTuple

from jaxckpt._planning.global_plan import GlobalSavePlan

SIZE = 16
_plans: collections.OrderedDict[Key, GlobalSavePlan] = collections.OrderedDict()
_stats = {"hits": 0, "misses": 0}


class CacheInfo(NamedTuple):
    """What :func:`plan_cache_info` returns."""

    hits: int
    misses: int
    size: int


class Key:
    """A cache key that hashes its (large) signature once, not on every dict operation."""

    __slots__ = ("sig", "h")

    def __init__(self, sig: tuple[object, ...]) -> None:
        self.sig, self.h = sig, hash(sig)

    def __hash__(self) -> int:
        return self.h

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Key) and self.h == other.h and self.sig == other.sig


def key(sig: tuple[object, ...]) -> Key | None:
    """The key of a signature; ``None`` where it cannot be hashed (an unhashable sharding or
    tree node: such a tree is planned without the cache)."""
    try:
        return Key(sig)
    except TypeError:
        return None


def lookup(k: Key | None) -> GlobalSavePlan | None:
    """The plan cached under ``k`` (a hit), or ``None`` (a miss; always without a key)."""
    plan = _plans.get(k) if k is not None else None
    if plan is not None and k is not None:
        _plans.move_to_end(k)
        _stats["hits"] += 1
        return plan
    _stats["misses"] += 1
    return None


def store(k: Key | None, plan: GlobalSavePlan) -> None:
    """Cache ``plan`` under ``k`` (nothing without a key); the least recently used goes."""
    if k is None:
        return
    _plans[k] = plan
    while len(_plans) > SIZE:
        _plans.popitem(last=False)


def plan_cache_info() -> CacheInfo:
    """Hits and misses of the save-plan cache (a miss is a full planning pass).

    Returns:
      ``CacheInfo(hits, misses, size)``: counts since the process started (or the cache was
      cleared), and the plans it holds.

    Example:
      >>> import jaxckpt
      >>> info = jaxckpt.plan_cache_info()
      >>> info.size <= 16
      True
    """
    return CacheInfo(_stats["hits"], _stats["misses"], len(_plans))


def clear_plan_cache() -> None:
    """Forget every cached plan and the counts (benchmarks time a first save)."""
    _plans.clear()
    _stats.update(hits=0, misses=0)
