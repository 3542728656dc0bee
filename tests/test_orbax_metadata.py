"""An Orbax item's manifest from its metadata alone: no orbax, no tensorstore reads."""

from __future__ import annotations

import numpy as np
import pytest

from jaxckpt._errors import ManifestError
from jaxckpt._sources.orbax import Stored, manifest_from_orbax, parse_metadata
from jaxckpt._storage.location import Location

LOC = Location("/nowhere/item")


def _leaf(*path: tuple[str, int], value_type: str) -> dict:
    return {
        "key_metadata": [{"key": k, "key_type": t} for k, t in path],
        "value_metadata": {"value_type": value_type},
    }


DOC = {
    "tree_metadata": {
        "('params', 'w')": _leaf(("params", 2), ("w", 2), value_type="jax.Array"),
        "('opt', '0')": _leaf(("opt", 2), ("0", 1), value_type="np.ndarray"),
        "('step',)": _leaf(("step", 2), value_type="scalar"),
        "('name',)": _leaf(("name", 2), value_type="string"),
        "('extra',)": _leaf(("extra", 2), value_type="Dict"),
    },
    "use_ocdbt": True,
    "use_zarr3": False,
}


def test_manifest_from_metadata_and_opened_arrays():
    item = parse_metadata(LOC, DOC)
    assert item.empty == {"extra": "dict"} and item.ocdbt and not item.zarr3
    arrays = {
        "params/w": Stored("params.w", (8, 12), np.dtype("float32"), (4, 12)),
        "opt/0": Stored("opt.0", (0,), np.dtype("uint8"), (0,)),
    }
    m = manifest_from_orbax(LOC, item, arrays, {"step": 7, "name": "run"})
    assert list(m.entries) == ["params/w", "opt/0", "step", "name"]
    w = m.entries["params/w"]
    assert (w.path, w.shape, w.dtype, w.chunks, w.checksum) == (
        "params.w",
        (8, 12),
        "float32",
        (4, 12),
        "none",
    )
    assert m.entries["opt/0"].chunks == (1,)  # a zarr chunk of 0 becomes 1
    assert m.entries["step"].value == 7
    assert m.created == {"source": "orbax", "use_ocdbt": True, "use_zarr3": False}
    assert m.tree["type"] == "dict" and m.tree["keys"] == ["params", "opt", "step", "name", "extra"]


def test_a_value_leaf_holding_an_array_is_a_typed_error():
    item = parse_metadata(LOC, DOC)
    with pytest.raises(ManifestError, match=r"leaf 'step' holds a ndarray"):
        manifest_from_orbax(LOC, item, {}, {"step": np.zeros(2), "name": "run"})
