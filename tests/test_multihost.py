"""Multi-host save and restore on real ``jax.distributed`` process groups on 127.0.0.1.

One pipeline, run once per module (process groups are slow to start on small machines):

1. this pytest process (8 devices, no ``jax.distributed``) saves ``ckpt1``;
2. a group of 2 processes x 4 devices restores it (1 -> 2) and saves ``ckpt2``;
3. a group of 4 processes x 4 devices restores ``ckpt2`` (2 -> 4), saves ``ckpt4`` and checks
   balance, dedup policies, overwrite, async saves, shared failures, a plan mismatch, and a
   process killed mid-save;
4. this process restores ``ckpt4`` (4 -> 1).

The workers (``tests/mh_worker.py``) check each error with ``pytest.raises(match=)`` in the
process that raised it and record ``"ok"`` or the traceback; the tests here read the records.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax
import mh_worker
import numpy as np
import pytest
from groups import run_group
from helpers import one_array_per_leaf  # noqa: F401 (autouse)

import jaxckpt
from jaxckpt._cli.main import main

WORKER = Path(__file__).with_name("mh_worker.py")
GROUP_TIMEOUT_S = 150


def _run_group(stage: str, n: int, work: Path) -> list[dict]:
    return run_group(WORKER, stage, n, work, GROUP_TIMEOUT_S)


@pytest.fixture(scope="module")
def groups(tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("multihost")
    jaxckpt.save(work / "ckpt1", mh_worker.make_state("single"))
    two = _run_group("two", 2, work)
    four = _run_group("four", 4, work)
    return {"work": work, "two": two, "four": four}


def _ok(records: list[dict], check: str, processes=None) -> None:
    for p in processes if processes is not None else range(len(records)):
        got = records[p]["checks"].get(check, "not run")
        assert got == "ok", f"check {check!r} on process {p}:\n{got}"


def test_single_process_save_needs_no_coordinator(groups):
    from jax._src import distributed

    assert distributed.global_state.client is None
    assert jaxckpt.metadata(groups["work"] / "ckpt1").created["process_count"] == 1


def test_restore_one_to_two_processes_bit_exact(groups):
    _ok(groups["two"], "restore_1")


def test_restore_two_to_four_processes_bit_exact(groups):
    _ok(groups["two"], "save_2")
    _ok(groups["four"], "restore_2")


def test_round_trip_four_processes_bit_exact(groups):
    _ok(groups["four"], "save_4")
    _ok(groups["four"], "save_async_overwrite")
    _ok(groups["four"], "save_async_budget")
    assert jaxckpt.metadata(groups["work"] / "ckpt4").created["process_count"] == 4


def test_restore_four_to_one_process_bit_exact(groups):
    ckpt = groups["work"] / "ckpt4"
    mh_worker.check_state(jaxckpt.restore(ckpt, mh_worker.target("two", jax.devices())))
    host = jaxckpt.restore(ckpt)  # no target: numpy on this host
    for key in mh_worker.ARRAYS:
        got = host
        for part in key.split("/"):
            got = got[part]
        assert got.tobytes() == mh_worker.value(key).tobytes(), key


def _overhead(ckpt: Path) -> tuple[int, int]:
    """(zarr.json bytes, chunk files) of a checkpoint: what tensorstore writes besides data."""
    meta = sum(p.stat().st_size for p in ckpt.glob("arrays/*/zarr.json"))
    chunks = sum(1 for p in ckpt.glob("arrays/*/c/**/*") if p.is_file())
    return meta, chunks


def _payload() -> int:
    return sum(mh_worker.value(k).nbytes for k in [*mh_worker.ARRAYS, mh_worker.HOST])


def test_every_byte_written_once(groups):
    _ok(groups["four"], "save_4")
    written = [r["data"]["written_4"] for r in groups["four"]]
    meta, chunks = _overhead(groups["work"] / "ckpt4")
    # The file bytes of all processes are exactly the data once, plus each chunk's crc32c and
    # the arrays' metadata.
    assert sum(written) == _payload() + 4 * chunks + meta


def test_writes_balanced_across_processes(groups):
    _ok(groups["four"], "save_4")
    written = [r["data"]["written_4"] for r in groups["four"]]
    meta, chunks = _overhead(groups["work"] / "ckpt4")
    # Each process writes its share, give or take one chunk (the coordinator also writes the
    # arrays' metadata).
    share = _payload() / 4
    for p, w in enumerate(written):
        data = w - (meta if p == 0 else 0)
        assert abs(data - share) <= mh_worker.MAX_CHUNK_BYTES + 4 * chunks, (p, written, share)


def test_lowest_dedup_gives_replicas_to_process_zero(groups):
    _ok(groups["four"], "save_lowest")
    written = [r["data"]["written_lowest"] for r in groups["four"]]
    replicated = sum(mh_worker.value(k).nbytes for k in mh_worker.ARRAYS if k.startswith("rep/"))
    replicated += mh_worker.value(mh_worker.HOST).nbytes
    meta, chunks = _overhead(groups["work"] / "lowest")
    assert sum(written) == _payload() + 4 * chunks + meta
    assert written[0] - meta > replicated
    assert all(w < written[0] - replicated for w in written[1:]), written


def test_each_process_reads_only_what_its_devices_need(groups):
    for stage, key in (("two", "1"), ("four", "2")):
        for p, record in enumerate(groups[stage]):
            read = record["data"][f"read_{key}"]
            least, most = record["data"][f"needed_{key}"]
            # The whole chunks of the regions its devices need, nothing else.
            assert least <= read <= most, (stage, p, read, least, most)
    # The premise: a process of four needs a quarter of the sharded arrays and all of the
    # replicated ones, about half of the checkpoint's chunks, not all of them.
    chunks = (groups["work"] / "ckpt2").glob("arrays/*/c/**/*")
    whole = sum(p.stat().st_size for p in chunks if p.is_file())
    assert all(r["data"]["read_2"] < 0.6 * whole for r in groups["four"])


def test_packs_are_split_across_writers_and_restore_on_one_process(groups):
    _ok(groups["two"], "save_packed")
    written = [set(r["data"]["packs_written"]) for r in groups["two"]]
    assert all(written) and not written[0] & written[1], written  # one writer per pack, both write
    z = jaxckpt.metadata(groups["work"] / "zstd")  # the same, compressed by both writers
    assert z.version == 4 and {p.compression for p in z.packs.values()} == {"zstd"}
    assert main(["verify", str(groups["work"] / "zstd")]) == 0
    ckpt = groups["work"] / "packed"
    m = jaxckpt.metadata(ckpt)
    assert {f"<pack {p}>" for p in m.packs} == written[0] | written[1]
    assert m.entries["rep/0"].pack is not None and m.entries["params/w"].pack is None
    mh_worker.check_state(jaxckpt.restore(ckpt, mh_worker.target("two", jax.devices())))


def test_replicated_boxes_are_read_once_across_processes(groups):
    four = groups["four"]
    _ok(four, "restore_2_shared")  # 2 -> 4 processes, shared reads, bit-exact
    _ok(four, "shared_replicated")
    whole = four[0]["data"]["rep_bytes"]
    # Saved with the default planner: each 32 MiB replicated array in a chunk per process.
    assert jaxckpt.metadata(groups["work"] / "rep").entries["r0"].chunks == (512, 4096)
    shared = [r["data"]["rep_read_shared"] for r in four]
    assert all(r <= 0.3 * whole for r in shared), (shared, whole)
    assert sum(shared) <= 1.1 * whole, (shared, whole)
    # FSDP across hosts x replicated within: each host reads its own quarter, once.
    mixed = [r["data"]["rep_read_mixed"] for r in four]
    assert all(r <= 0.3 * whole for r in mixed) and sum(mixed) <= 1.1 * whole, mixed
    # Turned off, every process reads the whole state.
    assert all(r["data"]["rep_read_unshared"] >= whole for r in four)
    # Leading dimensions 16 devices do not divide: cut and read along the next one, once.
    assert four[0]["data"]["odd_chunks"] == {"conv": [3, 3, 64, 512], "vocab": [1001, 256]}
    odd = four[0]["data"]["odd_bytes"]
    odd_read = [r["data"]["odd_read"] for r in four]
    assert all(r <= 0.3 * odd for r in odd_read) and sum(odd_read) <= 1.1 * odd, (odd_read, odd)
    # Tensor-parallel within hosts x data-parallel across: saved and restored so, read once.
    tp = four[0]["data"]["tp_bytes"]
    tp_read = [r["data"]["tp_read"] for r in four]
    assert all(r <= 0.3 * tp for r in tp_read) and sum(tp_read) <= 1.1 * tp, (tp_read, tp)
    # safetensors weights, replicated: each process reads its rows (plus the file's header).
    st = four[0]["data"]["st_bytes"]
    st_read = [r["data"]["st_read"] for r in four]
    assert all(r <= 0.3 * st for r in st_read) and sum(st_read) <= 1.1 * st, (st_read, st)


def test_incremental_save_links_on_every_process(groups):
    """Each process decides for the boxes it writes; one manifest holds every digest."""
    records = groups["two"]
    for record in records:
        assert record["checks"]["save_incremental"] == "ok", record
        assert record["data"]["inc_written"] == 0 and record["data"]["inc_reused"] > 0, record
    data = records[0]["data"]
    assert data["inc_digests"] == data["inc_items"]  # every box, written by either process
    assert sum(r["data"]["inc_reused"] for r in records) == data["inc_bytes"]


def test_failure_on_one_process_raises_on_every_process(groups):
    _ok(groups["four"], "failure")
    _no_checkpoint(groups["work"] / "fail")


def test_existing_checkpoint_refused_on_every_process(groups):
    _ok(groups["four"], "exists")


def test_different_tree_on_one_process_is_a_plan_mismatch(groups):
    _ok(groups["four"], "mismatch")
    assert not (groups["work"] / "mismatch").exists()


def test_process_killed_mid_save(groups):
    four = groups["four"]
    assert four[3]["data"].get("killed_mid_save"), "process 3 was not killed while writing"
    _ok(four, "killed", processes=[0, 1, 2])
    _no_checkpoint(groups["work"] / "kill")


def _no_checkpoint(folder: Path) -> None:
    """No checkpoint in ``folder``: at most the hidden staging directory of the failed save,
    kept for a retry to resume (another process failed it: docs/manager.md, "Resuming a failed
    save"; tests/test_resume_save.py resumes one)."""
    left = os.listdir(folder)
    assert len(left) <= 1 and all(n.startswith(".ckpt.tmp-") for n in left), left


def test_state_has_replicated_and_sharded_leaves():
    # Guards the other tests' premises: replicas to dedup, and shards to read selectively.
    devices = np.array(jax.devices()).reshape(2, 4)
    assert len(mh_worker.sharding("single", "rep/0", devices).device_set) == 8
    assert mh_worker.sharding("single", "params/w", devices).shard_shape((256, 128)) == (128, 32)
