"""A restore onto arrays that span processes fails on every process, or on none.

A restore whose target puts arrays on devices of several processes returns pieces of the same
global arrays on every process. If one process could not read its share (a corrupt or missing
chunk, an I/O deadline, a target it refuses), the others must not go on: their next jax
collective (the restore's own gather of shared reads in ``LoadPlanner.finish``, or the
caller's first computation) would wait forever for the process that gave up. So:

1. (a process that fails, reading or before) posts at once that it failed, under the restore's
   one watched key ``<agreement.PREFIX>/<scope>/restore-failed``, then joins step 3 with its
   error;
2. (every process, from the start of the restore) a watcher thread waits for that key with one
   blocking get (re-armed after ``WAIT_S`` seconds); the reading thread only looks at what the
   watcher found, between boxes (no store operation, never a collective), and stops reading
   once another process has failed;
3. (every process) after its own reads and before ``finish`` (the only step of the default
   planner that runs jax collectives), one :func:`jaxckpt._runtime.agreement.decide`: each
   posts its error, or a digest of the restore it made (:func:`what_restores`: the target's
   leaves that span processes, ``keys``, the planner); the lowest process, once all have
   posted (so after every failure was posted), sets the watched key to ``done`` (every watcher
   returns) and deletes it, then answers every process with the failures, or with the
   processes whose restores differ;
4. (every process) raises the same error if any process failed: the first failing process's
   type (a :class:`jaxckpt.CheckpointError` subclass, else ``DistributedError``) and
   message, prefixed with ``Restore of PATH failed on process N``; or a ``DistributedError``
   naming the processes whose restores differ (their collectives would not match).

So no process ever waits in a jax collective while another waits in the coordination service
(the agreement comes after every read and before every collective), nor the other way round.
The scope is what every process derives from the path (``agreement.scope_of``), never a count
of restores, so a restore one process skipped does not put later ones out of step. The next
restore of the same path watches the same key, so it must find it absent: the leader deletes it
before it answers (step 3), and every process gets its answer only after that. A process posts
in step 3 only once its watcher has sent its get, so the leader's ``done`` finds it waiting. A
process whose watcher has not returned once it has its answer (its get reached the store after
the delete nonetheless), or whose agreement failed, sets the key to ``done`` itself, joins its
watcher and deletes the key again (:meth:`RestoreMeeting.close`): no watcher outlives its
restore, as a thread still blocked in the store when the interpreter exits aborts the process.
(A next restore begun meanwhile on another process may then see ``done`` and watch no more: it
still fails together, at its agreement.) A failure left posted by a restore whose agreement
never finished (a process crashed) stops the next restore of the path on every process, which
then raises a ``DistributedError`` that says so; that restore's leader clears it.

A restore whose target is all on this process's devices (or on the host) needs nobody else:
it meets no one, so one process may call it alone (an evaluator reading a checkpoint), and a
single-process job makes no call here at all. Only the processes whose devices the target uses
take part, the lowest of them leading.

Cost per restore across processes: one agreement (O(1) key-value operations per process, O(N)
on the leader), one blocking get per process for the watch (one more per ``WAIT_S`` seconds of
reading: none in practice), two on the leader (``done``, delete), and one more on a process
that fails (posting that it failed); never an operation per box or per second of reading.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from concurrent.futures import wait as _wait_for
from typing import Any

import jax

from jaxckpt._errors import CheckpointError, DistributedError
from jaxckpt._runtime import agreement as _agreement
from jaxckpt._runtime import distributed as _distributed
from jaxckpt._runtime import pools
from jaxckpt._runtime.kvstore import KeyValueClient, timed_out

WAIT_S = 600.0  # a watcher's blocking get is re-armed after this long (a restore reading on)
JOIN_S = 1.0  # once answered, how long to wait for the watcher the leader's "done" woke
WATCHER = "jaxckpt-restore-watcher"  # the watcher thread's name
DONE = "done"  # the watched key's value once the restore is agreed: no failure, stop watching


def spanned(target: Any) -> set[int]:
    """The processes whose devices hold the arrays of ``target`` that span several processes
    (its ``jax.Array``, ``ShapeDtypeStruct`` or bare ``Sharding`` leaves not fully addressable
    here); empty where there are none.

    Example:
      >>> import jax
      >>> spanned({"w": jax.sharding.SingleDeviceSharding(jax.devices()[0]), "b": None})
      set()
    """
    found: set[int] = set()
    seen: set[Any] = set()  # many leaves share a few shardings
    for leaf in jax.tree_util.tree_leaves(target):
        where = leaf if isinstance(leaf, jax.sharding.Sharding) else getattr(leaf, "sharding", None)
        if not isinstance(where, jax.sharding.Sharding) or where in seen:
            continue
        seen.add(where)
        if not where.is_fully_addressable:
            devices: Any = where.device_set  # jax's Device stubs lack process_index
            found |= {int(d.process_index) for d in devices}
    return found


def what_restores(target: Any, also: str) -> str:
    """A digest of what a restore asks of the processes it spans: the position, shape, dtype
    and sharding of each leaf of ``target`` that spans processes, and ``also`` (its ``keys``
    and planner). Alike on every process that makes the same restore; leaves of this process
    alone (which may differ between processes) do not count.

    Example:
      >>> what_restores({"w": None}, "keys=None") == what_restores({"b": None}, "keys=None")
      True
    """
    h = hashlib.sha256(also.encode())
    names: dict[int, str] = {}  # many leaves share a few shardings: each described once
    for i, leaf in enumerate(jax.tree_util.tree_leaves(target)):
        where = leaf if isinstance(leaf, jax.sharding.Sharding) else getattr(leaf, "sharding", None)
        if not isinstance(where, jax.sharding.Sharding) or where.is_fully_addressable:
            continue
        name = names.get(id(where)) or names.setdefault(id(where), repr(where))
        shape, dtype = getattr(leaf, "shape", None), getattr(leaf, "dtype", None)
        h.update(f"{i} {shape} {dtype} {name};".encode())
    return h.hexdigest()[:16]


class RestoreMeeting:
    """The agreement of one restore (see the module's docstring); a no-op where the restore
    is this process's alone.

    Args:
      path: the checkpoint as the user gave it (the same on every process).
      target: the restore's target.
      also: what else every process must give alike (``keys``, the planner).
    """

    def __init__(self, path: str, target: Any, also: str = "") -> None:
        self.path = path
        members = spanned(target) if _distributed.process_count() > 1 else set()
        self.process = _distributed.process_index() if members else 0
        self.members = sorted(members)
        self.alone = self.process not in members or len(members) < 2
        self._settled = self._agreed = False
        self._echo: BaseException | None = None  # raised here for another process's failure
        self._watcher: Future[bool] | None = None  # True once another process failed
        if not self.alone:
            self._digest = what_restores(target, also)
            self._scope = _agreement.scope_of(path)
            self._failed = f"{_agreement.PREFIX}/{self._scope}/restore-failed"

    def __enter__(self) -> RestoreMeeting:
        """Start watching for another process's failure (step 2 of the module's docstring)."""
        if not self.alone:
            self._armed, self._over = threading.Event(), threading.Event()
            kv = _distributed.kv_client()
            watch = _watch, kv, self._failed, self._armed, self._over
            self._watcher = pools.abandonable(*watch, name=WATCHER)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """End the watcher, however the restore ended: it must not outlive the restore (nor
        block in the store at interpreter exit). Normally the leader's ``done`` has woken it;
        else this process sets ``done`` itself, then deletes the key again."""
        watcher, self._watcher = self._watcher, None
        if watcher is None:
            return
        self._over.set()
        if self._agreed and _wait_for([watcher], JOIN_S).done:
            return
        kv = _distributed.kv_client()
        with contextlib.suppress(Exception):
            if not watcher.done():
                kv.key_value_set(self._failed, DONE, allow_overwrite=True)
                _wait_for([watcher], _distributed.sync_timeout())
            kv.key_value_delete(self._failed)

    def watch(self) -> None:
        """Raise at once if another process has failed its share (as the watcher found: no
        store operation here), so that nobody reads on for a restore that cannot succeed.

        Raises:
          DistributedError: another process failed (replaced by its error once agreed).
        """
        watcher = self._watcher
        if watcher is None or not watcher.done() or not watcher.result() or self._settled:
            return
        self._echo = DistributedError(f"Restore of {self.path}: another process failed")
        raise self._echo

    @contextlib.contextmanager
    def sharing(self) -> Iterator[None]:
        """Any error raised inside is shared with the other processes; then every process
        raises the first failing process's error (step 4 of the module's docstring)."""
        try:
            yield
        except BaseException as e:
            if self.alone or self._settled:
                raise
            shared = self._settle(e)
            if shared is None or shared is e:
                raise
            raise shared from (None if e is self._echo else e)

    def agree(self) -> None:
        """Return once every process has read its share; raise if any process failed.

        Raises:
          CheckpointError: the first failing process's error (its type where it is one of
            jaxckpt's, else ``DistributedError``), naming that process; ``DistributedError``
            where a process did not reach the restore in time.
        """
        if self.alone or self._settled:
            return
        shared = self._settle(None)
        if shared is not None:
            raise shared

    def _settle(self, error: BaseException | None) -> BaseException | None:
        """Steps 1, 3 and 4: the error this process raises (``None``: none)."""
        self._settled = True
        own = error is not None and error is not self._echo  # not another's, echoed
        mine = _describe(error) if own and error is not None else ""
        if mine:  # those still reading stop at once (their watchers return), then agree
            with contextlib.suppress(Exception):
                kv, key = _distributed.kv_client(), self._failed
                kv.key_value_set(key, str(self.process), allow_overwrite=True)
        if self._watcher is not None:  # its get goes out before this process's post (step 3)
            self._armed.wait(JOIN_S)
        try:
            verdict = _agreement.decide(
                "restore",
                mine or "=" + self._digest,
                self._leads,
                scope=self._scope,
                members=self.members,
                call=f"jaxckpt.restore({self.path})",
            )
        except DistributedError as e:
            if own:  # this process's own error says more
                return error
            return DistributedError(
                f"Restore of {self.path}: {e}. The restored arrays span processes "
                f"{self.members}, so restore must be called on every one of them with the same "
                f"target; this process ({self.process}) returns nothing."
            )
        self._agreed = True
        said = json.loads(verdict or "{}")
        if "differ" in said:
            return error if own else self._differ(said["differ"])
        failed = {int(p): why for p, why in said.items()}
        if failed:
            return self._error(failed, error if own else None)
        return None if error is None or own else self._stale()

    def _leads(self, posted: dict[int, str]) -> str:
        """(the leader, once every process has posted: after every failure was posted) Wake
        every watcher and delete the watched key, so the next restore of the path starts
        clean; then :func:`_verdict`."""
        kv = _distributed.kv_client()
        with contextlib.suppress(Exception):
            kv.key_value_set(self._failed, DONE, allow_overwrite=True)
        with contextlib.suppress(Exception):
            kv.key_value_delete(self._failed)
        return _verdict(posted)

    def _stale(self) -> DistributedError:
        """This process stopped reading for a failure that no process reported."""
        return DistributedError(
            f"Restore of {self.path}: this process ({self.process}) stopped reading as a "
            f"failure was posted under {self._failed}, but no process taking part "
            f"({self.members}) reported one: it was left by an earlier restore of this path "
            f"whose agreement did not finish (a process crashed or timed out), and is cleared "
            f"now. Restore again on every process."
        )

    def _differ(self, groups: list[list[int]]) -> DistributedError:
        shown = "; ".join(f"processes {g}" for g in groups[:4])
        return DistributedError(
            f"Restore of {self.path}: the processes made different restores ({shown} each gave "
            f"their own): the leaves of the target that span processes (their shapes, dtypes "
            f"or shardings), keys= or the planner differ, so their collectives would not "
            f"match. Every process must call restore with the same target, keys and planner; "
            f"this process ({self.process}) returns nothing."
        )

    def _error(self, failed: dict[int, list[str]], own: BaseException | None) -> BaseException:
        """The error every process raises: the first failing process's, naming it."""
        first = min(failed)
        kind, why = failed[first]
        also = "".join(
            f"; also on process {p}: {failed[p][0]}: {failed[p][1].rstrip('.')}"
            for p in sorted(failed)[1:3]
        )
        cls = _KINDS.get(kind, DistributedError)
        if first == self.process and own is not None and not isinstance(own, CheckpointError):
            return own  # not one of ours (an OSError, an interrupt): raised as it was
        where = "" if cls is not DistributedError or kind == cls.__name__ else f"{kind}: "
        return cls(
            f"Restore of {self.path} failed on process {first}: {where}{why.rstrip('.')}{also}. "
            f"Every process taking part ({self.members}) raises this error and returns nothing, "
            f"as the arrays span them; fix the cause on process {first} (see its log) and "
            f"restore again on every process."
        )


def _kinds() -> dict[str, type[CheckpointError]]:
    """jaxckpt's error classes by name: the type another process's error is raised as."""
    out: dict[str, type[CheckpointError]] = {}
    todo = [CheckpointError]
    while todo:
        cls = todo.pop()
        if cls.__module__ == CheckpointError.__module__:  # never a user's subclass
            out[cls.__name__] = cls
        todo.extend(cls.__subclasses__())
    return out


_KINDS = _kinds()


def _verdict(posted: dict[int, str]) -> str:
    """The leader's verdict as JSON ("" if all is well): the processes that failed and their
    errors, else the groups of processes whose restores differ (``"differ"``)."""
    failed = {str(p): json.loads(v) for p, v in sorted(posted.items()) if not v.startswith("=")}
    if failed:
        return json.dumps(failed)
    groups: dict[str, list[int]] = {}
    for p, v in sorted(posted.items()):
        groups.setdefault(v, []).append(p)
    return json.dumps({"differ": sorted(groups.values())}) if len(groups) > 1 else ""


def _describe(error: BaseException) -> str:
    """``error`` as a process posts it: ``[type name, message]`` in JSON, the message cut."""
    text = str(error) or type(error).__name__
    text = text if len(text) <= 2000 else text[:2000] + " ..."
    return json.dumps([type(error).__name__, text])


def _watch(kv: KeyValueClient, key: str, armed: threading.Event, over: threading.Event) -> bool:
    """(a restore's watcher thread) Wait for ``key``: whether another process failed (its
    value is not ``done``). Sets ``armed`` as it sends its first get. Returns once ``key`` is
    set, or where the store is lost (the agreement reports that), or once ``over`` is set
    after a get timed out."""
    while not over.is_set():
        armed.set()
        try:
            return kv.blocking_key_value_get(key, int(WAIT_S * 1000)) != DONE
        except Exception as e:  # noqa: BLE001 - the client raises one runtime error type
            if not timed_out(e):
                return False
    return False
