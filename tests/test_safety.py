"""A checkpoint on disk may be hostile, and a target directory may hold the user's own files.

Overwrite never deletes what jaxckpt did not write; reads never leave the checkpoint; a hostile
manifest cannot make jaxckpt allocate what the checkpoint does not hold; malformed manifests
and unstorable leaves get typed errors naming the key.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import one_array_per_leaf  # noqa: F401 (autouse: the tests edit per-array files)
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxckpt
from jaxckpt._cli.main import main
from jaxckpt._format.manifest import Manifest
from jaxckpt._storage.location import Location, kvstore

# 1. overwrite never deletes foreign files -----------------------------------------------------


@pytest.mark.parametrize("overwrite", [False, True])
def test_directory_of_user_files_is_never_replaced(tmp_path, overwrite):
    d = tmp_path / "mydata"
    (d / "sub").mkdir(parents=True)
    (d / "thesis.tex").write_text("years of work")
    (d / "sub" / "notes.txt").write_text("mine")
    with pytest.raises(jaxckpt.CheckpointExistsError, match=r"'sub'.*move 'sub' away") as e:
        jaxckpt.save(d, {"w": jnp.ones(2)}, overwrite=overwrite)
    assert "pass overwrite=True" not in str(e.value).lower()
    assert (d / "thesis.tex").read_text() == "years of work"
    assert (d / "sub" / "notes.txt").read_text() == "mine"


def test_overwrite_keeps_a_user_file_beside_a_checkpoint(tmp_path):
    d = tmp_path / "c"
    jaxckpt.save(d, {"w": jnp.ones(2)})
    (d / "README.txt").write_text("what this run was")
    with pytest.raises(jaxckpt.CheckpointExistsError, match=r"a checkpoint and also 'README.txt'"):
        jaxckpt.save(d, {"w": jnp.zeros(2)}, overwrite=True)
    assert (d / "README.txt").read_text() == "what this run was"
    np.testing.assert_array_equal(jaxckpt.restore(d)["w"], np.ones(2))


def test_overwrite_of_a_plain_checkpoint_still_works(tmp_path):
    d = tmp_path / "c"
    jaxckpt.save(d, {"w": jnp.ones(2)})
    jaxckpt.save(d, {"w": jnp.zeros(2)}, overwrite=True)
    np.testing.assert_array_equal(jaxckpt.restore(d)["w"], np.zeros(2))


@pytest.mark.parametrize("committed", [False, True])
def test_object_store_overwrite_keeps_foreign_objects(committed):
    url = f"memory://safety-{committed}/c"
    if committed:
        jaxckpt.save(url, {"w": jnp.ones(2)})
    kv = kvstore(Location(url).kvstore)  # jaxckpt's context: the same memory store
    kv.write("notes.txt", b"mine").result()
    with pytest.raises(jaxckpt.CheckpointExistsError, match=r"'notes.txt'.*even with overwrite"):
        jaxckpt.save(url, {"w": jnp.zeros(2)}, overwrite=True)
    assert kv.read("notes.txt").result().value == b"mine"


class _DropsAFile(jaxckpt.DefaultSavePlanner):
    """Writes a user's file into the target while the save writes its arrays (a real race)."""

    def __init__(self, drop) -> None:
        super().__init__()
        self.drop = drop

    def resolve_data(self, item):
        if self.drop is not None:
            self.drop()
            self.drop = None
        return super().resolve_data(item)


def test_a_file_written_into_the_target_during_an_overwrite_survives(tmp_path):
    d = tmp_path / "c"
    jaxckpt.save(d, {"w": jnp.ones(2)})
    planner = _DropsAFile(lambda: (d / "notes.txt").write_text("mine"))
    with pytest.raises(jaxckpt.CheckpointExistsError, match=r"also 'notes.txt'.*even with"):
        jaxckpt.save(d, {"w": jnp.zeros(2)}, overwrite=True, planner=planner)
    assert (d / "notes.txt").read_text() == "mine"
    np.testing.assert_array_equal(jaxckpt.restore(d)["w"], np.ones(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]  # the save's temporaries went


def test_an_object_written_during_an_object_store_overwrite_survives():
    url = "memory://safety-race/c"
    jaxckpt.save(url, {"w": jnp.ones(2)})
    kv = kvstore(Location(url).kvstore)
    planner = _DropsAFile(lambda: kv.write("notes.txt", b"mine").result())
    jaxckpt.save(url, {"w": jnp.zeros(2)}, overwrite=True, planner=planner)
    assert kv.read("notes.txt").result().value == b"mine"
    np.testing.assert_array_equal(jaxckpt.restore(url)["w"], np.zeros(2))


def test_manager_refuses_a_step_directory_holding_user_files(tmp_path):
    (tmp_path / "run" / "00000003").mkdir(parents=True)
    (tmp_path / "run" / "00000003" / "plot.png").write_bytes(b"png")
    with jaxckpt.CheckpointManager(tmp_path / "run", async_save=False) as mgr:
        with pytest.raises(jaxckpt.CheckpointExistsError, match=r"'plot.png'") as e:
            mgr.save(3, {"w": jnp.ones(2)})
    assert "pass overwrite=True" not in str(e.value).lower()
    assert (tmp_path / "run" / "00000003" / "plot.png").read_bytes() == b"png"


def test_manager_on_an_object_store_keeps_a_step_prefix_holding_user_objects():
    url = "memory://safety-manager/run"
    kv = kvstore(Location(url).kvstore)
    kv.write("00000003/notes.txt", b"mine").result()
    with jaxckpt.CheckpointManager(url, async_save=False) as mgr:  # its clean-up leaves it
        mgr.save(1, {"w": jnp.ones(2)})
        with pytest.raises(jaxckpt.CheckpointExistsError, match=r"'notes.txt'.*even with") as e:
            mgr.save(3, {"w": jnp.ones(2)})
        assert "pass overwrite=True" not in str(e.value).lower()
        assert mgr.all_steps() == [1]
    assert kv.read("00000003/notes.txt").result().value == b"mine"


# 2. no read leaves the checkpoint ---------------------------------------------------------------


_UNPACKED = jaxckpt.DefaultSavePlanner(pack_bytes=0)  # one zarr array per leaf: arrays/KEY


def _two(tmp_path: Path) -> tuple[Path, Path]:
    mine, other = tmp_path / "mine", tmp_path / "other"
    jaxckpt.save(mine, {"w": jnp.zeros(4)}, planner=_UNPACKED)
    jaxckpt.save(other, {"w": jnp.full(4, 7.0)}, planner=_UNPACKED)  # a valid crc32c: only
    return mine, other  # the link gives it away


def _cli(capsys, *argv) -> tuple[int, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out + err


@pytest.mark.parametrize("what", ["chunk", "c folder"])
def test_links_below_an_array_folder_are_refused(tmp_path, capsys, what):
    mine, other = _two(tmp_path)
    folder = "arrays/w"
    if what == "c folder":
        shutil.rmtree(mine / folder / "c")
        (mine / folder / "c").symlink_to(other / folder / "c")
    else:
        (mine / folder / "c/0").unlink()
        (mine / folder / "c/0").symlink_to(other / folder / "c/0")
    with pytest.raises(jaxckpt.ManifestError, match=r"Key 'w': arrays/w/c.* is a link; refusing"):
        jaxckpt.restore(mine)
    with pytest.raises(jaxckpt.ManifestError, match="is a link"):
        jaxckpt.restore(mine, keys=["w"])
    code, out = _cli(capsys, "verify", mine)
    assert code != 0 and "is a link" in out and "OK" not in out
    code, out = _cli(capsys, "export", mine, tmp_path / "out.npz")
    assert code != 0 and "is a link" in out
    assert not (tmp_path / "out.npz").exists()


def test_a_linked_manifest_is_refused_by_metadata_and_restore(tmp_path, capsys):
    mine, other = _two(tmp_path)
    (mine / "manifest.json").unlink()
    (mine / "manifest.json").symlink_to(other / "manifest.json")
    for read in (jaxckpt.metadata, jaxckpt.restore):
        with pytest.raises(jaxckpt.ManifestError, match=r"manifest.json is a link.*refusing"):
            read(mine)
    code, out = _cli(capsys, "inspect", mine)
    assert code != 0 and "is a link" in out


# 3. a hostile manifest cannot exhaust memory ----------------------------------------------------

_LIMITED = textwrap.dedent(
    """
    import resource, sys
    import jaxckpt
    from jaxckpt._cli.main import main
    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))  # far below what is declared
    path, how = sys.argv[1], sys.argv[2]
    try:
        if how == "restore":
            jaxckpt.restore(path)
        else:
            sys.exit(10 + main(["verify", path]))
    except jaxckpt.CorruptChunkError as e:
        print("TYPED", e)
        sys.exit(3)
    """
)


@pytest.mark.parametrize(
    "shape,chunks",
    [([2**30], [2**30]), ([2**34], [2**18]), ([2**30], [1])],
    ids=["one-4GiB-chunk", "2**34-1MiB-chunks", "2**30-chunks"],
)
@pytest.mark.parametrize("how", ["restore", "verify"])
def test_declared_but_absent_chunks_are_an_error_not_an_allocation(tmp_path, shape, chunks, how):
    d = tmp_path / "c"
    jaxckpt.save(d, {"w": np.zeros(4, np.float32)}, planner=_UNPACKED)
    m = json.loads((d / "manifest.json").read_text())
    m["entries"]["w"].update(shape=shape, chunks=chunks)
    (d / "manifest.json").write_text(json.dumps(m))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    r = subprocess.run(
        [sys.executable, "-c", _LIMITED, str(d), how],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    if how == "restore":
        assert r.returncode == 3, r.stderr[-2000:]
        assert "TYPED Key 'w':" in r.stdout, r.stdout
    else:
        assert r.returncode == 11, r.stderr[-2000:]
        assert "DAMAGED w: Key 'w':" in r.stdout, r.stdout
    want = "holds 20 bytes of chunks" if shape == chunks else "chunk (1) of arrays/w"
    assert want in r.stdout and "restore an earlier one" in r.stdout, r.stdout


def test_object_store_restores_list_nothing_and_name_the_missing_chunk():
    # No listing: the reads' own answers (a missing chunk is an error, never fill values). An
    # object per chunk; data objects' records are checked in tests/test_objects.py.
    url = "memory://safety-listing/c"
    chunks = jaxckpt.DefaultSavePlanner(pack_bytes=0, layout="chunks")
    jaxckpt.save(url, {"w": np.ones(1, np.float32), "c": {"c": np.ones(2)}}, planner=chunks)
    assert jaxckpt.restore(url)["c"]["c"].shape == (2,)  # an array named c: keys c/c/...
    kv = kvstore(Location(url).kvstore)
    m = json.loads(kv.read("manifest.json").result().value)
    m["entries"]["w"].update(shape=[2**20], chunks=[1])  # one chunk on the store
    kv.write("manifest.json", json.dumps(m).encode()).result()
    # Which missing chunk is named first depends on which read answers first.
    missing = r"Key 'w': chunk \([0-9]+\) of arrays/w .* is missing"
    with pytest.raises(jaxckpt.CorruptChunkError, match=missing):
        jaxckpt.restore(url)


_LIMITED_OBJECTS = textwrap.dedent(
    """
    import json, resource, numpy as np
    import jaxckpt
    from jaxckpt._storage.location import Location, kvstore
    url = "memory://safety-alloc/c"
    chunks = jaxckpt.DefaultSavePlanner(pack_bytes=0, layout="chunks")  # an object per chunk
    jaxckpt.save(url, {"w": np.zeros(4, np.float32)}, planner=chunks)
    kv = kvstore(Location(url).kvstore)
    m = json.loads(kv.read("manifest.json").result().value)
    m["entries"]["w"].update(shape=[2**34], chunks=[2**18])  # 64 GiB in 65,536 chunks
    kv.write("manifest.json", json.dumps(m).encode()).result()
    resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))  # far below what is declared
    try:
        jaxckpt.restore(url)
    except jaxckpt.CorruptChunkError as e:
        print("TYPED", e)
    """
)


def test_an_object_store_box_too_big_to_allocate_is_checked_against_its_chunks():
    # Only then is the array's chunks listed: the missing one is named, not a MemoryError.
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    r = subprocess.run(
        [sys.executable, "-c", _LIMITED_OBJECTS],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "TYPED Key 'w': chunk (1) of arrays/w" in r.stdout, r.stdout
    assert "1 of 65536 declared chunks found" in r.stdout, r.stdout


def test_zero_size_arrays_and_scalars_have_no_missing_chunks(tmp_path):
    d = tmp_path / "c"
    tree = {"z": np.zeros((0, 3)), "s": np.float32(2), "m": np.ones((3, 5))}
    jaxckpt.save(d, tree, planner=_UNPACKED)
    out = jaxckpt.restore(d)
    assert out["z"].shape == (0, 3) and out["s"] == 2
    (d / "arrays/s/c").unlink()
    with pytest.raises(jaxckpt.CorruptChunkError, match=r"Key 's': chunk \(\) .* is missing"):
        jaxckpt.restore(d)


# 4. every malformed manifest is a ManifestError -------------------------------------------------


def _manifest_bytes(tmp_path: Path) -> bytes:
    d = tmp_path / "c"
    jaxckpt.save(d, {"a": {"b": jnp.ones(2), "n": 3}, "l": [1.5, "x"]})
    return (d / "manifest.json").read_bytes()


def test_a_tree_nested_beyond_the_json_decoder_is_a_manifest_error(tmp_path):
    m = json.loads(_manifest_bytes(tmp_path))
    deep = '{"type": "list", "children": [' * 100_000 + "]}" * 100_000
    raw = json.dumps(m).replace(json.dumps(m["tree"]), deep).encode()
    with pytest.raises(jaxckpt.ManifestError, match="nested too deeply"):
        Manifest.from_json(raw)


def test_a_tree_nested_within_the_decoder_but_too_deep_is_a_manifest_error(tmp_path):
    m = json.loads(_manifest_bytes(tmp_path))
    tree = json.dumps(m["tree"])
    deep = '{"type": "list", "children": [' * 420 + tree + "]}" * 420  # deeper than 400
    with pytest.raises(jaxckpt.ManifestError, match="malformed"):
        Manifest.from_json(json.dumps(m).replace(tree, deep).encode())


@pytest.mark.parametrize("key", [["a"], {"k": 1}, None, 1.5, True])
def test_tree_keys_must_be_str_or_int(tmp_path, key):
    m = json.loads(_manifest_bytes(tmp_path))
    m["tree"]["keys"][0] = key
    with pytest.raises(jaxckpt.ManifestError, match="keys must be str or int"):
        Manifest.from_json(json.dumps(m).encode())


@pytest.mark.parametrize("value", [[], ["float32"], {"a": 1}])
def test_a_pack_dtype_that_is_not_a_string_is_a_manifest_error(tmp_path, value):
    d = tmp_path / "c"  # found by the property test below (on packed manifests)
    jaxckpt.save(
        d,
        {"a": np.ones(2, np.float32), "b": np.ones(3, np.float32)},
        planner=jaxckpt.DefaultSavePlanner(pack_bytes=1 << 10),
    )
    m = json.loads((d / "manifest.json").read_bytes())
    m["packs"][next(iter(m["packs"]))]["storage_dtype"] = value
    with pytest.raises(jaxckpt.ManifestError, match=r"pack 'arrays/pack.* data type"):
        Manifest.from_json(json.dumps(m).encode())


def test_a_leaf_key_that_is_not_a_string_is_a_manifest_error(tmp_path):
    m = json.loads(_manifest_bytes(tmp_path))
    m["tree"]["children"][0]["children"][0]["key"] = ["a", "b"]
    with pytest.raises(jaxckpt.ManifestError, match="no entry"):
        Manifest.from_json(json.dumps(m).encode())


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda kids: (
        st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids, max_size=4)
    ),
    max_leaves=12,
)


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, (*prefix, i))


_VALID: dict = {}


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_any_mutation_of_a_valid_manifest_loads_or_is_a_manifest_error(tmp_path_factory, data):
    if not _VALID:
        _VALID["m"] = json.loads(_manifest_bytes(tmp_path_factory.mktemp("valid")))
    m = json.loads(json.dumps(_VALID["m"]))
    for _ in range(data.draw(st.integers(1, 3))):
        paths = [p for p in _paths(m) if p]
        where = data.draw(st.sampled_from(paths))
        parent = m
        for part in where[:-1]:
            parent = parent[part]
        if data.draw(st.booleans()) and isinstance(parent, dict):
            del parent[where[-1]]
        else:
            parent[where[-1]] = data.draw(_json)
    try:
        loaded = Manifest.from_json(json.dumps(m).encode())
    except jaxckpt.ManifestError:
        return
    from jaxckpt._planning import tree as _tree

    _tree.unflatten(loaded.tree, {k: e for k, e in loaded.entries.items()})


# 5. bad leaves get a typed error naming the key -------------------------------------------------


def _deleted() -> jax.Array:
    x = jnp.ones(3)
    x.delete()
    return x


@pytest.mark.parametrize("how", ["save", "save_async", "manager"])
def test_a_deleted_array_is_an_unsupported_leaf(tmp_path, how):
    tree = {"params": {"w": _deleted()}}
    with pytest.raises(jaxckpt.UnsupportedLeafError, match=r"'params/w' is a deleted.*donat"):
        _save(tmp_path, tree, how)
    assert not (tmp_path / "c").exists()


def test_a_donated_array_is_an_unsupported_leaf(tmp_path):
    x = jax.device_put(jnp.ones(3))
    jax.jit(lambda a: a + 1, donate_argnums=0)(x)
    if not x.is_deleted():  # CPU may decline the donation
        pytest.skip("this backend did not donate")
    with pytest.raises(jaxckpt.UnsupportedLeafError, match=r"'x' is a deleted"):
        jaxckpt.save(tmp_path / "c", {"x": x})


@pytest.mark.parametrize("how", ["save", "save_async", "manager"])
def test_a_tracer_is_an_unsupported_leaf(tmp_path, how):
    @jax.jit
    def step(w):
        _save(tmp_path, {"w": w}, how)
        return w

    with pytest.raises(jaxckpt.UnsupportedLeafError, match=r"'w' is a JAX tracer.*outside"):
        step(jnp.ones(2))


@pytest.mark.parametrize("how", ["save", "save_async", "manager"])
def test_dict_keys_jax_cannot_sort_are_an_unsupported_leaf(tmp_path, how):
    tree = {"opt": {"layers": {1: jnp.ones(2), "bias": jnp.zeros(2)}}}
    with pytest.raises(jaxckpt.UnsupportedLeafError, match=r"dict at 'opt/layers'.*one type"):
        _save(tmp_path, tree, how)


def _save(tmp_path: Path, tree, how: str) -> None:
    """Save; the error must come at the call (it is found while planning), not later."""
    if how == "save":
        jaxckpt.save(tmp_path / "c", tree)
    elif how == "save_async":
        jaxckpt.save_async(tmp_path / "c", tree)
    else:
        mgr = jaxckpt.CheckpointManager(tmp_path / "run")
        try:
            mgr.save(1, tree)
        finally:
            mgr.close()
