"""Regenerate the list-rooted Orbax fixture in this folder (issue 51.2).

Orbax saves a tree whose root is a list or tuple with every key path starting at a sequence
index (``key_type`` 1 in ``_METADATA``), and records no dict at the root; it does not record
whether the root was a list or a tuple either. Flax's ``save_checkpoint`` with a list or
tuple ``target`` writes the same layout through Orbax.

How it was made (CPU only), with the repo's own venv (orbax-checkpoint 0.12.8, jax 0.10.2):

    JAX_PLATFORMS=cpu .venv/bin/python \\
        tests/data/orbax_list_root/make_list_root.py

Writes, next to this file (Orbax's defaults: OCDBT, zarr v2 inside):

* ``list/``   - ``ocp.StandardCheckpointer().save(path, [a, b])``.
* ``nested/`` - the same with a tuple root holding lists of dicts and a Python scalar:
  ``([{"foo": c, "bar": [d, {"x": e}]}, {"foo": f}], 3)``.
* ``expected.json`` - every leaf's dtype, shape and values (keyed by the ``/``-joined tree
  path) and the versions used, so a test compares bit-exactly without Orbax installed.
"""

from __future__ import annotations

import json
import os
import shutil
from importlib.metadata import version
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402

HERE = Path(__file__).resolve().parent


def trees() -> dict:
    return {
        "list": [jnp.arange(6, dtype=jnp.float32).reshape(2, 3), jnp.arange(4, dtype=jnp.int32)],
        "nested": (
            [
                {
                    "foo": jnp.array([1.5, -2.0], jnp.float32),
                    "bar": [jnp.arange(3, dtype=jnp.int16), {"x": jnp.ones((1, 2), jnp.float16)}],
                },
                {"foo": jnp.array([7.0], jnp.float32)},
            ],
            3,
        ),
    }


def _key(p) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in p)


def describe(tree) -> dict:
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if isinstance(leaf, int):
            out[_key(path)] = {"kind": "python", "value": leaf}
            continue
        a = np.asarray(leaf)
        out[_key(path)] = {"kind": "array", "dtype": str(a.dtype), "shape": list(a.shape),
                           "value": a.tolist()}  # fmt: skip
    return out


def main() -> None:
    expected = {
        "versions": {p: version(p) for p in ("orbax-checkpoint", "jax", "numpy", "tensorstore")}
    }
    for name, tree in trees().items():
        shutil.rmtree(HERE / name, ignore_errors=True)
        with ocp.StandardCheckpointer() as c:
            c.save(HERE / name, tree)
            c.wait_until_finished()
        expected[name] = describe(tree)
        with ocp.StandardCheckpointer() as c:  # sanity: Orbax reads back what it wrote
            back = c.restore(HERE / name)
        assert describe(back) == expected[name], (describe(back), expected[name])
    (HERE / "expected.json").write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")
    print("ok", expected["versions"])


if __name__ == "__main__":
    main()
