"""One version for every package: the repository's VERSION file.

Each ``packages/*/pyproject.toml`` declares its version dynamic and reads it from
``../../VERSION`` (``[tool.hatch.version]``); an sdist keeps it in its PKG-INFO, which hatchling
reads back when it builds the wheel. These tests keep it that way, and check that the ranges
with which the packages require each other (``pallas-flash-core>=0.1,<0.2``) admit that
version, so that a release's wheels install together.
"""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[3]
VERSION_FILE = ROOT / "VERSION"
if not VERSION_FILE.is_file():  # e.g. the tests of an unpacked sdist, outside the repository
    pytest.skip("not in the repository (no VERSION file)", allow_module_level=True)

PYPROJECTS = sorted((ROOT / "packages").glob("*/pyproject.toml"))
PROJECTS = {path.parent.name: tomllib.loads(path.read_text()) for path in PYPROJECTS}
DISTRIBUTIONS = {project["project"]["name"] for project in PROJECTS.values()}


def _version() -> Version:
    return Version(VERSION_FILE.read_text().strip())


def test_the_version_file_holds_one_version() -> None:
    text = VERSION_FILE.read_text()
    assert text.strip() and len(text.split()) == 1, f"{VERSION_FILE}: {text!r}"
    assert str(_version()) == text.strip(), "not a normalised PEP 440 version"


@pytest.mark.parametrize("package", list(PROJECTS))
def test_the_version_comes_from_the_version_file(package: str) -> None:
    project = PROJECTS[package]
    assert "version" not in project["project"], "a static version: use ../../VERSION"
    assert "version" in project["project"].get("dynamic", [])
    source = project["tool"]["hatch"]["version"]
    assert (ROOT / "packages" / package / source["path"]).resolve() == VERSION_FILE


@pytest.mark.parametrize("package", list(PROJECTS))
def test_requirements_on_other_packages_admit_the_version(package: str) -> None:
    project = PROJECTS[package]["project"]
    lines = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        lines.extend(extra)
    requirements = [Requirement(line) for line in lines]
    ours = [r for r in requirements if r.name.startswith("pallas-flash")]
    assert {r.name for r in ours} <= DISTRIBUTIONS
    refused = [str(r) for r in ours if not r.specifier.contains(_version(), prereleases=True)]
    assert not refused, f"{package} requires {refused}, which refuse version {_version()}"


@pytest.mark.parametrize("distribution", sorted(DISTRIBUTIONS))
def test_installed_packages_carry_the_version(distribution: str) -> None:
    try:
        installed = importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"{distribution} is not installed")
    assert Version(installed) == _version(), f"{distribution} {installed}: reinstall it"
