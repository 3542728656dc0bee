"""One process of a group for tests/test_pod_scale_groups.py (run as a script).

    python tests/pod_worker.py STAGE PROCESS_ID NUM_PROCESSES PORT WORKDIR

Saves benchmarks/pod_scale.py's toy transformer to ``$POD_URL`` (fake-gcs-server behind the
test's proxy) and restores it onto the same shardings, counting what this process sent: HTTP
requests (tensorstore's own counter, retries and listing pages included) and operations on
jax.distributed's key-value store (its client, counted as it is called). Writes
``WORKDIR/STAGE-PID.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import groups

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))


class Counting:
    """jax.distributed's client, counting the key-value and barrier calls made through it."""

    def __init__(self, client: object) -> None:
        self._client, self.calls = client, 0

    def __getattr__(self, name: str):
        found = getattr(self._client, name)
        if not callable(found) or not name.startswith(("key_value", "blocking_", "wait_at")):
            return found

        def counted(*args, **kwargs):
            self.calls += 1
            return found(*args, **kwargs)

        return counted


def _requests() -> int:
    import tensorstore as ts

    found = ts.experimental_collect_matching_metrics("/tensorstore/http/request_completed")
    return sum(int(v.get("value", 0)) for m in found for v in m["values"])


def main() -> None:
    stage, pid, n, port, work = sys.argv[1:6]
    pid, n = int(pid), int(n)
    groups.join(pid, n, int(port))
    import jax
    import numpy as np
    from jax._src import distributed
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P
    from pod_scale import toy_transformer

    import jaxckpt
    from jaxckpt._runtime.pools import settle

    mesh = Mesh(np.array(jax.devices()), ("fsdp",))  # the backend holds the real client
    counting = Counting(distributed.global_state.client)
    distributed.global_state.client = counting
    tree = {}
    for i, (key, a) in enumerate(sorted(toy_transformer().items())):
        sharding = NamedSharding(mesh, P("fsdp") if a.sharded else P())
        tree[key] = jax.make_array_from_callback(
            a.shape,
            sharding,
            lambda idx, s=a.shape, i=i: (np.arange(np.prod(s), dtype=np.float32).reshape(s) + i)[
                idx
            ],
        )
    url = os.environ["POD_URL"]
    jaxckpt.save(url + "/warm", tree)  # the store's one check; plans cached
    settle()
    r0, c0 = _requests(), counting.calls
    jaxckpt.save(url + "/ck", tree)
    settle()  # the lease's delete, after the commit
    r1, c1 = _requests(), counting.calls
    got = jaxckpt.restore(url + "/ck", tree)
    r2, c2 = _requests(), counting.calls
    exact = all(
        np.array_equal(np.asarray(a.data), np.asarray(b.data))
        for k in tree
        for a, b in zip(tree[k].addressable_shards, got[k].addressable_shards)
    )
    record = {
        "save_requests": r1 - r0,
        "save_coordination": c1 - c0,
        "restore_requests": r2 - r1,
        "restore_coordination": c2 - c1,
        "exact": exact,
    }
    # An incremental run: step 2 changes one array and references the rest of step 1, its
    # held-by markers written by process 0 beside every process's data.
    mgr = jaxckpt.CheckpointManager(url + "/run", incremental=True, async_save=False)
    mgr.save(1, tree)
    first = sorted(tree)[0]
    changed = dict(tree, **{first: tree[first] + 1})
    mgr.save(2, changed)
    back = mgr.restore(2, target=tree)
    mgr.close()
    record["incremental_exact"] = all(
        np.array_equal(np.asarray(a.data), np.asarray(b.data))
        for k in tree
        for a, b in zip(changed[k].addressable_shards, back[k].addressable_shards)
    )
    record["referenced"] = len(jaxckpt.metadata(url + "/run/00000002").refs)
    Path(work, f"{stage}-{pid}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
