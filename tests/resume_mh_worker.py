"""One process of a 2-process group for tests/test_resume_save.py: a multi-host save that one
process's death fails, then its retry by a new group (run as a script, through tests/groups.py).

    python tests/resume_mh_worker.py STAGE PROCESS_ID NUM_PROCESSES PORT WORKDIR

``die``: both save :func:`state` to WORKDIR/ckpt; process 1 SIGKILLs itself once it has written
:data:`DIE_AFTER` of its chunks, process 0 raises (another process failed the save). ``retry``:
a new group saves the same state again, records the bytes each process wrote and kept, and
restores it. Each writes ``WORKDIR/STAGE-PID.json`` (process 1 of ``die`` before it dies).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import groups
import jax
import numpy as np
import pytest

import jaxckpt

SHAPE = (1024, 512)  # float32, 2 MiB: sharded over the 8 devices of the group, in 64 KiB chunks
MAX_CHUNK_BYTES = 64 << 10
DIE_AFTER = 10  # of process 1's 16 chunks


def host() -> np.ndarray:
    return np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE)


def state() -> dict:
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()).reshape(8), ("a",))
    sharding = NamedSharding(mesh, PartitionSpec("a"))
    h = host()
    return {"w": jax.make_array_from_callback(SHAPE, sharding, lambda idx: h[idx]), "step": 3}


class DieAfter(jaxckpt.DefaultSavePlanner):
    def __init__(self, record, n: int | None) -> None:
        super().__init__(max_chunk_bytes=MAX_CHUNK_BYTES)
        self.record, self.n = record, n

    def resolve_data(self, item):
        if self.n is not None:
            self.n -= 1
            if self.n < 0:
                time.sleep(2.0)  # its writes in flight land
                self.record({"died": True})
                os.kill(os.getpid(), signal.SIGKILL)
        return super().resolve_data(item)


def main(argv: list[str]) -> None:
    stage, pid, n, port, work = argv[0], int(argv[1]), int(argv[2]), int(argv[3]), Path(argv[4])
    groups.join(pid, n, port)

    def record(data: dict) -> None:
        (work / f"{stage}-{pid}.json").write_text(json.dumps({"data": data}))

    path = work / "ckpt"
    if stage == "die":
        os.environ["JAXCKPT_SYNC_TIMEOUT"] = "3"
        planner = DieAfter(record, DIE_AFTER if pid == 1 else None)
        with pytest.raises(jaxckpt.DistributedError, match="process 1"):
            jaxckpt.save(path, state(), planner=planner)
        record({"raised": True})
    else:
        h = jaxckpt.save_async(path, state(), planner=DieAfter(record, None))
        h.wait()
        got = jaxckpt.restore(path)
        assert got["w"].tobytes() == host().tobytes() and got["step"] == 3
        record({"nbytes": h.nbytes, "resumed": h.resumed_bytes, "left": os.listdir(work)})
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no shutdown barrier: in ``die`` a process is gone for good


if __name__ == "__main__":
    main(sys.argv[1:])
