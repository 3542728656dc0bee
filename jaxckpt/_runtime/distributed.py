"""Process index/count and the save's synchronisation between processes.

Single-process saves need none of this and pay nothing for it. Multi-process saves
synchronise through JAX's distributed key-value store (``jax.distributed.initialize``, through
``jaxckpt._runtime.kvstore``), never through device collectives, so a checkpoint never competes
with training for the accelerators.

The protocol of one save. Its keys never come from a count kept by each process (one that
failed early would fall behind for good); they come from what every process knows alike:

1. ``plan``, the first step (:meth:`SaveSync.agree`), at the *door* of the path:
   ``jaxckpt/save/door/<hash of the path>/``. Each process posts the digest of its global plan
   and a token of its own under ``at/P``, or ``!`` and its error where it failed before (in
   planning, taking its iterators' states, ...: :meth:`SaveSync.failed`). The coordinator
   (process 0) waits for every process, then answers each under ``go/P`` with that process's
   token, the save's id (``jaxckpt/save/<hash>-<n>``, unique: every later key is under it)
   and the verdict: ``ok``, the plans' mismatch, or the failure, which every process raises.
   A stale answer (a token not its own) is dropped, so a process that gave up on an earlier
   save of the path meets the others at the next one.
2. ``broadcast(name, value)``: the coordinator's value (the staging directory) for everyone.
3. ``barrier(name)``: each other process posts its arrival; the coordinator waits for all of
   them and releases the others with one key. Only the coordinator reads the arrivals; each
   other process makes a bounded number of store operations per save, whatever the number of
   processes or leaves. With ``wait_for_all=False`` (arrays created, checkpoint committed)
   only the others wait.
4. ``failed(error)``: a process that fails after the first step posts why under ``failed/``;
   every wait also watches that folder, so the others raise a :class:`DistributedError`
   naming it within :data:`~jaxckpt._runtime.kvstore.LONGEST_SLICE_S`. Every process then
   posts ``stopped/P``; the coordinator waits for those before it removes the staging
   directory, so nobody writes into it afterwards.

Waits block on one key at a time with the store's own timeout, in slices that grow
(``kvstore.Backoff``). Each wait has a deadline (``JAXCKPT_SYNC_TIMEOUT`` seconds, default 600);
a timeout names the processes that did not arrive. A wait longer than
:data:`FIRST_REPORT_S` is logged on the coordinator, then every :data:`REPORT_EVERY_S`, with
the processes it still waits for and what they have not done yet. The coordinator deletes each
arrival folder once everyone has arrived, and a save's other keys (its releases) once
:data:`KEPT_SAVES` later saves have begun, so the store holds a bounded number of keys.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TypeVar, cast

import jax

from jaxckpt._errors import CheckpointError, DistributedError
from jaxckpt._runtime.collective import Notice, must_be_collective
from jaxckpt._runtime.collective import processes as _procs
from jaxckpt._runtime.kvstore import Backoff, timed_out
from jaxckpt._runtime.kvstore import KeyValueClient as KeyValueClient
from jaxckpt._runtime.kvstore import coordinator_address as coordinator_address
from jaxckpt._runtime.kvstore import kv_client as kv_client

T = TypeVar("T")

logger = logging.getLogger("jaxckpt")
DEFAULT_TIMEOUT_S = 600.0
FIRST_REPORT_S = 5.0  # a wait this long is logged on the coordinator ...
REPORT_EVERY_S = 30.0  # ... and again after each of these
_PREFIX = "jaxckpt/save"
_saves = itertools.count()  # the coordinator's: makes each save's id unique; the others learn it
_saves_lock = threading.Lock()
_recent: collections.deque[str] = collections.deque()  # the coordinator's last saves' ids
KEPT_SAVES = 8  # older saves' keys are deleted: the store holds a bounded number of keys
# What the processes a step still waits for have not done yet (for the coordinator's log).
_PHASES = {
    "plan": "plan the save",
    "reuse": "compare their boxes with the base",
    "written": "finish writing",
    "stopped": "stop after the failure",
}


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


def path_key(path: str) -> str:
    """A short name for ``path`` in store keys, the same on every process.

    Example:
      >>> path_key("/ckpt/step_1") == path_key("/ckpt/step_1") != path_key("/ckpt/step_2")
      True
    """
    return hashlib.sha256(path.encode()).hexdigest()[:16]


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

    Made before anything that can fail on one process only (planning, taking the iterators'
    states), so that such a failure reaches every process: :meth:`failed` (or :meth:`run`)
    before :meth:`agree` fails the first step on every process.

    Args:
      path: the checkpoint path as the user passed it; every process must pass the same.
      timeout: seconds to wait at each step; default :func:`sync_timeout`.
      call: the public call, for messages: a process that waits at the first step says it is
        collective (``jaxckpt._runtime.collective``).
    """

    def __init__(
        self, path: str, *, timeout: float | None = None, call: str = "jaxckpt.save"
    ) -> None:
        self.path, self.call = path, call
        self.process = process_index()
        self.count = process_count()
        self.is_coordinator = self.process == 0
        self.waits: list[tuple[int, float]] = []  # (thread, seconds) of each wait for others
        self.id: str | None = None  # this save's keys, agreed at the first step
        if self.count == 1:
            return
        self.timeout = sync_timeout() if timeout is None else timeout
        # The others wait a little longer than the coordinator, so that when a process is
        # missing they get the coordinator's report, which names it.
        self._grace = min(max(2.0, 0.1 * self.timeout), 30.0)
        self._kv = kv_client()
        self._key = path_key(path)
        self._door = f"{_PREFIX}/door/{self._key}"
        self._shut = False  # the first step failed: nothing is left to share
        self._peer_errors: set[int] = set()  # errors that report another process's failure
        self._missing: set[int] = set()  # processes this one timed out waiting for

    def agree(self, digest: str) -> None:
        """Check every process planned the same checkpoint (``GlobalSavePlan.digest``): the
        save's first step, where every process learns its id.

        Raises:
          DistributedError: naming the processes whose plans differ, or the process that
            failed before this step and its error.
        """
        if self.count == 1:
            return
        verdict = self._open(f"{digest} {self.path}")
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

        The others raise a :class:`DistributedError` naming this process. Before the first
        step, the error is this process's answer to it (every process raises at that step);
        after it, the coordinator returns only once the others have stopped writing (or its
        deadline passed), so the caller can remove the staging directory safely afterwards.
        """
        if self.count == 1 or error is self._last_failed or self._shut:
            return error
        peer = id(error) in self._peer_errors
        try:
            if self.id is None:
                self._open("!" + _describe(error))
            else:
                if not peer:
                    self._kv.key_value_set(f"{self.id}/failed/{self.process}", _describe(error))
                self._kv.key_value_set(f"{self.id}/stopped/{self.process}", "")
                if self.is_coordinator:
                    self._wait_stopped()
        except Exception:  # noqa: BLE001 - the store is gone or a peer too: the error stands
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

    # -- the first step --------------------------------------------------------------------

    def _open(self, value: str) -> str:
        """Post ``value`` at the door; learn the save's id and the verdict ("" when ok)."""
        if not self.is_coordinator:
            return self._knock(value)
        with _saves_lock:
            self.id = f"{_PREFIX}/{self._key}-{next(_saves)}-{os.urandom(3).hex()}"
            _recent.append(self.id)
            old = _recent.popleft() if len(_recent) > KEPT_SAVES else None
        if old is not None:  # the keys a save leaves (its releases) are read long since
            self._kv.key_value_delete(old)
        posted = self._await(f"{self._door}/at/", "plan", set(range(1, self.count)), watch=False)
        missing = set(range(1, self.count)) - set(posted)
        values = {p: v.partition(" ")[2] for p, v in posted.items()}
        values[0] = value
        error = self._timeout("plan", missing, self.timeout) if missing else None
        verdict = str(error) if error is not None else self._judge(values)
        # Before the answers: a process that has its answer may post at the door again.
        self._kv.key_value_delete(f"{self._door}/at")
        for p, v in posted.items():  # each with its own token: a stale answer is known
            answer = f"{v.partition(' ')[0]} {self.id} {verdict or 'ok'}"
            self._kv.key_value_set(f"{self._door}/go/{p}", answer, allow_overwrite=True)
        self._shut = bool(verdict)
        if error is not None:
            raise error
        return verdict

    @_timed
    def _knock(self, value: str) -> str:
        """A non-coordinator's part of :meth:`_open`: one post, then one blocking get."""
        token, go = os.urandom(4).hex(), f"{self._door}/go/{self.process}"
        self._kv.key_value_set(f"{self._door}/at/{self.process}", f"{token} {value}", True)
        waited = self.timeout + self._grace
        deadline, notice = time.monotonic() + waited, Notice(f"{self.call}({self.path})", waited)
        while True:
            left = min(deadline - time.monotonic(), notice.left())
            try:
                got = self._kv.blocking_key_value_get(go, max(1, int(left * 1000)))
            except Exception as e:  # noqa: BLE001 - the client raises one runtime error type
                if not timed_out(e):
                    raise self._lost("plan", e) from e
                if time.monotonic() < deadline:  # the notice's slice ended: log it, wait on
                    notice.check("process 0 to answer (it answers once every process calls it)")
                    continue
                self._kv.key_value_delete(f"{self._door}/at/{self.process}")  # not answered
                raise self._timeout("plan", set(), waited, on_coordinator=True) from None
            self._kv.key_value_delete(go)
            mine, _, rest = got.partition(" ")
            if mine == token:
                break
        self.id, _, verdict = rest.partition(" ")
        self._shut = verdict != "ok"
        return "" if verdict == "ok" else verdict

    def _judge(self, values: dict[int, str]) -> str:
        """The door's verdict on every process's value: a failure, a mismatch or ""."""
        failures = {p: v[1:] for p, v in values.items() if v.startswith("!")}
        if failures:
            return self._peer_message(failures)
        return _compare_plans(values, self.path)

    # -- waiting ---------------------------------------------------------------------------

    def _arrive(self, name: str, value: str) -> dict[int, str] | None:
        """Post this process's arrival; the coordinator gets every process's value."""
        folder = f"{self.id}/at/{name}/"
        if not self.is_coordinator:
            self._kv.key_value_set(folder + str(self.process), value)
            return None
        got = self._await(folder, name, set(range(1, self.count)), watch=True)
        missing = set(range(1, self.count)) - set(got)
        if missing:
            raise self._timeout(name, missing, self.timeout)
        got[0] = value
        return got

    @_timed
    def _await(self, folder: str, name: str, expect: set[int], *, watch: bool) -> dict[int, str]:
        """The values under ``folder`` of the processes ``expect``: all of them, or those
        there at the deadline. Blocks on the first missing one's key in growing slices;
        ``watch``: raise as soon as a process reports a failure. Logs a long wait."""
        start = time.monotonic()
        deadline, slices, report = start + self.timeout, Backoff(), start + FIRST_REPORT_S
        notice = Notice(f"{self.call}({self.path})", self.timeout, quiet=name != "plan")
        while True:
            got = {int(k.rsplit("/", 1)[1]): v for k, v in self._dir(folder)}
            missing = expect - set(got)
            if not missing:
                return got
            if watch:
                self._check_peers()
            now = time.monotonic()
            if now > deadline:
                return got
            if now >= report:
                report = now + REPORT_EVERY_S
                logger.warning(
                    "Save to %s: still waiting on %s to %s (%.0f s so far, deadline %g s: "
                    "JAXCKPT_SYNC_TIMEOUT)",
                    self.path,
                    _procs(missing),
                    _PHASES.get(name, f"reach '{name}'"),
                    now - start,
                    self.timeout,
                )
            notice.check(f"{_procs(missing)} to call it")  # the first step: called at all?
            wait = min(slices.next(), deadline - now, report - now, notice.left())
            self._block(folder + str(min(missing)), name, max(wait, 0.001))

    def _block(self, key: str, name: str, seconds: float) -> None:
        """Wait up to ``seconds`` for ``key`` to be set."""
        try:
            self._kv.blocking_key_value_get(key, max(1, int(seconds * 1000)))
        except Exception as e:  # noqa: BLE001 - the client raises one runtime error type
            if not timed_out(e):
                raise self._lost(name, e) from e

    def _release(self, name: str, verdict: str) -> None:
        self._kv.key_value_set(f"{self.id}/go/{name}", verdict)
        self._kv.key_value_delete(f"{self.id}/at/{name}")  # only the coordinator read them

    def _released(self, name: str) -> str:
        return self._wait_key(f"{self.id}/go/{name}", name, arrivals=True)

    @_timed
    def _wait_key(self, key: str, name: str, *, arrivals: bool) -> str:
        """The value of ``key`` once the coordinator sets it; raise if a process failed."""
        waited = self.timeout + self._grace
        deadline, slices = time.monotonic() + waited, Backoff()
        while True:
            left = min(deadline - time.monotonic(), slices.next())
            try:
                return self._kv.blocking_key_value_get(key, max(1, int(left * 1000)))
            except Exception as e:  # noqa: BLE001 - the client raises one runtime error type
                if not timed_out(e):
                    raise self._lost(name, e) from e
            self._check_peers()
            if time.monotonic() > deadline:
                missing = set()
                if arrivals:  # still there: the coordinator deletes them when it releases
                    got = self._dir(f"{self.id}/at/{name}/")
                    posted = {int(k.rsplit("/", 1)[1]) for k, _ in got}
                    missing = set(range(1, self.count)) - posted
                raise self._timeout(name, missing, waited, on_coordinator=True)

    def _check_peers(self) -> None:
        failures = {int(k.rsplit("/", 1)[1]): v for k, v in self._dir(f"{self.id}/failed/")}
        failures.pop(self.process, None)
        if failures:
            error = DistributedError(self._peer_message(failures))
            self._peer_errors.add(id(error))
            raise error

    def _wait_stopped(self) -> None:
        expected = set(range(1, self.count)) - self._missing
        self._await(f"{self.id}/stopped/", "stopped", expected, watch=False)

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
            f"{self.process}). {must_be_collective(self.call)}, with the same path: a process "
            f"crashed, hangs, or did not call it. Check the logs; if saves are just slow, raise "
            f"the deadline with JAXCKPT_SYNC_TIMEOUT=SECONDS. {done}"
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


def _describe(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}"
    return text if len(text) <= 2000 else text[:2000] + " ..."
