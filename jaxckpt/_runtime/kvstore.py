"""JAX's coordination-service key-value store, as jaxckpt uses it: counted, and waited on.

Process 0 hosts the store (``jax.distributed.initialize``); it also carries the job's
heartbeats, so jaxckpt keeps its load small and bounded. Every call jaxckpt makes goes through
the one client :func:`kv_client` returns, which counts them per kind (:func:`operations`:
what tests and benchmarks read to show the count per save does not grow with processes or
leaves). A wait blocks on one key with the store's own timeout where it can, in slices that
grow from :data:`FIRST_SLICE_S` to :data:`LONGEST_SLICE_S` (:class:`Backoff`), never in a
fixed-interval poll.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Protocol

from jaxckpt._errors import DistributedError

FIRST_SLICE_S = 0.25  # the first wait on a key before looking at what else happened
LONGEST_SLICE_S = 4.0  # the longest: a failure elsewhere is seen within this
_ops: Counter[str] = Counter()
_ops_lock = threading.Lock()


class KeyValueClient(Protocol):
    """The calls jaxckpt makes on jax's ``DistributedRuntimeClient`` (which has no types).

    Timeouts are in milliseconds; the blocking gets raise (``DEADLINE_EXCEEDED``) after them.
    """

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None: ...
    def key_value_set_bytes(self, key: str, value: bytes) -> None: ...
    def blocking_key_value_get(self, key: str, timeout_in_ms: int) -> str: ...
    def blocking_key_value_get_bytes(self, key: str, timeout_in_ms: int) -> bytes: ...
    def key_value_dir_get(self, key: str) -> list[tuple[str, str]]: ...
    def key_value_delete(self, key: str) -> None: ...


class CountedClient:
    """A :class:`KeyValueClient` that counts each call (by method name) before making it."""

    def __init__(self, client: KeyValueClient) -> None:
        self.client = client

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
        _count("key_value_set")
        self.client.key_value_set(key, value, allow_overwrite=allow_overwrite)

    def key_value_set_bytes(self, key: str, value: bytes) -> None:
        _count("key_value_set_bytes")
        self.client.key_value_set_bytes(key, value)

    def blocking_key_value_get(self, key: str, timeout_in_ms: int) -> str:
        _count("blocking_key_value_get")
        return self.client.blocking_key_value_get(key, timeout_in_ms)

    def blocking_key_value_get_bytes(self, key: str, timeout_in_ms: int) -> bytes:
        _count("blocking_key_value_get_bytes")
        return self.client.blocking_key_value_get_bytes(key, timeout_in_ms)

    def key_value_dir_get(self, key: str) -> list[tuple[str, str]]:
        _count("key_value_dir_get")
        return self.client.key_value_dir_get(key)

    def key_value_delete(self, key: str) -> None:
        _count("key_value_delete")
        self.client.key_value_delete(key)


def _count(name: str) -> None:
    with _ops_lock:
        _ops[name] += 1


def operations() -> dict[str, int]:
    """The store operations this process has made so far, by method name (and ``"total"``).

    Example:
      >>> ops = operations()
      >>> ops["total"] == sum(n for k, n in ops.items() if k != "total")
      True
    """
    with _ops_lock:
        out = dict(_ops)
    out["total"] = sum(out.values())
    return out


_counted: dict[int, CountedClient] = {}


def kv_client() -> KeyValueClient:
    """JAX's distributed key-value store client, counted; raises if ``jax.distributed`` is not
    set up."""
    from jax._src import distributed

    client: KeyValueClient | None = distributed.global_state.client
    if client is None:
        import jax

        raise DistributedError(
            f"jax.process_count() is {jax.process_count()} but jax.distributed is not "
            f"initialized in this process, so the processes cannot agree on a save. Call "
            f"jax.distributed.initialize() at start-up, before any jax computation."
        )
    with _ops_lock:  # one wrapper per client (a re-initialized runtime has a new one)
        counted = _counted.get(id(client))
        if counted is None or counted.client is not client:
            counted = _counted[id(client)] = CountedClient(client)
    return counted


def coordinator_address() -> str:
    """``host:port`` of process 0's coordination service, as ``jax.distributed`` was given it."""
    from jax._src import distributed

    kv_client()  # raises the usual error where jax.distributed is not initialized
    return distributed.global_state.coordinator_address or ""


def timed_out(error: Exception) -> bool:
    """Whether a blocking get's ``error`` is its timeout (the key is not there yet)."""
    return "DEADLINE_EXCEEDED" in str(error)


class Backoff:
    """The slices a wait blocks in: :data:`FIRST_SLICE_S`, doubling up to
    :data:`LONGEST_SLICE_S`, so that a long wait costs a few store operations per slice.

    Example:
      >>> b = Backoff()
      >>> [b.next() for _ in range(6)]
      [0.25, 0.5, 1.0, 2.0, 4.0, 4.0]
    """

    def __init__(self) -> None:
        self.slice = FIRST_SLICE_S

    def next(self) -> float:
        out = self.slice
        self.slice = min(self.slice * 2, LONGEST_SLICE_S)
        return out
