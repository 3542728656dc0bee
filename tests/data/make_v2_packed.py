"""Writes tests/data/v2_packed: a format-version-2 checkpoint (packed small arrays) as jaxckpt
wrote it on 2026-12-06, after the move into layered subpackages (with ``pack_bytes=4096``, so
that a small fixture holds both packed and unpacked arrays). Committed once, so that every
later version is tested against bytes it did not write itself (tests/test_pack.py).

Run from the repository root: ``.venv/bin/python tests/data/make_v2_packed.py`` (only to make
it again on purpose: the test compares with the values below, not with this script's output).
"""

import os
import shutil

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxckpt  # noqa: E402


def state() -> dict:
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
    return {
        "big": jax.device_put(  # 4 KiB in 8 shards: packed (each shard <= pack_bytes)
            jnp.arange(1024, dtype=jnp.float32).reshape(32, 32),
            NamedSharding(mesh, P("data", "model")),
        ),
        "huge": jax.device_put(  # 32 KiB: its own zarr array, 4 chunks
            jnp.arange(8192, dtype=jnp.int32).reshape(128, 64), NamedSharding(mesh, P("data"))
        ),
        "bias": jnp.arange(6, dtype=jnp.bfloat16) / 4,
        "q": np.arange(7, dtype=ml_dtypes.uint4),
        "i4": jnp.arange(-3, 3, dtype=jnp.int4),
        "rng": jax.random.key(7),
        "empty": np.zeros((0, 3), np.float16),
        "flag": np.array([True, False, True]),
        "step": 12,
        "name": "v2",
    }


if __name__ == "__main__":
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "v2_packed")
    shutil.rmtree(out, ignore_errors=True)
    jaxckpt.save(out, state(), planner=jaxckpt.DefaultSavePlanner(pack_bytes=4096))
