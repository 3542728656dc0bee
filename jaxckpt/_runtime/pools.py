"""The library's thread pools: the one place jaxckpt makes threads.

Each pool is made on first use, under one lock, and lives as long as the process: an idle
thread is reused instead of started per call. ``ThreadPoolExecutor`` threads are not daemons:
at interpreter exit Python runs what is queued and joins them, so a program that ends right
after ``save_async`` still commits. After that (an ``atexit`` hook, a signal handler run
during shutdown) Python's executors take no new work; the pools here then run what is
submitted on the calling thread (:class:`Pool`), so a save started that late still commits,
blocking, instead of failing with "cannot schedule new futures after interpreter shutdown".

Imports neither jax nor tensorstore, so storage may use it (tests/test_structure.py).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, ParamSpec, TypeVar

T = TypeVar("T")
Args = ParamSpec("Args")
logger = logging.getLogger("jaxckpt")

SAVE_THREADS = 32
READ_THREADS = max(4, min(64, os.cpu_count() or 4))  # tensorstore's file I/O default
WRITEBACK_THREADS = 2  # each call only queues I/O, it does not wait for it
# Chunk files written straight to disk: each thread copies, checksums and then waits for its
# O_DIRECT write, so several keep the disk busy while the others copy; as many as the write
# limit's threads (docs/benchmarks.md).
WRITE_THREADS = 8
STAGE_THREADS = max(2, min(8, os.cpu_count() or 2))  # numpy copies release the GIL
# Hashing is bound by memory bandwidth: half the cores hash, the rest write, link and resolve;
# at least two, as two threads read memory faster than one and the saving thread mostly waits.
HASH_THREADS = max(2, min(8, (os.cpu_count() or 2) // 2))
# An elastic restore receives each stream on a thread of its own (a receiver waits only on its
# sender, so all must run at once); threads are made as streams need them, up to this many.
STREAM_THREADS = 512
_lock = threading.Lock()


class Pool(ThreadPoolExecutor):
    """A ``ThreadPoolExecutor`` that keeps working while the interpreter exits: once Python
    takes no new work (its executors refuse it after it joined their threads, before the
    ``atexit`` hooks run), :meth:`submit` runs ``fn`` on the calling thread and returns a done
    future with its outcome. A caller that hands a pool a task which waits for the caller
    (a consumer of a queue the caller fills) asks :func:`start` instead.

    Args:
      threads: at most this many threads.
      name: their name.
      alongside: the pool's tasks must run alongside their caller (a stream's receiver while
        the caller sends): at exit each runs on a thread of its own instead, where Python still
        starts threads (not 3.12), and its caller must wait for it before returning.
    """

    def __init__(self, threads: int, name: str, *, alongside: bool = False) -> None:
        super().__init__(threads, name)
        self.name, self.alongside = name, alongside

    def submit(
        self, fn: Callable[Args, T], /, *args: Args.args, **kwargs: Args.kwargs
    ) -> Future[T]:
        try:
            return super().submit(fn, *args, **kwargs)
        except RuntimeError as e:
            if not _exiting(e):
                raise
        future: Future[T] = Future()

        def run() -> None:
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as e:  # noqa: BLE001 - handed to the caller with the future
                future.set_exception(e)

        if not (self.alongside and _start(threading.Thread(target=run, name=self.name))):
            run()
        return future


def _exiting(error: RuntimeError) -> bool:
    """Whether ``error`` is a refusal of work as the interpreter exits: an executor's ("cannot
    schedule new futures after interpreter shutdown", or "... after shutdown" from a pool whose
    threads had run: they mark it shut down as they end; the library never shuts one down) or,
    on Python 3.12, a thread's ("can't create new thread at interpreter shutdown")."""
    message = str(error)
    return message.startswith("cannot schedule new futures") or "interpreter shutdown" in message


_pools: dict[str, Pool] = {}


def _get(name: str, threads: int, *, alongside: bool = False) -> Pool:
    with _lock:
        pool = _pools.get(name)
        if pool is None:
            pool = _pools[name] = Pool(threads, name, alongside=alongside)
    return pool


def save_pool() -> ThreadPoolExecutor:
    """Background saves (``save_async``, the manager's finishing step). Starting a thread per
    save would make ``save_async`` wait until the new thread runs, while the device copies keep
    the cores busy. The local tier's streams, sent and received at once, run here too (so its
    tasks run alongside their callers at exit, see :class:`Pool`)."""
    return _get("jaxckpt-save", SAVE_THREADS, alongside=True)


def read_pool() -> ThreadPoolExecutor:
    """Chunk files read in place (``jaxckpt._storage.chunkfile``)."""
    return _get("jaxckpt-read", READ_THREADS)


def prefetch_pool() -> ThreadPoolExecutor:
    """Read-ahead hints for chunk files about to be read (``jaxckpt._storage.chunkfile``):
    one thread, as each call only queues I/O."""
    return _get("jaxckpt-prefetch", 1)


def writeback_pool() -> ThreadPoolExecutor:
    """Early write-back of written chunk files (``jaxckpt._storage.writeback``)."""
    return _get("jaxckpt-writeback", WRITEBACK_THREADS)


def write_pool() -> ThreadPoolExecutor:
    """Chunk files written straight to local disk (``jaxckpt._storage.directwrite``): the
    number of writes in flight."""
    return _get("jaxckpt-write", WRITE_THREADS)


def stage_pool() -> ThreadPoolExecutor:
    """The threads that copy staged items (and dispatch device copies, see
    ``DefaultSavePlanner.detach``)."""
    return _get("jaxckpt-stage", STAGE_THREADS)


def hash_pool() -> ThreadPoolExecutor:
    """The threads that hash boxes for incremental saves (``jaxckpt._planning.reuse``)."""
    return _get("jaxckpt-hash", HASH_THREADS)


def stream_pool() -> ThreadPoolExecutor:
    """The receivers of an elastic restore's streams (``jaxckpt._tiers.elastic_restore``):
    up to ``STREAM_THREADS`` at once, each waiting on one sender."""
    return _get("jaxckpt-stream", STREAM_THREADS, alongside=True)


def start(pool: ThreadPoolExecutor, fn: Callable[..., T], *args: Any) -> Future[T] | None:
    """Run ``fn(*args)`` on ``pool``'s threads; ``None`` where the interpreter is exiting and
    takes no new threads, without running ``fn`` (for a task that waits on its caller, which
    could not run on the caller's own thread)."""
    try:
        return ThreadPoolExecutor.submit(pool, fn, *args)
    except RuntimeError as e:
        if not _exiting(e):
            raise
        return None


def in_background(fn: Callable[..., T], *args: Any) -> Future[T] | None:
    """Run ``fn(*args)`` on the save threads; ``None`` once it has run here instead, where the
    interpreter is exiting (an ``atexit`` hook) and takes no new threads."""
    future = start(save_pool(), fn, *args)
    if future is None:
        fn(*args)
    return future


class Repeating:
    """``fn()`` every ``seconds`` on a daemon thread of its own until :meth:`stop` (a live
    save's heartbeat, ``jaxckpt._storage.lease``). An error of ``fn`` skips one beat. No
    beats where no thread can start (see :func:`_start`)."""

    def __init__(self, seconds: float, fn: Callable[[], object]) -> None:
        self._stopped = threading.Event()
        beat = threading.Thread(
            target=self._run, args=(seconds, fn), name="jaxckpt-beat", daemon=True
        )
        self._thread = beat if _start(beat) else None

    def _run(self, seconds: float, fn: Callable[[], object]) -> None:
        while not self._stopped.wait(seconds):
            try:
                fn()
            except Exception:  # noqa: BLE001 - the next beat tries again
                pass

    def stop(self, *, wait: bool = False) -> None:
        """No more beats; with ``wait``, return once a beat running now has ended too (what
        is written after must not be overwritten by it)."""
        self._stopped.set()
        if wait and self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()


def after(seconds: float, fn: Callable[[], object]) -> threading.Timer:
    """Call ``fn()`` once, ``seconds`` from now, on a daemon thread of its own, unless the
    returned timer's ``cancel()`` comes first (the staging pool's release of idle arenas)."""
    timer = threading.Timer(seconds, fn)
    timer.daemon = True
    timer.name = "jaxckpt-after"
    _start(timer)
    return timer


def _start(thread: threading.Thread) -> bool:
    """``thread.start()``; ``False`` where the interpreter is exiting and starts no threads
    (Python 3.12, in an ``atexit`` hook): a heartbeat or a delayed release is then skipped, as
    the work it would accompany runs on the calling thread and the process ends after it."""
    try:
        thread.start()
    except RuntimeError as e:
        if not _exiting(e):
            raise
        return False
    return True


def repeat(seconds: float, fn: Callable[[], object]) -> Repeating:
    """Call ``fn()`` every ``seconds`` until the returned object's ``stop()``."""
    return Repeating(seconds, fn)


_after_commit: set[Future[Any]] = set()  # see after_commit


def after_commit(fn: Callable[..., Any], *args: Any) -> None:
    """Run ``fn(*args)`` in the background after a commit: deleting what it replaced, off the
    commit's path (a save returns once committed). :func:`settle` waits for all of them."""
    future = in_background(_logged, fn, *args)
    if future is not None:
        with _lock:
            _after_commit.add(future)
        future.add_done_callback(_done_after_commit)


def _logged(fn: Callable[..., Any], *args: Any) -> None:
    try:
        fn(*args)
    except Exception as e:  # the checkpoint is committed: what is left goes at a later clean-up
        logger.warning("a clean-up after a commit failed (%s); the checkpoint is committed", e)


def _done_after_commit(future: Future[Any]) -> None:
    with _lock:
        _after_commit.discard(future)


def settle() -> None:
    """Wait until the work every commit so far left for the background is done (e.g. before
    inspecting what a store holds)."""
    with _lock:
        pending = list(_after_commit)
    for future in pending:
        future.result()


def abandonable(fn: Callable[..., T], *args: Any, name: str = "jaxckpt-abandonable") -> Future[T]:
    """Run ``fn(*args)`` on a new daemon thread named ``name``, for a call that may never
    return (a pull from a peer that died: ``jax.experimental.transfer`` ignores its timeout
    then). The caller waits on the future with a deadline and gives the thread up after it;
    the interpreter neither joins nor waits for it at exit, as it would a pool's."""
    future: Future[T] = Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to the waiting caller
            future.set_exception(e)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future
