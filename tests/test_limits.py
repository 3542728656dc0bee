"""What save accepts, restore reads (issue 29.8): one depth limit and one int digit limit,
shared by both sides (``jaxckpt._format.manifest_check``); save refuses beyond them, before
anything is written, with an ``UnsupportedLeafError`` naming where."""

from __future__ import annotations

import sys
from typing import NamedTuple

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jaxckpt
from jaxckpt._format.manifest_check import MAX_DEPTH, MAX_INT_DIGITS


def _nest(depth: int, leaf, kind: str):
    """``leaf`` at ``depth`` (the root is depth 0) under ``kind`` containers."""
    tree = leaf
    for i in range(depth):
        tree = {"a": tree} if kind == "dict" else [tree] if kind == "list" else (tree, i)
    return tree


def _saves_iff_restores(path, tree) -> bool:
    """Save ``tree``; if save accepts it, restore must return it; if not, nothing is written."""
    try:
        jaxckpt.save(path, tree)
    except jaxckpt.UnsupportedLeafError:
        assert not path.exists() and not list(path.parent.iterdir())
        return False
    got = jaxckpt.restore(path)
    assert repr(got) == repr(tree)
    return True


@pytest.mark.parametrize("depth", [450, 600, 5000, 100_000])
def test_a_tree_deeper_than_restore_reads_is_refused_by_save(tmp_path, depth):
    with pytest.raises(
        jaxckpt.UnsupportedLeafError, match=rf"deeper than {MAX_DEPTH} levels \(below 'a/a/a"
    ):
        jaxckpt.save(tmp_path / "c", _nest(depth, 1, "dict"))
    assert not list(tmp_path.iterdir())


def test_the_deepest_tree_save_accepts_restores(tmp_path):
    assert _saves_iff_restores(tmp_path / "c", _nest(MAX_DEPTH, np.arange(3), "dict"))


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    depth=st.integers(MAX_DEPTH - 3, MAX_DEPTH + 3),
    kind=st.sampled_from(["dict", "list", "tuple"]),
    leaf=st.sampled_from([1, None, "s", {}, [], (), 2.5]),
)
def test_save_accepts_exactly_what_restore_reads_at_any_depth(tmp_path_factory, depth, kind, leaf):
    d = tmp_path_factory.mktemp("depth")
    assert _saves_iff_restores(d / "c", _nest(depth, leaf, kind)) == (depth <= MAX_DEPTH)


class Pair(NamedTuple):
    left: object
    right: object


def test_registered_nodes_count_as_levels(tmp_path):
    tree = 1
    for _ in range(MAX_DEPTH + 1):
        tree = Pair(tree, None)
    with pytest.raises(jaxckpt.UnsupportedLeafError, match=f"deeper than {MAX_DEPTH} levels"):
        jaxckpt.save(tmp_path / "c", tree)


def test_an_int_json_cannot_spell_is_refused_by_save(tmp_path):
    with pytest.raises(
        jaxckpt.UnsupportedLeafError,
        match=rf"Leaf 'a' has an int of more than {MAX_INT_DIGITS} digits",
    ):
        jaxckpt.save(tmp_path / "c", {"a": 10**5000})
    assert not list(tmp_path.iterdir())
    with pytest.raises(jaxckpt.UnsupportedLeafError, match=r"dict key is an int of more than"):
        jaxckpt.save(tmp_path / "c", {10**5000: 1})
    assert not list(tmp_path.iterdir())


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    digits=st.integers(MAX_INT_DIGITS - 3, MAX_INT_DIGITS + 3),
    sign=st.sampled_from([1, -1]),
    low=st.integers(0, 9),
)
def test_save_accepts_exactly_the_ints_restore_reads(tmp_path_factory, digits, sign, low):
    value = sign * (10 ** (digits - 1) + low)  # exactly ``digits`` decimal digits
    d = tmp_path_factory.mktemp("int")
    assert _saves_iff_restores(d / "c", {"a": value, "b": [value]}) == (digits <= MAX_INT_DIGITS)


def test_a_lower_interpreter_limit_is_obeyed(tmp_path):
    old = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(1000)
    try:
        with pytest.raises(jaxckpt.UnsupportedLeafError, match="more than 1000 digits"):
            jaxckpt.save(tmp_path / "c", {"a": 10**1000})
        jaxckpt.save(tmp_path / "c", {"a": 10**999})
        assert jaxckpt.restore(tmp_path / "c")["a"] == 10**999
    finally:
        sys.set_int_max_str_digits(old)
