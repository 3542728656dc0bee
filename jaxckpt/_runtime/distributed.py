"""Process index/count and the save's synchronisation between processes.

Single-process saves need none of this and pay nothing for it. Multi-process saves
synchronise through JAX's distributed key-value store (``jax.distributed.initialize``), never
through device collectives, so a checkpoint never competes with training for the accelerators.

The protocol of one save, keys under ``jaxckpt/save/N/`` (``N`` counts this process's saves, so
it is the same on every process when every process calls every save, as it must):

1. ``plan``: each process posts the digest of its global plan and the path; the coordinator
   (process 0) compares them and releases everyone with ``ok`` or the mismatch, which every
   process raises.
2. ``broadcast(name, value)``: the coordinator's value (the staging directory) for everyone.
3. ``barrier(name)``: each process posts its arrival; the coordinator waits for all of them and
   releases the others with one key. Only the coordinator reads the arrivals (O(N) per poll);
   the others wait on one key, so the store's load grows linearly with the processes. With
   ``wait_for_all=False`` (arrays created, checkpoint committed) only the others wait.
4. ``failed(error)``: a process that fails posts why under ``failed/``; every wait also watches
   that folder, so the others raise a :class:`DistributedError` naming it within a poll
   interval. Every process then posts ``stopped/P``; the coordinator waits for those before it
   removes the staging directory, so nobody writes into it afterwards.

Each wait has a deadline (``JAXCKPT_SYNC_TIMEOUT`` seconds, default 600); a timeout names the
processes that did not arrive. The coordinator deletes each arrival folder once everyone has
arrived, so a save leaves only a handful of small keys in the store.
"""

from __future__ import annotations

import functools
import itertools
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Protocol, TypeVar, cast

import jax

from jaxckpt._errors import CheckpointError, DistributedError

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 600.0
_POLL_S = 0.5  # longest sleep between two looks at the store while waiting
_PREFIX = "jaxckpt/save"
_saves = itertools.count()
_saves_lock = threading.Lock()


def process_index() -> int:
    return jax.process_index()


def process_count() -> int:
    count: int = jax.process_count()  # untyped in jax
    return count


def sync_timeout() -> float:
    """Seconds a process waits for the others at each step of a save."""
    text = os.environ.get("JAXCKPT_SYNC_TIMEOUT", "")
    try:
        return float(text) if text else DEFAULT_TIMEOUT_S
    except ValueError:
        raise DistributedError(
            f"JAXCKPT_SYNC_TIMEOUT={text!r} is not a number of seconds; set it to e.g. 600."
        ) from None


class KeyValueClient(Protocol):
    """The calls jaxckpt makes on jax's ``DistributedRuntimeClient`` (which has no types).

    Timeouts are in milliseconds; the blocking gets raise (``DEADLINE_EXCEEDED``) after them.
    """

    def key_value_set(self, key: str, value: str) -> None: ...
    def key_value_set_bytes(self, key: str, value: bytes) -> None: ...
    def blocking_key_value_get(self, key: str, timeout_in_ms: int) -> str: ...
    def blocking_key_value_get_bytes(self, key: str, timeout_in_ms: int) -> bytes: ...
    def key_value_dir_get(self, key: str) -> list[tuple[str, str]]: ...
    def key_value_delete(self, key: str) -> None: ...


def kv_client() -> KeyValueClient:
    """JAX's distributed key-value store client; raises if ``jax.distributed`` is not set up."""
    return _client()


def coordinator_address() -> str:
    """``host:port`` of process 0's coordination service, as ``jax.distributed`` was given it."""
    from jax._src import distributed

    _client()  # raises the usual error where jax.distributed is not initialized
    return distributed.global_state.coordinator_address or ""


def _client() -> KeyValueClient:
    from jax._src import distributed

    client: KeyValueClient | None = distributed.global_state.client
    if client is None:
        raise DistributedError(
            f"jax.process_count() is {process_count()} but jax.distributed is not initialized "
            f"in this process, so the processes cannot agree on a save. Call "
            f"jax.distributed.initialize() at start-up, before any jax computation."
        )
    return client


F = TypeVar("F", bound=Callable[..., object])


def _timed(wait: F) -> F:
    """``wait`` (a method of :class:`SaveSync`), its seconds added to the save's ``waits``."""

    def timed(self: SaveSync, *args: object, **kwargs: object) -> object:
        start = time.monotonic()
        try:
            return wait(self, *args, **kwargs)
        finally:
            self.waits.append((threading.get_ident(), time.monotonic() - start))

    return cast(F, functools.wraps(wait)(timed))


class SaveSync:
    """Keeps the processes of one save in step: same plan, one commit, shared failure.

    Single-process: every call is immediate and touches no distributed state.

    Made before planning, so that a failure anywhere (planning included) reaches every
    process; then :meth:`agree` on the plan's digest.

    Args:
      path: the checkpoint path as the user passed it; every process must pass the same.
      timeout: seconds to wait at each step; default :func:`sync_timeout`.
    """

    def __init__(self, path: str, *, timeout: float | None = None) -> None:
        self.path = path
        self.process = process_index()
        self.count = process_count()
        self.is_coordinator = self.process == 0
        self.waits: list[tuple[int, float]] = []  # (thread, seconds) of each wait for others
        if self.count == 1:
            return
        self.timeout = sync_timeout() if timeout is None else timeout
        # The others wait a little longer than the coordinator, so that when a process is
        # missing they get the coordinator's report, which names it.
        self._grace = min(max(2.0, 0.1 * self.timeout), 30.0)
        self._kv = _client()
        with _saves_lock:
            self.id = f"{_PREFIX}/{next(_saves)}"
        self._peer_errors: set[int] = set()  # errors that report another process's failure
        self._missing: set[int] = set()  # processes this one timed out waiting for

    def agree(self, digest: str) -> None:
        """Check every process planned the same checkpoint (``GlobalSavePlan.digest``).

        Raises:
          DistributedError: naming the processes whose plans differ.
        """
        if self.count == 1:
            return
        plans = self._arrive("plan", f"{digest} {self.path}")
        if plans is not None:  # the coordinator judges and tells the others
            verdict = _compare_plans(plans, self.path)
            self._release("plan", verdict or "ok")
        else:
            verdict = self._released("plan")
            verdict = "" if verdict == "ok" else verdict
        if verdict:
            raise DistributedError(verdict)

    def run(self, name: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` (every process); its failure is shared like any other."""
        try:
            return fn()
        except BaseException as e:
            out = self.failed(e)
            if out is e:
                raise
            raise out from e

    _last_failed: BaseException | None = None  # failed() shares each failure once

    def waited(self, here: bool = False) -> float:
        """Seconds this process has spent waiting for the others so far (``here``: on the
        calling thread only)."""
        me = threading.get_ident()
        return sum((s for t, s in list(self.waits) if not here or t == me), 0.0)

    def barrier(self, name: str, *, wait_for_all: bool = True) -> None:
        """Return once every process has called ``barrier(name)``; raise if one failed.

        With ``wait_for_all=False`` only the others wait, for the coordinator (e.g. until it
        has created the arrays or committed); the coordinator passes at once.
        """
        if self.count == 1:
            return
        if not wait_for_all:
            if self.is_coordinator:
                self._kv.key_value_set(f"{self.id}/go/{name}", "ok")
            else:
                self._wait_key(f"{self.id}/go/{name}", name, arrivals=False)
        elif self._arrive(name, "") is not None:
            self._release(name, "ok")
        else:
            self._released(name)

    def gather(self, name: str, value: str) -> dict[int, str] | None:
        """A barrier that also brings every process's ``value`` to the coordinator.

        Returns:
          On the coordinator, ``{process: value}`` of every process; elsewhere ``None``.
        """
        if self.count == 1:
            return {0: value}
        got = self._arrive(name, value)
        if got is not None:
            self._release(name, "ok")
        else:
            self._released(name)
        return got

    def reduce(self, name: str, value: str, combine: Callable[[list[str]], str]) -> str:
        """``combine`` of every process's ``value`` (in process order), on every process."""
        if self.count == 1:
            return combine([value])
        got = self._arrive(name, value)
        if got is None:
            return self._released(name)
        out = combine([got[p] for p in sorted(got)])
        self._release(name, out)
        return out

    def broadcast(self, name: str, value: str) -> str:
        """The coordinator's ``value`` on every process (the others' ``value`` is ignored)."""
        if self.count == 1:
            return value
        key = f"{self.id}/bcast/{name}"
        if self.is_coordinator:
            self._kv.key_value_set(key, value)
            return value
        return self._wait_key(key, name, arrivals=False)

    def failed(self, error: BaseException) -> BaseException:
        """Share ``error`` with the others; return the error to raise on this process.

        The others raise a :class:`DistributedError` naming this process. The coordinator
        returns only once the others have stopped writing (or its deadline passed), so the
        caller can remove the staging directory safely afterwards.
        """
        if self.count == 1 or error is self._last_failed:
            return error
        peer = id(error) in self._peer_errors
        try:
            if not peer:
                self._kv.key_value_set(f"{self.id}/failed/{self.process}", _describe(error))
            self._kv.key_value_set(f"{self.id}/stopped/{self.process}", "")
            if self.is_coordinator:
                self._wait_stopped()
        except Exception:  # noqa: BLE001 - the store is gone: nobody is left to tell
            pass
        if peer or isinstance(error, CheckpointError) or not isinstance(error, Exception):
            out = error
        else:
            out = DistributedError(
                f"Save to {self.path} failed on this process ({self.process}): "
                f"{_describe(error)}. The other processes stop too; no checkpoint is committed."
            )
            out.__cause__ = error
        self._last_failed = out
        return out

    # -- waiting ---------------------------------------------------------------------------

    @_timed
    def _arrive(self, name: str, value: str) -> dict[int, str] | None:
        """Post this process's arrival; the coordinator gets every process's value."""
        folder = f"{self.id}/at/{name}/"
        self._kv.key_value_set(folder + str(self.process), value)
        if not self.is_coordinator:
            return None
        deadline = time.monotonic() + self.timeout
        delay = 0.002
        while True:
            got = {int(k.rsplit("/", 1)[1]): v for k, v in self._kv.key_value_dir_get(folder)}
            if len(got) == self.count:
                return got
            self._check_peers()
            if time.monotonic() > deadline:
                raise self._timeout(name, set(range(self.count)) - set(got), self.timeout)
            time.sleep(delay)
            delay = min(delay * 1.5, _POLL_S)

    def _release(self, name: str, verdict: str) -> None:
        self._kv.key_value_set(f"{self.id}/go/{name}", verdict)
        self._kv.key_value_delete(f"{self.id}/at/{name}")  # only the coordinator read them

    def _released(self, name: str) -> str:
        return self._wait_key(f"{self.id}/go/{name}", name, arrivals=True)

    @_timed
    def _wait_key(self, key: str, name: str, *, arrivals: bool) -> str:
        """The value of ``key`` once the coordinator sets it; raise if a process failed."""
        waited = self.timeout + self._grace
        deadline = time.monotonic() + waited
        while True:
            left = deadline - time.monotonic()
            try:
                return self._kv.blocking_key_value_get(key, max(1, int(min(left, _POLL_S) * 1000)))
            except Exception as e:  # noqa: BLE001 - the client raises one runtime error type
                if "DEADLINE_EXCEEDED" not in str(e):
                    raise self._lost(name, e) from e
            self._check_peers()
            if time.monotonic() > deadline:
                missing = set()
                if arrivals:  # still there: the coordinator deletes them when it releases
                    got = self._dir(f"{self.id}/at/{name}/")
                    missing = set(range(self.count)) - {int(k.rsplit("/", 1)[1]) for k, _ in got}
                raise self._timeout(name, missing, waited, on_coordinator=True)

    def _check_peers(self) -> None:
        failures = {int(k.rsplit("/", 1)[1]): v for k, v in self._dir(f"{self.id}/failed/")}
        failures.pop(self.process, None)
        if failures:
            error = DistributedError(self._peer_message(failures))
            self._peer_errors.add(id(error))
            raise error

    @_timed
    def _wait_stopped(self) -> None:
        expected = set(range(self.count)) - self._missing
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            stopped = {int(k.rsplit("/", 1)[1]) for k, _ in self._dir(f"{self.id}/stopped/")}
            if expected <= stopped:
                return
            time.sleep(0.05)

    def _dir(self, folder: str) -> list[tuple[str, str]]:
        try:
            return self._kv.key_value_dir_get(folder)
        except Exception as e:  # noqa: BLE001
            raise self._lost(folder, e) from e

    # -- messages --------------------------------------------------------------------------

    def _timeout(
        self, name: str, missing: set[int], waited: float, on_coordinator: bool = False
    ) -> DistributedError:
        self._missing |= missing
        if not on_coordinator:
            what = f"{_procs(missing)} did not reach '{name}'"
            done = "No checkpoint was committed."
        else:
            what = f"process 0 (the coordinator) did not release '{name}'"
            if missing:
                what += f"; {_procs(missing)} had not arrived"
            done = "The save did not complete on this process."
        return DistributedError(
            f"Save to {self.path}: {what} within {waited:g} s (seen from process "
            f"{self.process}). A process crashed, hangs, or did not call save (every process "
            f"must). Check the logs; if saves are just slow, raise the deadline with "
            f"JAXCKPT_SYNC_TIMEOUT=SECONDS. {done}"
        )

    def _lost(self, name: str, error: Exception) -> DistributedError:
        return DistributedError(
            f"Save to {self.path}: process {self.process} lost contact with the JAX distributed "
            f"service while waiting for '{name}' ({error}). The coordinator (process 0) has "
            f"probably died; check its log. The save did not complete on this process."
        )

    def _peer_message(self, failures: dict[int, str]) -> str:
        # Root causes first: a timeout is usually the echo of another process's failure.
        order = sorted(failures, key=lambda p: (failures[p].startswith("DistributedError"), p))
        first = order[0]
        also = "".join(f"; also on process {p}: {failures[p]}" for p in order[1:3])
        return (
            f"Save to {self.path} failed on process {first}: {failures[first]}{also}. No "
            f"checkpoint was committed; this process ({self.process}) stopped its part. Fix "
            f"the cause on process {first} (see its log) and save again."
        )


def _compare_plans(plans: dict[int, str], path: str) -> str:
    """'' when every process planned the same checkpoint, else the message that says how not."""
    groups: dict[str, list[int]] = {}
    for p in sorted(plans):
        groups.setdefault(plans[p], []).append(p)
    if len(groups) == 1:
        return ""
    lines = []
    for value, procs in sorted(groups.items(), key=lambda g: g[1]):
        digest, _, where = value.partition(" ")
        lines.append(f"{_procs(procs)}: plan {digest}, path {where!r}")
    return (
        f"Save to {path}: the processes planned different checkpoints ({'; '.join(lines)}). "
        f"Every process must call save with the same path and a tree of the same structure, "
        f"shapes, dtypes and shardings, and the same planner options and compression."
    )


def _procs(procs: Iterable[int]) -> str:
    procs = sorted(procs)
    shown = ", ".join(map(str, procs[:16])) + (", ..." if len(procs) > 16 else "")
    return f"process {shown}" if len(procs) == 1 else f"processes [{shown}]"


def _describe(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}"
    return text if len(text) <= 2000 else text[:2000] + " ..."
