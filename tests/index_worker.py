"""One process of a group for tests/test_run_index.py (run as a script).

    python tests/index_worker.py STAGE PROCESS_ID NUM_PROCESSES PORT WORKDIR

Runs a ``CheckpointManager`` (``max_to_keep=2``) on ``$INDEX_URL`` (fake-gcs-server behind the
test's proxy) for 6 steps of a sharded state, then reopens it, counting the listings this
process sent (tensorstore's own counter of GCS list calls) when the manager opens, in each
step (``save`` to ``wait``, retention included) and when it opens again. Writes
``WORKDIR/STAGE-PID.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import groups


def _lists() -> int:
    import tensorstore as ts

    found = ts.experimental_collect_matching_metrics("/tensorstore/kvstore/gcs/list")
    return sum(int(v.get("value", 0)) for m in found for v in m["values"])


def main() -> None:
    stage, pid, n, port, work = sys.argv[1:6]
    pid, n = int(pid), int(n)
    groups.join(pid, n, int(port))
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxckpt

    sharding = NamedSharding(Mesh(np.array(jax.devices()), ("d",)), P("d"))
    size = 4 * len(jax.devices())

    def state(step: int) -> dict:
        return {
            f"a{i}": jax.make_array_from_callback(
                (size,),
                sharding,
                lambda idx, i=i: (np.arange(size, dtype=np.float32) + i + step)[idx],
            )
            for i in range(8)
        }

    url = os.environ["INDEX_URL"]
    counts: dict = {"steps": []}
    before = _lists()
    mgr = jaxckpt.CheckpointManager(url, max_to_keep=2)
    counts["open"] = _lists() - before
    for step in range(1, 7):
        before = _lists()
        mgr.save(step, state(step))
        mgr.wait()
        counts["steps"].append(_lists() - before)
    mgr.close()
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices("retention done")  # process 0's, in its background
    before = _lists()
    again = jaxckpt.CheckpointManager(url, max_to_keep=2)
    counts["reopen"] = _lists() - before
    counts["all_steps"] = again.all_steps()
    got = again.restore(6, state(0))
    counts["exact"] = all(
        np.array_equal(np.asarray(a.data), np.asarray(b.data))
        for k, v in state(6).items()
        for a, b in zip(v.addressable_shards, got[k].addressable_shards)
    )
    # A step saved into the run by hand, newer than the one asked for: only process 0 lists
    # the names after the newest step it knows, and its refusal is raised on every process.
    jaxckpt.save(f"{url}/00000008", state(8))
    try:
        again.save(7, state(7))
    except jaxckpt.CheckpointExistsError as e:
        counts["refused"] = str(e)
    again.close()
    Path(work, f"{stage}-{pid}.json").write_text(json.dumps(counts))


if __name__ == "__main__":
    main()
