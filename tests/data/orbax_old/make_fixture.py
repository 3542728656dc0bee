"""Regenerate the old-Orbax fixture in this folder.

These checkpoints were written by orbax-checkpoint 0.11.25, which (like every
release up to 0.11.30) does NOT record ``use_ocdbt`` in an item's
``_METADATA`` file; 0.11.31 and later do.  They are OCDBT checkpoints
(Orbax's default), so a reader must detect OCDBT from the files on disk
(``manifest.ocdbt`` / ``ocdbt.process_*``), not from that flag.

How it was made (CPU only, outside the repo's own venv):

    python3 -m venv /tmp/orbax-old
    /tmp/orbax-old/bin/pip install "orbax-checkpoint==0.11.25" "jax[cpu]==0.6.2" \
        "jaxlib==0.6.2" "optax==0.2.5" "numpy==2.4.6" "tensorstore==0.1.86"
    cd /tmp && JAX_PLATFORMS=cpu /tmp/orbax-old/bin/python \
        /work/main/tests/data/orbax_old/make_fixture.py

(Run it from a directory other than site-packages; the output location is
taken from this file's own path.)

Writes, next to this file:

* ``standard/`` - ``ocp.StandardCheckpointer().save(path, state)``.
* ``manager/``  - an ``ocp.CheckpointManager`` directory with steps 1 and 2,
  items ``state`` (``args.StandardSave``) and ``metadata`` (``args.JsonSave``).
* ``expected.json`` - every leaf's dtype, shape and values as plain lists
  (keyed by the ``/``-joined tree path), plus the versions used, so a test can
  compare bit-exactly without the old Orbax installed.  The PRNG key is
  recorded as its ``jax.random.key_data`` (uint32) plus its impl name.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_platforms", "cpu")

from importlib.metadata import version  # noqa: E402

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402

HERE = Path(__file__).resolve().parent


def make_state(scale: int = 1):
    return {
        "w": jnp.arange(16, dtype=jnp.float32).reshape(4, 4) * scale,
        "b": jnp.arange(4, dtype=jnp.int32) * scale,
        "opt": optax.adam(0.1).init({"w": jnp.zeros((4, 4), jnp.float32)}),
        "step": 3 * scale,
        "rng": jax.random.key(scale - 1),
    }


def _key(p) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in p)


def describe(tree) -> dict:
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        k = _key(path)
        if isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            data = np.asarray(jax.random.key_data(leaf))
            out[k] = {
                "kind": "prng_key",
                "impl": str(jax.random.key_impl(leaf)),
                "key_data_dtype": str(data.dtype),
                "shape": list(data.shape),
                "key_data": data.tolist(),
            }
        elif isinstance(leaf, (int, float)) and not isinstance(leaf, bool):
            out[k] = {"kind": "python", "type": type(leaf).__name__, "value": leaf}
        else:
            a = np.asarray(leaf)
            out[k] = {
                "kind": "array",
                "dtype": str(a.dtype),
                "shape": list(a.shape),
                "value": a.tolist(),
            }
    return out


def main() -> None:
    for sub in ("standard", "manager"):
        shutil.rmtree(HERE / sub, ignore_errors=True)

    state = make_state(1)
    with ocp.StandardCheckpointer() as c:
        c.save(HERE / "standard", state)
        c.wait_until_finished()

    meta = {1: {"lr": 0.1, "note": "step one"}, 2: {"lr": 0.05, "note": "step two"}}
    states = {1: make_state(1), 2: make_state(2)}
    opts = ocp.CheckpointManagerOptions(max_to_keep=5, create=True)
    with ocp.CheckpointManager(HERE / "manager", options=opts) as mngr:
        for step in (1, 2):
            mngr.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(states[step]),
                    metadata=ocp.args.JsonSave(meta[step]),
                ),
            )
        mngr.wait_until_finished()

    expected = {
        "versions": {
            p: version(p)
            for p in ("orbax-checkpoint", "jax", "jaxlib", "optax", "numpy", "tensorstore")
        },
        "standard": describe(state),
        "manager": {str(s): {"state": describe(states[s]), "metadata": meta[s]} for s in (1, 2)},
    }
    (HERE / "expected.json").write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")

    # Sanity: restore with this same old Orbax and compare.
    with ocp.StandardCheckpointer() as c:
        back = c.restore(HERE / "standard")
    assert describe(back) == expected["standard"], (describe(back), expected["standard"])
    print("ok", expected["versions"])


if __name__ == "__main__":
    main()
