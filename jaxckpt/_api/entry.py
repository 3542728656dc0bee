"""save / save_async: the public write entry points (restore and metadata: ``restoring``).

Each is a short pipeline: planner (tree -> plan) then storage (plan -> tensorstore), so a
reader can follow ``save()`` to the byte written in three hops.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from typing import Any, TypeVar

from jaxckpt._api import reports as _reports
from jaxckpt._api.incremental import Increment
from jaxckpt._api.staged import Staged, budget_arg, stage_all, stream
from jaxckpt._format import codecs as _codecs
from jaxckpt._format import iterators as _iterators
from jaxckpt._format import objects as _objects
from jaxckpt._format.manifest import ArrayEntry, storage_entries
from jaxckpt._format.plan import SavePlan, WriteItem
from jaxckpt._planning.global_plan import GlobalSavePlan
from jaxckpt._planning.save_planner import DefaultSavePlanner, SavePlanner
from jaxckpt._runtime import collector, pools
from jaxckpt._runtime import distributed as _distributed
from jaxckpt._runtime import events as _events
from jaxckpt._runtime import progress as _progress
from jaxckpt._runtime import staging as _staging
from jaxckpt._storage import location as _location
from jaxckpt._storage import resume as _resume
from jaxckpt._storage import writer as _storage
from jaxckpt._storage.messages import typed_os_error

logger = logging.getLogger("jaxckpt")
T = TypeVar("T")
PathLike = str | os.PathLike[str]


def save(
    path: PathLike,
    tree: Any,
    *,
    overwrite: bool = False,
    planner: SavePlanner | None = None,
    base: PathLike | None = None,
    digests: bool = False,
    iterators: Mapping[str, _iterators.Checkpointable] | None = None,
    progress: _progress.ProgressArg = None,
    compression: str | None = None,
) -> None:
    """Save a pytree of ``jax.Array``s (any sharding), numpy arrays and Python scalars.

    Blocks until committed. Replicated shards are written once, spread across devices and
    processes; ``manifest.json`` is written last.

    Args:
      path: a local directory (a leading ``~`` is the home directory, as in a shell), or a
        ``file://``, ``memory://``, ``s3://`` or ``gs://`` URL.
      tree: the state to save. Leaves: ``jax.Array`` (incl. PRNG keys), numpy arrays,
        ``int``/``float``/``bool``/``str``/``None``.
      overwrite: replace an existing checkpoint at ``path``. The old one stays intact until
        the new one is committed.
      planner: a :class:`SavePlanner`; default :class:`DefaultSavePlanner`.
      base: an earlier checkpoint to save incrementally against (e.g. the previous step):
        boxes the base holds are hard-linked from it (local files) or, for arrays that did
        not change at all, referenced (object stores; the base must sit beside ``path``)
        instead of written; whole either way (docs/format.md, "Incremental").
      digests: record content digests even without ``base`` (always with one), so that a later
        save against this one compares without reading it back (costs one hash of the state).
      iterators: data iterators whose position goes into the checkpoint, by name (objects
        with ``get_state()``/``set_state()``: Grain's ``DataLoader`` iterators and
        ``DatasetIterator``s), each process its own; their states are taken during the call.
      progress: ``True``: this process's bytes written, rate, time left on stderr (tqdm's bar
        if installed); a callable: ``fn(done_bytes, total_bytes)`` as it goes; ``None``: quiet.
      compression: ``"zstd"`` or ``"lz4"``: compress every chunk, losslessly (blosc after a
        byte shuffle; format version 4, readable by jaxckpt 0.2 and later and by zarr v3
        readers); ``None`` (default): raw chunks, which local disks read in place.
        docs/object_storage.md, "Compression", says when it pays.

    Raises:
      CheckpointExistsError: ``path`` holds a checkpoint and ``overwrite=False``.
      InvalidArgumentError: ``compression`` is not one of the names above.
      UnsupportedLeafError: a leaf cannot be stored (names its key path).

    Example:
      >>> import jax.numpy as jnp, jaxckpt, tempfile
      >>> d = tempfile.mkdtemp()
      >>> jaxckpt.save(d + "/ckpt", {"w": jnp.ones((2, 3)), "step": 7})
      >>> jaxckpt.restore(d + "/ckpt")["step"]
      7
    """
    with collector.paused():
        handle = _start_save(
            path,
            tree,
            overwrite=overwrite,
            planner=planner,
            stage=False,
            base=base,
            digests=digests,
            iterators=iterators,
            progress=_progress.check_arg(progress, "jaxckpt.save"),
            compression=_codecs.check_arg(compression, "jaxckpt.save"),
        )
    handle.wait()


def save_async(
    path: PathLike,
    tree: Any,
    *,
    overwrite: bool = False,
    planner: SavePlanner | None = None,
    base: PathLike | None = None,
    digests: bool = False,
    iterators: Mapping[str, _iterators.Checkpointable] | None = None,
    max_host_bytes: int | None = None,
    progress: _progress.ProgressArg = None,
    compression: str | None = None,
) -> SaveHandle:
    """Like :func:`save`, but returns once the state is copied off the caller's buffers.

    The caller may then donate or overwrite the arrays and advance the ``iterators``; storage
    writes and the commit run in a background thread (``wait()`` before relying on it).

    Args:
      max_host_bytes: the host memory this save may stage in at once, in bytes (each
        process its own). ``None`` (default): this process's whole share is copied at once
        (device copies on CPU devices, dispatched; else one host buffer), as with a budget
        that holds the whole share. With a smaller budget the chunks stream through a
        buffer of at most this many bytes, reused as each is written: the call returns once
        the last chunk is copied, after the writes of all but about ``max_host_bytes`` of
        the share (docs/manager.md, "Within a host-memory budget"). It must hold this
        process's largest chunk (``DefaultSavePlanner(max_chunk_bytes=...)``).
      overwrite, planner, base, digests, iterators, progress, compression: as for
        :func:`save`.

    Returns:
      A :class:`SaveHandle`; ``wait()`` re-raises any error of the save.

    Raises:
      InvalidArgumentError: ``max_host_bytes`` is not a positive int.
      CheckpointError: ``max_host_bytes`` cannot hold this process's largest chunk (nothing
        is written), or any error of the save met before the call returns.

    Example:
      >>> import jax.numpy as jnp, jaxckpt, tempfile
      >>> h = jaxckpt.save_async(tempfile.mkdtemp() + "/c", {"w": jnp.zeros(4)})
      >>> h.wait(); h.done()
      True
      >>> two = {"a": jnp.zeros(1 << 20), "b": jnp.ones(1 << 20)}  # 2 chunks of 4 MiB
      >>> h = jaxckpt.save_async(tempfile.mkdtemp() + "/c", two, max_host_bytes=4 << 20)
      >>> h.wait(); h.nbytes
      8388608
    """
    budget = budget_arg(max_host_bytes)
    with collector.paused():  # the blocking part only, not the background write
        return _start_save(
            path,
            tree,
            overwrite=overwrite,
            planner=planner,
            stage=True,
            base=base,
            digests=digests,
            iterators=iterators,
            budget=budget,
            progress=_progress.check_arg(progress, "jaxckpt.save_async"),
            compression=_codecs.check_arg(compression, "jaxckpt.save_async"),
        )


class SaveHandle:
    """A save in progress, as returned by :func:`save_async`.

    ``wait()`` blocks and re-raises the save's error; ``done()`` polls. Once done,
    ``timings`` holds the seconds of each phase of this process (``plan``, ``stage``,
    ``write``, ``commit``, and ``wait``: waiting for the other processes, in none of the
    others), of the call (``blocking``) and of the whole save (``total``); ``nbytes`` the bytes
    this process wrote and ``gbps`` its write throughput; the same are logged at INFO on the
    ``jaxckpt`` logger and recorded as ``jax.monitoring`` events (docs/observability.md). On
    the coordinator (process 0) of a multi-process save, ``processes`` holds every process's
    phases and bytes, and ``slowest`` the slowest process of each phase
    (``{phase: [process, seconds]}``).

    Example:
      >>> import jax.numpy as jnp, jaxckpt, tempfile
      >>> h = jaxckpt.save_async(tempfile.mkdtemp() + "/c", {"w": jnp.zeros(1024)})
      >>> h.wait()
      >>> h.done(), h.nbytes, sorted(h.timings)
      (True, 4096, ['blocking', 'commit', 'plan', 'stage', 'total', 'wait', 'write'])
    """

    def __init__(self, path: str, attrs: tuple[str, str] = ("local", "save")) -> None:
        self.path = path
        self.timings: dict[str, float] = {}
        self.nbytes = 0
        self.reused_bytes = 0  # bytes an incremental save took from its base instead
        self.resumed_bytes = 0  # bytes a failed save of the same plan had written, kept
        self.processes: dict[int, dict[str, float]] = {}  # the coordinator's: every process's
        self.slowest: dict[str, list[Any]] = {}
        self._attrs = attrs  # the events' store and call attributes
        self._error: BaseException | None = None
        self._future: Future[None] | None = None  # the background run, staging buffers released
        self._runner: int | None = None  # the thread id that runs it
        self._finished = threading.Event()

    def done(self) -> bool:
        """Whether the save has finished (committed or failed); never blocks.

        Returns:
          ``True`` once ``wait()`` would return or raise at once.
        """
        return self._finished.is_set() and (self._future is None or self._future.done())

    def wait(self, timeout: float | None = None) -> None:
        """Block until the save is committed; re-raise its error if it failed.

        Args:
          timeout: seconds to wait at most; ``None`` waits as long as it takes.

        Raises:
          TimeoutError: still running after ``timeout`` seconds (the save goes on).
          CheckpointError: or any other error the save met, as raised in the background.
        """
        if not self._finished.wait(timeout):
            raise TimeoutError(f"save to {self.path} still running after {timeout} s")
        if self._future is not None and self._runner != threading.get_ident():
            self._future.result()  # its staging buffers are back in the pool once it has ended
        if self._error is not None:
            raise self._error

    @property
    def gbps(self) -> float:
        """Bytes written per second of the write and commit phases, in GB/s (0 until done)."""
        t = sum(self.timings.get(k, 0.0) for k in ("write", "commit"))
        return self.nbytes / t / 1e9 if t else 0.0


def _start_save(
    path: PathLike,
    tree: Any,
    *,
    overwrite: bool,
    planner: SavePlanner | None,
    stage: bool,
    base: PathLike | None = None,
    digests: bool = False,
    iterators: Mapping[str, _iterators.Checkpointable] | None = None,
    budget: int | None = None,
    progress: _progress.ProgressArg = None,
    compression: str | None = None,
) -> SaveHandle:
    """Plan on every process, stage (if ``stage``: all at once, or streaming within
    ``budget`` host bytes), then write and commit: in the background when staged, else here."""
    # Made first, so that a failure on any process from here on reaches all of them.
    call = "jaxckpt.save_async" if stage else "jaxckpt.save"
    sync = _distributed.SaveSync(os.fspath(path), call=call)
    clock = _events.Clock({}, lambda: sync.waited(here=True))
    loc = sync.run("open", lambda: _location.Location(path, one_operation=True))
    sync.path = str(loc)
    records = sync.run("iterators", lambda: _iterators.capture(iterators))  # the positions now
    planner = planner if planner is not None else DefaultSavePlanner()
    planner.max_host_bytes = budget  # before step 1 (SavePlanner)
    handle = SaveHandle(str(loc), (_events.store_kind(loc), "save_async" if stage else "save"))
    clock.into = handle.timings
    global_plan, local = _plan_everywhere(sync, planner, tree, compression)
    plain = base is None and not digests and compression is None and loc.local is None
    global_plan = _with_objects(global_plan, sync.count, planner, plain)
    entries = storage_entries(global_plan.manifest)  # arrays, and packs as 1-D arrays
    base_loc = None if base is None else _location.Location(base)
    # The base's manifest is read beside the writer's first requests, before any data.
    base_read = None if base_loc is None else _location.start_read_stamped(base_loc)
    incremental = base is not None or digests
    writer = _open_writer(loc, sync, overwrite, global_plan, entries, compression, incremental)
    increment = None
    if incremental:
        made = functools.partial(Increment, base_loc, loc, global_plan.manifest, entries)
        increment = _with_writer(writer, lambda: sync.run("base", lambda: made(base_read)))
    clock.mark("plan")
    order = local.items if increment is None else increment.order(local.items)
    bar = _progress.Progress("save", local.nbytes, progress)
    args = (handle, loc, sync, writer, entries, global_plan, local, bar, clock.start)
    if not stage:
        data = Staged(((item, planner.resolve_data(item)) for item in order), None)
        clock.mark("stage")
        _write_and_commit(*args, data, increment, records)
        _blocked(handle, clock.start)
        return handle
    # Copy every item off the caller's buffers, which it may reuse once we return.
    if budget is None:
        staged = stage_all(planner, order, loc, sync, writer)
        clock.mark("stage")  # before the writes start, which send it to the coordinator
    else:
        all_first = increment is not None and increment.hashes_all_first
        staged = stream(planner, order, loc, sync, writer, budget=budget, hash_all_first=all_first)
    _in_background(handle, staged, lambda: _write_and_commit(*args, staged, increment, records))
    staged.wait()  # streaming: until the last item is staged, as the writes free the ring
    clock.mark("stage")
    if not staged.complete:  # the save failed before its last item was staged
        handle.wait()  # its error
    _blocked(handle, clock.start)
    return handle


def _with_writer(writer: _storage.Writer, fn: Callable[[], T]) -> T:
    """``fn()``; where it fails, ``writer`` is aborted first (its lease and data go)."""
    try:
        return fn()
    except BaseException as e:
        writer.abort(e)
        raise


def _open_writer(
    loc: _location.Location,
    sync: _distributed.SaveSync,
    overwrite: bool,
    plan: GlobalSavePlan,
    entries: dict[str, ArrayEntry],
    compression: str | None = None,
    incremental: bool = False,
) -> _storage.Writer:
    """The save's ``Writer`` (its staging directory or generation, leased), writing format v5's
    data objects where the plan has them. A failed save of this same plan is resumed
    (``_storage.resume``), unless this one is incremental (its boxes are linked or referenced,
    never compared with leftovers)."""
    resume = None
    if not incremental:
        objects = plan.manifest.objects
        layout = "chunks" if objects is None else f"objects:{objects.processes}:{objects.target}"
        resume = _resume.plan_id(f"{plan.digest}:{compression}:{layout}", entries.values())
    writer = sync.run(
        "open",
        lambda: _storage.Writer(
            loc,
            overwrite=overwrite,
            is_coordinator=sync.is_coordinator,
            broadcast=sync.broadcast,
            plan=resume,
        ),
    )
    writer.use_objects(plan.manifest.objects, entries, sync.process)
    return writer


def _with_objects(plan: GlobalSavePlan, count: int, planner: Any, plain: bool) -> GlobalSavePlan:
    """``plan`` with format v5's data objects (who writes each chunk, from its array plans)
    where the save is ``plain`` (an object store, not compressed, not incremental) and the
    planner does not ask for ``layout="chunks"`` (``DefaultSavePlanner``'s default, ``"auto"``,
    writes them there); else ``plan``. A planner without ``layout`` (a ``SavePlanner`` of
    one's own) keeps a file per chunk."""
    if not plain or getattr(planner, "layout", "chunks") not in ("auto", "objects"):
        return plan
    rows = ((a.entry, a.offsets, a.process) for a in plan.arrays)
    objects = _objects.from_plans(rows, count, planner.object_bytes)
    version = max(plan.manifest.version, _objects.VERSION)
    manifest = dataclasses.replace(plan.manifest, objects=objects, version=version)
    return dataclasses.replace(plan, manifest=manifest)


def _blocked(handle: SaveHandle, start: float) -> None:
    """The end of the call's blocking part (a failed one reports nothing)."""
    if handle._error is None:
        blocking = handle.timings.get("total", time.perf_counter() - start)
        _reports.blocked(handle.timings, blocking, handle._attrs)


def _in_background(handle: SaveHandle, staged: Staged, run: Callable[[], None]) -> None:
    """Run the write and commit of a staged save on a save thread; its staging arena goes
    back to the pool when it ends."""

    def run_then_release() -> None:
        handle._runner = threading.get_ident()
        try:
            run()
        finally:
            staged.settle()
            if staged.arena is not None:
                _staging.POOL.give_back(staged.arena)

    handle._future = pools.in_background(run_then_release)


def _plan_everywhere(
    sync: _distributed.SaveSync, planner: SavePlanner, tree: Any, compression: str | None
) -> tuple[GlobalSavePlan, SavePlan]:
    """The global plan every process agrees on (by digest, with its compression), and this
    process's part of it."""

    def plan() -> tuple[Any, Any]:
        planner.set_up_planner(tree, process_index=sync.process, process_count=sync.count)
        global_plan = planner.create_global_plan()
        planner.check_global_plan(global_plan)
        return global_plan, planner.finish_plan(global_plan)

    global_plan, local = sync.run("plan", plan)
    sync.agree(f"{global_plan.digest}:{compression or 'uncompressed'}")
    if compression is not None:  # the same items; their arrays' entries say how they are stored
        manifest = global_plan.manifest.compressed(compression)
        global_plan = dataclasses.replace(global_plan, manifest=manifest)
    return global_plan, local


def _write_and_commit(
    handle: SaveHandle,
    loc: _location.Location,
    sync: _distributed.SaveSync,
    writer: _storage.Writer,
    entries: dict[str, ArrayEntry],
    global_plan: GlobalSavePlan,
    local: SavePlan,
    bar: _progress.Progress,
    start: float,
    staged: Staged,
    increment: Increment | None = None,
    records: dict[str, Any] | None = None,
) -> None:
    """Create the arrays, write this process's items, commit; errors go to ``handle``."""
    try:
        clock = _events.Clock(handle.timings, lambda: sync.waited(here=True))
        items, staged.items = _counted(staged.items, bar), iter(())  # none held once written
        skip: set[str] = set()
        if increment is not None:  # hash each box; the base's boxes are linked or referenced
            items, skip = increment.to_write(items, sync, writer, ahead_bytes=staged.ahead_bytes)
        if sync.is_coordinator:
            writer.open_arrays((e for k, e in entries.items() if k not in skip), create=True)
            if increment is None and not records:  # committed as planned: no iterators added
                writer.encode_ahead(global_plan.manifest)
            if sync.count > 1:  # the others open them after the barrier
                writer.opened()
        sync.barrier("created", wait_for_all=False)
        if not sync.is_coordinator:
            own = {i.key for i in local.items} - skip
            writer.open_arrays((entries[k] for k in own), create=False)
        handle.nbytes = writer.write(entries, items, release_each=staged.release_each)
        writer.flush()
        clock.mark("write")
        timed = _reports.own(handle.timings, sync.waited(), handle.nbytes)
        mine = _events.payload(timed, _written(records, increment))
        payloads = sync.gather("written", mine)  # every process's timings ride it too
        clock.mark("write")
        if sync.is_coordinator and payloads is not None:  # (gathered: the coordinator)
            _commit(handle, loc, writer, global_plan, increment, payloads, sync.count)
        sync.barrier("committed", wait_for_all=False)
        clock.mark("commit")
        handle.reused_bytes = increment.reused_bytes if increment is not None else 0
        handle.resumed_bytes = writer.resumed.kept if writer.resumed is not None else 0
        bar.finish()
        handle.timings.update(wait=sync.waited(), total=time.perf_counter() - start)
        t, nbytes, reused = handle.timings, handle.nbytes, handle.reused_bytes
        _reports.saved(str(loc), t, nbytes, reused, handle.gbps, handle._attrs)
    except BaseException as e:  # re-raised by wait()
        # failed() first: it returns once the others stopped
        handle._error = sync.failed(typed_os_error(e, loc))
        writer.abort(handle._error)
    finally:
        bar.close()
        handle._finished.set()


def _written(records: dict[str, Any] | None, increment: Increment | None) -> str:
    """What this process sends the coordinator at the "written" barrier, after its timings:
    its iterators' records and its increment's digests."""
    return _iterators.payload(records or {}, increment.payload() if increment else "")


def _commit(
    handle: SaveHandle,
    loc: _location.Location,
    writer: _storage.Writer,
    global_plan: GlobalSavePlan,
    increment: Increment | None,
    gathered: dict[int, str],
    count: int,
) -> None:
    """(coordinator) Every process's timings noted (stragglers named), then the commit of
    the manifest with what the processes sent."""
    got = _reports.gathered(str(loc), gathered, handle._attrs[0])
    handle.processes, handle.slowest, payloads = got
    saved, payloads = _iterators.collect(payloads, count, str(loc))
    manifest = global_plan.manifest  # the object encoded ahead, unless it changes
    if saved:
        manifest = dataclasses.replace(manifest, iterators=saved)
    if increment is not None:
        manifest = increment.manifest(manifest, payloads)
    writer.commit(manifest)


def _counted(
    items: Iterator[tuple[WriteItem, Any]], bar: _progress.Progress
) -> Iterator[tuple[WriteItem, Any]]:
    """``items``, each counted by ``bar`` as the writer takes it (as they are without a bar to
    show); holds none of them (``map`` keeps no reference to what it returned, as
    ``Writer.write``'s ``release_each`` needs)."""
    if not bar.active:
        return items

    def count(pair: tuple[WriteItem, Any]) -> tuple[WriteItem, Any]:
        bar.add(pair[0].nbytes)
        return pair

    return map(count, items)
