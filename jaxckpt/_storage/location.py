"""Where checkpoints live: local paths and tensorstore kvstore URLs, and the manifest's bytes.

``Location`` turns what a user passes as ``path`` (a local path, with ``~`` expanded as a shell
would; ``file://``, ``memory://``, ``s3://``, ``gs://``) into a tensorstore kvstore spec; one tensorstore context serves the
process (its request queues renewed after an abandoned request: :func:`context`), so
``memory://`` checkpoints live as long as it does.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import stat
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol, TypeVar

import tensorstore as ts

from jaxckpt._errors import CheckpointError, CheckpointNotFoundError, ManifestError
from jaxckpt._format.names import MANIFEST
from jaxckpt._storage import throttle as _throttle
from jaxckpt._storage import urls as _urls

# One context for the process: memory:// stores live in it, and no chunk cache is kept.
# Files are not fsynced one by one (that multiplies the cost of many small arrays,
# docs/benchmarks.md); the commit syncs
# the staging dir's file system once before writing the manifest.
# Object stores: how many requests the process has in flight at once, shared by every save
# and restore (docs/object_storage.md, "Tuning"); read once, at import.
REQUEST_CONCURRENCY_ENV = "JAXCKPT_REQUEST_CONCURRENCY"
DEFAULT_REQUEST_CONCURRENCY = 64


def _request_concurrency() -> int:
    try:
        n = int(os.environ.get(REQUEST_CONCURRENCY_ENV, DEFAULT_REQUEST_CONCURRENCY))
    except ValueError:
        n = DEFAULT_REQUEST_CONCURRENCY
    return n if n > 0 else DEFAULT_REQUEST_CONCURRENCY


CONTEXT = ts.Context(
    {
        "cache_pool": {"total_bytes_limit": 0},
        "file_io_sync": False,
        "gcs_request_concurrency": {"limit": _request_concurrency()},
        "s3_request_concurrency": {"limit": _request_concurrency()},
    }
)

# A save's heartbeat (``jaxckpt._storage.lease``) rewrites one small key while the save's own
# requests fill CONTEXT's queue; behind them it would wait as long as the whole save's data, and
# its deadline, which is for a server that stopped answering, would fail a busy save. Its own
# queue lets it through at once.
BEAT_CONTEXT = ts.Context(
    {"gcs_request_concurrency": {"limit": 2}, "s3_request_concurrency": {"limit": 2}}
)


def _queues(limit: int, parent: ts.Context | None = None) -> ts.Context:
    spec = {"gcs_request_concurrency": {"limit": limit}, "s3_request_concurrency": {"limit": limit}}
    return ts.Context(spec) if parent is None else ts.Context(spec, parent)


# A request given up at its deadline keeps its place in the queue that sent it while curl
# waits on a silent server (see the curl note below), so after one, stores opened from then on
# get fresh queues (the resources of CONTEXT otherwise: its memory:// stores are the same):
# the process goes on working with a server that answers again, whatever was abandoned.
_now = [CONTEXT, BEAT_CONTEXT]


def context(*, own_queue: bool = False) -> ts.Context:
    """The context that stores and arrays open in now: :data:`CONTEXT` (``own_queue``:
    :data:`BEAT_CONTEXT`) until a request was abandoned at its deadline, then one with request
    queues of its own."""
    return _now[1 if own_queue else 0]


def _renew_queues() -> None:
    _now[:] = [_queues(_request_concurrency(), CONTEXT), _queues(2)]


# The stamp generation of a missing key: a write conditional on it creates a key only if absent.
ABSENT = ts.KvStore.open({"driver": "memory"}).result().read("x").result().stamp.generation

# Deadlines of object-store operations (docs/object_storage.md, "Deadlines").
IO_TIMEOUT_ENV = "JAXCKPT_IO_TIMEOUT"
DEFAULT_IO_TIMEOUT = 30.0  # seconds: a stalled or dead server fails a save in well under a minute
_MIN_RATE = 8 << 20  # bytes/s: a transfer of N bytes gets N / _MIN_RATE seconds more
_io_timeout: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "io_timeout", default=None
)
# A request wait() gives up is cancelled, but curl (tensorstore's HTTP client) keeps its
# connection, and its place in its queue, until the server answers or closes it. Only the
# process-wide TENSORSTORE_CURL_LOW_SPEED_* variables (or absl flags) make curl drop a silent
# connection: tensorstore has no context or spec form of them, so jaxckpt leaves them to the
# user (docs/object_storage.md, "Abandoned requests") and renews its queues instead
# (context()); importing jaxckpt changes no setting of the process.


def io_timeout() -> float:
    """The deadline of one object-store operation, in seconds: the innermost :func:`deadline`,
    else ``$JAXCKPT_IO_TIMEOUT``, else :data:`DEFAULT_IO_TIMEOUT`.

    Raises:
      CheckpointError: ``$JAXCKPT_IO_TIMEOUT`` is not a positive number.
    """
    seconds = _io_timeout.get()
    if seconds is not None:
        return seconds
    text = os.environ.get(IO_TIMEOUT_ENV, "").strip()
    if not text:
        return DEFAULT_IO_TIMEOUT
    try:
        return positive_seconds(float(text), IO_TIMEOUT_ENV)
    except ValueError:
        raise CheckpointError(
            f"{IO_TIMEOUT_ENV}={text!r} is not a number of seconds; set it to e.g. 60, or unset "
            f"it for the default ({DEFAULT_IO_TIMEOUT:g} s)."
        ) from None


def positive_seconds(seconds: float, name: str) -> float:
    if not seconds > 0 or seconds == float("inf"):
        raise CheckpointError(
            f"{name} must be a positive, finite number of seconds, got {seconds!r}."
        )
    return float(seconds)


@contextlib.contextmanager
def deadline(seconds: float | None) -> Iterator[None]:
    """Within the block, object-store operations of new :class:`Location`s get ``seconds``
    (``None``: the default, :func:`io_timeout`). The ``CheckpointManager``'s ``io_timeout``."""
    token = _io_timeout.set(seconds)
    try:
        yield
    finally:
        _io_timeout.reset(token)


class Location:
    """Where a checkpoint lives: a local directory or a tensorstore kvstore URL."""

    def __init__(self, path: str | os.PathLike[str], *, one_operation: bool = False) -> None:
        """``one_operation``: the location of one save or restore (see :func:`wait`)."""
        text = os.fspath(path)
        if "://" not in text:  # "~/ck" is the home directory's, as in a shell (not ./~/ck)
            text = os.path.expanduser(text)
        self.url = text
        if text.startswith("file://"):
            text = text[len("file://") :]
            _urls.check_file_url(self.url, text)
        # Object stores get a deadline per operation (see wait); local files and memory:// none.
        self.io_timeout: float | None = None
        self.one_operation = one_operation
        self.stalled: str | None = None  # why, once a wait missed its deadline: see wait
        # The requests watch() was given and not yet seen finished (weak: never kept alive
        # here), and the time.monotonic() one was last seen finished.
        self._watched: deque[weakref.ref[Any]] = deque()
        self._answered = 0.0
        self._throttled = 0  # throttling answers seen by then (jaxckpt._storage.throttle)
        self._watch_lock = threading.Lock()
        if "://" in text:
            self.local: Path | None = None
            self.kvstore: dict[str, Any] = _urls.kvstore_spec(text)
            if self.kvstore["driver"] != "memory":
                self.io_timeout = io_timeout()
                self._throttled = _throttle.answers()
                self.kvstore["context"] = _urls.retries(self.kvstore["driver"], self.io_timeout)
        else:
            self.local = _urls.local_path(self.url, text)
            self.kvstore = {"driver": "file", "path": str(self.local) + "/"}

    def __str__(self) -> str:
        return self.url

    def watch(self, fut: ts.Future[Any] | ts.WriteFutures) -> None:
        """Count ``fut``'s completion as progress of what is done at this location: a
        :func:`wait` here keeps waiting while requests started beside the one it waits for
        finish (the server is working through this operation's queue, not stalled). Whoever
        keeps many requests in flight (a save's writes, a restore's reads) watches each.

        Polled, not a done-callback: no Python runs in tensorstore's threads (a callback per
        request would queue them for the GIL, docs/benchmarks.md). Each call drops the oldest
        requests that finished (they mostly finish in order), so what is watched stays about
        what is in flight."""
        if self.io_timeout is None:
            return
        with self._watch_lock:
            self._watched.append(weakref.ref(fut))
            while self._watched and _finished(self._watched[0]):
                self._watched.popleft()
                self._answered = time.monotonic()

    def answered(self) -> float:
        """The ``time.monotonic()`` a watched request was last seen finished (0: none yet),
        looking at every one watched now."""
        throttled = _throttle.answers() if self.io_timeout is not None else 0
        with self._watch_lock:
            pending = deque(r for r in self._watched if not _finished(r))
            if len(pending) < len(self._watched) or throttled != self._throttled:
                self._answered = time.monotonic()  # a "slow down" is an answer too
            self._throttled = throttled
            self._watched = pending
            return self._answered

    @property
    def name(self) -> str:
        """The last part of the path (a step's name in a run directory)."""
        if self.local is not None:
            return self.local.name
        return self.url.rstrip("/").rpartition("/")[2]

    def child(self, name: str) -> dict[str, Any]:
        """The kvstore spec of ``name`` under this location (for a zarr array: a folder)."""
        return {**self.kvstore, "path": self.kvstore["path"] + name + "/"}

    def parent(self) -> Location:
        """The location that holds this one (e.g. the folder of ``CKPT/manifest.json``)."""
        if self.local is not None:
            return Location(self.local.parent, one_operation=self.one_operation)
        with deadline(self.io_timeout):
            up = self.url.rstrip("/").rpartition("/")[0]
            return Location(up, one_operation=self.one_operation)

    def sibling(self, name: str) -> Location:
        """The location ``name`` beside this one (another step of the same run directory)."""
        if self.local is not None:
            return Location(self.local.parent / name)
        return Location(self.url.rstrip("/").rpartition("/")[0] + "/" + name)

    def join(self, name: str) -> Location:
        """The location ``name`` below this one (e.g. a step of a checkpoint directory)."""
        if self.local is not None:
            return Location(self.local / name)
        with deadline(self.io_timeout):
            return Location(self.url.rstrip("/") + "/" + name)


def _finished(ref: weakref.ref[Any]) -> bool:
    fut = ref()
    return fut is None or bool(fut.done())  # gone: its caller took its result (or gave it up)


T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class Pending(Protocol[T_co]):
    """What :func:`wait` waits for: a tensorstore ``Future`` or ``WriteFutures``."""

    def result(self, timeout: float | None = None) -> T_co: ...
    def done(self) -> bool: ...
    def cancel(self) -> bool: ...


def wait(fut: Pending[T], loc: Location, what: str, nbytes: int = 0) -> T:
    """``fut.result()``, within ``loc``'s deadline on object stores (plus a second per 8 MiB
    that ``fut`` transfers); past it the operation is cancelled. The deadline counts from the
    later of the call and the last completion of a request :meth:`Location.watch` watches at
    ``loc``: a request queued behind others of the same save (tensorstore keeps
    ``JAXCKPT_REQUEST_CONCURRENCY`` in flight, a save up to a GiB of data) waits as long as the
    server keeps answering them, and a server that answers none fails it within 1.25 deadlines
    of its last answer (answers are seen when looked for, every quarter deadline).

    On the location of one save or restore (``Location(..., one_operation=True)``) the first
    miss marks it stalled: every later wait on it (the rest of the save's writes, its abort)
    cancels its operation at once instead of waiting a deadline of its own, so a stalled or
    dead server fails a whole save or restore within about one deadline, however many
    operations it has in flight.

    Raises:
      CheckpointError: the deadline passed; names the URL, the operation and what to check.
    """
    if loc.io_timeout is None:
        return fut.result()
    if loc.stalled is not None and not fut.done():
        fut.cancel()
        raise DeadlineError(f"{what} at {loc} was not waited for: {loc.stalled}")
    limit = loc.io_timeout + nbytes / _MIN_RATE
    end = time.monotonic() + limit
    while (left := end - time.monotonic()) > 0:
        try:  # looks at the watched requests every quarter deadline: each answer is seen late
            return fut.result(timeout=min(left, limit / 4))  # by that much at most
        except TimeoutError:
            end = max(end, loc.answered() + limit)
    fut.cancel()
    _renew_queues()  # the abandoned request may hold its queue's place: see context()
    server = _urls.endpoint(loc.kvstore)
    message = (
        f"{what} at {loc} did not finish within {limit:.3g} s ({IO_TIMEOUT_ENV}="
        f"{loc.io_timeout:g} s): {server} is not answering, or too slowly. Check that it is up "
        f"and reachable (endpoint, network, credentials), or raise {IO_TIMEOUT_ENV} (or "
        f"CheckpointManager(io_timeout=...)) for a slow link."
    )
    if loc.one_operation:
        loc.stalled = message
    raise DeadlineError(message)


class DeadlineError(CheckpointError):
    """An operation on a store missed its deadline (:func:`wait`). ``cause`` says what and
    what to check; the message adds what that means for a save that fails so before its
    commit, which a commit of unknown outcome quotes ``cause`` without."""

    AFTER = (
        "A save that fails so before its commit has not committed; the last committed "
        "checkpoint is intact."
    )

    def __init__(self, cause: str) -> None:
        super().__init__(f"{cause} {self.AFTER}")
        self.cause = cause


def kvstore(
    spec: dict[str, Any], loc: Location | None = None, *, own_queue: bool = False
) -> ts.KvStore:
    """The open kvstore of ``spec`` (within ``loc``'s deadline, if given); with ``own_queue``
    its requests to GCS or S3 skip the queue of this process's others (:data:`BEAT_CONTEXT`;
    ``memory://`` is one store per context, so it stays in the shared one)."""
    own = own_queue and spec["driver"] in ("gcs", "s3")
    fut = ts.KvStore.open(spec, context=context(own_queue=own))
    return wait(fut, loc, "opening the store") if loc is not None else fut.result()


def read_manifest(loc: Location) -> bytes:
    """The bytes of ``manifest.json``, or :class:`CheckpointNotFoundError`."""
    return read_stamped(loc)[0]


# What identifies one committed manifest: (device, inode, size, mtime, ctime) of a local file,
# the object store's generation elsewhere. A save never brings back an older generation, so
# a stamp unchanged after a read means every byte read came from the manifest's generation.
Stamp = tuple[int, ...] | tuple[bytes]  # a local file's, an object's


def read_stamped(loc: Location) -> tuple[bytes, Stamp]:
    """The bytes of ``manifest.json`` and the stamp of the very file they were read from.

    Raises:
      CheckpointNotFoundError: no manifest at ``loc``.
      ManifestError: the manifest is a link or not a regular file.
    """
    return start_read_stamped(loc)()


def start_read_stamped(loc: Location) -> Callable[[], tuple[bytes, Stamp]]:
    """:func:`read_stamped`, its request sent now (object stores); the call that waits for it
    and raises its errors. A save sends it beside its other first requests."""
    if loc.local is not None:
        return lambda: _read_local_stamped(loc)
    fut = kvstore(loc.kvstore, loc).read(MANIFEST)

    def finish() -> tuple[bytes, Stamp]:
        try:
            got = wait(fut, loc, f"reading {MANIFEST}")
        except ValueError as e:  # the store refused: no bucket, no access
            raise CheckpointError(
                f"Cannot read {loc}/{MANIFEST}: {' '.join(str(e).split('[', 1)[0].split())}. "
                f"Check that the bucket exists and that the credentials "
                f"({_urls.credentials_hint(loc.kvstore)}) may read it."
            ) from e
        if got.state == "value":
            return got.value, (got.stamp.generation,)
        raise CheckpointNotFoundError(f"No checkpoint at {loc}: {MANIFEST} is missing.")

    return finish


def _read_local_stamped(loc: Location) -> tuple[bytes, Stamp]:
    assert loc.local is not None
    path = loc.local / MANIFEST
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):  # a link could lead anywhere; a FIFO hangs
            raise ManifestError(
                f"{path} is a link or not a regular file; refusing to read it (it could lead "
                f"outside the checkpoint). Copy the checkpoint without links (cp -rL)."
            )
        with open(path, "rb", opener=_no_follow) as f:
            return f.read(), _file_stamp(os.fstat(f.fileno()))
    except (FileNotFoundError, NotADirectoryError):
        pass
    raise CheckpointNotFoundError(f"No checkpoint at {loc}: {MANIFEST} is missing.")


def manifest_changed(loc: Location, stamp: Stamp) -> bool:
    """Whether ``manifest.json`` at ``loc`` is no longer the one ``stamp`` was taken from."""
    if loc.local is not None:
        try:
            return _file_stamp(os.stat(loc.local / MANIFEST, follow_symlinks=False)) != stamp
        except OSError:
            return True
    generation = stamp[0]
    if not isinstance(generation, bytes):  # a local file's stamp: not this manifest's
        return True
    got = wait(
        kvstore(loc.kvstore, loc).read(MANIFEST, if_not_equal=generation),
        loc,
        f"checking {MANIFEST}",
    )
    # "unspecified": GCS answered 304, still the generation of ``stamp``. A store that ignores
    # the precondition (fake-gcs-server) answers the object: its generation is compared here,
    # so the check never depends on the store honouring it.
    if got.state == "unspecified":
        return False
    return got.state != "value" or got.stamp.generation != generation


def _file_stamp(st: os.stat_result) -> Stamp:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _no_follow(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK)


def exists(loc: Location) -> bool:
    try:
        read_manifest(loc)
        return True
    except CheckpointNotFoundError:
        return False


def read_small(kv: ts.KvStore, loc: Location, name: str, limit: int) -> bytes | None:
    """The bytes of a metadata file ``name`` under ``loc`` (``None`` if absent), at most ``limit``.

    Raises:
      ManifestError: the file is larger than ``limit`` (treated as damage, never allocated).
    """
    size = None
    if loc.local is not None:
        try:
            size = os.stat(loc.local / name).st_size
        except OSError:
            return None
    if size is None or size <= limit:
        got = wait(kv.read(name), loc, f"reading {name}")
        data = got.value if got.state == "value" else None
        if data is None or len(data) <= limit:
            return data
    raise ManifestError(
        f"{loc}/{name} is larger than {limit} bytes, more than any real one: it is damaged or "
        f"not what its name says. Nothing was read."
    )
