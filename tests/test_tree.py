"""Pytree flattening: stable key paths, None kept, structure rebuilt without a target."""

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_equal

import jaxckpt
from jaxckpt._planning import tree as _tree


@functools.partial(jax.tree_util.register_dataclass, data_fields=["w", "b"], meta_fields=["name"])
@dataclasses.dataclass
class Dense:
    w: jax.Array
    b: jax.Array | None
    name: str = "dense"


def test_key_paths_are_stable_strings():
    tree = {"params": [Dense(jnp.ones(2), None), {"x": 1}], "opt": (jnp.zeros(1),)}
    keys, leaves, _ = _tree.flatten_with_treedef(tree)
    assert keys == ["opt/0", "params/0/w", "params/0/b", "params/1/x"]
    assert leaves[2] is None


def test_custom_nodes_round_trip_with_target_and_as_dicts_without(tmp_path):
    tree = {"layers": [Dense(jnp.arange(3.0), jnp.ones(3)), Dense(jnp.ones((2, 2)), None, "head")]}
    jaxckpt.save(tmp_path / "c", tree)
    back = jaxckpt.restore(tmp_path / "c", tree)
    assert isinstance(back["layers"][1], Dense) and back["layers"][1].name == "head"
    assert back["layers"][1].b is None
    assert_tree_equal(back, tree)
    host = jaxckpt.restore(tmp_path / "c")
    assert set(host["layers"][0]) == {"w", "b"} and host["layers"][1]["b"] is None
    np.testing.assert_array_equal(host["layers"][0]["w"], np.arange(3.0))


def test_int_dict_keys_and_nested_empty_containers(tmp_path):
    tree = {"by_id": {3: jnp.ones(1), 10: jnp.zeros(1)}, "e": [(), {}], "t": ()}
    jaxckpt.save(tmp_path / "c", tree)
    back = jaxckpt.restore(tmp_path / "c")
    assert set(back["by_id"]) == {3, 10} and back["e"] == [(), {}] and back["t"] == ()


def test_none_and_an_empty_node_stand_for_each_other_in_a_strict_restore(tmp_path):
    """Both hold no data (JAX treats None as an empty subtree, Orbax saves every empty node
    as None): a target may hold either where the checkpoint holds the other."""
    tree = {"w": jnp.ones(2), "none": None, "empty": (), "nested": {"e": {}}}
    jaxckpt.save(tmp_path / "c", tree)
    swapped = {"w": jnp.ones(2), "none": (), "empty": None, "nested": {"e": None}}
    assert_tree_equal(jaxckpt.restore(tmp_path / "c", swapped), swapped)
    with pytest.raises(jaxckpt.KeyMismatchError, match=r"in `target` missing .*\['nested/e/x'\]"):
        jaxckpt.restore(tmp_path / "c", swapped | {"nested": {"e": {"x": None}}})
    with pytest.raises(jaxckpt.KeyMismatchError, match=r"not in `target`: \['none'\]"):
        jaxckpt.restore(tmp_path / "c", {"w": jnp.ones(2), "empty": (), "nested": {"e": {}}})


def test_a_leaf_saved_as_none_keeps_the_targets_under_strict_false(tmp_path, caplog):
    """Levanter's allow_partial: a leaf saved as None (no leaf) leaves the target's in place
    under strict=False, as a key the checkpoint lacks does (issue 51.3)."""
    m = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("x",))
    sharded = jax.device_put(
        jnp.arange(16.0), jax.sharding.NamedSharding(m, jax.sharding.PartitionSpec("x"))
    )
    jaxckpt.save(
        tmp_path / "c", {"w": jnp.full(2, 5.0), "head": None, "opt": {"mu": None, "n": None}}
    )
    target = {"w": jnp.zeros(2), "head": sharded, "opt": {"mu": np.ones(3, np.int8), "n": 4}}
    with caplog.at_level(logging.WARNING, logger="jaxckpt"):  # whatever an earlier test set
        back = jaxckpt.restore(tmp_path / "c", target, strict=False)
    assert back["head"] is sharded and back["opt"]["mu"] is target["opt"]["mu"]
    assert back["opt"]["n"] == 4
    np.testing.assert_array_equal(back["w"], [5.0, 5.0])  # the saved leaves still restore
    assert "['head', 'opt/mu', 'opt/n']" in caplog.text and "saved as None" in caplog.text
    # Without a target, or with None there, the None comes back as saved.
    assert jaxckpt.restore(tmp_path / "c")["head"] is None
    assert jaxckpt.restore(tmp_path / "c", target | {"head": None}, strict=False)["head"] is None
    with pytest.raises(
        jaxckpt.ShapeMismatchError,
        match=r"Key 'head': the target holds an array of shape \(16,\) but the checkpoint None "
        r".*Pass strict=False to keep the target's array",
    ):
        jaxckpt.restore(tmp_path / "c", target)


def test_structure_is_json_and_unflatten_drops_unselected():
    tree = {"a": [1, 2], "b": {"c": 3}}
    node = _tree.structure(tree)
    assert _tree.unflatten(node, {"a/0": 1, "a/1": 2, "b/c": 3}) == tree
    assert _tree.unflatten(node, {"b/c": 3}) == {"b": {"c": 3}}
    assert _tree.unflatten(node, {"a/1": 2}) == {"a": {"1": 2}}


def test_select_matches_exact_keys_and_prefixes():
    keys = ["params/w", "params/b", "paramsx", "opt/0"]
    assert _tree.select(keys, ["params"]) == ["params/w", "params/b"]
    assert _tree.select(keys, "params/w") == ["params/w"]
    assert _tree.select(keys, None) == keys
    with pytest.raises(jaxckpt.KeyMismatchError, match="'nope'"):
        _tree.select(keys, ["params", "nope"])
