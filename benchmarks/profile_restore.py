"""Where a restore's time goes: reads (tensorstore: file, crc32c, decode), the copy, the
device transfer, and Python per leaf. Run from the repository root::

    .venv/bin/python benchmarks/profile_restore.py --workload big --runs 3 [--reshard]

Each part is timed alone on the same boxes the restore reads, in one process after a warm-up
restore (so the page cache is warm): ``restore`` end to end; ``read`` storage's reads of the
plan's boxes alone (what tensorstore costs, crc32c and decode included); ``crc32c`` the
checksum of the same bytes with google-crc32c (an estimate of its share of ``read``);
``copy`` one memcpy of the bytes; ``device_put`` the boxes onto their devices in one batched
call, as the planner places them; ``python`` the time spent in jaxckpt's own Python code (cProfile, self time).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import tempfile
import time

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _state  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

import jaxckpt  # noqa: E402
from jaxckpt._storage import location as _location  # noqa: E402
from jaxckpt._storage import reader as _reader


def _median(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--workload", default="big", choices=sorted(_state.LAYOUTS))
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--reshard", action="store_true", help="restore onto the (2,4) mesh instead")
    args = p.parse_args()
    path = os.path.join(tempfile.mkdtemp(prefix="jaxckpt-prof-"), "ckpt")
    jaxckpt.save(path, _state.build(args.workload))
    target = _state.abstract(
        args.workload, _state.RESHARD_MESH if args.reshard else _state.SAVE_MESH
    )
    restore = lambda: jax.block_until_ready(jaxckpt.restore(path, target))  # noqa: E731
    restore()  # warm: page cache, contexts, compilations

    manifest = jaxckpt.metadata(path)
    planner = jaxckpt.DefaultLoadPlanner()
    planner.set_up_planner(target, manifest)
    items = planner.create_local_plan().items
    loc = _location.Location(path)
    boxes = [a for _, a in _reader.CheckpointReader(loc).read(manifest.entries, items)]
    nbytes = sum(b.nbytes for b in boxes)

    def read():
        for _ in _reader.CheckpointReader(loc).read(manifest.entries, items):
            pass

    import google_crc32c

    def crc():
        for b in boxes:
            google_crc32c.value(b.reshape(-1).view(np.uint8))

    out = [np.empty_like(b) for b in boxes]

    def copy():
        for o, b in zip(out, boxes):
            np.copyto(o, b)

    devices = {d.id: d for d in jax.devices()}
    flat = jax.tree_util.tree_leaves(target)
    shardings = dict(zip(planner.wants, (x.sharding for x in flat)))
    arrays, where = [], []  # as the planner places them: whole replicated arrays in one put
    for b, i in zip(boxes, items):
        one = [shardings[i.key]] if i.key in planner._whole else [devices[d] for d in i.devices]
        arrays += [b] * len(one)
        where += one
    put = lambda: jax.block_until_ready(jax.device_put(arrays, where))  # noqa: E731

    prof = cProfile.Profile()
    prof.enable()
    restore()
    prof.disable()
    stats = pstats.Stats(prof)
    own = sum(
        v[2] for k, v in stats.stats.items() if f"{os.sep}jaxckpt{os.sep}" in k[0]
    )  # self time in jaxckpt's modules

    rows = [
        ("restore", _median(restore, args.runs)),
        ("read (tensorstore)", _median(read, args.runs)),
        ("  of which crc32c (est.)", _median(crc, args.runs)),
        ("copy (memcpy once)", _median(copy, args.runs)),
        ("device_put (batched)", _median(put, args.runs)),
        ("python in jaxckpt (self)", own),
    ]
    print(
        f"{args.workload}: {len(items)} boxes, {nbytes / 2**20:.0f} MiB, "
        f"{len(manifest.entries)} keys; medians of {args.runs}"
    )
    print("| part | s | ÷ restore |\n|---|---|---|")
    for name, t in rows:
        print(f"| {name} | {t:.3f} | {t / rows[0][1]:.2f} |")


if __name__ == "__main__":
    main()
