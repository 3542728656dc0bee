"""What ``restore`` returns for one saved array, as a ``jax.ShapeDtypeStruct`` (no sharding):
shared by the abstract tree of ``jaxckpt.metadata`` and the display of a manifest."""

from __future__ import annotations

import jax
import numpy as np

from jaxckpt._format.dtypes import dtype_from_name
from jaxckpt._format.entries import ArrayEntry


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
