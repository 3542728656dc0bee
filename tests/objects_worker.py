"""One process of a group saving and restoring format v5's data objects (tests/test_objects.py).

    python tests/objects_worker.py STAGE PROCESS_ID NUM_PROCESSES PORT WORKDIR

STAGE is the checkpoint's URL's last part; the URL's prefix is in ``WORKDIR/url``. Each process
saves a state sharded over all the group's devices with ``layout="objects"``, restores it onto
another sharding, and writes ``WORKDIR/STAGE-PID.json`` with ``ok`` or the error.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import groups
import numpy as np


def main() -> None:
    stage, pid, n, port, work = (
        sys.argv[1],
        int(sys.argv[2]),
        int(sys.argv[3]),
        sys.argv[4],
        Path(sys.argv[5]),
    )
    groups.join(pid, n, port)
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxckpt

    url = f"{(work / 'url').read_text()}/{stage}"
    record: dict = {}
    try:
        devices = np.array(jax.devices()).reshape(n * 2, 2)
        mesh = Mesh(devices, ("a", "b"))
        values = {
            f"w{i}": np.arange(64 * 32, dtype=np.float32).reshape(64, 32) + i for i in range(6)
        }
        tree = {
            k: jax.make_array_from_callback(
                v.shape, NamedSharding(mesh, P("a", "b")), lambda idx, v=v: v[idx]
            )
            for k, v in values.items()
        }
        planner = jaxckpt.DefaultSavePlanner(layout="objects", pack_bytes=0, max_chunk_bytes=1024)
        jaxckpt.save(url, tree, planner=planner)
        other = NamedSharding(Mesh(devices.reshape(2, n * 2), ("x", "y")), P("y", "x"))
        got = jaxckpt.restore(url, dict.fromkeys(values, other))
        for k, v in values.items():
            for shard in got[k].addressable_shards:
                np.testing.assert_array_equal(np.asarray(shard.data), v[shard.index])
        record["ok"] = True
    except BaseException:  # noqa: BLE001 - reported to the test
        record["error"] = traceback.format_exc()
    (work / f"{stage}-{pid}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
