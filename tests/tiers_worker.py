"""One process of a multi-process JAX group for tests/test_tiers.py (run as a script).

    python tests/tiers_worker.py STAGE PROCESS_ID NUM_PROCESSES PORT WORKDIR

Each process has its own local directory ``WORKDIR/local/p<PROCESS_ID>`` and all share the
persistent directory ``WORKDIR/persistent``; the manager saves a local step every step and a
persistent step every 5. Stages, each a restart of the whole group:

* ``train`` (4): steps 0..7, then process 3 is killed during its local save of step 8 (its
  part written, not committed);
* ``restart`` (4): (a)+(e) restores local step 7; (b) process 1's local directory wiped:
  step 7 again, its part from its peer's replica; then steps 8 and 9 again, and process 2 is
  killed while it sends its replica of step 9;
* ``replaced`` (4, process 2's local directory wiped before the start): (d) a different mesh
  gets local step 8, resharded; (e) step 8 (step 9 lacks a whole part 2), part 2 from its replica;
  (c) processes 1 and 2 (its replica holder) wiped: persistent step 5;
* ``two`` (2): (d) fewer processes, parts 1 and 2 held by no one: persistent step 5;
* ``kv`` (2): the key-value relay; process 1's directory wiped, its part from its peer; then
  step 1 saved again by one manager: its part and its replica are replaced;
* ``memory`` (2): one large part sent by each transport, the peak memory of both sides;
* ``el_train`` (4), ``el_two`` (2), ``el_four`` (4): elastic recovery for tests/test_elastic.py
  (issue 46), in ``WORKDIR/el``: 4 -> 2 processes onto a (2, 2) mesh, a process killed in an
  elastic restore, 2 -> 4 processes with empty disks; ``el_kill`` (4): 2 -> 4 again, process 1
  killed as it sends its first piece (issue 54).

Records go to ``WORKDIR/STAGE-PID.json`` after each check, as in ``mh_worker.py``.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import zlib
from pathlib import Path

import groups
import jax
import numpy as np
from worker_record import Record

import jaxckpt

ARRAYS = {"w": ((256, 128), "float32"), "b": ((128,), "bfloat16"), "rep": ((64, 64), "float32")}
SPECS = {"w": ("a", "b"), "b": ("b",), "rep": ()}
OTHER_SPECS = {"w": ("b", "a"), "b": ("a",), "rep": ()}  # the same devices, another layout


def value(key: str, step: int) -> np.ndarray:
    import ml_dtypes

    shape, dtype = ARRAYS[key]
    rng = np.random.default_rng(zlib.crc32(key.encode()) + 1000 * step)
    return rng.standard_normal(shape).astype(getattr(ml_dtypes, dtype, dtype))


def _mesh(n: int):
    from jax.sharding import Mesh

    return Mesh(np.array(jax.devices()).reshape(n, len(jax.devices()) // n), ("a", "b"))


def _small_mesh(n: int):
    """A (n, 2) mesh of the first two devices of each process (the others stay unused)."""
    from jax.sharding import Mesh

    devices = [[d for d in jax.devices() if d.process_index == p][:2] for p in range(n)]
    return Mesh(np.array(devices), ("a", "b"))


def _sharding(key: str, specs: dict, n: int, mesh=None):
    from jax.sharding import NamedSharding, PartitionSpec

    return NamedSharding(mesh or _mesh(n), PartitionSpec(*specs[key]))


def make_state(step: int, n: int) -> dict:
    state = {}
    for key in ARRAYS:
        v = value(key, step)
        state[key] = jax.make_array_from_callback(
            v.shape, _sharding(key, SPECS, n), lambda idx, v=v: v[idx]
        )
    state["step"] = step
    state["host"] = np.full(3, step, np.int32)
    return state


def target(n: int, specs: dict = SPECS, mesh=None, *, bare: bool = False) -> dict:
    out = {}
    for key, (shape, _) in ARRAYS.items():
        dtype, sharding = value(key, 0).dtype, _sharding(key, specs, n, mesh)
        out[key] = sharding if bare else jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    return {**out, "step": None, "host": None}


def check_state(tree: dict, step: int) -> None:
    for key in ARRAYS:
        want = value(key, step)
        assert tree[key].dtype == want.dtype, key
        for shard in tree[key].addressable_shards:
            assert np.asarray(shard.data).tobytes() == want[shard.index].tobytes(), (key, step)
    assert tree["step"] == step, (tree["step"], step)
    assert np.asarray(tree["host"]).tolist() == [step] * 3


def manager(work: Path, pid: int, replicas: int = 1) -> jaxckpt.CheckpointManager:
    return jaxckpt.CheckpointManager(
        work / "persistent",
        save_interval_steps=5,
        local_directory=work / "local" / f"p{pid}",
        local_save_interval_steps=1,
        local_max_to_keep=3,
        local_replicas=replicas,
    )


def restored(rec: Record, name: str, mgr, tgt, step: int, n: int) -> None:
    tree = mgr.restore(target=tgt)
    check_state(tree, step)
    got = mgr.restored_from
    rec.data[name] = [got.tier, got.step, list(got.from_peers)]
    rec.data[f"{name}_resharded"] = got.resharded_from
    stats = mgr._local.last_elastic
    if got.resharded_from is not None and stats is not None:
        needed = sum(
            s.data.nbytes
            for key in ARRAYS
            for s in {str(s.index): s for s in tree[key].addressable_shards}.values()
        )
        rec.data[f"{name}_stats"] = {
            "read": len(stats.read),
            "sent": stats.sent_bytes,
            "received": stats.received_bytes,
            "needed": needed,
        }


def _die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def stage_train(rec: Record, work: Path, pid: int, n: int) -> None:
    from jaxckpt._storage import writer as _writer

    mgr = manager(work, pid)
    # (f): foreign things the manager must neither use nor delete.
    local = work / "local" / f"p{pid}"
    (local / "notes.txt").write_text("not jaxckpt's")
    other = local / "jaxckpt-0123456789abcdef" / f"p{pid}" / "00000001"
    other.mkdir(parents=True)
    (other / "keep.txt").write_text("another run")
    (mgr._local.mine / "00000001").mkdir()
    (mgr._local.mine / "00000001" / "foreign.txt").write_text("foreign")
    junk = mgr._local.mine / "00000099" / f"part-{pid}-of-{n}"
    junk.mkdir(parents=True)
    (junk / "manifest.json").write_text("{not a manifest")

    def train():
        for step in range(8):
            mgr.save(step, make_state(step, n))
        mgr.wait()
        rec.data["local_steps"] = mgr.all_steps("local")
        rec.data["persistent_steps"] = mgr.all_steps("persistent")
        rec.data["all_steps"] = mgr.all_steps()

    rec.run("train", train)
    commit = _writer.Writer.commit

    def commit_or_die(self, manifest):  # process 3 dies with step 8's part written
        if pid == 3 and f"part-3-of-{n}" in str(self.loc) and "00000008" in str(self.loc):
            rec.data["killed"] = True
            rec.flush()
            _die()
        return commit(self, manifest)

    _writer.Writer.commit = commit_or_die
    os.environ["JAXCKPT_SYNC_TIMEOUT"] = "8"
    mgr.save(8, make_state(8, n))
    try:
        mgr.close()
    except Exception as e:  # noqa: BLE001
        rec.data["close"] = repr(e)
    rec.flush()


def stage_restart(rec: Record, work: Path, pid: int, n: int) -> None:
    from jaxckpt._runtime import streams

    mine = work / "local" / f"p{pid}"
    rec.data["tmp_before"] = sorted(str(p) for p in mine.rglob(".part-*"))
    mgr = manager(work, pid)
    rec.data["tmp_after"] = sorted(str(p) for p in mine.rglob(".part-*"))
    rec.run("a", lambda: restored(rec, "a", mgr, target(n), 7, n))
    mgr.close()

    def b():
        if pid == 1:
            shutil.rmtree(mine)
        with manager(work, pid) as m:
            restored(rec, "b", m, target(n), 7, n)
            rec.data["b_local_after"] = m.all_steps("local")

    rec.run("b", b)
    # several chunks per part, so a kill lands between two
    streams.CHUNK_BYTES = streams.TRANSFER_CHUNK_BYTES = 16 << 10
    mgr = manager(work, pid)

    die = []

    def again():
        for step in (8, 9):
            if step == 9:
                mgr.wait()  # step 8 whole everywhere before the kill
                rec.checks["again_8"] = "ok"
                rec.data["transport_8"] = transport()  # every process replicated step 8
                rec.flush()
                os.environ["JAXCKPT_SYNC_TIMEOUT"] = "8"
                die.append(True)
            mgr.save(step, make_state(step, n))

    flush = streams._Stream.flush

    def flush_or_die(self):  # process 2 dies after the first chunk of its step-9 replica
        if pid == 2 and die and "/2-3/" in self.prefix and self.seq == 1:
            rec.data["killed"] = True
            rec.flush()
            _die()
        return flush(self)

    streams._Stream.flush = flush_or_die
    rec.run("again", lambda: (again(), mgr.wait()))
    rec.flush()


def stage_replaced(rec: Record, work: Path, pid: int, n: int) -> None:
    mgr = manager(work, pid)
    rec.run("d_mesh", lambda: restored(rec, "d_mesh", mgr, target(n, OTHER_SPECS), 8, n))
    rec.run("e", lambda: restored(rec, "e", mgr, target(n), 8, n))
    mgr.close()

    def c():
        if pid in (1, 2):
            shutil.rmtree(work / "local" / f"p{pid}")
        with manager(work, pid) as m:
            restored(rec, "c", m, target(n), 5, n)

    rec.run("c", c)


def stage_two(rec: Record, work: Path, pid: int, n: int) -> None:
    with manager(work, pid) as mgr:
        rec.run("d_count", lambda: restored(rec, "d_count", mgr, target(n), 5, n))


def stage_el_train(rec: Record, work: Path, pid: int, n: int) -> None:
    """Issue 46: 4 processes, each part kept by 2 peers: local steps 5, 6, 7, persistent 5."""
    work = work / "el"

    def train():
        with manager(work, pid, replicas=2) as mgr:
            for step in range(8):
                mgr.save(step, make_state(step, n))

    rec.run("train", train)


def stage_el_two(rec: Record, work: Path, pid: int, n: int) -> None:
    """2 processes on the disks of processes 0 and 1 of ``el_train``: local step 7 onto a
    (2, 2) mesh (abstract target, then bare shardings); then step 8 saved by the 2; then
    process 1 dies during an elastic restore of it (another layout): process 0 falls back."""
    from jaxckpt._tiers import elastic_restore

    work = work / "el"
    mgr = manager(work, pid, replicas=2)
    small = _small_mesh(n)
    rec.run("el_sds", lambda: restored(rec, "el_sds", mgr, target(n, mesh=small), 7, n))
    bare = target(n, mesh=small, bare=True)
    rec.run("el_bare", lambda: restored(rec, "el_bare", mgr, bare, 7, n))
    rec.run("el_save", lambda: (mgr.save(8, make_state(8, n)), mgr.wait()))
    carry_out = elastic_restore.carry_out

    def carry_out_or_die(*args, **kwargs):
        if pid == 1:
            rec.data["killed"] = True
            rec.flush()
            _die()
        return carry_out(*args, **kwargs)

    elastic_restore.carry_out = carry_out_or_die
    os.environ["JAXCKPT_SYNC_TIMEOUT"] = "8"
    # Onto process 0's devices only, so that its fallback reads the persistent step alone (a
    # restore onto devices of the dead process would wait for it in jax's device_put).
    from jax.sharding import Mesh

    mesh = Mesh(
        np.array([d for d in jax.devices() if d.process_index == 0]).reshape(2, 2), ("a", "b")
    )
    import logging

    class Log(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            rec.data.setdefault("el_die_log", []).append(record.getMessage())

    logging.getLogger("jaxckpt").addHandler(Log(logging.WARNING))
    rec.run("el_die", lambda: restored(rec, "el_die", mgr, target(n, OTHER_SPECS, mesh), 5, n))


def stage_el_four(rec: Record, work: Path, pid: int, n: int) -> None:
    """4 processes, 2 of them with empty disks: step 8 of the 2 processes, resharded; each
    process's share of the plan comes in pieces of 256 characters."""
    from jaxckpt._runtime import agreement

    agreement.PIECE = 256
    work = work / "el"
    with manager(work, pid, replicas=2) as mgr:
        rec.run("el_grow", lambda: restored(rec, "el_grow", mgr, target(n), 8, n))


def stage_el_kill(rec: Record, work: Path, pid: int, n: int) -> None:
    """Issue 54: 4 processes restore step 8 of the 2 (processes 2 and 3 with empty disks)
    onto a (4, 2) mesh of devices of processes 0, 2, 3 and 0 again; process 1 is killed as it
    sends its first piece. The pieces relay through the key-value store, so nothing but the
    heartbeat tells its receivers it died (a transfer server's socket may say so sooner): they
    see it dead within the I/O deadline (5 s here), and all fall back to the persistent step;
    the times are recorded for the test to report."""
    import time

    from jax.sharding import Mesh

    from jaxckpt._runtime import streams

    os.environ["JAXCKPT_IO_TIMEOUT"] = "5"
    os.environ["JAXCKPT_REPLICATION"] = "kv"
    os.environ["JAXCKPT_SYNC_TIMEOUT"] = "90"  # what the fallback must not wait for
    write = streams.Outgoing.write

    def write_or_die(self, data):
        if pid == 1:
            rec.data["killed"] = time.time()
            rec.flush()
            _die()
        return write(self, data)

    streams.Outgoing.write = write_or_die
    mine = {p: [d for d in jax.devices() if d.process_index == p] for p in (0, 2, 3)}
    devices = [mine[0][:2], mine[2][:2], mine[3][:2], mine[0][2:]]
    mesh = Mesh(np.array(devices), ("a", "b"))
    work = work / "el"

    def kill():
        with manager(work, pid, replicas=2) as mgr:
            t0 = time.monotonic()
            restored(rec, "el_kill", mgr, target(n, mesh=mesh), 5, n)
            rec.data["el_kill_s"] = time.monotonic() - t0
            rec.data["el_kill_end"] = time.time()

    rec.run("el_kill", kill)


def transport() -> str:
    """How this process's replicas went: ``transfer`` once its transfer server started."""
    from jaxckpt._runtime import transfer

    return "transfer" if transfer._server is not None else "kv"


def stage_kv(rec: Record, work: Path, pid: int, n: int) -> None:
    """The key-value relay, forced: replicas made and one used (process 1's dir wiped)."""
    os.environ["JAXCKPT_REPLICATION"] = "kv"
    work = work / "kv"

    def save():
        with manager(work, pid) as mgr:
            for step in range(2):
                mgr.save(step, make_state(step, n))

    def b():
        if pid == 1:
            shutil.rmtree(work / "local" / f"p{pid}")
        with manager(work, pid) as m:
            restored(rec, "kv_b", m, target(n), 1, n)

    def again():  # a step saved again by the same manager replaces its part and its replica
        with manager(work, pid) as m:
            restored(rec, "kv_rollback", m, target(n), 1, n)
            m.rollback(0)  # step 1 goes from every process's disk
            m.save(1, make_state(11, n))
            m.wait()
            if pid == 1:  # its new part is lost: the one to use is process 0's new replica
                shutil.rmtree(m._local.mine / "00000001" / f"part-1-of-{n}")
            restored(rec, "kv_again", m, target(n), 11, n)

    rec.run("kv_save", save)
    rec.run("kv_b", b)
    rec.run("kv_again", again)


def _vm(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) << 10
    raise KeyError(field)


def stage_memory(rec: Record, work: Path, pid: int, n: int) -> None:
    """Process 0 sends a part of PART_MIB to process 1 by each transport; each records its
    peak RSS growth (VmHWM reset through /proc/self/clear_refs) during the transfer."""
    import numpy as np

    from jaxckpt._runtime import agreement, replication, streams, transfer

    src, rng = work / "mem-src", np.random.default_rng(0)
    if pid == 0:
        src.mkdir()
        for i in range(PART_MIB // 50):
            with open(src / f"f{i}", "wb") as f:
                for _ in range(50 // 5):
                    f.write(rng.bytes(5 << 20))
    transfer.server()  # started before the measurement, as by any earlier replica
    agreement.decide("memory-ready", "", lambda _: "")
    for mode in ("transfer", "kv"):
        os.environ["JAXCKPT_REPLICATION"] = mode

        def move(mode=mode):
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # VmHWM := VmRSS
            base = _vm("VmRSS")
            if pid == 0:
                replication.send_dir(f"memory/{mode}/", src)
            else:
                replication.receive_dir(f"memory/{mode}/", work / f"mem-{mode}", max_bytes=1 << 40)
            rec.data[f"growth_{mode}"] = _vm("VmHWM") - base
            agreement.decide(f"memory-{mode}", "", lambda _: "")

        rec.run(f"memory_{mode}", move)
    rec.data["chunks"] = [
        streams.WINDOW,
        streams.TRANSFER_CHUNK_BYTES,
        streams.CHUNK_BYTES,
    ]


PART_MIB = 200


def main(argv: list[str]) -> None:
    stage, pid, n, port, work = argv[0], int(argv[1]), int(argv[2]), int(argv[3]), Path(argv[4])
    if stage == "replaced" and pid == 2:
        shutil.rmtree(work / "local" / "p2")  # a replaced node: its local disk is empty
    if stage in ("el_four", "el_kill") and pid >= 2:
        shutil.rmtree(work / "el" / "local" / f"p{pid}")  # new nodes: empty disks
    groups.join(pid, n, port)
    rec = Record(work / f"{stage}-{pid}.json")
    stages = {"train": stage_train, "restart": stage_restart, "replaced": stage_replaced}
    stages.update(two=stage_two, kv=stage_kv, memory=stage_memory)
    stages.update(el_train=stage_el_train, el_two=stage_el_two, el_four=stage_el_four)
    stages.update(el_kill=stage_el_kill)
    stages[stage](rec, work, pid, n)
    rec.data["transport"] = transport()
    rec.flush()
    # Process 0 hosts the coordination service: it exits last, or the others die with it
    # (jax kills a process whose service went away), perhaps before reading the answer of the
    # stage's last agreement; not waiting for a process whose heartbeat stopped (el_kill).
    from jaxckpt._runtime import agreement

    agreement.decide("end", "", lambda _: "", survivors=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
