"""The arguments of a ``CheckpointManager``, checked and bound: its retention
:class:`~jaxckpt._manager.retention.Policy`, its local tier, its deadline. Each check raises
an ``InvalidArgumentError`` naming the argument (``CheckpointManager``'s docstring says what
each means)."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any, Literal

from jaxckpt._errors import InvalidArgumentError
from jaxckpt._manager.retention import Policy
from jaxckpt._storage import location as _location
from jaxckpt._tiers.local_tier import LocalTier


def local_tier(
    directory: str | os.PathLike[str] | None,
    loc: _location.Location,
    interval: int,
    max_to_keep: int,
    replicas: int,
) -> LocalTier | None:
    """The local tier in ``directory`` (``None``: no local tier)."""
    if directory is None:
        return None
    return LocalTier(directory, loc, interval=interval, max_to_keep=max_to_keep, replicas=replicas)


def timeout_arg(seconds: float | None) -> float | None:
    """``io_timeout``, checked (``None``: the default deadline)."""
    return None if seconds is None else _location.positive_seconds(seconds, "io_timeout")


def policy(
    max_to_keep: int | None,
    keep_every_n_steps: int | None,
    best_fn: Callable[[Mapping[str, Any]], float] | None,
    best_mode: Literal["min", "max"],
    keep_every_n_secs: float | None,
    *,
    keep_without_metrics: bool,
) -> Policy:
    """The retention arguments, checked and bound."""
    check_counts(max_to_keep=max_to_keep, keep_every_n_steps=keep_every_n_steps)
    return Policy(
        max_to_keep,
        keep_every_n_steps,
        best_fn,
        best_mode,
        keep_every_n_secs,
        keep_without_metrics=bool(keep_without_metrics),
    )


def check_counts(**counts: int | None) -> None:
    """Refuse a count that is neither a positive int nor ``None``, naming it."""
    for name, value in counts.items():
        if value is not None and (not isinstance(value, int) or value < 1):
            raise InvalidArgumentError(f"{name} must be a positive int or None, got {value!r}")


def check_options(
    best_mode: str,
    local_replicas: int,
    read_only: bool,
    local: object,
    counts: Mapping[str, int | None],
) -> None:
    """Check the manager's options (``counts``: positive ints or ``None``, by name)."""
    check_counts(**counts)
    if not isinstance(local_replicas, int) or local_replicas < 0:
        raise InvalidArgumentError(
            f"local_replicas must be a non-negative int, got {local_replicas!r}"
        )
    if best_mode not in ("min", "max"):
        raise InvalidArgumentError(f"best_mode must be 'min' or 'max', got {best_mode!r}")
    if read_only and local is not None:
        raise InvalidArgumentError(
            "a read_only manager has no local tier: pass local_directory=None"
        )
