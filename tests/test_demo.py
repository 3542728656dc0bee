"""The demo (examples/demo.py, `make demo`) trains, is preempted twice, resumes on other meshes,
and its loss matches an uninterrupted run step for step."""

import importlib.util
from pathlib import Path

import jaxckpt

DEMO = Path(__file__).parent.parent / "examples" / "demo.py"


def _demo():
    spec = importlib.util.spec_from_file_location("jaxckpt_demo", DEMO)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_demo_resumes_on_other_meshes_with_the_uninterrupted_loss(tmp_path):
    d = tmp_path / "run"
    out = _demo().main(["--steps", "12", "--save-every", "3", "--dir", str(d), "--quiet"])
    assert out["preempted_at"] == [4, 8]  # SIGTERM, saved at the step it arrived, twice
    assert len(out["resumed"]) == 12
    assert out["resumed"] == out["uninterrupted"]  # bit for bit, every step
    assert out["resumed"][-1] < out["resumed"][0]  # and it did learn
    assert jaxckpt.CheckpointManager(d).all_steps() == [8, 9, 12]  # max_to_keep=3


def test_demo_saving_continuously_resumes_with_the_uninterrupted_loss(tmp_path):
    d = tmp_path / "run"
    out = _demo().main(["--steps", "12", "--save-secs", "0", "--dir", str(d), "--quiet"])
    assert out["preempted_at"] == [4, 8]
    assert out["resumed"] == out["uninterrupted"]  # the pipeline resumed at its saved position
    assert jaxckpt.CheckpointManager(d).latest_step() >= 8  # the last: as commits allowed


def test_demo_rejects_a_bad_mesh(tmp_path):
    import pytest

    with pytest.raises(SystemExit, match="--mesh 3x4"):
        _demo().main(["--mesh", "3x4", "--dir", str(tmp_path / "x"), "--quiet"])
