"""Test set-up shared by tests/ and the doctests in jaxckpt/: 8 simulated CPU devices."""

import os

# Must happen before jax is imported anywhere.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

assert jax.device_count() == 8, "conftest must run before jax is imported"
