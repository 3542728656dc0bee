"""Crash safety on an object store: SIGKILL during incremental saves and reference-aware
retention on ``s3://`` (a real moto server on 127.0.0.1, tests/test_s3.py's fixture).

Workers (tests/fault_worker_s3.py, forked from the forkserver tests/test_faults.py uses) save
incremental steps with ``CheckpointManager(s3://..., max_to_keep=2, incremental=True)``: most
steps reference arrays of older steps, and most retention passes delete a step that the kept
steps reference (its manifest goes, the referenced arrays stay). Each worker is killed with
SIGKILL at a moment chosen as a fraction of its own save cycle, or by a tripwire on an
object-store call. After every kill, before any clean-up: every committed step restores
bit-exactly (so nothing a kept step references is missing) and ``latest_step()`` is at least
the last step known committed; after the next manager's clean-up the bucket holds only what
docs/format.md allows; and the next save succeeds, after which retention leaves exactly that
again.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time

import fault_worker_s3 as fw3
import pytest
from helpers import assert_tree_equal
from test_faults import _last_started, _lines, _wait_for
from test_s3 import BUCKET, keys, s3  # noqa: F401  (the moto server fixture)

import jaxckpt
from jaxckpt._format.manifest import MANIFEST

# Kill moments as fractions of the worker's own save cycle, measured in each run: the kills
# spread over a whole cycle however fast the machine saves (0.1-0.3 s, slower under load).
# The finer spreads are tried only until a kill has landed inside a save (a save's writes
# fill ~15% of the cycle here, in two or three stretches).
SPREAD = [i / 10 for i in range(10)]
MORE = [(i + k) / 10 for k in (0.5, 0.25, 0.75) for i in range(10)]
AWS = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION")


@pytest.fixture(scope="module")
def ctx():
    c = multiprocessing.get_context("forkserver")
    c.set_forkserver_preload(["jaxckpt", "jax.numpy", "pytest"])  # no effect if it runs already
    return c


@pytest.fixture(scope="module")
def run(s3):  # noqa: F811
    """One run prefix for the whole module: each kill goes on from the state the last left."""
    return f"faults-{os.getpid()}-{time.monotonic_ns() % 10**8}"


def _kill(ctx, url: str, progress, trap: str | None, fraction: float = 0.0) -> list[str]:
    """Start a worker on ``url``; kill it ``fraction`` of a save cycle after its second
    commit (the cycle timed between its first two), or let its tripwire do it. Returns its
    progress lines."""
    env = {k: os.environ[k] for k in AWS}  # the forkserver may predate the moto fixture
    proc = ctx.Process(target=fw3.save_loop, args=(url, str(progress), trap, env), daemon=True)
    proc.start()
    try:
        if trap is None:
            first = int(_wait_for(progress, proc, "first ")[0].split()[1])
            _wait_for(progress, proc, f"started {first + 1}")  # it has committed a step
            t = time.monotonic()
            _wait_for(progress, proc, f"started {first + 2}")
            time.sleep(fraction * (time.monotonic() - t))
            proc.kill()
        proc.join(60)
    finally:
        if proc.exitcode is None:
            proc.kill()
            proc.join(10)
    lines = _lines(progress)
    assert proc.exitcode == -signal.SIGKILL, (trap, lines)
    return lines


def _stored(s3, run: str) -> dict[str, list[str]]:  # noqa: F811
    """The run's keys by top-level name (a step, or ``metrics.json``)."""
    out: dict[str, list[str]] = {}
    for k in keys(s3, run):
        top, _, rest = k.partition("/")
        out.setdefault(top, []).append(rest)
    return out


def _manifests(s3, run: str, stored: dict) -> dict[str, dict]:  # noqa: F811
    return {
        name: json.loads(
            s3.get_object(Bucket=BUCKET, Key=f"{run}/{name}/{MANIFEST}")["Body"].read()
        )
        for name, rest in stored.items()
        if MANIFEST in rest
    }


def _allowed(manifests: dict[str, dict]) -> dict[str, set[str]]:
    """Array folders each step may hold: a committed step its own arrays; any step (committed
    or not) the arrays that a committed step references in it, and that step's marker
    ``held-by/STEP`` (docs/format.md)."""
    allowed = {  # an entry's path in "refs" is held by the step the reference names
        name: ({e["path"] for e in m["entries"].values() if "path" in e} | set(m.get("packs", {})))
        - set(m.get("refs", {}))
        for name, m in manifests.items()
    }
    for name, m in manifests.items():
        for target in m.get("refs", {}).values():
            _, held_by, path = target.split("/", 2)
            allowed.setdefault(held_by, set()).update({path, f"held-by/{name}"})
    return allowed


def _check_bucket(s3, run: str) -> dict[str, dict]:  # noqa: F811
    """What docs/format.md allows after a manager's clean-up: ``metrics.json`` (naming only
    committed steps), committed steps (their manifest and own arrays), and of a step whose
    manifest is gone only the arrays that committed steps reference; each of those arrays is
    there (its zarr.json; the callers restore every step). Returns the manifests."""
    stored = _stored(s3, run)
    manifests = _manifests(s3, run, stored)
    allowed = _allowed(manifests)
    for name, rest in stored.items():
        if name == "metrics.json":
            metrics = json.loads(s3.get_object(Bucket=BUCKET, Key=f"{run}/{name}")["Body"].read())
            assert set(metrics["steps"]) <= {str(int(n)) for n in manifests}, metrics
            continue
        if name == ".steps":  # the run's index: a marker per committed step, nothing else
            assert set(rest) <= set(manifests), (rest, sorted(manifests))
            continue
        folders = allowed.get(name, set())
        orphans = [
            r
            for r in rest
            if r != MANIFEST
            and r not in folders
            and not r.startswith(tuple(f + "/" for f in folders))
        ]
        assert not orphans, (name, orphans, sorted(folders))
    for name, folders in allowed.items():
        for f in folders:  # every array a step holds or references is there (its zarr.json),
            want = f if f.startswith("held-by/") else f"{f}/zarr.json"  # and each marker
            assert want in stored.get(name, []), (name, f)
    return manifests


def _check_after_crash(s3, url: str, run: str, lines: list[str]) -> str:  # noqa: F811
    """Restore every committed step as the crash left it, then let a manager clean up.

    Returns the phase the kill hit: ``saving`` (a newer step without manifest), ``deleting``
    (an older one holding what no committed step references), else ``between``.
    """
    stored = _stored(s3, run)
    committed = sorted(int(n) for n, rest in stored.items() if MANIFEST in rest)
    allowed = _allowed(_manifests(s3, run, stored))
    phase = "between"
    for name, rest in stored.items():
        if name.isdigit() and MANIFEST not in rest:
            if int(name) > max(committed, default=-1):
                phase = "saving"
                break
            if any(not r.startswith(tuple(f + "/" for f in allowed.get(name, ()))) for r in rest):
                phase = "deleting"
    for step in committed:  # before any clean-up: each committed step is whole
        assert_tree_equal(jaxckpt.restore(f"{url}/{step:08d}"), fw3.host_state(step))
    # What those restores read (manifests, own and referenced arrays), but for a step whose
    # delete wrote its tombstone in the run's index: the clean-up finishes that delete.
    doomed = {r.split(".")[0] for r in stored.get(".steps", []) if r.endswith(".deleting")}
    kept = _allowed({n: m for n, m in _manifests(s3, run, stored).items() if n not in doomed})
    needed = {
        f"{name}/{r}"
        for name, rest in stored.items()
        for r in rest
        if (r == MANIFEST and name.isdigit() and name not in doomed)
        or r.startswith(tuple(f + "/" for f in kept.get(name, ())))
    }
    mgr = jaxckpt.CheckpointManager(url, max_to_keep=2, incremental=True)  # cleans up
    assert mgr.all_steps() == [s for s in committed if f"{s:08d}" not in doomed]
    lost = needed - set(keys(s3, run))
    assert not lost, f"the clean-up deleted what committed steps need: {sorted(lost)}"
    latest = mgr.latest_step()
    last_started = _last_started(lines)
    assert latest is not None
    if last_started is not None:  # save(N) returned => step N - 1 was committed
        assert latest >= last_started - 1, (latest, last_started, lines)
    _check_bucket(s3, run)
    return phase


def _next_save_works(s3, url: str, run: str) -> None:  # noqa: F811
    mgr = jaxckpt.CheckpointManager(url, max_to_keep=2, incremental=True)
    step = mgr.latest_step() + 1
    mgr.save(step, fw3.device_state(step))
    mgr.wait()
    assert mgr.last_save.reused_bytes > 0  # it did reference older steps
    assert mgr.all_steps()[-1] == step and len(mgr.all_steps()) == 2
    manifests = _check_bucket(s3, run)
    for name in manifests:
        assert_tree_equal(mgr.restore(int(name)), fw3.host_state(int(name)))


@pytest.mark.parametrize("trap", fw3.TRAPS)
def test_sigkill_at_a_chosen_object_store_call(s3, ctx, run, tmp_path, trap):  # noqa: F811
    url = f"s3://{BUCKET}/{run}"
    lines = _kill(ctx, url, tmp_path / "progress", trap)
    fired = [x for x in lines if x.startswith(f"fired {trap}")]
    assert fired, lines
    if "referenced" in trap:  # the step being deleted is one that kept steps reference
        assert "keep []" not in fired[0], fired
    elif "plain" in trap:
        assert fired[0].endswith("keep []"), fired
    _check_after_crash(s3, url, run, lines)


def test_sigkill_at_a_spread_of_moments(s3, ctx, run, tmp_path):  # noqa: F811
    url = f"s3://{BUCKET}/{run}"
    phases = []
    for i, fraction in enumerate(SPREAD + MORE):
        if i >= len(SPREAD) and "saving" in phases:
            break
        lines = _kill(ctx, url, tmp_path / f"progress{i}", None, fraction)
        phases.append(_check_after_crash(s3, url, run, lines))
    print("phase at each kill:", phases)
    assert "saving" in phases  # the kills did land inside saves
    _next_save_works(s3, url, run)
