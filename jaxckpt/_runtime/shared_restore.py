"""A restore onto arrays that span processes fails on every process, or on none.

A restore whose target puts arrays on devices of several processes returns pieces of the same
global arrays on every process: if one process could not read its share (a corrupt or missing
chunk, an I/O deadline, a target it refuses), the others must not return theirs, or their
first computation on them (or the restore's own gather of shared reads) waits forever in a
collective for the process that gave up. So after reading, and before any array is assembled,
the processes agree on success: one :func:`jaxckpt._runtime.agreement.decide` (each process
posts ``""`` or its error; process 0 answers every process with the failures), under a key
every process derives from the path (``agreement.scope_of``), never a count of restores.

A restore whose target is all on this process's devices (or on the host) needs nobody else:
it meets no one, so one process may call it alone (an evaluator reading a checkpoint). Only
the processes whose devices the target uses take part (survivors restoring onto their own
devices do not wait for a dead process), the lowest of them leading.

A process that fails posts its error at once; the others, still reading, look for one at
most once a second (between boxes) and stop: so every process raises within about a second of
the failure (plus the box it is reading), not after reading all of its share.

Cost: one agreement per restore across processes: O(1) key-value operations per process, O(N)
on the leader, plus one listing per second of reading on each process, after the slowest process has read its share; nothing for a local restore.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from typing import Any

import jax

from jaxckpt._errors import DistributedError
from jaxckpt._runtime import agreement as _agreement
from jaxckpt._runtime import distributed as _distributed

WATCH_S = 1.0  # how often a process still reading looks for another's failure


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


class RestoreMeeting:
    """The agreement of one restore (see the module's docstring); a no-op where the restore
    is this process's alone.

    Args:
      path: the checkpoint as the user gave it (the same on every process).
      target: the restore's target.
    """

    def __init__(self, path: str, target: Any) -> None:
        self.path = path
        self.process = _distributed.process_index()
        # only the processes the arrays span take part (a dead one outside them is no matter)
        self.members = spanned(target) if _distributed.process_count() > 1 else set()
        self.alone = self.process not in self.members
        self._settled = False
        self._scope = _agreement.scope_of(self.path)
        self._failed = f"{_agreement.PREFIX}/{self._scope}/restore-failed"
        self._looked = time.monotonic()
        self._echo: BaseException | None = None  # raised here for another process's failure

    def watch(self) -> None:
        """Raise at once if another process has failed its share (looked for at most once
        every ``WATCH_S`` seconds, one key-value listing), so that nobody reads on for a
        restore that cannot succeed.

        Raises:
          DistributedError: naming the process that failed and why.
        """
        if self.alone or time.monotonic() - self._looked < WATCH_S:
            return
        self._looked = time.monotonic()
        try:
            got = _distributed.kv_client().key_value_dir_get(self._failed + "/")
        except Exception:  # noqa: BLE001 - the agreement that follows reports a lost service
            return
        failed = {int(k.rsplit("/", 1)[1]): v for k, v in got}
        failed.pop(self.process, None)
        if failed:
            self._echo = DistributedError(self._message(failed))
            raise self._echo

    @contextlib.contextmanager
    def sharing(self) -> Iterator[None]:
        """Any error raised inside is shared with the other processes, then raised here."""
        try:
            yield
        except BaseException as e:
            if self.alone or self._settled:
                raise
            self._settle(e)
            raise

    def agree(self) -> None:
        """Return once every process has read its share; raise if any process failed.

        Raises:
          DistributedError: naming the processes that failed and why (their errors name the
            key and chunk), or a process that did not reach the restore in time.
        """
        if not self.alone and not self._settled:
            self._settle(None)

    def _settle(self, error: BaseException | None) -> None:
        self._settled = True
        own = error is not None and error is not self._echo  # not another's, echoed
        mine = _describe(error) if own and error is not None else ""
        kv = _distributed.kv_client()
        if mine:  # those still reading stop at once (watch), then agree
            with contextlib.suppress(Exception):
                kv.key_value_set(f"{self._failed}/{self.process}", mine)

        def verdict_of(posted: dict[int, str]) -> str:  # on the leader, before any answer
            kv.key_value_delete(self._failed)  # read by now: the next restore starts clean
            return _failures(posted)

        try:
            verdict = _agreement.decide(
                "restore", mine, verdict_of, scope=self._scope, members=sorted(self.members)
            )
        except DistributedError as e:
            if error is not None:  # this process's own error says more
                return
            raise DistributedError(
                f"Restore of {self.path}: {e}. The restored arrays span every process, so "
                f"restore must be called on every process with the same target; this process "
                f"({self.process}) returns nothing."
            ) from e
        failed = {int(p): why for p, why in json.loads(verdict or "{}").items()}
        failed.pop(self.process, None)
        if error is not None or not failed:
            return  # the caller raises its own error
        raise DistributedError(self._message(failed))

    def _message(self, failed: dict[int, str]) -> str:
        failed = {p: why.rstrip(".") for p, why in failed.items()}
        first = min(failed)
        also = "".join(f"; also on process {p}: {failed[p]}" for p in sorted(failed)[1:3])
        return (
            f"Restore of {self.path} failed on process {first}: {failed[first]}{also}. This "
            f"process ({self.process}) returns nothing, as the arrays span every process. Fix "
            f"the cause on process {first} (see its log) and restore again on every process."
        )


def _failures(posted: dict[int, str]) -> str:
    """Process 0's verdict: the processes that failed and why, as JSON ("" if none)."""
    failed = {str(p): why for p, why in sorted(posted.items()) if why}
    return json.dumps(failed) if failed else ""


def _describe(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    return text if len(text) <= 2000 else text[:2000] + " ..."
