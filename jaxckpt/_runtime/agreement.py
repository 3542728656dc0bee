"""One decision for all processes: every process posts a value, process 0 decides.

The multi-tier manager (``jaxckpt._tiers.local_tier``) agrees on its run, on what to restore and
on whether every process rebuilt its share through these calls, never through a shared file
system. Only small messages go through the key-value store of ``jax.distributed`` (the
coordination service, hosted by process 0):

1. (every process) posts its value under ``<key>/at/<process>``;
2. (process 0) waits for all of them, applies the decision function once and posts the verdict
   under ``<key>/go`` (and with :func:`decide_each` one more value per process, in pieces of at
   most ``PIECE`` characters under ``<key>/go/<process>/<i>`` and their number under
   ``<key>/go/<process>``, which that process deletes once read);
3. (every process) reads the verdict; a verdict that starts with ``!`` is an error, raised on
   every process.

With ``survivors``, process 0 does not wait for a process whose heartbeat says it died
(``jaxckpt._runtime.heartbeat``: within that process's I/O deadline, not
``JAXCKPT_SYNC_TIMEOUT``).

Every process must make the same decisions in the same order (like a save): the key of each
is its number in this process's sequence.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable

from jaxckpt._errors import DistributedError
from jaxckpt._runtime import distributed as _distributed
from jaxckpt._runtime import heartbeat as _heartbeat

PREFIX = "jaxckpt/tiers/decide"
_POLL_S = 0.2
PIECE = 1 << 20  # characters of one value in the store: far below its gRPC message limit
_decisions = itertools.count()
_lock = threading.Lock()

# What process 0 computes from every process's value: the verdict for all, and with
# decide_each one more value per process.
_Decision = Callable[[dict[int, str]], tuple[str, dict[int, str]]]


def decide(
    name: str, value: str, fn: Callable[[dict[int, str]], str], *, survivors: bool = False
) -> str:
    """``fn`` of every process's ``value``, computed on process 0, returned on every process.

    ``fn`` runs once; if it raises, every process raises. ``survivors``: a process that has
    not posted within ``JAXCKPT_SYNC_TIMEOUT`` (it died) is left out of ``fn``'s argument
    instead of failing the decision, so the others still agree (``fn`` must then treat a
    missing process as one that failed).

    Raises:
      DistributedError: a process did not post its value in time (not ``survivors``), or
        process 0 did not answer.

    Example:
      >>> decide("example", "3", lambda posted: str(sum(int(v) for v in posted.values())))
      '3'
    """
    verdict, _ = _agree(name, value, lambda posted: (fn(posted), {}), survivors, each=False)
    return verdict


def decide_each(
    name: str, value: str, fn: _Decision, *, survivors: bool = False
) -> tuple[str, str]:
    """As :func:`decide`, but ``fn`` returns ``(verdict, {process: its own value})``: every
    process gets the verdict and its own value ("" where ``fn`` gives it none). For decisions
    too large to send whole to every process (a plan of which process sends what to whom).
    ``survivors`` as for :func:`decide`.

    Example:
      >>> decide_each("example", "x", lambda posted: ("all", {0: posted[0] * 2}))
      ('all', 'xx')
    """
    return _agree(name, value, fn, survivors, each=True)


def _agree(name: str, value: str, fn: _Decision, survivors: bool, each: bool) -> tuple[str, str]:
    process, count = _distributed.process_index(), _distributed.process_count()
    if count == 1:
        verdict, owns = fn({0: value})
        return verdict, owns.get(0, "")
    kv = _distributed.kv_client()
    timeout = _distributed.sync_timeout()
    with _lock:
        key = f"{PREFIX}/{next(_decisions)}-{name}"
    kv.key_value_set(f"{key}/at/{process}", value)
    if process != 0:
        # Process 0 may itself have waited a timeout (for a dead peer) before it got here.
        wait = (3 if survivors else 1) * timeout + 5
        got = _get(kv, f"{key}/go", wait, name)
        if got.startswith("!"):
            raise DistributedError(got[1:])
        if not each:
            return got, ""
        pieces = int(_get(kv, f"{key}/go/{process}", timeout + 5, name))
        own = "".join(_get(kv, f"{key}/go/{process}/{i}", 5, name) for i in range(pieces))
        kv.key_value_delete(f"{key}/go/{process}")
        return got, own
    posted = _collect(kv, key, name, count, timeout, survivors)
    try:
        verdict, owns = fn(posted)
    except Exception as e:
        kv.key_value_set(f"{key}/go", f"!agreeing on {name} failed on process 0: {e}")
        raise
    if each:  # before the verdict: a process that reads the verdict finds its own value
        for p in range(1, count):
            _post_long(kv, f"{key}/go/{p}", owns.get(p, ""))
    kv.key_value_set(f"{key}/go", verdict)
    kv.key_value_delete(f"{key}/at")
    return verdict, owns.get(0, "")


def _post_long(kv: _distributed.KeyValueClient, key: str, value: str) -> None:
    """Post ``value`` under ``key/<i>`` in pieces of at most ``PIECE`` characters (a process's
    share of a plan may exceed the store's message limit), then their number under ``key``."""
    pieces = [value[i : i + PIECE] for i in range(0, len(value), PIECE)] or [""]
    for i, piece in enumerate(pieces):
        kv.key_value_set(f"{key}/{i}", piece)
    kv.key_value_set(key, str(len(pieces)))


def _collect(
    kv: _distributed.KeyValueClient,
    key: str,
    name: str,
    count: int,
    timeout: float,
    survivors: bool,
) -> dict[int, str]:
    """Every process's value (process 0); where ``survivors``, those that posted in time,
    and not waiting for those whose heartbeat says they died (``heartbeat.dead``)."""
    deadline, delay, looked = time.monotonic() + timeout, 0.002, time.monotonic()
    while True:
        posted = {int(k.rsplit("/", 1)[1]): v for k, v in kv.key_value_dir_get(f"{key}/at/")}
        if len(posted) == count:
            return posted
        if survivors and time.monotonic() - looked >= 1:
            looked = time.monotonic()
            if set(posted) | set(_heartbeat.dead(set(range(count)) - set(posted))) == set(
                range(count)
            ):
                return posted
        if time.monotonic() > deadline:
            if survivors:
                return posted
            missing = sorted(set(range(count)) - set(posted))
            message = f"agreeing on {name}: processes {missing} did not answer in {timeout:g} s"
            kv.key_value_set(f"{key}/go", "!" + message)
            raise DistributedError(message)
        time.sleep(delay)
        delay = min(delay * 1.5, _POLL_S)


def _get(kv: _distributed.KeyValueClient, key: str, timeout: float, name: str) -> str:
    try:
        return kv.blocking_key_value_get(key, max(1, int(timeout * 1000)))
    except Exception as e:  # noqa: BLE001 - the client raises one runtime error type
        raise DistributedError(
            f"agreeing on {name}: no answer from process 0 within {timeout:g} s ({key}: "
            f"{str(e).splitlines()[0][:200]}). It crashed, hangs, or is slow: raise "
            f"JAXCKPT_SYNC_TIMEOUT=SECONDS if it is just slow."
        ) from e
