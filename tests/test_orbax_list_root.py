"""Orbax checkpoints whose root is a list or tuple restore as the tree they were saved from
(issue 51.2): the fixture in data/orbax_list_root (see its make_list_root.py) needs no Orbax;
the last test writes them live with Orbax and Flax where those are installed."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_fixture_leaves, mesh, put
from jax.sharding import NamedSharding

import jaxckpt

DATA = Path(__file__).resolve().parent / "data" / "orbax_list_root"
EXPECTED = json.loads((DATA / "expected.json").read_text())


def test_a_list_root_restores_as_a_list():
    got = jaxckpt.restore(DATA / "list")
    assert type(got) is list and len(got) == 2
    assert_fixture_leaves(got, EXPECTED["list"])
    assert list(jaxckpt.metadata(DATA / "list").entries) == ["0", "1"]


def test_a_tuple_root_with_lists_of_dicts_restores_with_and_without_a_target():
    got = jaxckpt.restore(DATA / "nested")  # Orbax records no tuple: lists, as for JSON
    assert type(got) is list and type(got[0]) is list and type(got[0][0]["bar"]) is list
    assert set(got[0][0]) == {"foo", "bar"} and set(got[0][1]) == {"foo"}
    assert_fixture_leaves(got, EXPECTED["nested"])

    m = mesh((2,), ("x",))
    one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = (
        [
            {
                "foo": put(jnp.zeros(2, jnp.float32), m, "x"),
                "bar": [np.zeros(3, np.int16), {"x": None}],
            },
            {"foo": jax.ShapeDtypeStruct((1,), jnp.float32, sharding=one_device)},
        ],
        0,
    )
    got = jaxckpt.restore(DATA / "nested", target)
    assert type(got) is tuple and type(got[0]) is list
    assert isinstance(got[0][0]["foo"].sharding, NamedSharding)
    assert_fixture_leaves(got, EXPECTED["nested"])


def test_a_target_of_another_structure_is_refused_by_key():
    with pytest.raises(jaxckpt.KeyMismatchError, match=r"'2'"):
        jaxckpt.restore(DATA / "list", [np.zeros((2, 3)), np.zeros(4, np.int32), np.zeros(1)])


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")
@pytest.mark.parametrize("root", [list, tuple])
def test_list_and_tuple_roots_written_by_orbax_and_flax_restore(tmp_path, root):
    ocp = pytest.importorskip("orbax.checkpoint")
    checkpoints = pytest.importorskip("flax.training.checkpoints")
    tree = root([jnp.arange(4.0), [{"foo": jnp.ones((2, 2), jnp.int32), "n": 3}]])
    with ocp.StandardCheckpointer() as c:
        c.save(tmp_path / "standard", tree)
    flax_path = checkpoints.save_checkpoint(tmp_path / "flax", tree, step=1)
    for path in (tmp_path / "standard", flax_path):
        got = jaxckpt.restore(path)
        assert type(got) is list and got[1][0]["n"] == 3
        np.testing.assert_array_equal(got[0], np.arange(4.0))
        np.testing.assert_array_equal(got[1][0]["foo"], np.ones((2, 2), np.int32))
        back = jaxckpt.restore(path, tree)
        assert type(back) is root
        np.testing.assert_array_equal(back[1][0]["foo"], tree[1][0]["foo"])
