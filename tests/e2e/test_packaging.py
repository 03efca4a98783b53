"""The published shape: every package builds an sdist, and a wheel from that sdist (as an installer
does from an sdist), each shipping the license, with complete metadata that ``twine check --strict``
passes; wheels of core + algos in a fresh venv outside the repository run a recipe, and a packaged
recipe that needs another package names it. The release policy itself: docs/releasing.md."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from packaging.metadata import Metadata
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
PACKAGES = sorted(p.name for p in (REPO / "packages").iterdir() if (p / "pyproject.toml").is_file())
TINY = sorted(p.name for p in (REPO / "recipes" / "tiny").glob("*.yaml"))


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert proc.returncode == 0, (
        f"{' '.join(map(str, cmd))}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    )
    return proc


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    """Every package built as ``uv build`` does by default: the sdist, then the wheel from the sdist."""
    out = tmp_path_factory.mktemp("dist")
    for package in PACKAGES:
        _run(["uv", "build", "--package", package, "-o", str(out)], cwd=REPO)
    return out


def _artifacts(dist: Path, package: str) -> tuple[Path, Path]:
    stem = package.replace("-", "_")
    sdists, wheels = list(dist.glob(f"{stem}-*.tar.gz")), list(dist.glob(f"{stem}-*.whl"))
    assert len(sdists) == 1 and len(wheels) == 1, (package, sorted(p.name for p in dist.iterdir()))
    return sdists[0], wheels[0]


@pytest.mark.parametrize("package", PACKAGES)
def test_each_package_builds_an_sdist_and_a_wheel_from_it_with_the_license(dist, package):
    sdist, wheel = _artifacts(dist, package)
    license_text = (REPO / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    # each package ships a copy of the repository's LICENSE (a package cannot reach outside its folder)
    assert (REPO / "packages" / package / "LICENSE").read_text() == license_text
    with tarfile.open(sdist) as tar:
        top = tar.getnames()[0].split("/")[0]
        assert tar.extractfile(f"{top}/LICENSE").read().decode() == license_text
        sdist_names = tar.getnames()
    with zipfile.ZipFile(wheel) as whl:
        info = next(n.split("/")[0] for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
        assert whl.read(f"{info}/licenses/LICENSE").decode() == license_text
        metadata = Parser().parsestr(whl.read(f"{info}/METADATA").decode())
        wheel_names = whl.namelist()
    assert metadata["License-Expression"] == "Apache-2.0"
    assert metadata.get_all("License-File") == ["LICENSE"]
    # the README is the published description: it says at least how to install the package
    assert re.search(rf"pip install [^\n]*\b{package}\b", metadata.get_payload()), f"{package}/README.md"
    if package == "loongsage-core":  # the tiny recipes, carried by the sdist into the wheel
        assert sorted(n.rsplit("/", 1)[1] for n in sdist_names if "/recipes/tiny/" in n) == TINY
        assert sorted(n.rsplit("/", 1)[1] for n in wheel_names if n.startswith("loongsage/core/recipes/tiny/")) == TINY
    if package == "loongsage-agentflow":  # its chat and tool_agent agents import them
        required = {r.split(">")[0].split("=")[0].split(";")[0].strip() for r in metadata.get_all("Requires-Dist")}
        assert {"openai", "httpx"} <= required, required


@pytest.mark.parametrize("package", PACKAGES)
def test_each_wheel_carries_complete_valid_metadata(dist, package):
    project = tomllib.loads((REPO / "packages" / package / "pyproject.toml").read_text())["project"]
    _, wheel = _artifacts(dist, package)
    with zipfile.ZipFile(wheel) as whl:
        info = next(n.split("/")[0] for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
        raw = whl.read(f"{info}/METADATA")
        entry_points = whl.read(f"{info}/entry_points.txt").decode()
    metadata = Metadata.from_email(raw, validate=True)  # raises on any field PyPI would refuse
    assert (metadata.name, str(metadata.version)) == (package, project["version"])
    assert metadata.summary == project["description"]
    assert str(metadata.requires_python) == project["requires-python"]
    assert sorted(metadata.classifiers or []) == sorted(project["classifiers"])
    assert sorted(metadata.keywords or []) == sorted(project["keywords"])
    assert (metadata.license_expression, metadata.license_files) == ("Apache-2.0", ["LICENSE"])
    assert metadata.description_content_type == "text/markdown"
    readme = (REPO / "packages" / package / "README.md").read_text()
    assert metadata.description and metadata.description.strip() == readme.strip()
    required = {r.name for r in metadata.requires_dist or [] if "extra" not in str(r.marker or "")}
    assert required == {Requirement(r).name for r in project["dependencies"]}
    for name, target in project.get("entry-points", {}).get("loongsage", {}).items():
        assert f"{name} = {target}" in entry_points, (name, entry_points)
    assert metadata.project_urls is None or all(u.startswith("https://") for u in metadata.project_urls.values())


def test_twine_check_strict_passes_on_every_sdist_and_wheel(dist):
    artifacts = sorted([*dist.glob("*.tar.gz"), *dist.glob("*.whl")])
    assert len(artifacts) == 2 * len(PACKAGES), [a.name for a in artifacts]
    checked = _run([sys.executable, "-m", "twine", "check", "--strict", *map(str, artifacts)])
    assert checked.stdout.count("PASSED") == len(artifacts), checked.stdout


def test_a_core_wheel_built_straight_from_the_repository_carries_the_recipes_too(tmp_path):
    _run(["uv", "build", "--wheel", "--package", "loongsage-core", "-o", str(tmp_path)], cwd=REPO)
    (wheel,) = tmp_path.glob("*.whl")
    with zipfile.ZipFile(wheel) as whl:
        names = sorted(n.rsplit("/", 1)[1] for n in whl.namelist() if n.startswith("loongsage/core/recipes/tiny/"))
    assert names == TINY


def test_wheels_run_the_packaged_tiny_recipe(tmp_path, model_cache, dist):
    wheels = [str(_artifacts(dist, package)[1]) for package in ("loongsage-core", "loongsage-algos")]
    # Same third-party versions as the lock (so the downloads come from uv's cache), but the two
    # packages themselves only from their wheels: pip semantics, nothing from the workspace.
    constraints = tmp_path / "constraints.txt"
    exported = _run(
        ["uv", "export", "--no-hashes", "--no-emit-workspace", "--no-dev", "--frozen", "--format", "requirements-txt"],
        cwd=REPO,
    ).stdout
    constraints.write_text(exported)
    venv = tmp_path / "venv"
    _run(["uv", "venv", "--python", sys.executable, str(venv)])
    python = venv / "bin" / "python"
    _run(["uv", "pip", "install", "--python", str(python), "-c", str(constraints), *wheels])

    user = tmp_path / "elsewhere"  # no recipes/ here: the packaged recipe must be found
    user.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH", "UV_"))}
    env["LOONGSAGE_CACHE"] = str(model_cache)
    probe = _run(
        [str(python), "-c", "import loongsage.core, loongsage.algos; print(loongsage.core.__file__)"], cwd=user, env=env
    )
    assert str(venv) in probe.stdout
    listing = _run([str(venv / "bin" / "loongsage"), "plugins"], cwd=user, env=env).stdout
    assert "grpo" in listing and "loongsage-algos 0.1.0" in listing
    # on GPUs the weight transport comes from loongsage-sync, which these two packages do not pull
    gpus = subprocess.run(
        [str(venv / "bin" / "loongsage"), "train", "tiny/grpo_arith_cpu", "placement.gpus_per_actor=1"],
        cwd=user,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert gpus.returncode == 2 and "uses the 'ipc' transport of loongsage-sync, which is not installed" in gpus.stderr
    # and the SGLang engine from loongsage-sglang: the miss names the package
    sgl = subprocess.run(
        [str(venv / "bin" / "loongsage"), "train", "tiny/grpo_arith_cpu", "rollout.engine.name=sglang"],
        cwd=user,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (
        sgl.returncode == 2
        and "unknown engine 'sglang'; known: native (the 'sglang' engine is in loongsage-sglang: "
        "pip install loongsage-sglang)"
        in sgl.stderr
    ), sgl.stderr
    # packaged recipes that need another package say which, whatever the entry's kind
    for recipe, miss, package in (
        ("tiny/tool_calc_cpu", "unknown model_builder 'tiny_tool_calc'", "loongsage-agentflow"),
        ("tiny/grpo_moe_r3_cpu", "unknown trainer 'megatron'", "loongsage-megatron"),
    ):
        done = subprocess.run(
            [str(venv / "bin" / "loongsage"), "train", recipe],
            cwd=user,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 2 and miss in done.stderr and f"pip install {package})" in done.stderr, done.stderr
    _run(
        [
            str(venv / "bin" / "loongsage"),
            "train",
            "tiny/grpo_arith_cpu",
            "run.name=pkg",
            "run.total_steps=2",
            "data_sources.0.prompts_per_step=2",
            "data_sources.0.samples_per_prompt=2",
            "evaluation.max_prompts=8",
            "evaluation.pass_k=0",
            "tracking.progress=false",
        ],
        cwd=user,
        env=env,
    )
    rows = [json.loads(line) for line in (user / "runs" / "pkg" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/loss" in r] == [1, 2]
    assert (user / "runs" / "pkg" / "final" / "config.json").is_file()
