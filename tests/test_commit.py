"""overwrite=False holds at the commit: of two saves racing to one new path exactly one commits.

Each race is forced: a planner makes both saves wait for each other after they passed the start
check (the target did not exist yet for either), so the second commit always finds the first.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
from test_s3 import BUCKET, keys, prefix, s3  # noqa: F401  (fixtures)

import jaxckpt
from jaxckpt._format.manifest import storage_entries
from jaxckpt._runtime.pools import settle
from jaxckpt._storage.location import Location
from jaxckpt._storage.writer import Writer

ROUNDS = 12


class MeetPlanner(jaxckpt.DefaultSavePlanner):
    """Waits at ``barrier`` when asked for the first array's data (after the start check)."""

    def __init__(self, barrier: threading.Barrier) -> None:
        super().__init__()
        self.barrier = barrier
        self.met = False

    def resolve_data(self, item):
        if not self.met:
            self.met = True
            try:
                self.barrier.wait(timeout=60)
            except threading.BrokenBarrierError:  # the other save already lost
                pass
        return super().resolve_data(item)


def race(path: str, *, use_async: bool) -> list:
    """Two threads save different trees to ``path``; returns each one's tree or error."""
    barrier = threading.Barrier(2)
    results: list = [None, None]

    def one(i: int) -> None:
        tree = {"w": np.full((4, 4), i, np.float32), "who": i}
        try:
            planner = MeetPlanner(barrier)
            if use_async:
                jaxckpt.save_async(path, tree, planner=planner).wait()
            else:
                jaxckpt.save(path, tree, planner=planner)
            results[i] = tree
        except jaxckpt.CheckpointExistsError as e:
            barrier.abort()  # object stores: the loser may stop before the meeting point
            results[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def check_one_winner(path: str, results: list) -> None:
    """Exactly one commit, and the committed arrays are the winner's (on object stores too:
    the second save to take a prefix writes into a generation of its own)."""
    won = [r for r in results if isinstance(r, dict)]
    lost = [r for r in results if isinstance(r, jaxckpt.CheckpointExistsError)]
    assert len(won) == 1 and len(lost) == 1, results
    assert "lost the race to one path" in str(lost[0]) and path in str(lost[0])
    got = jaxckpt.restore(path)
    assert got["who"] == won[0]["who"]
    np.testing.assert_array_equal(got["w"], won[0]["w"])


@pytest.mark.parametrize("use_async", [False, True], ids=["save", "save_async"])
def test_two_threads_one_commits_local(tmp_path, use_async):
    for r in range(ROUNDS):
        path = str(tmp_path / f"ck{r}")
        check_one_winner(path, race(path, use_async=use_async))
    assert sorted(os.listdir(tmp_path)) == sorted(f"ck{r}" for r in range(ROUNDS))  # no staging


def test_loser_into_an_empty_directory(tmp_path):
    # The start check allows an existing empty directory; the winner replaces it, the loser not.
    path = tmp_path / "ck"
    path.mkdir()
    check_one_winner(str(path), race(str(path), use_async=False))
    assert os.listdir(tmp_path) == ["ck"]


def test_two_threads_one_commits_memory():
    for r in range(ROUNDS):
        path = f"memory://commit-race/{os.getpid()}/{r}"
        check_one_winner(path, race(path, use_async=r % 2 == 1))


def test_two_threads_one_commits_s3(s3, prefix):  # noqa: F811
    for r in range(3):
        path = f"s3://{BUCKET}/{prefix}/ck{r}"
        check_one_winner(path, race(path, use_async=False))
        settle()  # the winner's clean-up runs after its commit, in the background
        found = keys(s3, f"{prefix}/ck{r}")  # the winner's data and manifest, nothing else
        assert "manifest.json" in found, found
        gens = {re.match(r"(g[0-9a-f]{8}/)?", k)[0] for k in found if k != "manifest.json"}
        assert len(gens) == 1 and all(
            re.fullmatch(r"(g[0-9a-f]{8}/)?(arrays/(w|pack\.float32\.0)/.+|data/0\.0)", k)
            for k in found
            if k != "manifest.json"
        ), found


WORKER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import numpy as np
    import jaxckpt

    root, me, rounds = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])

    class Meet(jaxckpt.DefaultSavePlanner):  # file barrier with the other process
        def __init__(self, r):
            super().__init__()
            self.r, self.met = r, False
        def resolve_data(self, item):
            if not self.met:
                self.met = True
                (root / f"at-{self.r}-{me}").touch()
                deadline = time.monotonic() + 60
                while not (root / f"at-{self.r}-{1 - me}").exists():
                    assert time.monotonic() < deadline
                    time.sleep(0.002)
            return super().resolve_data(item)

    for r in range(rounds):
        try:
            jaxckpt.save(root / f"ck{r}", {"who": me, "w": np.full(8, me)}, planner=Meet(r))
            print(f"{r} won", flush=True)
        except jaxckpt.CheckpointExistsError:
            print(f"{r} lost", flush=True)
    """
)


def test_two_processes_one_commits(tmp_path):
    rounds = 8
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, str(tmp_path), str(i), str(rounds)],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=240)[0].split("\n") for p in procs]
    assert all(p.returncode == 0 for p in procs)
    for r in range(rounds):
        said = [next(line.split()[1] for line in out if line.startswith(f"{r} ")) for out in outs]
        assert sorted(said) == ["lost", "won"], (r, said)
        assert jaxckpt.restore(str(tmp_path / f"ck{r}"))["who"] == said.index("won")
    left = sorted(p.name for p in Path(tmp_path).iterdir() if not p.name.startswith("at-"))
    assert left == sorted(f"ck{r}" for r in range(rounds))


def test_overwrite_true_still_replaces(tmp_path):
    path = str(tmp_path / "ck")
    jaxckpt.save(path, {"a": np.zeros(2)})
    jaxckpt.save(path, {"a": np.ones(2)}, overwrite=True)
    np.testing.assert_array_equal(jaxckpt.restore(path)["a"], np.ones(2))
    settle()  # the replaced checkpoint goes in the background
    assert os.listdir(tmp_path) == ["ck"]


def test_a_program_that_ends_right_after_an_overwrite_deletes_the_old_checkpoint(tmp_path):
    # The replaced checkpoint goes in the background; Python runs that work before it exits.
    code = textwrap.dedent(
        """
        import sys
        import numpy as np
        import jaxckpt
        path = sys.argv[1]
        jaxckpt.save(path, {"a": np.zeros(2)})
        jaxckpt.save(path, {"a": np.ones(2)}, overwrite=True)
        """
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "ck")], env=env, check=True)
    assert os.listdir(tmp_path) == ["ck"]
    np.testing.assert_array_equal(jaxckpt.restore(tmp_path / "ck")["a"], np.ones(2))


def test_a_save_aborted_while_its_arrays_are_created_leaves_nothing(tmp_path):
    """Arrays are created in the background while the first boxes are resolved: an abort
    waits for them, so no file appears after its clean-up."""
    jaxckpt.save(tmp_path / "model", {f"w{i}": np.zeros((64, 64), np.float32) for i in range(32)})
    entries = storage_entries(jaxckpt.metadata(tmp_path / "model"))
    writer = Writer(Location(tmp_path / "new"), overwrite=False)
    writer.open_arrays(entries.values(), create=True)
    writer.abort()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_an_array_that_cannot_be_opened_names_it_at_the_flush(tmp_path):
    """Opening arrays that do not exist fails where the writer waits for them, naming one."""
    jaxckpt.save(tmp_path / "model", {"w": np.zeros(4, np.float32)})
    entries = storage_entries(jaxckpt.metadata(tmp_path / "model"))
    writer = Writer(Location(tmp_path / "new"), overwrite=False)
    writer.open_arrays(entries.values(), create=False)  # nobody created them
    with pytest.raises(
        jaxckpt.CheckpointError, match=r"failed opening array arrays/pack\S+ of key"
    ):
        writer.flush()
    writer.abort()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


@pytest.mark.parametrize("overwrite", [False, True])
def test_the_commit_makes_data_and_manifest_durable_in_one_flush(tmp_path, monkeypatch, overwrite):
    """A local save flushes once, after the manifest is written and before the rename: the
    coordinator's bytes and the manifest go to the disk together, and nothing is visible at
    the target before they are durable."""
    from jaxckpt._storage import local_commit

    target = tmp_path / "ckpt"
    if overwrite:
        jaxckpt.save(target, {"w": np.zeros(4)})
    flushes = []
    real = local_commit.syncfs

    def syncfs(path):
        staging = [p for p in tmp_path.iterdir() if p.name.startswith(".ckpt.tmp-")]
        flushes.append(
            {
                "manifest written": [(p / "manifest.json").exists() for p in staging],
                "target": jaxckpt.metadata(target).entries["w"].shape if target.exists() else None,
            }
        )
        real(path)

    monkeypatch.setattr(local_commit, "syncfs", syncfs)
    jaxckpt.save(target, {"w": np.arange(8.0)}, overwrite=overwrite)
    assert flushes == [{"manifest written": [True], "target": (4,) if overwrite else None}]
    np.testing.assert_array_equal(jaxckpt.restore(target)["w"], np.arange(8.0))
