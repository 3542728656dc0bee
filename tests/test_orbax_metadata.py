"""An Orbax item's manifest from its metadata alone: no orbax, no tensorstore reads."""

from __future__ import annotations

import numpy as np
import pytest

from jaxckpt._errors import ManifestError
from jaxckpt._sources.orbax_metadata import (
    Stored,
    manifest_from_orbax,
    parse_metadata,
    with_prng_impls,
)
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


def _array_metadatas(*entries: tuple[str, object]) -> dict:
    return {
        "array_metadatas": [
            {"array_metadata": {"param_name": n, "write_shape": [2], "ext_metadata": ext}}
            for n, ext in entries
        ]
    }


KEYS = {
    "rng": Stored("rng", (2,), np.dtype("uint32"), (2,)),
    "ks": Stored("ks", (8, 4), np.dtype("uint32"), (1, 4)),
    "w": Stored("w", (2,), np.dtype("float32"), (2,)),
}


def test_prng_keys_from_the_array_metadata():
    doc = _array_metadatas(
        ("rng", {"random_key_impl": "threefry2x32"}),
        ("ks", {"random_key_impl": "rbg"}),
        ("w", None),
    )
    got = with_prng_impls(LOC, KEYS, doc)
    assert {k: a.prng_impl for k, a in got.items()} == {
        "rng": "threefry2x32",
        "ks": "rbg",
        "w": None,
    }
    item = parse_metadata(
        LOC, {"tree_metadata": {"('rng',)": _leaf(("rng", 2), value_type="jax.Array")}}
    )
    entry = manifest_from_orbax(LOC, item, {"rng": got["rng"]}, {}).entries["rng"]
    assert (entry.prng_impl, entry.shape, entry.dtype) == ("threefry2x32", (2,), "uint32")
    assert with_prng_impls(LOC, KEYS, None) == KEYS  # older Orbax: no file, plain arrays


@pytest.mark.parametrize(
    "doc, match",
    [
        ([], r'no "array_metadatas" list'),
        ({"array_metadatas": [{"array_metadata": {"param_name": 3}}]}, r"entry 0 is not"),
        (_array_metadatas(("rng", [1])), r"entry 0 is not"),
        (_array_metadatas(("rng", {"random_key_impl": "mine"})), r"rng .*implementation 'mine'"),
        (_array_metadatas(("w", {"random_key_impl": "threefry2x32"})), r"w \(leaf 'w'\).*float32"),
        (
            _array_metadatas(("rng", {"random_key_impl": "rbg"})),
            r"rng.*uint32\[2\].*uint32\[\.\.\., 4\]",
        ),
    ],
)
def test_damaged_array_metadata_is_a_typed_error_naming_the_file(doc, match):
    with pytest.raises(ManifestError, match=r"item/array_metadatas/process_0: .*" + match):
        with_prng_impls(LOC, KEYS, doc)
