"""Python's cyclic garbage collector, paused while a save or restore does its bookkeeping.

A save or restore of many leaves allocates many small objects (manifest entries, plan items,
jax's per-array objects) and frees few, which makes CPython run full collections over the
whole heap again and again, each also calling jax's collection hook: a third of the time of a
10,000-leaf restore (docs/benchmarks.md). These calls make no reference cycles worth
collecting, so the collector waits until they return, then runs as it would have.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Run the block with automatic collection off (if it was on), and turn it back on after.

    Nested or concurrent uses are safe: only the outermost one that found it on turns it back
    on, and at worst a concurrent one gets its collections back early.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
