"""Arrays in host memory kinds (host-offloaded optimizer state) save and restore in place."""

import jax
import numpy as np
import pytest
from helpers import mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from packaging.version import Version

import jaxckpt

M8 = mesh((8,), ("x",))
M42 = mesh((4, 2), ("data", "model"))
KINDS = ["pinned_host", "unpinned_host", "device"]
pytestmark = pytest.mark.skipif(
    Version(jax.__version__) < Version("0.7.1"),
    reason="needs jax >= 0.7.1: CPU devices with pinned_host and device memories",
)


def test_cpu_devices_have_the_host_memory_kinds():
    # The premise of the tests below: they run on real memory spaces, not on a default.
    kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
    assert {"pinned_host", "unpinned_host", "device"} <= kinds


@pytest.mark.parametrize("saved_in", KINDS)
@pytest.mark.parametrize("restored_in", KINDS)
def test_restore_into_the_target_memory_kind(tmp_path, saved_in, restored_in):
    value = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)
    x = jax.device_put(value, NamedSharding(M8, P("x"), memory_kind=saved_in))
    jaxckpt.save(tmp_path / "c", {"opt": {"mu": x}, "step": 1})
    for spec in (P("x"), P(None, "x"), P()):  # same, resharded, replicated
        want = NamedSharding(M8, spec, memory_kind=restored_in)
        back = jaxckpt.restore(tmp_path / "c", {"opt": {"mu": want}, "step": None})
        got = back["opt"]["mu"]
        assert got.sharding.memory_kind == restored_in
        assert got.sharding == want
        assert np.asarray(got).tobytes() == value.tobytes()


def test_array_target_in_pinned_host_keeps_its_kind(tmp_path):
    s = NamedSharding(M42, P("data", "model"), memory_kind="pinned_host")
    x = jax.device_put(np.ones((8, 4), np.float32), s)
    jaxckpt.save(tmp_path / "c", {"x": x, "y": x})
    back = jaxckpt.restore(tmp_path / "c", {"x": x}, keys=["x"])
    assert back["x"].sharding == s
    np.testing.assert_array_equal(back["x"], x)
