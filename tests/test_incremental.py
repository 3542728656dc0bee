"""Incremental saves: a step writes only the boxes whose bytes changed, and stays whole.

Local files: unchanged boxes are hard links to the base's chunk files, so deleting any step
(by retention or rm -rf) never breaks another. Object stores: arrays unchanged as a whole are
referenced from the manifest, and retention keeps what a kept step references.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import zarr
from helpers import assert_tree_equal, mesh, put
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_s3 import BUCKET, keys, prefix, s3  # noqa: F401  (fixtures: the moto server)

import jaxckpt
from jaxckpt._cli.main import main
from jaxckpt._storage import chunkfile as _chunkfile
from jaxckpt._storage import location as _location

M = mesh((4, 2), ("data", "model"))
FROZEN = (
    np.random.default_rng(0).standard_normal((1024, 1024)).astype(np.float32)
)  # 4 MiB: unpacked


def state(step: int) -> dict:
    """A frozen sharded base, a frozen small leaf, and adapters that change every step."""
    return {
        "base": put(FROZEN, M, "data", "model"),
        "emb": put(FROZEN[:64, :64].astype(jnp.bfloat16), M, "data"),
        "adapter": put(np.full((64, 8), step, np.float32), M, "data"),
        "norm": jnp.full(8, 1.5),  # small: packed with its kind
        "step": step,
    }


def chunk_files(ckpt) -> dict[str, os.stat_result]:
    root = os.fspath(ckpt) + "/arrays"
    return {
        os.path.relpath(os.path.join(r, f), root): os.stat(os.path.join(r, f))
        for r, _, fs in os.walk(root)
        for f in fs
        if "/c" in r.replace(root, "") or f == "c"
    }


def test_unchanged_boxes_are_linked_not_written(tmp_path):
    jaxckpt.save(tmp_path / "1", state(1))
    h = jaxckpt.save_async(tmp_path / "2", state(2), base=tmp_path / "1")
    h.wait()
    assert h.reused_bytes == FROZEN.nbytes + 64 * 64 * 2  # base, and the bfloat16 pack of emb
    assert h.nbytes == (64 * 8 + 8) * 4  # the float32 pack: adapter and norm
    files = chunk_files(tmp_path / "2")
    linked = {k for k, s in files.items() if s.st_nlink == 2}
    assert any(k.startswith("base/") for k in linked), sorted(files)
    assert not any(k.startswith("adapter/") for k in linked)
    created = json.loads((tmp_path / "2" / "manifest.json").read_text())["created"]
    assert created["base"] == "1" and created["reused_bytes"] == h.reused_bytes
    assert_tree_equal(jaxckpt.restore(tmp_path / "2", state(0)), state(2))


def test_a_base_chunk_that_is_a_symlink_is_written_not_linked(tmp_path):
    """A base whose chunk file was swapped for a symbolic link (to a file with the same
    bytes) gives the new step a regular file of its own: a link to a link would make the new
    step depend on a file outside every checkpoint."""
    jaxckpt.save(tmp_path / "1", state(1))
    files = chunk_files(tmp_path / "1")
    name = next(k for k in sorted(files) if k.startswith("base/"))
    chunk = tmp_path / "1" / "arrays" / name
    outside = tmp_path / "outside"
    shutil.copyfile(chunk, outside)
    chunk.unlink()
    chunk.symlink_to(outside)
    h = jaxckpt.save_async(tmp_path / "2", state(2), base=tmp_path / "1")
    h.wait()
    new = tmp_path / "2" / "arrays" / name
    assert not new.is_symlink() and new.stat().st_nlink == 1
    assert h.reused_bytes < FROZEN.nbytes + 64 * 64 * 2  # that box was written
    outside.unlink()
    assert_tree_equal(jaxckpt.restore(tmp_path / "2", state(0)), state(2))


def test_a_base_chunk_folder_that_is_a_symlink_is_written_not_linked(tmp_path):
    """A base whose folder of chunks was swapped for a symbolic link (to a folder outside it,
    with the same files) gives the new step files of its own: nothing outside the base is
    linked into a step."""
    jaxckpt.save(tmp_path / "1", state(1), digests=True)
    name = next(k for k in sorted(chunk_files(tmp_path / "1")) if k.startswith("base/"))
    folder = (tmp_path / "1" / "arrays" / name).parent
    outside = tmp_path / "outside"
    shutil.copytree(folder, outside)
    shutil.rmtree(folder)
    folder.symlink_to(outside, target_is_directory=True)
    jaxckpt.save(tmp_path / "2", state(2), base=tmp_path / "1")
    links = [f.stat().st_nlink for f in outside.iterdir()]
    assert links and set(links) == {1}  # each outside file has its own name only
    shutil.rmtree(outside)
    assert_tree_equal(jaxckpt.restore(tmp_path / "2", state(0)), state(2))


def test_every_step_survives_deleting_the_others(tmp_path):
    """rm -rf of the base, cp -r of a step: each step is a whole checkpoint on its own."""
    jaxckpt.save(tmp_path / "1", state(1))
    jaxckpt.save(tmp_path / "2", state(2), base=tmp_path / "1")
    jaxckpt.save(tmp_path / "3", state(3), base=tmp_path / "2")
    shutil.copytree(tmp_path / "3", tmp_path / "copy")
    shutil.rmtree(tmp_path / "2")
    shutil.rmtree(tmp_path / "1")
    assert_tree_equal(jaxckpt.restore(tmp_path / "3"), jax.device_get(state(3)))
    shutil.rmtree(tmp_path / "3")
    assert_tree_equal(jaxckpt.restore(tmp_path / "copy"), jax.device_get(state(3)))
    assert main(["verify", str(tmp_path / "copy")]) == 0


def test_new_arrays_with_the_same_bytes_are_found(tmp_path):
    """What a jitted step hands back: new arrays, identical bytes (no identity is used)."""
    s1 = state(1)
    jaxckpt.save(tmp_path / "1", s1)
    s2 = {**s1, "base": jax.jit(lambda x: x * 1.0)(s1["base"]), "step": 2}
    assert s2["base"] is not s1["base"]
    h = jaxckpt.save_async(tmp_path / "2", s2, base=tmp_path / "1")
    h.wait()
    assert h.reused_bytes >= FROZEN.nbytes


FLIPS = {
    "one_element": lambda a: a.at[17, 300].add(1.0),
    "one_bit": lambda a: jax.lax.bitcast_convert_type(
        jax.lax.bitcast_convert_type(a, jnp.uint32).at[200, 5].add(1), jnp.float32
    ),
    "negative_zero": lambda a: a.at[1023, 1023].set(-0.0),
    "nan_payload": lambda a: jax.lax.bitcast_convert_type(
        jax.lax.bitcast_convert_type(a.at[1, 1].set(jnp.nan), jnp.uint32).at[1, 1].add(3),
        jnp.float32,
    ),
}


@pytest.mark.parametrize("flip", sorted(FLIPS))
def test_a_changed_box_is_always_written(tmp_path, flip):
    x = np.array(FROZEN)
    x[1023, 1023] = 0.0  # so that -0.0 is a change of bits only
    x[1, 1] = np.nan
    base = put(x, M, "data", "model")
    jaxckpt.save(tmp_path / "1", {"w": base})
    changed = put(np.asarray(FLIPS[flip](jnp.asarray(x))), M, "data", "model")
    assert np.asarray(changed).tobytes() != x.tobytes()
    h = jaxckpt.save_async(tmp_path / "2", {"w": changed}, base=tmp_path / "1")
    h.wait()
    back = jaxckpt.restore(tmp_path / "2")["w"]
    assert back.tobytes() == np.asarray(changed).tobytes()  # bit for bit, NaN payload included
    assert h.nbytes == x.nbytes // 8  # exactly the one changed shard of the 8
    assert h.reused_bytes == x.nbytes - x.nbytes // 8


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    index=st.tuples(st.integers(0, 15), st.integers(0, 7)),
    bit=st.integers(0, 31),
    packed=st.booleans(),
)
def test_any_single_bit_flip_is_saved(tmp_path, index, bit, packed):
    """Property: whatever bit of whatever element changes, the new step holds the new bits."""
    d = tmp_path / f"{index[0]}-{index[1]}-{bit}-{packed}"
    planner = jaxckpt.DefaultSavePlanner(pack_bytes=None if packed else 0)
    a = np.arange(128, dtype=np.uint32).reshape(16, 8)
    jaxckpt.save(d / "1", {"a": a, "b": a + 1}, planner=planner)
    b = a.copy()
    b[index] ^= np.uint32(1 << bit)
    jaxckpt.save(d / "2", {"a": b, "b": a + 1}, planner=planner, base=d / "1")
    back = jaxckpt.restore(d / "2")
    assert back["a"].tobytes() == b.tobytes() and back["b"].tobytes() == (a + 1).tobytes()


BIG = np.random.default_rng(1).standard_normal((512, 1024)).astype(np.float32)  # 256 KiB boxes


def _chain(d, arrays: list[np.ndarray]) -> list:
    """Save each array as step 1, 2, ... (each step's base the one before); the handles."""
    handles = []
    for n, x in enumerate(arrays, 1):
        h = jaxckpt.save_async(
            d / str(n), {"w": put(x, M, "data", "model")}, base=d / str(n - 1) if n > 1 else None
        )
        h.wait()
        handles.append(h)
    return handles


@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(at=st.integers(0, BIG.nbytes // 8 - 1), bit=st.integers(0, 7))
def test_a_bit_flip_anywhere_in_a_probed_box_is_saved(tmp_path, at, bit):
    """Property, with a base that recorded probes (a 3-step chain): a changed byte inside the
    probe's sample makes the probe differ, one outside it is found by the full digest."""
    d = tmp_path / f"{at}-{bit}"
    flipped = BIG.copy()
    b = flipped[:128, :512].copy().reshape(-1).view(np.uint8)  # one box of the (4, 2) mesh
    b[at] ^= np.uint8(1 << bit)
    flipped[:128, :512] = b.view(np.float32).reshape(128, 512)
    h = _chain(d, [BIG, BIG, flipped])
    manifest = jaxckpt.metadata(d / "2")
    assert manifest.probes and manifest.digests  # the base of step 3 recorded both
    back = jaxckpt.restore(d / "3")["w"]
    assert back.tobytes() == flipped.tobytes()
    assert h[2].nbytes == BIG.nbytes // 8  # exactly the changed box
    assert h[2].reused_bytes == BIG.nbytes - BIG.nbytes // 8


def test_boxes_that_keep_changing_are_probed_not_hashed(tmp_path):
    """Pre-training: a box whose probe differs from the base's is written without its full
    digest; at the first step it stops changing, the base's bytes are read back to compare
    (the base took no digest of them), and it is reused from that step on."""
    steps = [BIG, BIG + 1, BIG + 2, BIG + 2, BIG + 2]
    h = _chain(tmp_path, steps)
    third = jaxckpt.metadata(tmp_path / "3")
    (path,) = {e.path for e in third.entries.values() if isinstance(e, jaxckpt.ArrayEntry)}
    assert len(third.probes[path]) == 8 and path not in third.digests  # changed: no digest
    assert [x.reused_bytes for x in h[1:]] == [0, 0, BIG.nbytes, BIG.nbytes]
    assert len(jaxckpt.metadata(tmp_path / "4").digests[path]) == 8  # probe equal: digested
    for n, x in enumerate(steps, 1):
        assert jaxckpt.restore(tmp_path / str(n))["w"].tobytes() == x.tobytes()


def test_hostile_probes_are_refused(tmp_path):
    _chain(tmp_path, [BIG, BIG])
    raw = json.loads((tmp_path / "2" / "manifest.json").read_text())
    raw["probes"] = {"../../etc/passwd": {"0,0+128,512": "0" * 32}}
    (tmp_path / "2" / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(jaxckpt.ManifestError, match=r"the probes of '\.\./\.\./etc/passwd'"):
        jaxckpt.restore(tmp_path / "2")


def test_a_pack_is_reused_only_whole(tmp_path):
    small = {f"p{i}": np.full(16, i, np.float32) for i in range(20)}
    jaxckpt.save(tmp_path / "1", small)
    h = jaxckpt.save_async(tmp_path / "2", small, base=tmp_path / "1")
    h.wait()
    assert h.nbytes == 0 and h.reused_bytes == 20 * 16 * 4
    changed = {**small, "p7": np.full(16, -1, np.float32)}
    h = jaxckpt.save_async(tmp_path / "3", changed, base=tmp_path / "2")
    h.wait()
    assert h.reused_bytes == 0 and h.nbytes == 20 * 16 * 4
    assert_tree_equal(jaxckpt.restore(tmp_path / "3"), changed)


def test_a_base_saved_without_digests_is_read_once(tmp_path):
    """A base of an older jaxckpt (or saved without base=) has no digests: its bytes are read."""
    jaxckpt.save(tmp_path / "1", state(1))
    m = json.loads((tmp_path / "1" / "manifest.json").read_text())
    m.pop("digests", None)
    assert "digests" not in m
    h = jaxckpt.save_async(tmp_path / "2", state(2), base=tmp_path / "1")
    h.wait()
    assert h.reused_bytes >= FROZEN.nbytes
    assert "digests" in json.loads((tmp_path / "2" / "manifest.json").read_text())


def test_the_first_step_records_digests_so_the_second_reads_nothing_back(tmp_path):
    """An incremental run's first step (no base yet) records its digests, so the second step
    compares without reading the first one's bytes; a plain save hashes nothing."""
    jaxckpt.save(tmp_path / "plain", state(1))
    assert jaxckpt.metadata(tmp_path / "plain").digests == {}
    mgr = jaxckpt.CheckpointManager(tmp_path / "run", incremental=True, async_save=False)
    mgr.save(1, state(1))
    (step1,) = [p for p in (tmp_path / "run").iterdir() if p.is_dir()]
    first = jaxckpt.metadata(step1)
    assert first.digests and "base" not in first.created
    before = _chunkfile.bytes_read()
    mgr.save(2, state(2))
    assert _chunkfile.bytes_read() == before  # nothing of step 1 was read to compare
    assert mgr.last_save.reused_bytes >= FROZEN.nbytes
    assert_tree_equal(mgr.restore(2), jax.device_get(state(2)))


def test_an_old_format_base_is_compared_by_content(tmp_path):
    """tests/data/v1_main, written by an earlier jaxckpt (no digests, no packs), as a base:
    arrays saved with the same layout are reused, the others written."""
    old = os.path.join(os.path.dirname(__file__), "data", "v1_main")
    tree = jaxckpt.restore(old)
    planner = jaxckpt.DefaultSavePlanner(pack_bytes=0)  # laid out as v1 did: one array per leaf
    h = jaxckpt.save_async(tmp_path / "2", tree, planner=planner, base=old)
    h.wait()
    # "q" (uint4) and "params/b" are whole-array chunks on both sides; "params/w" was sharded
    assert h.reused_bytes >= tree["q"].nbytes + tree["params"]["b"].nbytes
    assert_tree_equal(jaxckpt.restore(tmp_path / "2"), tree)


def test_every_reader_reads_an_incremental_step(tmp_path, capsys):
    jaxckpt.save(tmp_path / "1", state(1))
    jaxckpt.save(tmp_path / "2", state(2), base=tmp_path / "1")
    step = tmp_path / "2"
    other = mesh((2, 4), ("x", "y"))
    shard = jax.sharding.NamedSharding(other, jax.sharding.PartitionSpec("y", "x"))
    got = jaxckpt.restore(step, {"base": shard}, keys=["base"], strict=False)
    assert got["base"].sharding == shard and np.array_equal(got["base"], FROZEN)
    assert jaxckpt.metadata(step).entries["base"].shape == FROZEN.shape
    assert main(["verify", str(step)]) == 0
    assert main(["inspect", str(step)]) == 0
    entry = jaxckpt.metadata(step).entries["base"]
    assert np.array_equal(zarr.open_array(str(step / entry.path), mode="r")[...], FROZEN)
    assert main(["export", str(step), str(tmp_path / "out.npz")]) == 0
    assert np.array_equal(np.load(tmp_path / "out.npz")["base"], FROZEN)
    jaxckpt.convert(str(step), str(tmp_path / "converted"))
    assert_tree_equal(jaxckpt.restore(tmp_path / "converted"), jax.device_get(state(2)))
    capsys.readouterr()
    assert main(["ls", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "1 " in out and "reused" in out


def test_manager_incremental_with_retention(tmp_path):
    d = tmp_path / "run"
    with jaxckpt.CheckpointManager(d, max_to_keep=2, incremental=True) as mgr:
        sizes = []
        for step in range(1, 6):
            mgr.save(step, state(step))
            mgr.wait()
            sizes.append((mgr.last_save.nbytes, mgr.last_save.reused_bytes))
        assert mgr.all_steps() == [4, 5]
        for step in (4, 5):
            assert_tree_equal(mgr.restore(step), jax.device_get(state(step)))
    first, later = sizes[0], sizes[1:]
    assert first[1] == 0
    assert all(reused >= FROZEN.nbytes and written < first[0] / 4 for written, reused in later)


def test_base_on_another_kind_of_storage_is_refused(tmp_path):
    jaxckpt.save(tmp_path / "1", state(1))
    with pytest.raises(jaxckpt.CheckpointError, match=r"same kind of storage.*base="):
        jaxckpt.save("memory://x/2", state(2), base=tmp_path / "1")


def test_a_missing_base_names_it(tmp_path):
    with pytest.raises(jaxckpt.CheckpointNotFoundError, match="nosuch"):
        jaxckpt.save(tmp_path / "2", state(2), base=tmp_path / "nosuch")
    assert not (tmp_path / "2").exists()


def test_s3_references_and_reference_aware_retention(s3, prefix):  # noqa: F811
    run = f"s3://{BUCKET}/{prefix}"
    with jaxckpt.CheckpointManager(run, max_to_keep=2, incremental=True) as mgr:
        for step in range(1, 5):
            mgr.save(step, state(step))
            mgr.wait()
            if step > 1:
                assert mgr.last_save.reused_bytes >= FROZEN.nbytes
        assert mgr.all_steps() == [3, 4]
        refs = jaxckpt.metadata(f"{run}/00000004").refs
        assert refs and all(t.startswith("../00000001/") for t in refs.values()), refs
        assert jaxckpt.metadata(f"{run}/00000004").version == 3
        # step 1 is gone as a checkpoint, but what steps 3 and 4 reference of it stays
        stored = keys(s3, prefix)
        assert "00000001/manifest.json" not in stored
        assert any(k.startswith("00000001/arrays/base/") for k in stored)
        assert not any(k.startswith("00000002/") for k in stored)
        for step in (3, 4):
            assert_tree_equal(mgr.restore(step), jax.device_get(state(step)))


def test_s3_retention_deletes_nothing_when_a_kept_manifest_cannot_be_read(
    s3,  # noqa: F811
    prefix,  # noqa: F811
    monkeypatch,
    caplog,
):
    """A kept step's manifest that times out (the service stalled) is no step that references
    nothing: retention deletes nothing that pass, instead of the arrays that step needs."""
    caplog.set_level(logging.WARNING, logger="jaxckpt")  # whatever an earlier test set
    run = f"s3://{BUCKET}/{prefix}"
    mgr = jaxckpt.CheckpointManager(run, max_to_keep=2, incremental=True)
    for step in (1, 2):
        mgr.save(step, state(step))
        mgr.wait()
    read = _location.read_manifest

    def stalled(loc):  # only retention's reads of the kept steps' manifests
        if sys._getframe(1).f_code.co_name == "referenced":
            raise jaxckpt.CheckpointError(f"reading manifest.json at {loc} did not finish")
        return read(loc)

    monkeypatch.setattr(_location, "read_manifest", stalled)
    mgr.save(3, state(3))
    mgr.wait()  # a failed retention does not fail the save: it is logged
    assert "retention after step 3" in caplog.text
    assert mgr.all_steps() == [1, 2, 3]  # step 1, referenced by 2 and 3, is still whole
    for step in (2, 3):
        assert_tree_equal(mgr.restore(step), jax.device_get(state(step)))
    monkeypatch.setattr(_location, "read_manifest", read)
    mgr.save(4, state(4))  # the next pass deletes what it could not
    mgr.wait()
    assert mgr.all_steps() == [3, 4]
    for step in (3, 4):
        assert_tree_equal(mgr.restore(step), jax.device_get(state(step)))


def test_s3_verify_reports_referenced_data_removed_by_hand(s3, prefix, capsys):  # noqa: F811
    run = f"s3://{BUCKET}/{prefix}"
    jaxckpt.save(f"{run}/1", state(1), digests=True)  # an object per chunk: referable
    jaxckpt.save(f"{run}/2", state(2), base=f"{run}/1")
    for k in keys(s3, prefix):
        if k.startswith("1/"):
            s3.delete_object(Bucket=BUCKET, Key=f"{prefix}/{k}")
    assert main(["verify", f"{run}/2"]) == 1
    err = capsys.readouterr()
    assert "an array this incremental step references" in err.out + err.err
    with pytest.raises(
        jaxckpt.CorruptChunkError, match=r"references \S+ in \S+/1, which no longer"
    ):
        jaxckpt.restore(f"{run}/2")


def test_local_copy_of_an_object_store_step_says_what_to_do(tmp_path):
    jaxckpt.save("memory://inc/1", state(1), digests=True)  # an object per chunk: referable
    jaxckpt.save("memory://inc/2", state(2), base="memory://inc/1")
    raw = jaxckpt.metadata("memory://inc/2")
    assert raw.refs
    (tmp_path / "2").mkdir()
    (tmp_path / "2" / "manifest.json").write_bytes(raw.to_json())
    with pytest.raises(jaxckpt.ManifestError, match="incremental step saved on an object store"):
        jaxckpt.restore(tmp_path / "2")


@pytest.mark.parametrize("digests", [False, True])
def test_a_base_in_data_objects_is_written_again_then_reused(digests):
    """A plain save on an object store writes format v5's data objects (the default): an
    incremental save against it works, and writes every array again (records are neither
    linked nor referenced), as an object per chunk with its digests, so the step after it
    references its unchanged arrays as usual."""
    run = f"memory://v5base-{digests}"
    jaxckpt.save(f"{run}/1", state(1))
    assert jaxckpt.metadata(f"{run}/1").version == 5
    first = jaxckpt.save_async(f"{run}/2", state(2), base=f"{run}/1", digests=digests)
    first.wait()
    step2 = jaxckpt.metadata(f"{run}/2")
    assert first.reused_bytes == 0 and not step2.refs and step2.version < 5
    assert_tree_equal(jaxckpt.restore(f"{run}/2"), jax.device_get(state(2)))
    second = jaxckpt.save_async(f"{run}/3", state(3), base=f"{run}/2")
    second.wait()
    assert second.reused_bytes >= FROZEN.nbytes
    assert jaxckpt.metadata(f"{run}/3").refs["arrays/base"] == "../2/arrays/base"
    assert_tree_equal(jaxckpt.restore(f"{run}/3"), jax.device_get(state(3)))
    assert_tree_equal(jaxckpt.restore(f"{run}/1"), jax.device_get(state(1)))


def test_hashing_happens_after_staging(tmp_path):
    """save_async returns before the write: donating the arrays after it is safe."""
    x = put(FROZEN, M, "data", "model")
    jaxckpt.save(tmp_path / "1", {"w": x})
    f = jax.jit(lambda a: a + 1, donate_argnums=0)
    h = jaxckpt.save_async(tmp_path / "2", {"w": x}, base=tmp_path / "1")
    f(x)  # donated while the save hashes and links in the background
    h.wait()
    assert np.array_equal(jaxckpt.restore(tmp_path / "2")["w"], FROZEN)


def test_an_older_reader_refuses_a_v3_step():
    """A manifest with references is version 3: a reader of versions 1-2 says to upgrade."""
    code = (
        "import jaxckpt._format.manifest as m, sys\n"
        "m.VERSIONS = (1, 2)\n"
        "try:\n"
        "    m.Manifest.from_json(sys.stdin.buffer.read())\n"
        "except m.ManifestError as e:\n"
        "    print(e)\n"
    )
    jaxckpt.save("memory://v3/1", state(1), digests=True)  # an object per chunk: referable
    jaxckpt.save("memory://v3/2", state(2), base="memory://v3/1")
    raw = jaxckpt.metadata("memory://v3/2").to_json()
    r = subprocess.run(
        [sys.executable, "-c", code], input=raw, capture_output=True, env={**os.environ}
    )
    assert b"version 3" in r.stdout and b"Upgrade jaxckpt" in r.stdout, r


class _Recorder(jaxckpt.DefaultSavePlanner):
    """Records the order in which the save resolves its boxes."""

    def __init__(self) -> None:
        super().__init__()
        self.order: list[str] = []

    def resolve_data(self, item):
        self.order.append(item.key)
        return super().resolve_data(item)


@pytest.mark.parametrize("use_async", [False, True])
def test_boxes_that_changed_in_the_base_step_are_resolved_early(tmp_path, use_async):
    """Boxes that changed in the base's own step (it took their probe, not their digest) are
    resolved right after the first few unchanged boxes, so their writes overlap the hashing of
    the rest; the order changes nothing that is saved."""
    from jaxckpt._planning.reuse import HASH_AHEAD_ITEMS

    frozen = {f"a{i}": put(BIG, M, "data", "model") for i in range(2)}  # 16 boxes
    for n in (1, 2, 3):
        tree = {**frozen, "z": put(BIG + n, M, "data", "model")}  # last in key order
        planner = _Recorder()
        base = tmp_path / str(n - 1) if n > 1 else None
        save = jaxckpt.save_async if use_async else jaxckpt.save
        h = save(tmp_path / str(n), tree, base=base, digests=n == 1, planner=planner)
        if use_async:
            h.wait()
        assert_tree_equal(jaxckpt.restore(tmp_path / str(n)), jax.device_get(tree))
    assert planner.order[-8:] != ["z"] * 8  # the key order would resolve z last
    assert planner.order[HASH_AHEAD_ITEMS : HASH_AHEAD_ITEMS + 8] == ["z"] * 8
    assert planner.order[:HASH_AHEAD_ITEMS] == ["a0"] * HASH_AHEAD_ITEMS


def test_a_save_goes_on_while_every_hash_thread_is_busy(tmp_path):
    """With every hash thread taken (another save, a stuck task), the saving thread hashes
    the boxes itself: the save completes, links what is unchanged and saves what changed."""
    import threading

    from jaxckpt._runtime import pools

    jaxckpt.save(tmp_path / "1", state(1), digests=True)
    release = threading.Event()
    blockers = [pools.hash_pool().submit(release.wait) for _ in range(pools.HASH_THREADS)]
    saving = threading.Thread(
        target=jaxckpt.save, args=(tmp_path / "2", state(2)), kwargs={"base": tmp_path / "1"}
    )
    saving.start()
    saving.join(timeout=120)
    waited = saving.is_alive()
    release.set()  # whatever happened, let the pool and a stuck save go
    saving.join()
    for b in blockers:
        b.result()
    assert not waited, "the save waited for hash threads that were all busy"
    reused = jaxckpt.metadata(tmp_path / "2").created["reused_bytes"]
    assert reused == FROZEN.nbytes + 64 * 64 * 2  # the base, and the bfloat16 pack of emb
    assert_tree_equal(jaxckpt.restore(tmp_path / "2", state(0)), state(2))
