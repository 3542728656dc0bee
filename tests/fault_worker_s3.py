"""Worker processes for tests/test_faults_s3.py: incremental saves to an S3 prefix, killed.

Like tests/fault_worker.py (whose forkserver setup and progress log it shares), but the run
directory is ``s3://BUCKET/PREFIX`` on a moto server, and the chosen moments are the object
store's: the "tripwires" wrap tensorstore's own calls (``ts.open`` of a new array,
``TensorStore.write`` of a box, ``KvStore.write`` of ``manifest.json``/``metrics.json``,
``KvStore.delete_range`` and ``KvStore.write`` of ``None``, a delete) and jaxckpt's ``catalog.delete`` (to tell a retention delete of a
step other steps reference from one of a step nobody references, and from the clean-up of
arrays no longer referenced), in this process only; the library has no hooks.
"""

from __future__ import annotations

import os
import signal
import traceback

import fault_worker as fw  # sets XLA_FLAGS (8 CPU devices) before jax starts
import jax
import numpy as np
import tensorstore as ts
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt._manager import manager as _manager
from jaxckpt._storage import catalog

PERIODS = (2, 3, 5)  # array "every{p}" changes when step // p does, else it is referenced


def host_state(step: int) -> dict:
    """The state saved at ``step``, as numpy (what a restore with target=None returns).

    ``frozen`` never changes (referenced by every step from the step that first wrote it),
    ``every{p}`` changes every ``p`` steps (so most retention passes delete a step that the
    kept steps reference), ``moving`` and the small (packed) leaves change every step.
    Arrays of 320 KiB: too big to be packed, so each is its own array (and reference).
    """
    grid = np.arange(320 * 256, dtype=np.float32).reshape(320, 256)
    return {
        "frozen": grid,
        "moving": grid + np.float32(step),
        **{f"every{p}": grid[:, ::-1] * p + np.float32(step // p) for p in PERIODS},
        "small": [np.arange(64, dtype=np.int32) * (i + 1) + step for i in range(4)],
        "step": step,
    }


def device_state(step: int) -> dict:
    """``host_state(step)``: ``frozen`` and ``moving`` in 2 shards (2 chunk objects each)."""
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    split, whole = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    h = host_state(step)
    out = {
        k: jax.device_put(v, split if k in ("frozen", "moving") else whole) for k, v in h.items()
    }
    out["small"] = [jax.device_put(x, whole) for x in h["small"]]
    out["step"] = step
    return out


TRAPS = [
    "first_array_create",  # before a save creates its first new array (its zarr.json write)
    "data_write_1",  # before the first box write of a save
    "data_write_3",  # before the third box write, two already issued
    "before_manifest",  # every array written, the commit not
    "manifest_in_flight",  # the commit's PUT issued, not waited for
    "after_manifest",  # committed; no metrics, no retention yet
    "before_metrics",
    "after_metrics",  # retention: metrics written without the doomed step, nothing deleted
    "before_referenced_delete",  # retention about to delete a step kept steps reference
    "after_referenced_manifest_delete",  # that step's manifest gone, all its arrays there
    "mid_referenced_delete",  # ... and two of its unreferenced objects deleted
    "after_plain_manifest_delete",  # a step nobody references: manifest gone, arrays there
    "mid_cleanup",  # clean-up after retention: arrays no step references any more
]


def arm(trap: str, progress: str) -> None:
    """Kill this process at the next ``trap`` moment (wraps the calls, in this process only)."""
    fw.log(progress, f"armed {trap}")
    orig = {
        "open": ts.open,
        "write": ts.TensorStore.write,
        "kv_write": ts.KvStore.write,
        "delete_range": ts.KvStore.delete_range,
        "delete": catalog.delete,
        "clean_up": _manager.CheckpointManager._clean_up,
    }
    seen: dict = {"write": 0, "deletes": 0}
    deleting: list[str] = []  # "referenced", "plain" or "cleanup" while catalog.delete runs

    def die(detail: str = "") -> None:
        fw.log(progress, f"fired {trap} {detail}".rstrip())
        os.kill(os.getpid(), signal.SIGKILL)

    def trapped_open(spec, *args, **kwargs):
        if trap == "first_array_create" and kwargs.get("create"):
            die()
        return orig["open"](spec, *args, **kwargs)

    def trapped_write(self, *args, **kwargs):
        seen["write"] += 1
        if trap == f"data_write_{seen['write']}":
            die()
        return orig["write"](self, *args, **kwargs)

    def trapped_kv_write(self, key, *args, **kwargs):
        raw = key.encode() if isinstance(key, str) else bytes(key)
        if deleting and args and args[0] is None:  # a delete of one key (catalog.delete_keys)
            fut = orig["kv_write"](self, key, *args, **kwargs)
            return deleted(fut, manifest=raw == b"manifest.json", whole=False)
        if trap == "first_array_create" and raw.endswith(b"/zarr.json"):
            die()  # object stores create an array by writing its zarr.json (Writer.open_arrays)
        name = {b"manifest.json": "manifest", b"metrics.json": "metrics"}.get(raw)
        if name is not None and trap == f"before_{name}":
            die()
        fut = orig["kv_write"](self, key, *args, **kwargs)
        if name == "manifest" and trap == "manifest_in_flight":
            die()
        if name is not None and trap == f"after_{name}":
            fut.result()
            die()
        return fut

    def trapped_delete(loc, *, keep=()):
        kind = "cleanup" if deleting == ["cleanup"] else "referenced" if keep else "plain"
        if trap == f"before_{kind}_delete":
            die(f"{loc} keep {sorted(keep)}")
        deleting.append(kind)
        seen["loc"] = f"{loc} keep {sorted(keep)}"
        seen["deletes"] = 0
        try:
            return orig["delete"](loc, keep=keep)
        finally:
            deleting.pop()

    def trapped_delete_range(self, key_range, *args, **kwargs):
        fut = orig["delete_range"](self, key_range, *args, **kwargs)
        if not deleting:
            return fut
        manifest = bytes(key_range.inclusive_min) == b"manifest.json"
        whole = bytes(key_range.inclusive_min) == b"" and bytes(key_range.exclusive_max) == b""
        return deleted(fut, manifest=manifest, whole=whole)

    def deleted(fut, *, manifest: bool, whole: bool):
        kind = deleting[-1]
        seen["deletes"] += 1
        if (
            (trap == f"after_{kind}_manifest_delete" and manifest)
            or (trap == f"mid_{kind}_delete" and seen["deletes"] == 3)
            or (trap == "mid_cleanup" and "cleanup" in deleting and not manifest and not whole)
        ):
            fut.result()
            die(seen["loc"])
        return fut

    def trapped_clean_up(self):
        deleting.append("cleanup")
        try:
            return orig["clean_up"](self)
        finally:
            deleting.pop()

    ts.open, ts.TensorStore.write, ts.KvStore.write = trapped_open, trapped_write, trapped_kv_write
    ts.KvStore.delete_range, catalog.delete = trapped_delete_range, trapped_delete
    _manager.CheckpointManager._clean_up = trapped_clean_up


def save_loop(url: str, progress: str, trap: str | None, env: dict[str, str]) -> None:
    """Save incremental steps to ``url`` (keep 2) until killed; ``started N`` once save(N)
    returned (step ``N - 1`` is then committed and its retention done).

    ``env``: the moto endpoint and credentials (the forkserver may predate the fixture).
    """
    os.environ.update(env)
    try:
        mgr = jaxckpt.CheckpointManager(url, max_to_keep=2, incremental=True)
        step = (mgr.latest_step() or 0) + 1
        fw.log(progress, f"first {step}")
        first = step
        while True:
            mgr.save(step, device_state(step), metrics={"loss": 1.0 / step})
            fw.log(progress, f"started {step}")
            if trap is not None and step == first + 1:  # once this worker has committed a step
                arm(trap, progress)
            step += 1
    except BaseException:
        fw.log(progress, "error " + traceback.format_exc().replace("\n", " | "))
        raise
