"""What a release promises agrees with itself: one version, the license, the changelog, the
requirements README states. (The wheel itself is built, installed and smoke-tested outside the
source tree by `make wheel-test`, which CI runs.)"""

from __future__ import annotations

import importlib.metadata
import re
import tomllib
from pathlib import Path

from packaging.version import Version

import jaxckpt
from jaxckpt._format.manifest import VERSIONS

ROOT = Path(__file__).resolve().parent.parent


def test_one_version_everywhere():
    assert importlib.metadata.version("jaxckpt") == jaxckpt.__version__
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "version" not in project and "version" in project["dynamic"]  # from _version.py


def test_license_file_and_spdx_string():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_changelog_names_this_release_and_every_format_version():
    log = (ROOT / "CHANGELOG.md").read_text()
    assert re.search(rf"^## {re.escape(jaxckpt.__version__)}\b", log, re.M)
    for v in VERSIONS:
        assert re.search(rf"^### Version {v}\b", log, re.M), v
    assert "(CHANGELOG.md)" in (ROOT / "README.md").read_text()


def _floors(text: str) -> dict[str, Version]:
    """``{package: floor}`` of requirement strings like ``jax>=0.6.2``."""
    return {k: Version(v) for k, v in re.findall(r"([A-Za-z0-9_.-]+)>=([0-9][0-9.]*)", text)}


def test_readme_requirements_are_the_wheels():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = _floors(" ".join(project["dependencies"]))
    declared["Python"] = Version(project["requires-python"].removeprefix(">="))
    readme = (ROOT / "README.md").read_text()
    line = " ".join(readme.split("Requirements:", 1)[1].split(". ", 1)[0].split())
    stated = {k: Version(v) for k, v in re.findall(r"([A-Za-z0-9_.-]+) ≥ ([0-9][0-9.]*)", line)}
    if "jaxlib" in stated and "jax" not in stated:  # "jax and jaxlib ≥ X"
        stated["jax"] = stated["jaxlib"]
    assert stated == declared, (stated, declared)
    floors = _floors((ROOT / ".ci" / "floors.txt").read_text().replace("==", ">="))
    assert {k: v for k, v in floors.items() if k in declared} == {
        k: v for k, v in declared.items() if k != "Python"
    }
