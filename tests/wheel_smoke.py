"""Smoke test of an installed jaxckpt wheel, run by `make wheel-test` from outside the source
tree with the wheel's own virtual environment: save, restore onto another mesh, the command
line, the type marker. Exits non-zero on any failure."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import importlib.metadata  # noqa: E402
import pathlib  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxckpt  # noqa: E402


def main() -> None:
    source = pathlib.Path(sys.argv[1]).resolve()  # the source tree: never what is imported
    package = pathlib.Path(jaxckpt.__file__).resolve().parent
    assert package != source / "jaxckpt" and "site-packages" in package.parts, package
    assert (package / "py.typed").is_file(), "py.typed is missing from the wheel"
    assert importlib.metadata.version("jaxckpt") == jaxckpt.__version__

    devices = np.array(jax.devices()[:8])
    mesh = Mesh(devices.reshape(4, 2), ("data", "model"))
    other = Mesh(devices.reshape(2, 4), ("x", "y"))
    w = np.arange(64.0, dtype=np.float32).reshape(8, 8)
    state = {"w": jax.device_put(w, NamedSharding(mesh, P("data", "model"))), "step": 3}
    path = os.path.join(tempfile.mkdtemp(), "ckpt")
    jaxckpt.save(path, state)
    got = jaxckpt.restore(path, {"w": NamedSharding(other, P("y")), "step": None})
    assert got["w"].sharding == NamedSharding(other, P("y")) and got["step"] == 3
    np.testing.assert_array_equal(np.asarray(got["w"]), w)
    cli = pathlib.Path(sys.executable).with_name("jaxckpt")
    for args in (["--version"], ["inspect", path], ["verify", path]):
        out = subprocess.run([str(cli), *args], capture_output=True, text=True)
        assert out.returncode == 0, (args, out.stderr)
    assert subprocess.run(
        [str(cli), "--version"], capture_output=True, text=True
    ).stdout.strip() == (f"jaxckpt {jaxckpt.__version__}")
    print(f"wheel smoke test passed: jaxckpt {jaxckpt.__version__} from {package}")


if __name__ == "__main__":
    main()
