"""Shared reads: the sharding under which a box that several processes need is read once in all.

A target that puts one box on devices of several processes (a replicated array, a data-parallel
axis across hosts) would have each of them read the whole box. Read instead under a sharding
that splits one dimension over all its devices, each process reads a part, and
``DefaultLoadPlanner.finish`` (``jaxckpt._planning.load_planner``) lets JAX's collectives bring
the parts into the target's sharding. The save cuts such a box into a chunk per process
(``jaxckpt._planning.global_plan.chunk_limit``), so each process's part is whole chunks.
"""

from __future__ import annotations

import collections
import functools
import math
from typing import Any

import jax
import numpy as np

from jaxckpt._format.manifest import ArrayEntry
from jaxckpt._format.plan import index_to_box


def read_sharding(entry: ArrayEntry, where: jax.sharding.Sharding) -> Any:
    """The sharding to read ``entry`` under when its target sharding ``where`` puts one box on
    devices of several processes (each byte is then read once), else ``None``."""
    # The unit of a read: a chunk (a packed array's is its whole self, so it is never split),
    # or where parts are read alone (safetensors) a row.
    unit = (1, *entry.shape[1:]) if entry.partial_reads else tuple(entry.chunks)
    return _shared_read_sharding(tuple(entry.shape), unit, where)


def shared_read_dim(shape: tuple[int, ...], chunks: tuple[int, ...], n: int) -> int | None:
    """The dimension a shared read splits over ``n`` devices: the first that the chunk grid
    ``chunks`` (the unit of a read) splits and ``n`` divides, or ``None``.

    Only a dimension of several chunks: a chunk is read whole, so splitting one chunk between
    processes would not save a byte, only add the all-gather.

    Example:
      >>> shared_read_dim((64, 64), (64, 16), 8)  # cut along columns: read along columns
      1
    """
    if math.prod(shape) == 0:
        return None
    dims = [d for d in range(len(shape)) if chunks[d] < shape[d] and shape[d] % n == 0]
    return dims[0] if dims else None


def default_memory(sharding: Any) -> bool:
    """Whether ``sharding`` is in its devices' default memory (host memory kinds keep the
    per-box placement, which names the kind for each device)."""
    kind = sharding.memory_kind
    return kind is None or kind == next(iter(sharding.device_set)).default_memory().kind


@functools.lru_cache(maxsize=1024)  # O(devices) per call: once per distinct layout
def _shared_read_sharding(shape: tuple[int, ...], chunks: tuple[int, ...], where: Any) -> Any:
    """A sharding that splits one dimension over all of ``where``'s devices, if ``where`` puts
    one box on devices of several processes (else ``None``): read under it, each byte is read
    once.

    The dimension is one the saved chunk grid splits (:func:`shared_read_dim`): a chunk is the
    unit of a read, and the save cuts a shared box into a chunk per process along it.
    """
    # Each process's devices side by side: its share is one run along that dimension, which is
    # whole chunks when the save cut the array into a chunk per process
    # (jaxckpt._planning.global_plan.chunk_limit).
    devices = sorted(where.device_set, key=lambda d: (d.process_index, d.id))
    dim = shared_read_dim(shape, chunks, len(devices))
    if dim is None:
        return None
    if not default_memory(where):
        return None  # the reshard runs a computation: keep host memory kinds out of it
    holders = collections.defaultdict(set)
    for d, index in where.devices_indices_map(shape).items():
        holders[index_to_box(index, shape)].add(d.process_index)
    if all(len(p) == 1 for p in holders.values()):
        return None
    mesh = jax.sharding.Mesh(np.array(devices), ("jaxckpt_read",))
    spec = (None,) * dim + ("jaxckpt_read",)
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
