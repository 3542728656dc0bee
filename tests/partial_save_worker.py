"""A save killed partway, for tests/test_resume_save.py: SIGKILLs itself once most of the state
is written, leaving what a preempted job leaves.

    python tests/partial_save_worker.py URL KILL_AFTER

Saves :func:`state` to URL (a local path or an ``s3://`` URL; the AWS variables come from the
environment). When the writer asks for item KILL_AFTER + 1, the items before it have been handed
to storage: the worker waits until their writes have landed, then kills itself (no abort, no
clean-up runs: the leftovers are exactly what the dead save wrote). Fault injection lives here,
in the test's worker, never in the library.
"""

from __future__ import annotations

import glob
import os
import signal
import sys
import time

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

import jaxckpt  # noqa: E402

ARRAYS = 20  # one item each: 90% is 18 items
ELEMENTS = 1 << 17  # float32: 512 KiB per array, one chunk each


def state(
    changed: int | None = None, arrays: int = ARRAYS, elements: int = ELEMENTS
) -> dict[str, np.ndarray]:
    """The state saved (``arrays`` float32 arrays of ``elements``); ``changed``: that array's
    data differs (a retry after the data moved)."""
    out = {}
    for i in range(arrays):
        a = np.arange(elements, dtype=np.float32) * (i + 1)
        out[f"a{i:02d}"] = a + 1 if i == changed else a
    return out


class KillAfter(jaxckpt.DefaultSavePlanner):
    """SIGKILLs this process when asked for item ``n + 1``, once the first ``n`` have landed.
    An object per chunk (``layout="chunks"``): the tests count what resumes chunk by chunk."""

    def __init__(self, n: int) -> None:
        super().__init__(layout="chunks")
        self.n, self.asked = n, 0

    def resolve_data(self, item):
        self.asked += 1
        if self.asked > self.n:
            deadline = time.monotonic() + 60
            while landed(URL) < self.n and time.monotonic() < deadline:
                time.sleep(0.05)  # the writes already handed to storage land meanwhile
            os.kill(os.getpid(), signal.SIGKILL)
        return super().resolve_data(item)


def landed(url: str) -> int:
    """Chunks written so far by the save to ``url``, wherever it writes them."""
    if "://" not in url:
        parent, name = os.path.split(url)
        return len(glob.glob(f"{parent}/.{name}.tmp-*/arrays/*/c/*"))
    import boto3  # the test's S3 client, pointed at the server by the AWS variables

    bucket, _, prefix = url[len("s3://") :].partition("/")
    client = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/")
    return sum("/c/" in o["Key"] for p in pages for o in p.get("Contents", []))


URL = sys.argv[1] if __name__ == "__main__" else ""

if __name__ == "__main__":
    jaxckpt.save(URL, state(), planner=KillAfter(int(sys.argv[2])))
    sys.exit("not killed")  # never reached
