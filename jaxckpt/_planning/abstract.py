"""What a restore returns, before reading it: the saved tree of ``jax.ShapeDtypeStruct``.

``jaxckpt.metadata(path)`` returns a :class:`CheckpointMetadata`: the checkpoint's
``Manifest``, plus :meth:`CheckpointMetadata.abstract`, the saved pytree (dicts, lists and
tuples as saved; other nodes as dicts of their children, as ``restore(path)`` returns them)
with a ``jax.ShapeDtypeStruct`` for each array, shaped and typed as ``restore`` returns it (a
PRNG key array as keys: the key array's shape, a key dtype), and the saved value for each
Python leaf. Give its structs shardings and it is a restore target (what Orbax users build
with ``ocp.utils.to_shape_dtype_struct`` from ``item_metadata``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from jaxckpt._format.dtypes import dtype_from_name
from jaxckpt._format.entries import ArrayEntry
from jaxckpt._format.manifest import Manifest
from jaxckpt._planning import tree as _tree


def leaf_struct(entry: ArrayEntry) -> jax.ShapeDtypeStruct:
    """The ``ShapeDtypeStruct`` of what ``restore`` returns for ``entry`` (no sharding).

    Example:
      >>> from jaxckpt._format.entries import ArrayEntry
      >>> e = ArrayEntry("rng", (2,), "uint32", "uint32", (2,), "arrays/rng",
      ...                prng_impl="threefry2x32")
      >>> s = leaf_struct(e); s.shape, str(s.dtype)
      ((), 'key<fry>')
    """
    if entry.prng_impl:
        impl = entry.prng_impl
        data = jax.ShapeDtypeStruct(entry.shape, np.uint32)
        keys: jax.ShapeDtypeStruct = jax.eval_shape(
            lambda d: jax.random.wrap_key_data(d, impl=impl), data
        )
        return keys
    return jax.ShapeDtypeStruct(entry.shape, dtype_from_name(entry.dtype))


@dataclasses.dataclass(frozen=True)
class CheckpointMetadata(Manifest):
    """A checkpoint's ``Manifest`` as :func:`jaxckpt.metadata` returns it, with
    :meth:`abstract`."""

    @classmethod
    def of(cls, manifest: Manifest) -> CheckpointMetadata:
        return cls(**{f.name: getattr(manifest, f.name) for f in dataclasses.fields(manifest)})

    def abstract(self) -> Any:
        """The saved pytree, with a ``jax.ShapeDtypeStruct`` for each array (as ``restore``
        returns it) and the saved value for each Python leaf; no array data is read.

        Example:
          >>> import jax, jax.numpy as jnp, jaxckpt, tempfile
          >>> d = tempfile.mkdtemp() + "/c"
          >>> jaxckpt.save(d, {"w": jnp.zeros((4, 2)), "rng": jax.random.key(0), "step": 3})
          >>> meta = jaxckpt.metadata(d).abstract()
          >>> meta["w"].shape, meta["rng"].shape, meta["step"]
          ((4, 2), (), 3)
          >>> s = jax.sharding.SingleDeviceSharding(jax.devices()[0])
          >>> place = lambda x: x.update(sharding=s) if isinstance(x, jax.ShapeDtypeStruct) else x
          >>> target = jax.tree.map(place, meta)
          >>> jaxckpt.restore(d, target)["w"].sharding == s
          True
        """
        values = {
            k: leaf_struct(e) if isinstance(e, ArrayEntry) else e.value
            for k, e in self.entries.items()
        }
        return _tree.unflatten(self.tree, values)
