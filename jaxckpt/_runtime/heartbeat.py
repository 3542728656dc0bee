"""A process's sign of life while it moves bytes for others: a dead peer is seen in seconds.

A stream's receiver waits for its sender's next chunk, and a sender for its receiver's
acknowledgement, for as long as ``JAXCKPT_SYNC_TIMEOUT`` (minutes: a live peer may be busy
reading or serving others). A peer that was killed would hold them that long. So, while a
process takes part in an elastic restore (``jaxckpt._tiers.elastic_restore``), it *beats*,
under a key prefix of that restore (every process knows it):

1. (each such process) :func:`beating` posts ``<count> <deadline>`` under
   ``<prefix>/beat/<process>/v`` in the key-value store every ``deadline / 6`` seconds (at
   most every 5 s, at least every 0.2 s) from a daemon thread; when the block ends,
   ``stopped`` (done with its part, alive) or ``failed`` (it gave up: its peers stop waiting
   for it at once);
2. (a waiting peer) :meth:`Watch.check` reads that value between slices of its wait
   (:data:`SLICE`): ``failed``, or a value that has not changed for its own ``deadline`` (as
   this process's clock sees it: no clocks are compared), ends the wait with a
   :class:`DistributedError` naming the process;
3. (process 0, agreeing with ``survivors``, ``jaxckpt._runtime.agreement``) :func:`dead`
   of the processes that have not posted: those that stopped beating without saying so (in
   the last restore this process beat in) are not waited for.

A process that never beat (it died before it started, or it does not take part) is waited
for as before, up to ``JAXCKPT_SYNC_TIMEOUT``. The cost: one small value per process every
few seconds through process 0's coordination service, and one read per slice of a wait.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Iterable, Iterator

from jaxckpt._errors import DistributedError
from jaxckpt._runtime import distributed as _distributed
from jaxckpt._runtime import pools

SLICE = 1.0  # seconds a watched wait blocks before it checks its peer again
STOPPED, FAILED = "stopped", "failed"
_lock = threading.Lock()
_holders = 0  # the calls inside beating(): one thread beats while there is one
_stop = threading.Event()  # the beating thread's; a new one for each thread
_counts = itertools.count()
_last = ""  # the prefix this process beat under last: dead() looks there
# What this process saw of each peer: (its value, when this process first saw that value).
_seen: dict[str, tuple[str, float]] = {}
_seen_lock = threading.Lock()


def period(deadline: float) -> float:
    """Seconds between two beats of a process that declares ``deadline``."""
    return min(max(deadline / 6, 0.2), 5.0)


@contextlib.contextmanager
def beating(prefix: str, deadline: float) -> Iterator[None]:
    """Beat under ``prefix`` within the block (nested calls share one thread): a peer that
    sees no new beat for ``deadline`` seconds takes this process for dead. One process, or
    no ``jax.distributed``: nothing to do."""
    global _holders, _stop, _last
    if _distributed.process_count() == 1:
        yield
        return
    kv, key = _distributed.kv_client(), f"{prefix}/beat/{_distributed.process_index()}/v"
    with _lock:
        _holders += 1
        if _holders == 1:
            if _last and _last != prefix:  # the last restore's beat: nobody looks there now
                kv.key_value_delete(f"{_last}/beat/{_distributed.process_index()}/v")
            _stop, _last = threading.Event(), prefix
            _post(kv, key, f"{next(_counts)} {deadline:g}")  # before any peer waits
            pools.abandonable(_beat, kv, key, deadline, _stop)  # a daemon thread, never joined
    ended = FAILED
    try:
        yield
        ended = STOPPED
    finally:
        with _lock:
            _holders -= 1
            if _holders == 0:
                _stop.set()
                _post(kv, key, ended)


def _beat(
    kv: _distributed.KeyValueClient, key: str, deadline: float, stop: threading.Event
) -> None:
    while not stop.wait(period(deadline)):
        with _lock:  # never after beating() posted its end
            if stop.is_set():
                return
            try:
                _post(kv, key, f"{next(_counts)} {deadline:g}")
            except Exception:  # noqa: BLE001 - the coordinator is gone: the waits will say so
                return


def _post(kv: _distributed.KeyValueClient, key: str, value: str) -> None:
    """Replace ``key``'s value (the store refuses to overwrite; a reader that looks between
    the two calls sees no beat, which is never a reason to give up on a peer)."""
    kv.key_value_delete(key)
    kv.key_value_set(key, value)


class Watch:
    """The heartbeat of process ``process`` under ``prefix``, as a waiting peer checks it."""

    def __init__(self, prefix: str, process: int) -> None:
        self.key, self.process = f"{prefix}/beat/{process}/v", process
        self._value, self._read_at = "", -float("inf")

    def check(self, what: str) -> None:
        """Raise if the process gave up or stopped beating without saying so (it died). The
        store is read at most twice per beat of the peer (once a second before its first).

        Raises:
          DistributedError: it did; names ``what`` was waited for.
        """
        value, now = self._value, time.monotonic()
        if now - self._read_at >= _every(value):
            got = _distributed.kv_client().key_value_dir_get(self.key.rsplit("/", 1)[0] + "/")
            value = self._value = next((v for k, v in got if k == self.key), "")
            self._read_at = now
        if value == FAILED:
            raise DistributedError(f"{what}: process {self.process} gave up (see its log)")
        if value and _stale(self.key, value):
            raise DistributedError(
                f"{what}: process {self.process} stopped answering (no sign of life for "
                f"{value.split()[-1]} s, its I/O deadline): it died"
            )


def _every(value: str) -> float:
    """Seconds between two reads of a beat that was ``value``: half its period."""
    try:
        return period(float(value.split()[-1])) / 2
    except (ValueError, IndexError):
        return SLICE


def dead(processes: Iterable[int]) -> list[int]:
    """Those of ``processes`` that stopped beating without saying so, under the prefix this
    process beat in last (one read of the store); none if it never beat."""
    wanted = set(processes)
    if not wanted or not _last:
        return []
    base = f"{_last}/beat/"
    out = []
    for key, value in _distributed.kv_client().key_value_dir_get(base):
        number = key[len(base) :].split("/", 1)[0]
        if number.isdigit() and int(number) in wanted and _stale(key, value):
            out.append(int(number))
    return sorted(out)


def _stale(key: str, value: str) -> bool:
    """Whether ``value``, the beat under ``key``, has stayed the same for its deadline."""
    if value in (STOPPED, FAILED):
        return False
    try:
        deadline = float(value.split()[-1])
    except (ValueError, IndexError):
        return False  # not ours: never a reason to give up on a peer
    now = time.monotonic()
    with _seen_lock:
        last, since = _seen.get(key, ("", now))
        if last != value:
            _seen[key] = (value, now)
            return False
    return now - since >= deadline
