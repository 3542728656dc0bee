"""Writes tests/data/v5_objects: a format-version-5 checkpoint (data objects: each process's
chunks as records in a few objects, no zarr arrays) of make_v2_packed's state, as jaxckpt wrote
it on 2026-12-07 when data objects were added (issue 63). Saved on ``memory://`` (data objects
are written on object stores only) with objects of at most 4 KiB, so that records span several
objects, then copied here; tests/test_compat.py restores it from an object store again.

Run from the repository root: ``.venv/bin/python tests/data/make_v5_objects.py`` (only to make
it again on purpose).
"""

import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import make_v2_packed  # noqa: E402  (sets XLA_FLAGS before jax is imported)
import tensorstore as ts  # noqa: E402

import jaxckpt  # noqa: E402
from jaxckpt._storage.location import CONTEXT  # noqa: E402  (the memory stores jaxckpt opens)

if __name__ == "__main__":
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "v5_objects")
    shutil.rmtree(out, ignore_errors=True)
    planner = jaxckpt.DefaultSavePlanner(pack_bytes=4096, layout="objects", object_bytes=4096)
    jaxckpt.save("memory://v5_objects", make_v2_packed.state(), planner=planner)
    kv = ts.KvStore.open({"driver": "memory", "path": "v5_objects/"}, context=CONTEXT).result()
    for key in kv.list().result():
        path = os.path.join(out, key.decode())
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(kv.read(key).result().value)
