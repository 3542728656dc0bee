"""Every ``--json`` output is RFC 8259 JSON: NaN and infinities are written as the strings
``"NaN"``, ``"Infinity"`` and ``"-Infinity"`` (docs/cli.md, *JSON output*), never as the
literals Python's ``json`` writes by default, which JavaScript and Go refuse."""

from __future__ import annotations

import json
import math
import shutil
import subprocess

import numpy as np
import pytest

import jaxckpt
from jaxckpt._cli.main import main

NAN, INF = float("nan"), float("inf")


def _refuse(literal: str) -> None:
    raise ValueError(f"not RFC 8259 JSON: {literal}")


def strict_loads(text: str):
    """``text`` parsed as RFC 8259 JSON: a ``NaN`` or ``Infinity`` literal is refused."""
    return json.loads(text, parse_constant=_refuse)


def json_of(capsys, *argv) -> object:
    code = main([str(a) for a in argv])
    out = capsys.readouterr().out
    assert code in (0, 1), out
    if shutil.which("node"):  # JavaScript's own parser, where the machine has one
        js = "let s='';process.stdin.on('data',d=>s+=d).on('end',()=>JSON.parse(s))"
        got = subprocess.run(["node", "-e", js], input=out, text=True, capture_output=True)
        assert got.returncode == 0, got.stderr
    return strict_loads(out)


def test_the_parser_of_these_tests_refuses_the_literals():
    with pytest.raises(ValueError, match="NaN"):
        strict_loads(json.dumps({"x": NAN}))


def test_inspect_json_spells_values_that_are_not_finite(tmp_path, capsys):
    values = {"f": NAN, "i": INF, "n": -INF, "c": complex(NAN, 1.0), "ok": 0.5}
    jaxckpt.save(tmp_path / "a", values | {"w": np.zeros(2)})
    doc = json_of(capsys, "inspect", "--json", tmp_path / "a")
    got = {e["key"]: e["value"] for e in doc["entries"] if e["kind"] == "value"}
    assert got == {"f": "NaN", "i": "Infinity", "n": "-Infinity", "c": ["NaN", 1.0], "ok": 0.5}
    assert math.isnan(float(got["f"])) and float(got["n"]) == -INF  # Python reads them back


def test_ls_json_spells_metrics_that_are_not_finite(tmp_path, capsys):
    with jaxckpt.CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(1, {"w": np.zeros(2)}, metrics={"loss": NAN, "grad": INF, "lr": 0.1})
    doc = json_of(capsys, "ls", "--json", tmp_path / "run")
    assert doc["entries"][0]["metrics"] == {"loss": "NaN", "grad": "Infinity", "lr": 0.1}


def test_diff_json_spells_differences_and_values_that_are_not_finite(tmp_path, capsys):
    jaxckpt.save(tmp_path / "a", {"x": np.array([1.0, 2.0]), "v": NAN, "u": INF})
    jaxckpt.save(tmp_path / "b", {"x": np.array([1.0, NAN]), "v": NAN, "u": -INF})
    doc = json_of(capsys, "diff", "--json", tmp_path / "a", tmp_path / "b")
    assert doc["arrays"]["x"]["max_abs"] == "Infinity" and not doc["equal"]
    assert doc["values"] == {"u": {"a": "Infinity", "b": "-Infinity"}}  # NaN equals NaN


def test_verify_json_is_one_document_of_what_was_found(tmp_path, capsys):
    jaxckpt.save(tmp_path / "a", {"w": np.arange(8.0), "v": NAN})
    doc = json_of(capsys, "verify", "--json", tmp_path / "a")
    assert doc["ok"] and doc["damaged"] == {} and doc["summary"].startswith("OK: ")
    chunk = next((tmp_path / "a" / "arrays").rglob("c/*"))
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0x55  # one bad byte (w may be packed: then its pack's chunk)
    chunk.write_bytes(bytes(data))
    doc = json_of(capsys, "verify", "--json", tmp_path / "a")
    assert not doc["ok"] and doc["bad_chunks"] == 1 and list(doc["damaged"]) == ["w"], doc
    assert doc["problems"][0].startswith("DAMAGED w") and doc["summary"].startswith("DAMAGED:")
