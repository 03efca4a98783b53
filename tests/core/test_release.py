"""The release policy of docs/releasing.md, read from the packages' pyproject files (nothing is built here).

All packages share one version, bumped together; a requirement on another LoongSage package has that
version as its floor; the installed distributions report it; CHANGELOG.md has its entry; and each
package's metadata is complete enough to publish (tests/e2e/test_packaging.py checks the built
artifacts themselves).
"""

from __future__ import annotations

import importlib.metadata
import re
import tomllib
from pathlib import Path
from urllib.parse import urlparse

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
PROJECTS = {
    path.parent.name: tomllib.loads(path.read_text())["project"]
    for path in sorted((REPO / "packages").glob("*/pyproject.toml"))
}
VERSIONS = {name: project["version"] for name, project in PROJECTS.items()}
VERSION = next(iter(VERSIONS.values()))


def _requirements(project: dict) -> list[Requirement]:
    extras = [req for group in project.get("optional-dependencies", {}).values() for req in group]
    return [Requirement(req) for req in [*project.get("dependencies", []), *extras]]


def test_the_project_packages_are_all_here() -> None:
    assert set(PROJECTS) == {
        "loongsage-core",
        "loongsage-algos",
        "loongsage-agentflow",
        "loongsage-sandbox",
        "loongsage-sync",
        "loongsage-sglang",
        "loongsage-megatron",
    }
    assert all(name == project["name"] for name, project in PROJECTS.items())


def test_every_package_has_the_same_version() -> None:
    assert len(set(VERSIONS.values())) == 1, f"one version for all packages (docs/releasing.md): {VERSIONS}"
    assert str(Version(VERSION)) == VERSION and re.fullmatch(r"\d+\.\d+\.\d+", VERSION), VERSION


@pytest.mark.parametrize("package", sorted(PROJECTS))
def test_the_installed_distribution_reports_the_version(package: str) -> None:
    # the workspace installs every package; the version exists only in pyproject.toml, read back from here
    assert importlib.metadata.version(package) == VERSION


@pytest.mark.parametrize("package", sorted(PROJECTS))
def test_requirements_on_loongsage_packages_have_the_version_as_their_floor(package: str) -> None:
    ours = [req for req in _requirements(PROJECTS[package]) if req.name.startswith("loongsage")]
    if package != "loongsage-core":
        assert any(req.name == "loongsage-core" for req in ours), f"{package} does not require loongsage-core"
    for req in ours:
        assert req.name in PROJECTS, f"{package} requires {req.name}, which is not a package of the project"
        assert req.specifier == SpecifierSet(f">={VERSION}"), (
            f"{package}: {req} should be {req.name}>={VERSION} (the shared version as the floor)"
        )


def test_the_changelog_has_an_entry_for_the_current_version() -> None:
    changelog = (REPO / "CHANGELOG.md").read_text()
    entries = re.findall(r"^## (\S+)(.*)$", changelog, re.M)
    assert entries, "CHANGELOG.md has no version entry (## <version>)"
    assert entries[0][0] == VERSION, f"the newest entry of CHANGELOG.md is {entries[0][0]}, the version is {VERSION}"
    assert len({version for version, _ in entries}) == len(entries), "a version with two entries"
    section = changelog.split(f"## {VERSION}", 1)[1].split("\n## ", 1)[0]
    groups = re.findall(r"^### (.+)$", section, re.M)
    assert "loongsage-core" in groups, groups
    named = [group for group in groups if group.startswith("loongsage")]
    assert set(named) <= set(PROJECTS), f"groups that are not packages: {sorted(set(named) - set(PROJECTS))}"
    assert re.search(r"^- ", section, re.M), "the entry says nothing"


@pytest.fixture(scope="module")
def trove() -> tuple[set[str], dict[str, list[str]]]:
    trove_classifiers = pytest.importorskip("trove_classifiers")
    return set(trove_classifiers.classifiers), dict(trove_classifiers.deprecated_classifiers)


@pytest.mark.parametrize("package", sorted(PROJECTS))
def test_the_metadata_is_complete(package: str, trove) -> None:
    project = PROJECTS[package]
    folder = REPO / "packages" / package
    assert project["readme"] == "README.md" and (folder / "README.md").is_file()
    assert project["description"] and "\n" not in project["description"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    assert (folder / "LICENSE").read_text() == (REPO / "LICENSE").read_text()
    assert project["requires-python"] == ">=3.11"
    known, deprecated = trove
    classifiers = project["classifiers"]
    assert len(set(classifiers)) == len(classifiers), classifiers
    unknown = [c for c in classifiers if c not in known or c in deprecated]
    assert not unknown, f"{package}: not (or no longer) a PyPI classifier: {unknown}"
    # PEP 639: the license is the License-Expression; PyPI refuses a License :: classifier beside it
    assert not [c for c in classifiers if c.startswith("License ::")], classifiers
    assert any(c.startswith("Topic :: ") for c in classifiers)
    floor = re.fullmatch(r">=(\d+\.\d+)", project["requires-python"]).group(1)
    python = re.compile(r"Programming Language :: Python :: (3\.\d+)")
    versions = [m.group(1) for m in map(python.fullmatch, classifiers) if m]
    assert versions and min(versions, key=Version) == floor, versions
    # a project URL is a real address or nothing (no placeholder, no path in the repository)
    for label, url in project.get("urls", {}).items():
        parsed = urlparse(url)
        assert parsed.scheme == "https" and parsed.netloc and "example" not in parsed.netloc, (label, url)
