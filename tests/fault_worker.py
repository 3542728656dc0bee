"""Worker processes for tests/test_faults.py, started through a multiprocessing forkserver.

The forkserver imports jax and jaxckpt once; every worker is then a fork of it that starts in
milliseconds, so the tests can kill many real processes at many moments. Workers
report progress by appending lines to a file (``os.write`` of one short line is atomic and
survives the writer's SIGKILL, unlike a multiprocessing queue).

Fault injection lives here, in the test, never in the library: a worker either runs until the
parent kills it, or arms a "tripwire" around one OS call the library makes (a rename, a delete,
a copy) that sends the worker SIGKILL at that exact moment.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import re  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import traceback  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxckpt  # noqa: E402
from jaxckpt._storage import local_commit  # noqa: E402

N_SMALL = 48  # many small arrays: many files, so deletes and writes take a while


def host_state(step: int, frozen: bool = False) -> dict:
    """The state saved at ``step``, as numpy (what a restore with target=None returns).

    ``frozen``: like a fine-tuning run, ``w`` and every other small array stay the same from
    step to step (what an incremental save links), the rest changes.
    """
    base = np.arange(256 * 512, dtype=np.float32).reshape(256, 512)
    small = np.arange(64 * 32, dtype=np.int32).reshape(64, 32)
    moving = [0 if frozen and i % 2 else step for i in range(N_SMALL)]
    return {
        "w": base + np.float32(0 if frozen else step),
        "small": [small * (i + 1) + m for i, m in enumerate(moving)],
        "step": step,
    }


def device_state(step: int, frozen: bool = False) -> dict:
    """``host_state(step, frozen)`` laid out over a (4, 2) mesh."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
    h = host_state(step, frozen)
    return {
        "w": jax.device_put(h["w"], NamedSharding(mesh, P("data", "model"))),
        "small": [jax.device_put(x, NamedSharding(mesh, P("data"))) for x in h["small"]],
        "step": step,
    }


def log(progress: str, line: str) -> None:
    fd = os.open(progress, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


_COMMIT = re.compile(r"\.[0-9]+\.tmp-[0-9a-f]+$")


def arm(trap: str, progress: str) -> None:
    """Kill this process at the next ``trap`` moment (wraps the OS call, in this process only)."""
    log(progress, f"armed {trap}")
    rename, replace, unlink, copyto, link = os.rename, os.replace, os.unlink, np.copyto, os.link
    count = {"unlink": 0, "copy": 0, "link": 0}

    def moment(src, dst, when: str) -> None:
        src, dst = os.fspath(src), os.fspath(dst)
        committing = _COMMIT.search(src) and re.fullmatch(r"[0-9]+", os.path.basename(dst))
        deleting = dst.endswith("-deleted")
        if (trap == f"{when}_commit_rename" and committing) or (
            trap == ("before_delete" if when == "before" else "after_delete_rename") and deleting
        ):
            _die()

    def trapped_rename(src, dst, *args, **kwargs):
        moment(src, dst, "before")
        rename(src, dst, *args, **kwargs)
        moment(src, dst, "after")

    def trapped_noreplace(src, dst):  # the overwrite=False commit renames through renameat2
        moment(src, dst, "before")
        done = noreplace(src, dst)
        moment(src, dst, "after")
        return done

    noreplace = local_commit.rename_noreplace
    local_commit.rename_noreplace = trapped_noreplace

    def trapped_unlink(path, *args, **kwargs):
        count["unlink"] += 1
        if trap == "mid_delete" and count["unlink"] == 40:
            _die()
        return unlink(path, *args, **kwargs)

    def trapped_replace(src, dst, *args, **kwargs):
        if trap == "before_metrics" and os.fspath(dst).endswith("metrics.json"):
            _die()
        return replace(src, dst, *args, **kwargs)

    def trapped_copyto(dst, src, *args, **kwargs):
        count["copy"] += 1
        if trap == "mid_staging" and count["copy"] == N_SMALL // 2:
            _die()
        return copyto(dst, src, *args, **kwargs)

    def trapped_link(src, dst, *args, **kwargs):  # an incremental save links the base's chunks
        count["link"] += 1
        if trap == "mid_link" and count["link"] == 3:
            _die()
        return link(src, dst, *args, **kwargs)

    os.rename, os.replace, np.copyto = trapped_rename, trapped_replace, trapped_copyto
    os.link = trapped_link
    if trap == "mid_delete":

        def trapped_rmtree(path, *args, **kwargs):
            os.unlink = trapped_unlink  # count only the unlinks of a retention delete
            try:
                return rmtree(path, *args, **kwargs)
            finally:
                os.unlink = unlink

        rmtree = shutil.rmtree
        shutil.rmtree = trapped_rmtree


def save_loop(directory: str, progress: str, trap: str | None, incremental: bool = False) -> None:
    """Save step after step (async, keep 2) until killed; ``started N`` once save(N) returned.

    When ``save(N)`` returns, step ``N - 1`` is committed and its retention is done.
    """
    try:
        mgr = jaxckpt.CheckpointManager(directory, max_to_keep=2, incremental=incremental)
        step = (mgr.latest_step() or 0) + 1
        log(progress, f"first {step}")
        first = step
        while True:
            mgr.save(step, device_state(step, incremental), metrics={"loss": 1.0 / step})
            log(progress, f"started {step}")
            if trap is not None and step == first + 1:  # once this worker has committed a step
                arm(trap, progress)
            step += 1
    except BaseException:
        log(progress, "error " + traceback.format_exc().replace("\n", " | "))
        raise


def overwrite_loop(path: str, progress: str) -> None:
    """Overwrite one checkpoint again and again until killed; ``saved N`` once save(N) returned
    (step N committed; the checkpoint it replaced is deleted in the background)."""
    try:
        step = 1
        while True:
            jaxckpt.save(path, device_state(step), overwrite=True)
            log(progress, f"saved {step}")
            step += 1
    except BaseException:
        log(progress, "error " + traceback.format_exc().replace("\n", " | "))
        raise


def train_until_preempted(directory: str, progress: str) -> None:
    """A loop that saves only on preemption (SIGTERM), then exits cleanly."""
    mgr = jaxckpt.CheckpointManager(directory, save_interval_steps=10_000, save_on_preemption=True)
    step = 1
    while True:
        mgr.save(step, device_state(step))
        log(progress, f"step {step}")
        if mgr.reached_preemption(step):
            mgr.close()
            log(progress, f"preempted {step}")
            return
        step += 1


def fill_disk(directory: str, progress: str, limit: int) -> None:
    """Save under RLIMIT_FSIZE: a small step fits, a big one fails; report what happened."""
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead
    mgr = jaxckpt.CheckpointManager(directory)
    mgr.save(1, device_state(1))
    mgr.wait()
    mgr.save(2, {"big": np.ones((limit // 2,), np.float32)})  # one 2x-limit chunk
    try:
        mgr.wait()
        log(progress, "no error")
    except jaxckpt.CheckpointError as e:
        log(progress, "error " + str(e).replace("\n", " "))
    mgr.save(3, device_state(3))
    mgr.wait()
    log(progress, f"steps {mgr.all_steps()}")
