"""One small adapter per library: ``save``, ``restore``, ``save_async`` on the same state.

Each adapter uses the library the way its documentation shows, with default options.
``save_async`` returns a callable that waits for the save to finish, so the caller can time
the blocking part (until ``save_async`` returns) apart from the whole save.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import jax
import numpy as np


class Jaxckpt:
    name = "jaxckpt"

    def __init__(self) -> None:
        import jaxckpt

        self.mod = jaxckpt

    def save(self, path: str, state: Any) -> None:
        self.mod.save(path, state)

    def restore(self, path: str, target: Any) -> Any:
        return self.mod.restore(path, target)

    def save_async(self, path: str, state: Any) -> Callable[[], None]:
        return self.mod.save_async(path, state).wait


class Orbax:
    """``orbax.checkpoint.StandardCheckpointer`` (async: ``save`` returns before the write)."""

    name = "orbax"

    def __init__(self) -> None:
        import orbax.checkpoint as ocp

        self.ocp = ocp
        self._ckptr = None  # made on first use, so "cold" includes it

    def _c(self):
        if self._ckptr is None:
            self._ckptr = self.ocp.StandardCheckpointer()
        return self._ckptr

    def save(self, path: str, state: Any) -> None:
        self._c().save(path, state)
        self._ckptr.wait_until_finished()

    def restore(self, path: str, target: Any) -> Any:
        return self._c().restore(path, target)

    def save_async(self, path: str, state: Any) -> Callable[[], None]:
        self._c().save(path, state)
        return self._ckptr.wait_until_finished


class JaxSerialization:
    """``jax.experimental.array_serialization``: ``pytree_serialization`` where present."""

    name = "jax.array_serialization"

    def __init__(self) -> None:
        try:
            from jax.experimental.array_serialization import pytree_serialization as ps
        except ImportError:  # older JAX: the per-array GlobalAsyncCheckpointManager
            ps = None
        self.ps = ps
        self.module = "pytree_serialization" if ps is not None else "serialization"

    def save(self, path: str, state: Any) -> None:
        self.save_async(path, state)()

    def restore(self, path: str, target: Any) -> Any:
        if self.ps is not None:
            return self.ps.load(path, target)
        from jax.experimental.array_serialization import serialization

        leaves, treedef = jax.tree_util.tree_flatten(target)
        paths = [os.path.join(path, str(i)) for i in range(len(leaves))]
        arrays = serialization.GlobalAsyncCheckpointManager().deserialize_with_paths(
            [x.sharding for x in leaves],
            paths,
            [x.shape for x in leaves],
            [x.dtype for x in leaves],
        )
        return jax.tree_util.tree_unflatten(treedef, arrays)

    def save_async(self, path: str, state: Any) -> Callable[[], None]:
        if self.ps is not None:
            return self.ps.nonblocking_save(state, path, overwrite=True).result
        from jax.experimental.array_serialization import serialization

        leaves = jax.tree_util.tree_leaves(state)
        mgr = serialization.GlobalAsyncCheckpointManager()
        mgr.serialize_with_paths(leaves, [os.path.join(path, str(i)) for i in range(len(leaves))])
        return mgr.wait_until_finished


def _box(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    starts = tuple(s.indices(n)[0] for s, n in zip(index, shape))
    stops = tuple(s.indices(n)[1] for s, n in zip(index, shape))
    return starts, stops


class RawNumpy:
    """The practical limit: each unique shard's bytes to its own file (``tofile``/``fromfile``),
    a tiny JSON index of the boxes, no fsync, no checksums, no atomic commit."""

    name = "raw numpy"
    durable = False

    def __init__(self) -> None:
        self.bytes_read = 0

    def save(self, path: str, state: Any) -> None:
        os.makedirs(path)
        index = []
        for i, leaf in enumerate(jax.tree_util.tree_leaves(state)):
            boxes: dict = {}
            for shard in leaf.addressable_shards:
                box = _box(shard.index, leaf.shape)
                if box not in boxes:
                    boxes[box] = f"{i}.{len(boxes)}"
                    with open(os.path.join(path, boxes[box]), "wb") as f:
                        np.asarray(shard.data).tofile(f)
                        self._sync(f)
            index.append([[list(b[0]), list(b[1]), f] for b, f in boxes.items()])
        with open(os.path.join(path, "index.json"), "w") as f:
            json.dump(index, f)
            self._sync(f)
        if self.durable:  # the new names: the folder's entries, then the folder's own entry
            for d in (path, os.path.dirname(os.path.abspath(path))):
                fd = os.open(d, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)

    def _sync(self, f) -> None:
        if self.durable:
            f.flush()
            os.fsync(f.fileno())

    def restore(self, path: str, target: Any) -> Any:
        with open(os.path.join(path, "index.json")) as f:
            index = json.load(f)
        leaves, treedef = jax.tree_util.tree_flatten(target)
        out = []
        for saved, leaf in zip(index, leaves):
            want: dict = {}
            for dev, idx in leaf.sharding.addressable_devices_indices_map(leaf.shape).items():
                want.setdefault(_box(idx, leaf.shape), []).append(dev)
            saved_boxes = {(tuple(a), tuple(b)): name for a, b, name in saved}
            if saved_boxes.keys() == want.keys():  # same layout: each file to its devices
                parts = {b: self._read(path, n, b, leaf.dtype) for b, n in saved_boxes.items()}
            else:  # another layout: assemble on the host, then slice per target shard
                full = np.empty(leaf.shape, leaf.dtype)
                for b, n in saved_boxes.items():
                    full[tuple(map(slice, *b))] = self._read(path, n, b, leaf.dtype)
                parts = {b: full[tuple(map(slice, *b))] for b in want}
            arrays, devs = [], []
            for b, ds in want.items():
                arrays += [parts[b]] * len(ds)
                devs += ds
            shards = jax.device_put(arrays, devs)
            out.append(jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding, shards))
        return jax.tree_util.tree_unflatten(treedef, out)

    def _read(self, path: str, name: str, box, dtype) -> np.ndarray:
        data = np.fromfile(os.path.join(path, name), dtype=dtype)
        self.bytes_read += data.nbytes
        return data.reshape([b - a for a, b in zip(*box)])

    def save_async(self, path: str, state: Any) -> Callable[[], None]:
        raise NotImplementedError("raw numpy has no async save; the baseline is jax.device_get")


class RawNumpyDurable(RawNumpy):
    """The physical limit of a *durable* write: raw numpy, plus an ``fsync`` of each file as
    soon as it is written (one thread, in order) and of the folder (and its parent) at the end.
    Still no checksums and no atomic commit."""

    name = "raw numpy+fsync"
    durable = True


LIBS: dict[str, type] = {
    "jaxckpt": Jaxckpt,
    "orbax": Orbax,
    "jax.array_serialization": JaxSerialization,
    "raw numpy": RawNumpy,
    "raw numpy+fsync": RawNumpyDurable,
}
