"""Writes tests/data/v3_incremental: a run directory of two steps, as jaxckpt wrote it on
2026-12-07 (issue 62), where step 2 is a format-version-3 incremental step: it was saved on an
object store with step 1 as its base, so its unchanged pack is a reference to step 1's copy
(``refs``) and step 1 holds the ``held-by/00000002`` marker for it. Saved to ``memory://``
(an object store without links) and copied out file by file. Committed once, so that every
later version is tested against references it did not write itself (tests/test_compat.py
copies it back into an object store and restores both steps).

Run from the repository root: ``.venv/bin/python tests/data/make_v3_incremental.py`` (only to
make it again on purpose: the test compares with values of its own, not with this script's).
"""

import os
import shutil

import ml_dtypes
import numpy as np
import tensorstore as ts

import jaxckpt
from jaxckpt._storage.location import CONTEXT


def state(step: int) -> dict:
    return {
        "w": np.arange(64, dtype=np.float32).reshape(8, 8),  # unchanged: referenced
        "b": np.full(3, step, dtype=np.int32),  # changed: written again
        "q": np.arange(5, dtype=ml_dtypes.bfloat16) / 2,
        "step": step,
    }


if __name__ == "__main__":
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "v3_incremental")
    shutil.rmtree(out, ignore_errors=True)
    jaxckpt.save("memory://v3run/00000001", state(1))
    jaxckpt.save("memory://v3run/00000002", state(2), base="memory://v3run/00000001")
    assert jaxckpt.metadata("memory://v3run/00000002").version == 3
    kv = ts.KvStore.open({"driver": "memory", "path": "v3run/"}, context=CONTEXT).result()
    for key in kv.list().result():
        name = key.decode()
        if name.startswith("00000001/writer") or name.startswith("00000002/writer"):
            continue  # a save's lease, gone after its commit
        path = os.path.join(out, *name.split("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(kv.read(key).result().value)
