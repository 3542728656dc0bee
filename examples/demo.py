"""Save a sharded state on a (4, 2) mesh of 8 simulated CPU devices; restore onto (2, 4)."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import tempfile  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxckpt  # noqa: E402


def main() -> None:
    devices = np.array(jax.devices()[:8])
    mesh = Mesh(devices.reshape(4, 2), ("data", "model"))
    state = {
        "w": jax.device_put(
            jnp.arange(64.0).reshape(8, 8), NamedSharding(mesh, P("data", "model"))
        ),
        "b": jax.device_put(jnp.ones(8), NamedSharding(mesh, P())),
        "step": 10,
    }
    path = os.path.join(tempfile.mkdtemp(), "ckpt")
    jaxckpt.save(path, state)
    print(f"saved to {path}: {sorted(jaxckpt.metadata(path).entries)}")
    other = Mesh(devices.reshape(2, 4), ("a", "b"))
    target = {
        "w": NamedSharding(other, P("b", "a")),
        "b": NamedSharding(other, P("a")),
        "step": None,
    }
    restored = jaxckpt.restore(path, target)
    assert np.array_equal(restored["w"], state["w"]) and restored["step"] == 10
    print(f"restored onto {restored['w'].sharding}")


if __name__ == "__main__":
    main()
