"""A training loop over a Grain pipeline, checkpointed continuously, for tests/test_resume_exact.py
(which kills it with SIGKILL mid-run and starts it again).

    python tests/resume_worker.py RUN_DIR LOG STEPS

At the start it restores the latest committed step, the state and the pipeline's position
(``iterators=``), if there is one. Each step takes the next batch, trains on it, appends
``{"step": s, "batch": [...]}`` to LOG (flushed: a SIGKILL loses no line), then calls
``save(step, state, iterators=...)`` (``save_interval_secs=0``: a save whenever the last one
has committed). At the end it appends the final state.

Importing this module only defines things: the test builds the same pipeline from it.
"""

from __future__ import annotations

import json
import os
import sys
import time

import grain
import jax
import jax.numpy as jnp
import numpy as np

import jaxckpt

BATCH = 4


def pipeline() -> grain.DatasetIterator:
    """Shuffled, transformed and batched: a batch is a (BATCH, 3) int array."""
    ds = grain.MapDataset.range(1000).shuffle(seed=11)
    ds = ds.map(lambda i: np.array([i, (i * 7) % 13, i % 5], np.int32)).batch(BATCH)
    return iter(ds.to_iter_dataset())


def fresh() -> dict:
    return {"w": jnp.zeros(3, jnp.float32), "h": 0}


def train(state: dict, batch: np.ndarray) -> dict:
    """A step that depends on the order of the batches: a decayed sum and a hash chain."""
    w = state["w"] * 0.75 + jnp.asarray(batch, jnp.float32).mean(0)
    digest = int(np.sum(batch * np.arange(1, batch.size + 1).reshape(batch.shape)))
    return {"w": w, "h": (state["h"] * 1_000_003 + digest) % (2**61 - 1)}


def main(run_dir: str, log_path: str, steps: int) -> None:
    it = pipeline()
    with jaxckpt.CheckpointManager(run_dir, max_to_keep=2, save_interval_secs=0) as mgr:
        start = mgr.latest_step() or 0
        state = fresh()
        if start:
            target = {"w": jax.ShapeDtypeStruct((3,), jnp.float32), "h": None}
            state = mgr.restore(start, target, iterators={"train": it})
        with open(log_path, "a") as log:
            log.write(json.dumps({"pid": os.getpid(), "resumed_from": start}) + "\n")
            for step in range(start + 1, steps + 1):
                batch = next(it)
                state = train(state, batch)
                log.write(json.dumps({"step": step, "batch": batch.tolist()}) + "\n")
                log.flush()
                mgr.save(step, state, iterators={"train": it})
                time.sleep(0.02)  # a step's worth of work, so that the kill lands mid-run
            mgr.wait()
            final = {"final_w": np.asarray(state["w"]).tolist(), "final_h": state["h"]}
            log.write(json.dumps(final) + "\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
