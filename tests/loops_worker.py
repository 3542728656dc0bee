"""One process of a 2-process JAX group for tests/test_schedule.py and tests/test_iterators.py.

    python tests/loops_worker.py two PROCESS_ID 2 PORT WORKDIR

Stage ``two`` runs, in order: a training loop with continuous checkpointing
(``save_interval_secs=0``) whose commits process 0 holds for a few steps (so some steps find a
save in flight), one saving by time with ``should_save`` asked first, the count of agreement
keys left in the key-value store, and sharded Grain pipelines saved and restored with
``iterators=``. Each process sleeps its own random times, so their clocks and commits differ.
The record goes to ``WORKDIR/two-PID.json`` (``groups.run_group``).
"""

from __future__ import annotations

import json
import sys
import threading
import time
import traceback
from pathlib import Path

import grain
import groups
import numpy as np
from jax.experimental import multihost_utils

import jaxckpt
from jaxckpt._runtime import agreement, distributed


def _state(step: int) -> dict:
    return {"w": np.full((1024, 256), step, np.float32), "step": step}  # the same everywhere


def continuous(work: Path, pid: int, rng: np.random.Generator) -> dict:
    steps = 24
    mgr = jaxckpt.CheckpointManager(work / "continuous", save_interval_secs=0)
    release = threading.Event()
    finish = mgr._finish

    def held(*args):  # process 0: a save stays in flight until the loop is 3 steps on
        release.wait(timeout=120)
        finish(*args)

    if pid == 0:
        mgr._finish = held
    saved, began = [], None
    for step in range(1, steps + 1):
        time.sleep(rng.uniform(0, 0.01))
        if mgr.save(step, _state(step)):
            saved.append(step)
            began = step
        if began is not None and step == began + 3:
            release.set()
            if pid == 0:
                mgr.wait()  # so that step began + 4 finds it committed, however slow the disk
            release.clear()  # (after the wait: the held save has gone past it) for the next
    release.set()
    mgr.close()
    return {"steps": steps, "saved": saved, "committed": mgr.all_steps()}


def timed(work: Path, pid: int, rng: np.random.Generator) -> dict:
    steps = 30
    mgr = jaxckpt.CheckpointManager(work / "timed", save_interval_secs=0.05)
    asked, saved = [], []
    for step in range(1, steps + 1):
        time.sleep(rng.uniform(0.005, 0.02))
        if mgr.should_save(step):
            asked.append(step)
        if mgr.save(step, _state(step)):
            saved.append(step)
    mgr.close()
    return {"steps": steps, "asked": asked, "saved": saved, "committed": mgr.all_steps()}


def _loader(pid: int) -> grain.DataLoader:
    shards = grain.sharding.ShardOptions(shard_index=pid, shard_count=2)
    sampler = grain.samplers.IndexSampler(40, shards, shuffle=True, seed=3, num_epochs=1)
    return grain.DataLoader(
        data_source=list(range(40)),
        sampler=sampler,
        operations=[grain.transforms.Batch(batch_size=2)],
        worker_count=0,
    )


def iterators(work: Path, pid: int) -> dict:
    it = iter(_loader(pid))
    with jaxckpt.CheckpointManager(work / "iterators") as mgr:
        for step in range(1, 7):
            next(it)  # the batches differ from process to process; the saved state does not
            mgr.save(step, {"x": np.arange(4), "step": step}, iterators={"train": it})
        mgr.wait()
        expected = [next(it).tolist() for _ in range(3)]
        again = iter(_loader(pid))
        mgr.restore(6, iterators={"train": again})
        got = [next(again).tolist() for _ in range(3)]
    saved = jaxckpt.metadata(work / "iterators" / "00000006").iterators["train"]
    out = {"expected": expected, "got": got, "saved": [saved.process_count, sorted(saved.states)]}
    names = {"train": it} if pid == 0 else {"eval": it}
    try:
        jaxckpt.save(work / "mismatch", {"x": 1}, iterators=names)
        out["mismatch"] = "saved"
    except jaxckpt.CheckpointError as e:
        out["mismatch"] = f"{type(e).__name__}: {e}"
    return out


def main(argv: list[str]) -> None:
    stage, pid, n, port, work = argv[0], int(argv[1]), int(argv[2]), int(argv[3]), Path(argv[4])
    assert stage == "two" and n == 2
    groups.join(pid, n, port)
    rng = np.random.default_rng(pid)
    record: dict = {}
    try:
        record["continuous"] = continuous(work, pid, rng)
        record["timed"] = timed(work, pid, rng)
        left = distributed.kv_client().key_value_dir_get(agreement.PREFIX + "/")
        record["answers_left"] = len(left)
        # Process 0 hosts the key-value store: it stays until the other has read every answer.
        multihost_utils.sync_global_devices("timed done")
        record["iterators"] = iterators(work, pid)
    except Exception:
        record["error"] = traceback.format_exc()
        print(record["error"], flush=True)
    (work / f"{stage}-{pid}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main(sys.argv[1:])
