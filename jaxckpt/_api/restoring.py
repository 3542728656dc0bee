"""restore / metadata: the public read entry points.

``restore()`` is a short pipeline: the source at the path (a jaxckpt manifest, Orbax, or
safetensors) and its reader, the load planner (target -> read items), then the reader's reads,
each box handed to the planner as it arrives.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

from jaxckpt._api import reports as _reports
from jaxckpt._format import iterators as _iterators
from jaxckpt._format.dtypes import dtype_from_name
from jaxckpt._format.manifest import ArrayEntry, Manifest
from jaxckpt._format.plan import ReadItem
from jaxckpt._planning.abstract import CheckpointMetadata
from jaxckpt._planning.load_planner import DefaultLoadPlanner, LoadPlanner
from jaxckpt._planning.mismatch import check_prng_keys
from jaxckpt._runtime import collector
from jaxckpt._runtime import distributed as _distributed
from jaxckpt._runtime import events as _events
from jaxckpt._runtime import progress as _progress
from jaxckpt._runtime.shared_restore import RestoreMeeting
from jaxckpt._sources import detect as _sources
from jaxckpt._storage import location as _location

PathLike = str | os.PathLike[str]


def restore(
    path: PathLike,
    target: Any = None,
    *,
    keys: str | Sequence[str] | None = None,
    strict: bool = True,
    planner: LoadPlanner | None = None,
    iterators: Mapping[str, _iterators.Checkpointable] | None = None,
    progress: _progress.ProgressArg = None,
) -> Any:
    """Restore a checkpoint onto ``target``'s shardings, or onto the host.

    Args:
      path: the checkpoint (local path or URL); also an Orbax checkpoint, or safetensors
        weights (a file, a folder, or its ``model.safetensors.index.json``), found by what is
        at the path (see docs/migration.md).
      target: a pytree whose leaves say where each array goes: a ``jax.Array`` (its sharding,
        shape and dtype), a ``jax.ShapeDtypeStruct`` (with a sharding, or without: the default
        device, as from ``jax.eval_shape``), a bare ``jax.sharding.Sharding`` (shape and dtype
        from the checkpoint) or ``None`` (a numpy array, or the saved Python value). A saved
        Python number restores into a scalar array target of its kind. ``None`` restores the
        whole saved tree on the host.
      keys: restore only these key paths or ``/``-prefixes (e.g. ``["params"]``).
      strict: missing or unexpected keys are an error naming them; with ``strict=False`` the
        keys both have are restored and other target leaves come back unchanged (an abstract
        ``ShapeDtypeStruct`` or ``Sharding`` leaf stays abstract), with a warning on the
        ``jaxckpt`` logger naming the target's keys the checkpoint lacks.
      planner: a :class:`LoadPlanner`; default :class:`DefaultLoadPlanner`.
      iterators: data iterators saved with the checkpoint (``save(..., iterators=)``), by
        name: each is set to the state this process saved, before any array is read.
      progress: as for :func:`save`: this process's bytes read.

    Returns:
      The restored tree, with ``target``'s structure (or the saved one when ``target=None``).

    Raises:
      CheckpointNotFoundError, ManifestError, KeyMismatchError, ShapeMismatchError,
      DtypeMismatchError, CorruptChunkError: each names the path, key or chunk.

    Example:
      >>> import jax, jax.numpy as jnp, jaxckpt, tempfile
      >>> d = tempfile.mkdtemp() + "/c"
      >>> jaxckpt.save(d, {"w": jnp.arange(8.0)})
      >>> s = jax.sharding.SingleDeviceSharding(jax.devices()[0])
      >>> jaxckpt.restore(d, {"w": s})["w"].sharding == s
      True
    """
    start = time.perf_counter()
    # Where the arrays span processes, every process reads its share or none returns: they
    # agree after reading, before any collective (jaxckpt._runtime.shared_restore); a watcher
    # thread of the meeting, ended with it, stops the reading once another process failed.
    planner = planner if planner is not None else DefaultLoadPlanner()
    meeting = RestoreMeeting(str(path), target, _asked(keys, strict, planner))
    with collector.paused(), meeting:
        with meeting.sharing():
            manifest, reader, loc = _open(path)
            # jax's process numbers only where there are iterators to set
            at = (_distributed.process_index(), _distributed.process_count())
            at = at if iterators else (0, 1)
            set_iterators = _iterators.restore_states(iterators, manifest.iterators, str(path), *at)
            planner.set_up_planner(target, manifest, keys=keys, strict=strict)
            progress = _progress.check_arg(progress, "jaxckpt.restore")
            items = planner.create_local_plan().items
        timings = {"open": time.perf_counter() - start}
        tree, nbytes = _read_into(planner, manifest, reader, items, progress, timings, meeting)
        set_iterators()  # only now: a restore refused on the way moves no iterator
        timings["total"] = time.perf_counter() - start
        _reports.restored(loc, timings, nbytes)
        return tree


def _read_into(
    planner: LoadPlanner,
    manifest: Manifest,
    reader: Any,
    items: Sequence[ReadItem],
    progress: _progress.ProgressArg,
    timings: dict[str, float],
    meeting: RestoreMeeting,
) -> tuple[Any, int]:
    """Read ``items`` and hand each box to ``planner``; once ``meeting`` agrees that every
    process read its share, the tree it builds of them and the bytes read. Adds to
    ``timings`` the seconds of ``read`` (waiting for the reader) and of ``place`` (the
    planner's: transforming, placing onto devices, building the tree)."""
    arrays = [e for e in manifest.entries.values() if isinstance(e, ArrayEntry)]
    size = {e.key: dtype_from_name(e.dtype).itemsize for e in arrays}
    total = sum(math.prod(i.sizes) * size[i.key] for i in items)
    ahead = planner.read_ahead_bytes
    if manifest.objects is not None and isinstance(planner, DefaultLoadPlanner):
        # v5 reads in flight hold only their bytes (no box yet, no decode buffers): three
        # quarters of the budget, the last quarter the boxes queued for their devices
        ahead = max(ahead, planner.max_host_bytes * 3 // 4)
    start, place, nbytes = time.perf_counter(), 0.0, 0
    with _progress.Progress("restore", total, progress) as bar:
        with meeting.sharing():
            for item, data in reader.read(manifest.entries, items, max_inflight_bytes=ahead):
                meeting.watch()  # another process failed: stop reading, fail together
                t = time.perf_counter()
                bar.add(data.nbytes)
                nbytes += data.nbytes
                planner.commit_tensor(item, planner.transform_tensor(item, data))
                del data  # the planner owns the box now: dropping it frees it once placed
                place += time.perf_counter() - t
        meeting.agree()  # before finish(): it may run jax collectives (shared reads)
        t = time.perf_counter()
        tree = planner.finish()
        bar.finish()
    end = time.perf_counter()
    timings.update(read=t - start - place, place=place + end - t)
    return tree, nbytes


def metadata(path: PathLike) -> CheckpointMetadata:
    """The checkpoint's manifest: per key shape, dtype, chunk grid; no array data is read.

    ``.abstract()`` of it is the saved tree of ``jax.ShapeDtypeStruct`` (as ``restore``
    returns each array) and saved values: give the structs shardings for a restore target.

    For an Orbax checkpoint or safetensors weights, the manifest jaxckpt builds from their
    metadata (Orbax's Python scalars are read, as they are stored as tiny arrays).

    Example:
      >>> import jax.numpy as jnp, jaxckpt, tempfile
      >>> d = tempfile.mkdtemp() + "/c"
      >>> jaxckpt.save(d, {"w": jnp.zeros((4, 2))})
      >>> jaxckpt.metadata(d).entries["w"].shape
      (4, 2)
    """
    start = time.perf_counter()
    manifest, _, loc = _open(path)
    info = CheckpointMetadata.of(manifest)
    if _events.listening():
        store = _events.store_kind(loc)
        secs = time.perf_counter() - start
        _events.record_duration(_events.METADATA_DURATION, secs, store=store)
    return info


def _asked(keys: str | Sequence[str] | None, strict: bool, planner: LoadPlanner) -> str:
    """What a restore asks besides its target, as every process making it names it."""
    try:
        chosen = (
            None if keys is None else sorted(map(str, [keys] if isinstance(keys, str) else keys))
        )
    except TypeError:  # not a sequence: set_up_planner says so, on every process alike
        chosen = [repr(keys)]
    share = getattr(planner, "share_reads", None)
    return f"keys={chosen} strict={strict} {type(planner).__qualname__}(share_reads={share})"


def _open(path: PathLike) -> tuple[Manifest, Any, _location.Location]:
    """The manifest (checked where it takes jax to check it) and the reader at ``path``."""
    loc = _location.Location(path, one_operation=True)
    manifest, reader = _sources.open_source(loc)  # jaxckpt, Orbax, safetensors
    check_prng_keys(manifest, f"{loc}/manifest.json")
    return manifest, reader, loc
