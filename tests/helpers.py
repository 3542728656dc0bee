"""Small helpers shared by the tests: meshes, shardings, tree comparison."""

from __future__ import annotations

import contextlib
import subprocess
from html.parser import HTMLParser

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxckpt._planning import packing as _pack


def mesh(shape: tuple[int, ...], names: tuple[str, ...], devices=None) -> Mesh:
    devs = np.array(devices if devices is not None else jax.devices()[: int(np.prod(shape))])
    return Mesh(devs.reshape(shape), names)


def put(x, m: Mesh, *spec) -> jax.Array:
    return jax.device_put(x, NamedSharding(m, P(*spec)))


def assert_tree_equal(a, b) -> None:
    """Bit-exact equality of two trees (same structure, dtypes, values)."""
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    assert ta == tb, f"{ta} != {tb}"
    for x, y in zip(la, lb):
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        if isinstance(x, (jax.Array, np.ndarray, np.generic)):
            x, y = np.asarray(x), np.asarray(y)
            assert x.dtype == y.dtype, (x.dtype, y.dtype)
            assert x.shape == y.shape, (x.shape, y.shape)
            assert x.tobytes() == y.tobytes()
        else:
            assert type(x) is type(y) and (x == y or (x != x and y != y)), (x, y)


@pytest.fixture(scope="module", autouse=True)
def one_array_per_leaf():
    """Autouse where imported: default saves store every array on its own (no packs, format v1).

    For the tests whose premise is one zarr array per leaf (its chunk files, its zarr.json);
    tests/test_pack.py covers the same behaviours for packed leaves.
    """
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_pack, "DEFAULT_PACK_BYTES", 0)
        yield


@contextlib.contextmanager
def tmpfs(path, size: str = "8m"):
    """A tmpfs mounted at ``path`` (made here), or skip where mounting is not allowed."""
    path.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


@contextlib.contextmanager
def x64():
    """64-bit arrays on for the block: ``jax.enable_x64`` is missing from the jax floor (0.6.2)
    and ``jax.experimental.enable_x64`` from newer ones, so set the flag and restore it."""
    before = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", before)


class HtmlTable(HTMLParser):
    """The rows of an HTML table, each a list of its cells' text; checks every tag closes."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self.rows: list[list[str]] = []
        self.caption = ""
        self.open: list[str] = []
        self.feed(html)
        self.close()
        assert not self.open, f"unclosed: {self.open}"

    def handle_starttag(self, tag, attrs):
        self.open.append(tag)
        if tag == "tr":
            self.rows.append([])
        elif tag in ("td", "th"):
            self.rows[-1].append("")

    def handle_endtag(self, tag):
        assert self.open and self.open.pop() == tag, f"</{tag}> closes nothing open"

    def handle_data(self, data):
        if "caption" in self.open:
            self.caption += data
        elif self.open and self.open[-1] in ("td", "th"):
            self.rows[-1][-1] += data


def fixture_leaf(tree, key: str):
    for part in key.split("/"):
        if hasattr(tree, "_fields"):  # a NamedTuple (optax's states) restored into a target
            tree = getattr(tree, part)
        else:
            tree = tree[int(part)] if isinstance(tree, (list, tuple)) else tree[part]
    return tree


def assert_fixture_leaves(got, expected: dict) -> None:
    """Every leaf of ``expected`` (make_fixture's ``describe``) is in ``got``, bit for bit."""
    for key, want in expected.items():
        leaf = fixture_leaf(got, key)
        if want["kind"] == "python":
            assert want.get("type", type(leaf).__name__) == type(leaf).__name__, key
            assert leaf == want["value"], key
            continue
        if want["kind"] == "prng_key":
            assert str(jax.random.key_impl(leaf)) == want["impl"], key
            leaf = jax.random.key_data(leaf)
            want = want | {"dtype": want["key_data_dtype"], "value": want["key_data"]}
        a = np.asarray(leaf)
        ref = np.asarray(want["value"], dtype=want["dtype"])
        assert (a.dtype.name, list(a.shape)) == (want["dtype"], want["shape"]), key
        assert a.tobytes() == ref.tobytes(), key
