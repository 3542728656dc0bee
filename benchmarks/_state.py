"""The benchmark workloads: the states saved and the targets restored onto.

All arrays are float32 with random contents (so no library gains from compression), built
shard by shard from a per-leaf seed, so a restore can be checked against a fresh copy.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

D, FF, LAYERS, VOCAB = 1024, 4096, 8, 4096
SMALL_GROUPS, SMALL_PER_GROUP, SMALL_ELEMS = 20, 100, 256  # 2,000 leaves of 1 KiB


def mesh(shape: tuple[int, int]) -> Mesh:
    """A mesh over the first 8 devices with axes ``("fsdp", "tp")`` of the given shape."""
    return Mesh(np.array(jax.devices()[:8]).reshape(shape), ("fsdp", "tp"))


def _big_layout() -> dict[str, dict]:
    """Key -> (shape, spec): 8 transformer layers with FSDP x TP specs plus an embedding."""
    fsdp_tp, tp_fsdp = P("fsdp", "tp"), P("tp", "fsdp")
    tree: dict[str, dict] = {"embed": {"table": ((VOCAB, D), tp_fsdp)}}
    for i in range(LAYERS):
        tree[f"layer_{i}"] = {
            "attn": {
                "q": ((D, D), fsdp_tp),
                "k": ((D, D), fsdp_tp),
                "v": ((D, D), fsdp_tp),
                "o": ((D, D), tp_fsdp),
            },
            "mlp": {"w1": ((D, FF), fsdp_tp), "w2": ((FF, D), tp_fsdp)},
            "norm": {"scale": ((D,), P())},
        }
    return tree


def _small_layout() -> dict[str, dict]:
    return {
        f"g{g:02d}": {f"p{i:03d}": ((SMALL_ELEMS,), P()) for i in range(SMALL_PER_GROUP)}
        for g in range(SMALL_GROUPS)
    }


def _size_layout(mib: int) -> dict[str, tuple]:
    """``mib`` MiB in 64 leaves of shape (4·mib, 1024), FSDP x TP: 512 unique shards."""
    return {f"w{i:02d}": ((4 * mib, 1024), P("fsdp", "tp")) for i in range(64)}


SCALING_ELEMS = 10_240_000  # 39 MiB of float32 however many leaves hold it


def _leaves_layout(n: int) -> dict[str, tuple]:
    """``n`` 1-D leaves totalling 39 MiB, each split over all 8 devices (8 unique shards)."""
    return {f"p{i:05d}": ((SCALING_ELEMS // n,), P(("fsdp", "tp"))) for i in range(n)}


# `scaling`: state size with the leaf count fixed (64), and leaf count with the size fixed.
SCALING = {f"size-{m}": functools.partial(_size_layout, m) for m in (100, 400, 1600)} | {
    f"leaves-{n}": functools.partial(_leaves_layout, n) for n in (100, 1000, 10000)
}
LAYOUTS = {"big": _big_layout, "small": _small_layout, **SCALING}
# Restore meshes. `reshard` goes from FSDP=4 x TP=2 to FSDP=2 x TP=4: every target shard has
# the transposed shape of a saved one (e.g. 512x256 vs 256x512) and straddles two saved chunks.
SAVE_MESH, RESHARD_MESH = (4, 2), (2, 4)


def _is_spec(x) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], P)


def _leaf_value(seed: int, shape: tuple[int, ...]) -> np.ndarray:
    return np.random.default_rng(seed).random(shape, dtype=np.float32)


def build(workload: str, mesh_shape: tuple[int, int] = SAVE_MESH) -> dict:
    """The state of ``workload`` as sharded ``jax.Array``s on ``mesh(mesh_shape)``."""
    m = mesh(mesh_shape)
    leaves, treedef = jax.tree_util.tree_flatten(LAYOUTS[workload](), is_leaf=_is_spec)
    out = []
    for seed, (shape, spec) in enumerate(leaves):
        full = _leaf_value(seed, shape)
        out.append(jax.make_array_from_callback(shape, NamedSharding(m, spec), full.__getitem__))
        del full
    return jax.block_until_ready(jax.tree_util.tree_unflatten(treedef, out))


def abstract(workload: str, mesh_shape: tuple[int, int] = SAVE_MESH) -> dict:
    """``ShapeDtypeStruct``s with shardings on ``mesh(mesh_shape)``: the restore target."""
    m = mesh(mesh_shape)
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x[0], np.float32, sharding=NamedSharding(m, x[1])),
        LAYOUTS[workload](),
        is_leaf=_is_spec,
    )


def check(workload: str, restored: dict) -> None:
    """Raise if ``restored`` differs from the state ``build(workload)`` makes."""
    leaves = jax.tree_util.tree_leaves(LAYOUTS[workload](), is_leaf=_is_spec)
    got = jax.tree_util.tree_leaves(restored)
    if len(got) != len(leaves):
        raise AssertionError(f"{workload}: restored {len(got)} leaves, expected {len(leaves)}")
    for seed, ((shape, _), arr) in enumerate(zip(leaves, got)):
        if not np.array_equal(np.asarray(arr), _leaf_value(seed, shape)):
            raise AssertionError(f"{workload}: leaf {seed} differs after restore")


def nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree))
