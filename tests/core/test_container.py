"""The container image and the lock do not drift: the stack container/Containerfile declares is the
one ``uv sync --locked --extra gpu --no-dev`` installs in it (Python 3.12 on Linux x86_64), the image
installs from the lock alone, and the CPU default of the lock stays apart from the GPU extra."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from packaging.markers import Marker

REPO = Path(__file__).resolve().parents[2]
CONTAINERFILE = REPO / "container" / "Containerfile"
# the image's interpreter: Ubuntu 24.04's Python under NVIDIA's CUDA image
IMAGE_PYTHON = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
}

pytestmark = pytest.mark.skipif(shutil.which("uv") is None, reason="needs uv (the project's installer)")


def _labels() -> dict[str, str]:
    return dict(re.findall(r'org\.loongsage\.stack\.([\w-]+)="([^"]+)"', CONTAINERFILE.read_text()))


def _arg(name: str) -> str:
    found = re.search(rf"^ARG {name}=(\S*)$", CONTAINERFILE.read_text(), re.M)
    assert found, f"container/Containerfile declares no ARG {name}"
    return found.group(1)


def _exported(*flags: str) -> dict[str, str]:
    """``{package: version}`` that ``uv sync --locked <flags>`` installs on the image's interpreter."""
    out = subprocess.run(
        ["uv", "export", "--locked", "--no-hashes", "--no-emit-workspace", "--no-header", *flags],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    versions = {}
    for line in out.splitlines():
        requirement, _, marker = line.strip().partition(" ; ")
        if "==" not in requirement or (marker and not Marker(marker).evaluate(IMAGE_PYTHON)):
            continue
        name, version = requirement.split("==")
        versions[name.lower()] = version
    return versions


def test_the_images_declared_stack_is_the_locked_gpu_extra() -> None:
    labels = _labels()
    assert {"torch", "cuda", "transformers", "sglang", "megatron-core", "ray", "transformer-engine"} <= labels.keys()
    locked = _exported("--extra", "gpu", "--no-dev")
    for package in ("torch", "transformers", "sglang", "megatron-core", "ray"):
        assert locked.get(package) == labels[package], (package, locked.get(package), labels[package])
    # the CUDA of the locked torch (its runtime wheel) is the one Transformer Engine's core is built for
    assert locked["nvidia-cuda-runtime"].split(".")[0] == labels["cuda"]
    assert labels["transformer-engine"] == _arg("TRANSFORMER_ENGINE_VERSION")
    assert f"transformer_engine_cu{labels['cuda']}==" in CONTAINERFILE.read_text()


def test_the_image_installs_from_the_lock_alone() -> None:
    text = "\n".join(line for line in CONTAINERFILE.read_text().splitlines() if not line.lstrip().startswith("#"))
    syncs = re.findall(r"uv sync[^\n]*", text)
    assert syncs and all("--locked" in s and "--no-dev" in s for s in syncs), syncs
    installs = re.findall(r"pip install[^&;]*", text)  # each install command, up to the next && or ;
    outside = [i for i in installs if '"uv==' not in i and "transformer_engine" not in i]
    assert not outside, f"installed outside the lock (only uv itself and Transformer Engine are): {outside}"


def test_the_cpu_default_stays_apart_from_the_gpu_extra() -> None:
    """The development environment (what ``uv sync --locked`` gives) keeps its own torch and
    transformers: SGLang's pins hold in the GPU extra only."""
    gpu, dev = _exported("--extra", "gpu", "--no-dev"), _exported()
    assert "sglang" not in dev and "sglang" in gpu
    assert gpu["torch"] != dev["torch"] or gpu["transformers"] != dev["transformers"]
    import torch
    import transformers

    assert dev["torch"] == torch.__version__.split("+")[0] and dev["transformers"] == transformers.__version__
