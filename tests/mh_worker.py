"""One process of a multi-process JAX group for tests/test_multihost.py (run as a script).

    python tests/mh_worker.py STAGE PROCESS_ID NUM_PROCESSES PORT WORKDIR

Each process runs the checks of STAGE in order and writes ``WORKDIR/STAGE-PID.json`` after
each one: ``checks`` maps a check's name to ``"ok"`` or its traceback, ``data`` holds what the
test compares across processes (bytes written and read, expected bytes). Errors are checked
here with ``pytest.raises(match=)``, on the real exception of the real process.

Importing this module only defines things: the test imports it for the state's definition.
"""

from __future__ import annotations

import itertools
import os
import signal
import sys
import time
import zlib
from pathlib import Path

import groups
import jax
import numpy as np
import pytest
from worker_record import Record as _Checks

import jaxckpt

# The saved state: key -> (shape, dtype). Values are a pure function of the key, so every
# process (and the test) knows every global array without communicating.
ARRAYS = {
    "params/w": ((256, 128), "float32"),
    "params/b": ((128,), "bfloat16"),
    "opt/mu": ((256, 128), "float32"),
    "ids": ((64,), "int32"),
    **{f"rep/{i}": ((64, 64), "float32") for i in range(8)},  # fully replicated
}
HOST = "host"  # a numpy array every process holds
STEP = 7
MAX_CHUNK_BYTES = 16 << 10

# PartitionSpecs per key over a mesh with axes ("a", "b"); each stage saves and restores with
# different ones, so every restore reshards.
SPECS = {
    "single": {"params/w": ("a", "b"), "params/b": ("b",), "opt/mu": (None, "b"), "ids": ("a",)},
    "two": {"params/w": ("b", "a"), "params/b": ("a",), "opt/mu": ("a", None), "ids": ("b",)},
    "four": {"params/w": ("a", "b"), "params/b": ("b",), "opt/mu": (("a", "b"),), "ids": ("a",)},
}
MESHES = {"single": (2, 4), "two": (2, 4), "four": (4, 4)}


def value(key: str) -> np.ndarray:
    """The global value of ``key``: the same on every process, bit for bit."""
    import ml_dtypes

    if key == HOST:
        return np.arange(40 * 100, dtype=np.int16).reshape(40, 100)
    shape, dtype = ARRAYS[key]
    rng = np.random.default_rng(zlib.crc32(key.encode()))
    if dtype.startswith("int"):
        return rng.integers(-(2**30), 2**30, size=shape).astype(dtype)
    return rng.standard_normal(shape).astype(getattr(ml_dtypes, dtype, dtype))


def nest(flat: dict) -> dict:
    tree: dict = {}
    for key, leaf in flat.items():
        *parents, last = key.split("/")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = leaf
    return tree


def sharding(stage: str, key: str, devices=None):
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devices = jax.devices() if devices is None else devices
    mesh = Mesh(np.array(devices).reshape(MESHES[stage]), ("a", "b"))
    return NamedSharding(mesh, PartitionSpec(*SPECS[stage].get(key, ())))


def make_state(stage: str, devices=None, **extra) -> dict:
    """The state, laid out for ``stage``, built without any collective."""
    flat = {}
    for key in ARRAYS:
        v = value(key)
        flat[key] = jax.make_array_from_callback(
            v.shape, sharding(stage, key, devices), lambda idx, v=v: v[idx]
        )
    flat[HOST] = value(HOST)
    flat["step"] = STEP
    flat.update(extra)
    return nest(flat)


def target(stage: str, devices=None) -> dict:
    """A restore target for ``stage``'s layout: arrays as ShapeDtypeStructs, host leaves None."""
    flat = {}
    for key, (shape, dtype) in ARRAYS.items():
        dt = value(key).dtype if dtype == "bfloat16" else dtype
        flat[key] = jax.ShapeDtypeStruct(shape, dt, sharding=sharding(stage, key, devices))
    flat[HOST] = None
    flat["step"] = None
    return nest(flat)


def check_state(tree: dict) -> None:
    """Every addressable shard (and host leaf) is bit-exact with the global value."""
    for key in ARRAYS:
        node = tree
        for part in key.split("/"):
            node = node[part]
        want = value(key)
        assert node.shape == want.shape and node.dtype == want.dtype, (key, node.dtype)
        for shard in node.addressable_shards:
            got = np.asarray(shard.data)
            assert got.tobytes() == want[shard.index].tobytes(), f"{key} at {shard.index}"
    assert np.asarray(tree[HOST]).tobytes() == value(HOST).tobytes()
    assert tree["step"] == STEP, tree["step"]


def bytes_needed(path: str, stage: str, devices=None) -> tuple[int, int]:
    """Bytes a restore onto ``stage``'s layout must read on this process, and may read.

    Reads are whole chunks (data plus a 4-byte crc32c). The least is every chunk that some
    distinct local target box overlaps, once; the most counts them once per box (if concurrent
    reads of a chunk were not merged) plus each array's ``zarr.json``. Host leaves need every
    chunk.
    """
    from jaxckpt._format.plan import index_to_box

    entries = jaxckpt.metadata(path).entries
    least = most = 0
    for key, entry in entries.items():
        if not isinstance(entry, jaxckpt.ArrayEntry):
            continue
        meta = (Path(path) / entry.path / "zarr.json").stat().st_size
        chunk_bytes = int(np.prod(entry.chunks)) * np.dtype(value(key).dtype).itemsize + 4
        if key == HOST:
            boxes = {((0,) * len(entry.shape), entry.shape)}
        else:
            imap = sharding(stage, key, devices).addressable_devices_indices_map(entry.shape)
            boxes = {index_to_box(i, entry.shape) for i in imap.values()}
        cells: list[tuple] = []
        for offsets, sizes in boxes:
            ranges = [
                range(o // c, (o + s - 1) // c + 1) for o, s, c in zip(offsets, sizes, entry.chunks)
            ]
            cells.extend(itertools.product(*ranges))
        least += len(set(cells)) * chunk_bytes
        most += meta + len(cells) * chunk_bytes
    return least, most


def file_bytes(metric: str) -> int:
    import tensorstore as ts

    if metric == "bytes_read":  # tensorstore's count plus the chunks jaxckpt reads in place
        from jaxckpt._storage import reader as _reader

        return _reader.file_bytes_read()
    found = ts.experimental_collect_matching_metrics(f"/tensorstore/kvstore/file/{metric}")
    return sum(v["value"] for m in found for v in m["values"])


def _planner(**kw):
    # One zarr array per leaf: the byte-count checks of test_multihost.py assume it.
    return jaxckpt.DefaultSavePlanner(max_chunk_bytes=MAX_CHUNK_BYTES, pack_bytes=0, **kw)


def restore_measured(data: dict, path: Path, stage: str, name: str) -> None:
    """Restore ``path`` onto ``stage``'s layout, check it, record bytes read and needed.

    Reads are not shared across processes here: each reads every box its devices need.
    """
    before = file_bytes("bytes_read")
    planner = jaxckpt.DefaultLoadPlanner(share_reads=False)
    check_state(jaxckpt.restore(path, target(stage), planner=planner))
    data[f"read_{name}"] = file_bytes("bytes_read") - before
    data[f"needed_{name}"] = bytes_needed(str(path), stage)


def stage_two(checks: _Checks, work: Path, pid: int) -> None:
    """2 processes: restore the single-process checkpoint (1 -> 2), save ckpt2 for stage four."""
    data = checks.result["data"]

    def restore_1():
        restore_measured(data, work / "ckpt1", "two", "1")

    def save_2():
        jaxckpt.save(work / "ckpt2", make_state("two"), planner=_planner())

    def save_packed():
        # Small leaves packed: 128 KiB of replicated float32 leaves in packs of >= 32 KiB, one
        # per process; each process writes the packs given to it, whole.
        planner = jaxckpt.DefaultSavePlanner(pack_bytes=32 << 10)
        jaxckpt.save(work / "packed", make_state("two"), planner=planner)
        mine = planner.global_plan.for_process(pid).items
        data["packs_written"] = sorted(i.key for i in mine if i.key.startswith("<pack "))
        check_state(jaxckpt.restore(work / "packed", target("two")))
        # Compressed (issue 52.4): each process compresses the chunks and packs it writes.
        planner = jaxckpt.DefaultSavePlanner(pack_bytes=32 << 10)
        jaxckpt.save(work / "zstd", make_state("two"), planner=planner, compression="zstd")
        check_state(jaxckpt.restore(work / "zstd", target("two")))

    def save_incremental():
        # The same state against ckpt2: every process links each box it writes from ckpt2, and
        # the coordinator's manifest records every process's digests.
        planner = _planner()
        h = jaxckpt.save_async(
            work / "inc2", make_state("two"), planner=planner, base=work / "ckpt2"
        )
        h.wait()
        every = [i for p in range(2) for i in planner.global_plan.for_process(p).items]
        data["inc_items"], data["inc_bytes"] = len(every), sum(i.nbytes for i in every)
        data["inc_written"], data["inc_reused"] = h.nbytes, h.reused_bytes
        m = jaxckpt.metadata(work / "inc2")
        data["inc_digests"] = sum(len(boxes) for boxes in m.digests.values())
        check_state(jaxckpt.restore(work / "inc2", target("two")))

    checks.run("restore_1", restore_1)
    checks.run("save_2", save_2)
    checks.run("save_packed", save_packed)
    checks.run("save_incremental", save_incremental)


class _FailingPlanner(jaxckpt.DefaultSavePlanner):
    """Fails (or dies) on one process while that process writes its data."""

    def __init__(self, process: int, kill: bool, checks: _Checks | None = None) -> None:
        super().__init__(max_chunk_bytes=MAX_CHUNK_BYTES)
        self.victim, self.kill, self.checks, self.calls = process, kill, checks, 0

    def resolve_data(self, item):
        self.calls += 1
        if self.process_index == self.victim and self.calls == 3:
            if self.kill:
                self.checks.result["data"]["killed_mid_save"] = True
                self.checks.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"disk on fire on process {self.victim}")
        return super().resolve_data(item)


def stage_four(checks: _Checks, work: Path, pid: int) -> None:
    """4 processes: restore ckpt2 (2 -> 4), balanced save + round trip, failures, a kill."""
    data = checks.result["data"]
    state = make_state("four")

    def restore_2():
        restore_measured(data, work / "ckpt2", "four", "2")

    def save_4():
        before = file_bytes("bytes_written")
        jaxckpt.save(work / "ckpt4", state, planner=_planner())
        data["written_4"] = file_bytes("bytes_written") - before
        check_state(jaxckpt.restore(work / "ckpt4", target("four")))

    def save_lowest():
        before = file_bytes("bytes_written")
        jaxckpt.save(work / "lowest", state, planner=_planner(dedup="lowest"))
        data["written_lowest"] = file_bytes("bytes_written") - before

    def save_async_overwrite():
        h = jaxckpt.save_async(work / "lowest", state, overwrite=True, planner=_planner())
        h.wait()
        check_state(jaxckpt.restore(work / "lowest", target("four")))

    def save_async_budget():
        # Within 48 KiB of host memory per process (chunks of 16 KiB): each process streams
        # its share through its own ring while the others do, with the barriers between.
        h = jaxckpt.save_async(work / "budget", state, planner=_planner(), max_host_bytes=48 << 10)
        h.wait()
        check_state(jaxckpt.restore(work / "budget", target("four")))

    def exists():
        want = (jaxckpt.CheckpointExistsError, "A checkpoint already exists")
        if pid != 0:  # only the coordinator checks the path; the others hear why it failed
            want = (jaxckpt.DistributedError, "failed on process 0: CheckpointExistsError")
        with pytest.raises(want[0], match=want[1]):
            jaxckpt.save(work / "ckpt4", state)

    def mismatch():
        tree = make_state("four", extra=1) if pid == 2 else state
        match = r"planned different checkpoints \(processes \[0, 1, 3\]: .*; process 2: plan"
        with pytest.raises(jaxckpt.DistributedError, match=match):
            jaxckpt.save(work / "mismatch" / "ckpt", tree)
        # The same tree, compressed on one process only: its chunks would not match the manifest
        codec = "zstd" if pid == 2 else None
        match = r"\[0, 1, 3\]: plan \w+:uncompressed, .*; process 2: plan \w+:zstd, .*compression"
        with pytest.raises(jaxckpt.DistributedError, match=match):
            jaxckpt.save(work / "mismatch" / "zstd", state, compression=codec)
        assert not (work / "mismatch" / "zstd").exists()

    def failure():
        planner = _FailingPlanner(1, kill=False)
        if pid == 1:
            want = r"failed on this process \(1\): RuntimeError: disk on fire on process 1"
        else:
            want = r"failed on process 1: RuntimeError: disk on fire on process 1\. No checkpoint"
        with pytest.raises(jaxckpt.DistributedError, match=want):
            jaxckpt.save(work / "fail" / "ckpt", state, planner=planner)
        assert not (work / "fail" / "ckpt").exists()

    def killed():
        os.environ["JAXCKPT_SYNC_TIMEOUT"] = "3"
        planner = _FailingPlanner(3, kill=True, checks=checks)
        t0 = time.monotonic()
        if pid == 0:
            match = r"process 3 did not reach 'written' within 3 s"
        else:  # the coordinator's report reaches the others before their own (longer) deadline
            match = r"failed on process 0: DistributedError: .*process 3 did not reach 'written'"
        with pytest.raises(jaxckpt.DistributedError, match=match):
            jaxckpt.save(work / "kill" / "ckpt", state, planner=planner)
        data["kill_raised_after_s"] = time.monotonic() - t0
        assert not (work / "kill" / "ckpt").exists()

    def restore_2_shared():  # 2 -> 4 processes, replicated boxes read once across processes
        check_state(jaxckpt.restore(work / "ckpt2", target("four")))

    def shared_replicated():
        # Replicated state over 4 processes x 4 devices, saved and restored with the default
        # planners: each process reads a quarter of each array (the save cuts a replicated box
        # into a chunk per process, and the restore splits the dimension it cut).
        from jax.experimental import multihost_utils
        from jax.sharding import Mesh, NamedSharding, PartitionSpec

        mesh = Mesh(np.array(jax.devices()).reshape(4, 4), ("a", "b"))
        rep = NamedSharding(mesh, PartitionSpec())

        def save(path: Path, values: dict, sharding) -> None:
            jaxckpt.save(
                path,
                {
                    k: jax.make_array_from_callback(v.shape, sharding, v.__getitem__)
                    for k, v in values.items()
                },
            )

        def restore_read(path: Path, values: dict, sharding, planner=None) -> int:
            """Bytes this process reads restoring ``values`` onto ``sharding``, bit-exact."""
            before = file_bytes("bytes_read")
            out = jaxckpt.restore(path, {k: sharding for k in values}, planner=planner)
            read = file_bytes("bytes_read") - before
            for k, arr in out.items():
                assert arr.sharding == sharding, (k, arr.sharding)
                for shard in arr.addressable_shards:
                    got = np.asarray(shard.data).tobytes()
                    assert got == values[k][shard.index].tobytes(), (path.name, k, shard.index)
            return read

        # 256 MiB fully replicated; onto FSDP across hosts x replicated within; sharing off.
        vals = {
            f"r{i}": np.random.default_rng(i).random((2048, 4096), np.float32) for i in range(8)
        }
        save(work / "rep", vals, rep)
        fsdp = NamedSharding(mesh, PartitionSpec("a"))
        for name, sharding, planner in (
            ("shared", rep, None),
            ("mixed", fsdp, None),
            ("unshared", rep, jaxckpt.DefaultLoadPlanner(share_reads=False)),
        ):
            data[f"rep_read_{name}"] = restore_read(work / "rep", vals, sharding, planner)
        data["rep_bytes"] = sum(v.nbytes for v in vals.values())
        # Leading dimensions the 16 devices do not divide (a 3x3 conv kernel, a vocabulary of
        # 1001): the save cuts them along the next dimension, and the read splits the same one.
        odd = {
            "conv": np.random.default_rng(8).random((3, 3, 256, 512), np.float32),
            "vocab": np.random.default_rng(9).random((1001, 1024), np.float32),
        }
        save(work / "odd", odd, rep)
        data["odd_read"] = restore_read(work / "odd", odd, rep)
        data["odd_chunks"] = {
            k: list(jaxckpt.metadata(work / "odd").entries[k].chunks) for k in odd
        }
        data["odd_bytes"] = sum(v.nbytes for v in odd.values())
        # Tensor-parallel within a host, data-parallel across: each column block is held by one
        # device of every process.
        tp = NamedSharding(mesh, PartitionSpec(None, "b"))
        cols = {f"t{i}": vals[f"r{i}"] for i in range(2)}
        save(work / "tp", cols, tp)
        data["tp_read"] = restore_read(work / "tp", cols, tp)
        data["tp_bytes"] = sum(v.nbytes for v in cols.values())
        # safetensors has no chunks: any byte range is read alone, so even one tensor's rows
        # are split between the processes.
        import safetensors.numpy

        st = work / "st" / "model.safetensors"
        weights = {"w": vals["r0"][:1024], "b": vals["r1"][0, :2048]}
        if jax.process_index() == 0:
            st.parent.mkdir()
            safetensors.numpy.save_file(weights, st)
        multihost_utils.sync_global_devices("safetensors written")
        data["st_read"] = restore_read(st, weights, rep)
        data["st_bytes"] = sum(v.nbytes for v in weights.values())

    checks.run("restore_2", restore_2)
    checks.run("restore_2_shared", restore_2_shared)
    checks.run("shared_replicated", shared_replicated)
    checks.run("save_4", save_4)
    checks.run("save_lowest", save_lowest)
    checks.run("save_async_overwrite", save_async_overwrite)
    checks.run("save_async_budget", save_async_budget)
    checks.run("exists", exists)
    checks.run("mismatch", mismatch)
    checks.run("failure", failure)
    checks.run("killed", killed)  # last: the group has lost a process after it
    data["process_index"] = jax.process_index()


def main(argv: list[str]) -> None:
    stage, pid, n, port, work = argv[0], int(argv[1]), int(argv[2]), int(argv[3]), Path(argv[4])
    groups.join(pid, n, port)
    checks = _Checks(work / f"{stage}-{pid}.json")
    {"two": stage_two, "four": stage_four}[stage](checks, work, pid)
    # Skip the shutdown barrier: after the kill check one process is gone for good.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
