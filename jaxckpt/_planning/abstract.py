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

from jaxckpt._format.entries import ArrayEntry
from jaxckpt._format.manifest import Manifest
from jaxckpt._planning import display as _display
from jaxckpt._planning import tree as _tree
from jaxckpt._planning.structs import leaf_struct

REPR_LINES = 20  # the tree's lines in a repr, at most (and one that counts the rest)


@dataclasses.dataclass(frozen=True, repr=False)
class CheckpointMetadata(Manifest):
    """A checkpoint's ``Manifest`` as :func:`jaxckpt.metadata` returns it, with
    :meth:`abstract`; its ``repr`` is the tree (its largest arrays where it is long), its
    ``str`` the whole tree, and a notebook shows it as an HTML table.

    Example:
      >>> import jax.numpy as jnp, jaxckpt, tempfile
      >>> d = tempfile.mkdtemp() + "/c"
      >>> jaxckpt.save(d, {"w": jnp.zeros((4, 2)), "step": 3})
      >>> jaxckpt.metadata(d)  # doctest: +ELLIPSIS
      CheckpointMetadata: 1 array (32 B), 1 value, format v2
        step  = 3
        w     float32[4,2]  packed  32 B  SingleDeviceSharding(...)
    """

    def __repr__(self) -> str:
        """The counts, then the tree: whole up to :data:`REPR_LINES` lines, else its largest
        arrays and how many others (``str()`` shows every entry)."""
        return self._show(REPR_LINES)

    def __str__(self) -> str:
        """The counts, then every entry of the tree, as ``jaxckpt inspect`` prints it."""
        return self._show(None)

    def _show(self, limit: int | None) -> str:
        lines = [f"CheckpointMetadata: {_display.summary(self)}"]
        lines += ["  " + line for line in _display.text(self, limit=limit)]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        """Jupyter's and Colab's view: the tree as a table of shapes, dtypes, shardings, bytes."""
        return _display.html_table(self)

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
