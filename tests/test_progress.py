"""Progress of long work: one implementation (jaxckpt._runtime.progress) behind save, restore,
save_async, convert and the command line; off by default in library calls."""

from __future__ import annotations

import io

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import mesh, put

import jaxckpt
from jaxckpt._runtime.progress import Progress


def _state():
    m = mesh((4, 2), ("x", "y"))
    return {"w": put(jnp.arange(64.0 * 64).reshape(64, 64), m, "x", "y"), "b": np.ones(16)}


def _calls():
    seen: list[tuple[int, int]] = []
    return seen, lambda done, total: seen.append((done, total))


def test_save_and_restore_report_bytes_to_a_callback(tmp_path):
    seen, fn = _calls()
    jaxckpt.save(tmp_path / "c", _state(), progress=fn)
    total = 64 * 64 * 4 + 16 * 8
    assert seen and seen[-1] == (total, total)
    assert all(t == total for _, t in seen) and [d for d, _ in seen] == sorted(d for d, _ in seen)
    seen, fn = _calls()
    jaxckpt.restore(tmp_path / "c", progress=fn)
    assert seen[-1] == (total, total)


def test_save_async_reports_until_committed(tmp_path):
    seen, fn = _calls()
    h = jaxckpt.save_async(tmp_path / "c", _state(), progress=fn)
    h.wait()
    assert seen[-1][0] == seen[-1][1] > 0


def test_library_calls_show_nothing_by_default(tmp_path, capsys):
    jaxckpt.save(tmp_path / "c", _state())
    jaxckpt.restore(tmp_path / "c")
    jaxckpt.convert(str(tmp_path / "c"), str(tmp_path / "d"))
    assert capsys.readouterr() == ("", "")


def test_progress_true_draws_on_stderr(tmp_path, capsys):
    jaxckpt.save(tmp_path / "c", _state(), progress=True)
    err = capsys.readouterr().err
    assert "save" in err and "100%" in err


def test_convert_reports_to_a_callback(tmp_path):
    jaxckpt.save(tmp_path / "c", _state())
    seen, fn = _calls()
    jaxckpt.convert(str(tmp_path / "c"), str(tmp_path / "d"), progress=fn)
    assert seen[-1] == (64 * 64 * 4 + 16 * 8,) * 2


@pytest.mark.parametrize("call", ["save", "restore", "convert"])
def test_a_bad_progress_argument_is_named(tmp_path, call):
    jaxckpt.save(tmp_path / "c", {"x": np.ones(2)})
    with pytest.raises(TypeError, match=rf"jaxckpt\.{call}: progress must be True, False, None"):
        if call == "save":
            jaxckpt.save(tmp_path / "d", {"x": 1}, progress="yes")
        elif call == "restore":
            jaxckpt.restore(tmp_path / "c", progress="yes")
        else:
            jaxckpt.convert(str(tmp_path / "c"), str(tmp_path / "e"), progress=3)


def test_the_plain_line_says_bytes_rate_and_time_left():
    stream = io.StringIO()
    p = Progress("verify", 4 << 20, True, stream=stream, use_tqdm=False)
    p.add(1 << 20)
    line = p.line(now=p.t0 + 2.0)
    assert line == "verify: 1.0/4.0 MiB (25%), 512.0 KiB/s, 0:06 left"
    p.finish()
    out = stream.getvalue()
    assert out.endswith("\n") and "4.0/4.0 MiB (100%)" in out


def test_with_tqdm_the_bar_is_tqdms():
    pytest.importorskip("tqdm")
    stream = io.StringIO()
    p = Progress("verify", 1 << 20, True, stream=stream)
    assert p.bar is not None
    p.add(1 << 20)
    p.finish()
    assert "verify" in stream.getvalue() and "100%" in stream.getvalue()


def test_close_twice_and_an_inactive_bar_cost_nothing():
    p = Progress("x", 10, None)
    assert not p.active
    p.add(5)
    p.close()
    p.close()
    assert p.done == 5


def test_cli_export_shows_progress_when_asked(tmp_path, capsys):
    from jaxckpt._cli.main import main

    jaxckpt.save(tmp_path / "c", _state())
    assert main(["export", str(tmp_path / "c"), str(tmp_path / "o.npz"), "--progress"]) == 0
    err = capsys.readouterr().err
    assert "export" in err and "100%" in err
    assert main(["export", str(tmp_path / "c"), str(tmp_path / "p.npz")]) == 0
    assert "100%" not in capsys.readouterr().err  # stderr is no terminal here: quiet


def test_a_budgeted_async_save_reports_and_restores_exactly(tmp_path):
    seen, fn = _calls()
    two = {"a": np.zeros(1 << 18, np.float32), "b": np.ones(1 << 18, np.float32)}  # 1 MiB each
    h = jaxckpt.save_async(tmp_path / "c", two, max_host_bytes=1 << 20, progress=fn)
    h.wait()
    assert seen[-1] == (2 << 20, 2 << 20)
    np.testing.assert_array_equal(jaxckpt.restore(tmp_path / "c")["b"], 1.0)
