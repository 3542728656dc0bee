"""One decision for all processes: every process posts a value, process 0 decides.

The multi-tier manager (``jaxckpt._tiers.local_tier``), the time-based schedule
(``jaxckpt._manager.schedule``) and a restore onto arrays of several processes
(``jaxckpt._api.restoring.restore``) agree through these calls, never through a shared file
system. Only small messages go through the key-value store of ``jax.distributed`` (the
coordination service, hosted by process 0). A decision's keys are ``<PREFIX>/<scope>/<name>``,
where ``scope`` is what every process derives alike (:func:`scope_of` a path), never a count
kept by each process, so a process that skipped a decision (it failed before it, or only it
called) does not put every later one out of step:

The lowest process taking part (process 0, unless ``members`` leaves it out) is the leader:

1. (every other process) deletes its own answer of an earlier round (one it never read), then
   posts its value under ``<key>/at/<process>``;
2. (the leader) waits for all of them, deletes ``<key>/at`` (only then: a process posts the next
   round's value only after reading this round's answer), applies the decision function once
   and posts each process its answer under ``<key>/go/<process>`` (with :func:`decide_each`
   its own value first, in pieces of at most ``PIECE`` characters under
   ``<key>/own/<process>/<i>``);
3. (every other process) reads its answer and deletes it; an answer that starts with ``!`` is
   an error, raised on every process. A process that gives up waiting withdraws its value, so
   that a later round of the same decision does not count it.

So each process other than the leader makes O(1) operations per decision and the leader
O(processes);
the store keeps no key of a finished decision.

With ``survivors``, process 0 does not wait for a process whose heartbeat says it died
(``jaxckpt._runtime.heartbeat``: within that process's I/O deadline, not
``JAXCKPT_SYNC_TIMEOUT``).

Every process must make the same decisions (like a save); two decisions of the same name and
scope never run at once.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from collections.abc import Callable, Sequence

from jaxckpt._errors import DistributedError
from jaxckpt._runtime import distributed as _distributed
from jaxckpt._runtime import heartbeat as _heartbeat
from jaxckpt._runtime.collective import Notice, must_be_collective, processes
from jaxckpt._runtime.kvstore import Backoff, timed_out

PREFIX = "jaxckpt/decide"
PIECE = 1 << 20  # characters of one value in the store: far below its gRPC message limit

# What process 0 computes from every process's value: the verdict for all, and with
# decide_each one more value per process.
_Decision = Callable[[dict[int, str]], tuple[str, dict[int, str]]]


def scope_of(*parts: str) -> str:
    """A short name for ``parts`` (a path, a run) that every process derives alike: the scope
    of the decisions, restores and schedules about it.

    Example:
      >>> scope_of("/runs/a") == scope_of("/runs/a") != scope_of("/runs/b")
      True
    """
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def decide(
    name: str,
    value: str,
    fn: Callable[[dict[int, str]], str],
    *,
    survivors: bool = False,
    scope: str = "",
    timeout: float | None = None,
    members: Sequence[int] | None = None,
    call: str = "",
) -> str:
    """``fn`` of every process's ``value``, computed on process 0, returned on every process.

    ``fn`` runs once; if it raises, every process raises. ``survivors``: a process that has
    not posted within the deadline (it died) is left out of ``fn``'s argument instead of
    failing the decision, so the others still agree (``fn`` must then treat a missing process
    as one that failed). ``scope``: what the decision is about (:func:`scope_of`), so that
    decisions of one name about different things do not meet. ``timeout``: the seconds to
    wait for the others (default ``JAXCKPT_SYNC_TIMEOUT``). ``members``: the processes that
    take part, this one among them (default: all); the lowest of them decides. ``call``: the
    public call that makes this decision (``CheckpointManager.save(7)``), named in the log line
    of a process that waits for the others more than a moment
    (``jaxckpt._runtime.collective``).

    Raises:
      DistributedError: a process did not post its value in time (not ``survivors``), or
        process 0 did not answer.

    Example:
      >>> decide("example", "3", lambda posted: str(sum(int(v) for v in posted.values())))
      '3'
    """
    verdict, _ = _agree(
        f"{scope}/{name}" if scope else name,
        value,
        lambda posted: (fn(posted), {}),
        survivors,
        timeout,
        members,
        call,
    )
    return verdict


def decide_each(
    name: str, value: str, fn: _Decision, *, survivors: bool = False, scope: str = ""
) -> tuple[str, str]:
    """As :func:`decide`, but ``fn`` returns ``(verdict, {process: its own value})``: every
    process gets the verdict and its own value ("" where ``fn`` gives it none). For decisions
    too large to send whole to every process (a plan of which process sends what to whom).
    ``survivors`` and ``scope`` as for :func:`decide`.

    Example:
      >>> decide_each("example", "x", lambda posted: ("all", {0: posted[0] * 2}))
      ('all', 'xx')
    """
    return _agree(f"{scope}/{name}" if scope else name, value, fn, survivors, None, None, "")


def _agree(
    name: str,
    value: str,
    fn: _Decision,
    survivors: bool,
    timeout: float | None,
    members: Sequence[int] | None,
    call: str,
) -> tuple[str, str]:
    process = _distributed.process_index()
    group = sorted(set(range(_distributed.process_count()) if members is None else members))
    if group == [process]:
        verdict, owns = fn({process: value})
        return verdict, owns.get(process, "")
    kv = _distributed.kv_client()
    timeout = _distributed.sync_timeout() if timeout is None else timeout
    key = f"{PREFIX}/{name}"
    notice = Notice(call or f"jaxckpt's agreement on {name.rsplit('/', 1)[-1]!r}", timeout)
    if process != group[0]:
        wait = (3 if survivors else 1) * timeout + 5
        return _ask(kv, key, name, process, group[0], value, wait, notice)
    posted = _collect(kv, key, name, set(group[1:]), timeout, survivors, notice)
    posted[process] = value
    kv.key_value_delete(f"{key}/at")  # before any answer: see the module's docstring
    try:
        verdict, owns = fn(posted)
    except Exception as e:
        _answer(kv, key, posted, f"!agreeing on {name} failed on process {process}: {e}", {})
        raise
    _answer(kv, key, posted, verdict, owns)
    return verdict, owns.get(process, "")


def _ask(
    kv: _distributed.KeyValueClient,
    key: str,
    name: str,
    process: int,
    leader: int,
    value: str,
    wait: float,
    notice: Notice,
) -> tuple[str, str]:
    """Post ``value`` and return the ``leader``'s answer to this process (another one): the
    verdict and this process's own value. ``wait``: the leader may itself have waited a
    timeout (for a dead peer) before it got here."""
    kv.key_value_delete(f"{key}/go/{process}")  # an earlier round's answer, never read
    kv.key_value_delete(f"{key}/own/{process}")
    kv.key_value_delete(f"{key}/at/{process}")  # posted by a round process 0 never joined
    kv.key_value_set(f"{key}/at/{process}", value)
    try:
        got = json.loads(_get(kv, f"{key}/go/{process}", wait, name, leader, notice))
    except DistributedError:
        kv.key_value_delete(f"{key}/at/{process}")  # withdrawn: a later round won't count it
        raise
    verdict, pieces = str(got[0]), int(got[1])
    if verdict.startswith("!"):
        raise DistributedError(verdict[1:])
    own = "".join(_get(kv, f"{key}/own/{process}/{i}", 5, name, leader) for i in range(pieces))
    # Read: clean up if the leader (maybe the service's host, exiting) is still there.
    with contextlib.suppress(Exception):
        kv.key_value_delete(f"{key}/go/{process}")
        if pieces:
            kv.key_value_delete(f"{key}/own/{process}")
    return verdict, own


def _answer(
    kv: _distributed.KeyValueClient,
    key: str,
    posted: dict[int, str],
    verdict: str,
    owns: dict[int, str],
) -> None:
    """(the leader) Each other process that posted gets its own value (in pieces of at most
    ``PIECE`` characters: a share of a plan may exceed the store's message limit), then the
    verdict with their number, which it reads first."""
    leader = _distributed.process_index()
    for p in sorted(posted):
        if p == leader:
            continue
        own = owns.get(p, "")
        pieces = [own[i : i + PIECE] for i in range(0, len(own), PIECE)]
        for i, piece in enumerate(pieces):
            kv.key_value_set(f"{key}/own/{p}/{i}", piece)
        kv.key_value_set(f"{key}/go/{p}", json.dumps([verdict, len(pieces)]))


def _collect(
    kv: _distributed.KeyValueClient,
    key: str,
    name: str,
    others: set[int],
    timeout: float,
    survivors: bool,
    notice: Notice,
) -> dict[int, str]:
    """The value of each of the ``others`` (on the leader); where ``survivors``, those that
    posted in time, and not waiting for those whose heartbeat says they died
    (``heartbeat.dead``)."""
    deadline, slices, looked = time.monotonic() + timeout, Backoff(), time.monotonic()
    while True:
        got = kv.key_value_dir_get(f"{key}/at/")
        posted = {p: v for p, v in ((int(k.rsplit("/", 1)[1]), v) for k, v in got) if p in others}
        if set(posted) >= others:
            return posted
        missing = sorted(others - set(posted))
        notice.check(f"{processes(missing)} to call it")
        if survivors and time.monotonic() - looked >= 1:
            looked = time.monotonic()
            if set(posted) | set(_heartbeat.dead(others - set(posted))) >= others:
                return posted
        if time.monotonic() > deadline:
            if survivors:
                return posted
            message = (
                f"agreeing on {name}: processes {missing} did not answer in {timeout:g} s. "
                f"{must_be_collective(notice.call)}; a process crashed, hangs, or did not "
                f"call it"
            )
            kv.key_value_delete(f"{key}/at")
            _answer(kv, key, posted, "!" + message, {})
            raise DistributedError(message)
        # Block on the first missing value, in slices that grow (a few operations per 4 s
        # of waiting, not a poll every 0.2 s); at most 1 s where dead peers are looked for.
        longest = 1.0 if survivors else deadline - time.monotonic()
        wait = min(slices.next(), deadline - time.monotonic(), notice.left(), longest)
        try:
            kv.blocking_key_value_get(f"{key}/at/{missing[0]}", max(1, int(wait * 1000)))
        except Exception as e:  # noqa: BLE001 - the client raises one runtime error type
            if not timed_out(e):
                raise DistributedError(
                    f"agreeing on {name}: lost the JAX distributed service ({e}); process 0, "
                    f"which hosts it, has probably died: see its log."
                ) from e


def _get(
    kv: _distributed.KeyValueClient,
    key: str,
    timeout: float,
    name: str,
    leader: int,
    notice: Notice | None = None,
) -> str:
    """``key``'s value once set; ``notice``: logged if it takes more than a moment."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        try:
            held = min(left, notice.left()) if notice is not None else left
            return kv.blocking_key_value_get(key, max(1, int(held * 1000)))
        except Exception as e:  # noqa: BLE001 - the client raises one runtime error type
            if notice is not None and timed_out(e) and time.monotonic() < deadline:
                notice.check(f"process {leader} to answer (it answers once all call it)")
                continue
            call = notice.call if notice is not None else f"agreeing on {name}"
            raise DistributedError(
                f"agreeing on {name}: no answer from process {leader} within {timeout:g} s "
                f"({key}: {str(e).splitlines()[0][:200]}). {must_be_collective(call)}; process "
                f"{leader} crashed, hangs, did not call it, or is slow: raise "
                f"JAXCKPT_SYNC_TIMEOUT=SECONDS if it is just slow."
            ) from e
