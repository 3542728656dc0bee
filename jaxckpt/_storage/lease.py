"""Who is writing a checkpoint now: the lease a save holds until it commits or gives up.

A save in progress leaves data that is not yet a checkpoint (a hidden staging directory, or
objects under a prefix without a manifest). A crash leaves the same data behind, and only the
second kind may be cleaned up: a clean-up must tell a dead save's leftovers from another
process's live save (a second ``CheckpointManager`` opened on the run while the trainer saves).

* **Local files**: the save's coordinator holds an exclusive ``flock`` on its staging directory
  from creating it until the commit's rename or the abort; the kernel drops the lock when the
  process dies, however it dies. A clean-up takes the same lock without waiting: if it cannot,
  the save is alive. Where the file system has no ``flock`` (some network file systems), the
  writer touches the directory every :data:`BEAT_S` seconds instead, and a leftover counts as
  dead once it is :data:`STALE_S` seconds old.
* **Object stores** (no locks): the coordinator writes ``writer.json`` beside the save's arrays
  (``{"host", "pid", "beat"}``) and rewrites it every :data:`BEAT_S` seconds; it goes at the
  commit. A save is dead if its ``writer.json`` is missing, names a process of this same host
  (hostname, boot and PID namespace) that no longer runs, or has not been rewritten (its
  generation unchanged) for :data:`STALE_S` seconds of the clean-up's own monotonic clock,
  between two looks of the same process: no host's clock is compared with another's. The
  ``beat`` time it holds (the writer's wall clock) decides alone only past :data:`STALE_S` +
  :data:`SKEW_S`, so a clean-up host whose clock runs ahead of the writer's by less than
  :data:`SKEW_S` never takes a live save for a dead one; a clock behind only delays the
  clean-up of a dead save's leftovers.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import tensorstore as ts

from jaxckpt._format.names import WRITER
from jaxckpt._runtime import pools
from jaxckpt._storage.location import ABSENT, Location, kvstore, wait

BEAT_S = 10.0  # how often a live save says so where it cannot hold a lock
STALE_S = 300.0  # a save silent for this long is dead
SKEW_S = 3600.0  # clocks of two hosts never disagree by more: see object_is_live
# writer.json leases looked at by this process: (location, key) -> (generation, first seen at
# time.monotonic()); an entry goes once its lease is judged dead or gone.
_seen: dict[tuple[str, str], tuple[bytes, float]] = {}
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.EBADF)


class LeaseLost(OSError):
    """A staging directory was removed before its save could lock it."""


class Lease:
    """Held by one save while it writes; :meth:`release` once it committed or gave up."""

    def __init__(self) -> None:
        self._fd: int | None = None
        self._beat: pools.Repeating | None = None
        self._object: tuple[Location, str] | None = None

    @classmethod
    def local(cls, staging: Path) -> Lease:
        """Lock the staging directory ``staging``, just made (or beat on it where locks are
        missing).

        Raises:
          LeaseLost: a clean-up took ``staging`` for a dead save's between its creation and
            the lock, and removed it: the caller makes another.
        """
        lease = cls()
        try:
            fd = os.open(staging, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError as e:  # removed between its creation and this open
            raise LeaseLost(str(staging)) from e
        try:  # blocking: a clean-up may be looking at it this instant (see holding)
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as e:
            os.close(fd)
            if e.errno not in _NO_LOCKS:
                raise
            lease._beat = pools.repeat(BEAT_S, lambda: os.utime(staging))
            return lease
        if os.fstat(fd).st_nlink == 0:  # removed while this waited for the lock
            os.close(fd)
            raise LeaseLost(str(staging))
        lease._fd = fd
        return lease

    @classmethod
    def object_store(
        cls, loc: Location, generation: str, *, only_if_absent: bool = False
    ) -> Lease | None:
        """Write ``writer.json`` under ``generation`` of ``loc`` and keep it fresh; with
        ``only_if_absent``, ``None`` if one is there already (another save took it)."""
        lease, fut = cls.start_object_store(loc, generation, only_if_absent=only_if_absent)
        return lease.taken(fut)

    @classmethod
    def start_object_store(
        cls, loc: Location, generation: str, *, only_if_absent: bool = False
    ) -> tuple[Lease, ts.Future[ts.KvStore.TimestampedStorageGeneration]]:
        """:meth:`object_store` in two steps: the write of ``writer.json`` starts now (beside
        other requests), :meth:`taken` waits for it."""
        lease = cls()
        lease._object = (loc, generation + WRITER)
        return lease, lease._start(only_if_absent)

    def taken(self, fut: ts.Future[ts.KvStore.TimestampedStorageGeneration]) -> Lease | None:
        """This lease once the write :meth:`start_object_store` started made it (it is kept
        fresh from then on), ``None`` if it did not (one was there already).

        Raises:
          CheckpointError: the write missed its deadline.
          ValueError: the store refused it.
        """
        assert self._object is not None
        loc, key = self._object
        if not wait(fut, loc, f"writing {key}").generation:
            self._object = None
            return None
        self._beat = pools.repeat(BEAT_S, self._write)
        return self

    def _write(self, only_if_absent: bool = False) -> bool:
        assert self._object is not None
        loc, key = self._object
        return bool(wait(self._start(only_if_absent), loc, f"writing {key}").generation)

    def _start(self, only_if_absent: bool) -> ts.Future[ts.KvStore.TimestampedStorageGeneration]:
        assert self._object is not None
        loc, key = self._object
        record = {"format": 1, "host": host_id(), "pid": os.getpid()}
        data = json.dumps({**record, "beat": time.time()}).encode()
        return kvstore(loc.kvstore, loc, own_queue=True).write(
            key, data, if_equal=ABSENT if only_if_absent else None
        )

    def probe(self) -> ts.Future[ts.KvStore.TimestampedStorageGeneration]:
        """Start a create-only-if-absent of this lease's ``writer.json``, which exists: a store
        that honours the preconditions refuses it (an empty generation), one that ignores
        them writes it (the same record; ``jaxckpt._storage.generations`` warns)."""
        return self._start(only_if_absent=True)

    def release(self, *, delete: bool = True) -> None:
        """Stop holding the lease (``delete``: remove ``writer.json`` too; never raises)."""
        if self._beat is not None:
            self._beat.stop()
        if self._fd is not None:
            os.close(self._fd)  # drops the lock
            self._fd = None
        if self._object is not None and delete:
            loc, key = self._object
            try:
                kv = kvstore(loc.kvstore, loc, own_queue=True)
                # One DELETE (a range delete lists first: a round trip more on GCS).
                wait(kv.write(key, None), loc, f"deleting {key}")
            except Exception:  # noqa: BLE001 - a stale writer.json only delays a clean-up
                pass
            self._object = None


@contextlib.contextmanager
def holding(path: Path) -> Iterator[bool]:
    """Take the lease of the staging directory (or temporary file) ``path`` if no live save
    holds it: yields ``True`` when nothing holds it (the caller may remove it: the lock is
    held until the block ends, so no save can take it meanwhile), ``False`` when a live save
    does. Where the file system has no locks, ``path`` is free once :data:`STALE_S` old."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        yield True  # gone, or a link: nothing of ours writes into it
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            free = True
        except OSError as e:
            if e.errno not in _NO_LOCKS and e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            free = e.errno in _NO_LOCKS and time.time() - os.fstat(fd).st_mtime >= STALE_S
        yield free
    finally:
        os.close(fd)  # drops the lock this took, if it took one


def local_is_live(path: Path) -> bool:
    """Whether a save still writes into the staging directory (or temporary file) ``path``."""
    with holding(path) as free:
        return not free


def is_lease(key: str) -> bool:
    """Whether ``key`` (relative to a checkpoint) is an object-store save's ``writer.json``."""
    top, _, rest = key.rpartition("/")
    return rest == WRITER and (top == "" or (len(top) == 9 and top[0] == "g"))


@contextlib.contextmanager
def locked_file(path: Path) -> Iterator[BinaryIO]:
    """A new file at ``path``, open for writing and locked (as a staging directory is) until
    the block ends, so that a clean-up never removes it while it is written."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    with os.fdopen(fd, "wb") as f:
        try:  # blocking: a clean-up may be looking at it this instant
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as e:
            if e.errno not in _NO_LOCKS:
                raise
        yield f


def object_is_live(
    loc: Location, key: str, now: float | None = None, clock: float | None = None
) -> bool:
    """Whether the save that holds ``writer.json`` at ``key`` of ``loc`` is alive: its record
    is readable, its process runs (same host), and it was rewritten within :data:`STALE_S`
    seconds of this process's monotonic clock (``clock``: that clock's reading, for tests)
    since this process first saw its generation; and, by the writer's clock, its ``beat`` is
    less than :data:`STALE_S` + :data:`SKEW_S` old (``now``: this host's ``time.time()``).
    A lease seen for the first time is alive unless the record, its process or its beat says
    otherwise: clean-ups look again later (each manager's start and save)."""
    got = wait(kvstore(loc.kvstore, loc).read(key), loc, f"reading {key}")
    seen = (str(loc), key)
    if got.state != "value":
        _seen.pop(seen, None)
        return False
    try:
        record = json.loads(got.value)
        age = (time.time() if now is None else now) - float(record["beat"])
        here = record.get("host") == host_id()
        pid = record.get("pid")
    except (ValueError, KeyError, TypeError, AttributeError):
        return False  # not ours to trust: a leftover like any other
    mono = time.monotonic() if clock is None else clock
    generation, since = _seen.get(seen, (None, mono))
    if generation != got.stamp.generation:
        since = mono
        _seen[seen] = (got.stamp.generation, since)
    dead = (here and type(pid) is int and pid > 0 and not _runs(pid)) or (
        mono - since >= STALE_S or age >= STALE_S + SKEW_S
    )
    if dead:
        _seen.pop(seen, None)
    return not dead


@functools.cache
def host_id() -> str:
    """This host as a writer's record names it: its name, boot and PID namespace (two
    containers may share a hostname but not a PID namespace)."""
    parts = [socket.gethostname()]
    try:
        parts.append(Path("/proc/sys/kernel/random/boot_id").read_text().strip())
        parts.append(str(os.stat("/proc/self/ns/pid").st_ino))
    except OSError:
        parts.append("?")  # no /proc: a PID cannot be checked, only the beat's age
    return "/".join(parts)


def _runs(pid: int) -> bool:
    if host_id().endswith("/?"):
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: it runs
        return True
    return True
