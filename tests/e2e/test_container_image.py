"""The container image built here, from nothing but Debian packages and PyPI: container/debian_base.sh
makes the base from a Debian mirror, container/Containerfile installs the workspace from uv.lock on
it, and the tiny recipe trains inside the image on the CPU (its warm start built there too).

Slow (minutes, gigabytes: the locked torch is PyPI's CUDA build) and needing root, Podman,
debootstrap and the network to PyPI and a Debian mirror, so outside the default suite:
``uv run pytest -m slow tests/e2e/test_container_image.py``. The image's pins are checked against
the lock in the default suite (tests/core/test_container.py).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BASE = "localhost/loongsage-debian-base:bookworm"
IMAGE = "localhost/loongsage:cpu-test"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.geteuid() != 0 or not (shutil.which("podman") and shutil.which("debootstrap")),
        reason="needs root, podman and debootstrap (apt-get install podman debootstrap)",
    ),
]


def _podman(*args: str, timeout: float = 1800) -> subprocess.CompletedProcess:
    return subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(3600)
def test_the_image_builds_from_debian_packages_and_trains_the_tiny_recipe(tmp_path) -> None:
    timings = {}
    if _podman("image", "exists", BASE).returncode != 0:
        t0 = time.monotonic()
        made = subprocess.run(
            [str(REPO / "container" / "debian_base.sh"), BASE], capture_output=True, text=True, timeout=1800
        )
        assert made.returncode == 0, made.stderr[-3000:]
        timings["base_s"] = round(time.monotonic() - t0)
    t0 = time.monotonic()
    # the machine's CA bundle, where a proxy re-signs TLS (docs/container.md)
    bundle = Path(os.environ.get("SSL_CERT_FILE") or "/etc/ssl/certs/ca-certificates.crt")
    secret = ["--secret", f"id=ca,src={bundle}"] if bundle.is_file() else []
    built = _podman(
        "build", "-f", str(REPO / "container" / "Containerfile"), *secret, "--build-arg", f"BASE={BASE}", "-t", IMAGE,
        str(REPO),
    )  # fmt: skip
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    timings["build_s"] = round(time.monotonic() - t0)
    size = json.loads(_podman("image", "inspect", IMAGE).stdout)[0]["Size"]

    t0 = time.monotonic()
    # limits the host allows (runc refuses engine defaults above the host's hard limits)
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    nofile = 1 << 20 if hard == resource.RLIM_INFINITY else hard
    limits = ["--ulimit", f"nofile={nofile}:{nofile}", "--ulimit", "nproc=8192:8192"]
    ran = _podman(
        "run", "--rm", *limits, "--shm-size=2g", "--network=none", "-v", f"{tmp_path}:/work", IMAGE,
        "loongsage", "train", "tiny/grpo_arith_cpu", "run.total_steps=4", "evaluation.every_steps=0",
        "evaluation.max_prompts=8", "tracking.progress=false",
        timeout=1800,
    )  # fmt: skip
    timings["run_s"] = round(time.monotonic() - t0)
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    assert "done: 4 steps" in ran.stdout, ran.stdout[-2000:]
    metrics = tmp_path / "runs" / "grpo_arith_cpu" / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows if "train/loss" in r] == [1, 2, 3, 4]
    stack = json.loads(_podman("image", "inspect", IMAGE).stdout)[0]["Labels"]
    print(json.dumps({"image_bytes": size, **timings, "labels": stack}))
