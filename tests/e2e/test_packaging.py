"""The published shape: wheels of core + algos in a fresh venv outside the repository run a recipe."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    return proc


def test_wheels_run_the_packaged_tiny_recipe(tmp_path, model_cache):
    dist = tmp_path / "dist"
    for package in ("loongsage-core", "loongsage-algos"):
        _run(["uv", "build", "--wheel", "--package", package, "-o", str(dist)], cwd=REPO)
    wheels = sorted(str(p) for p in dist.glob("*.whl"))
    assert len(wheels) == 2
    # Same third-party versions as the lock (so the downloads come from uv's cache), but the two
    # packages themselves only from their wheels: pip semantics, nothing from the workspace.
    constraints = tmp_path / "constraints.txt"
    exported = _run(["uv", "export", "--no-hashes", "--no-emit-workspace", "--no-dev", "--frozen",
                     "--format", "requirements-txt"], cwd=REPO).stdout
    constraints.write_text(exported)
    venv = tmp_path / "venv"
    _run(["uv", "venv", "--python", sys.executable, str(venv)])
    python = venv / "bin" / "python"
    _run(["uv", "pip", "install", "--python", str(python), "-c", str(constraints), *wheels])

    user = tmp_path / "elsewhere"  # no recipes/ here: the packaged recipe must be found
    user.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH", "UV_"))}
    env["LOONGSAGE_CACHE"] = str(model_cache)
    probe = _run([str(python), "-c", "import loongsage.core, loongsage.algos; print(loongsage.core.__file__)"],
                 cwd=user, env=env)
    assert str(venv) in probe.stdout
    listing = _run([str(venv / "bin" / "loongsage"), "plugins"], cwd=user, env=env).stdout
    assert "grpo" in listing and "loongsage-algos 0.1.0" in listing
    # on GPUs the weight transport comes from loongsage-sync, which these two packages do not pull
    gpus = subprocess.run([str(venv / "bin" / "loongsage"), "train", "tiny/grpo_arith_cpu", "placement.gpus_per_actor=1"],
                          cwd=user, env=env, capture_output=True, text=True, timeout=300)
    assert gpus.returncode == 2 and "uses the 'ipc' transport of loongsage-sync, which is not installed" in gpus.stderr
    # and the SGLang engine from loongsage-sglang: the miss names the package
    sgl = subprocess.run([str(venv / "bin" / "loongsage"), "train", "tiny/grpo_arith_cpu", "rollout.engine.name=sglang"],
                         cwd=user, env=env, capture_output=True, text=True, timeout=300)
    assert sgl.returncode == 2 and "unknown engine 'sglang'; known: native (the 'sglang' engine is in loongsage-sglang: " \
        "pip install loongsage-sglang)" in sgl.stderr, sgl.stderr
    _run([str(venv / "bin" / "loongsage"), "train", "tiny/grpo_arith_cpu", "run.name=pkg",
          "run.total_steps=2", "data_sources.0.prompts_per_step=2", "data_sources.0.samples_per_prompt=2",
          "evaluation.max_prompts=8", "evaluation.pass_k=0", "tracking.progress=false"], cwd=user, env=env)
    rows = [json.loads(line) for line in (user / "runs" / "pkg" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/loss" in r] == [1, 2]
    assert (user / "runs" / "pkg" / "final" / "config.json").is_file()
