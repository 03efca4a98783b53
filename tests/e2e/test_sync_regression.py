"""The synchronous path keeps today's numbers: a short tiny GRPO run through the launcher with a fixed
seed reproduces the per-step metrics recorded in ``golden/grpo_sync.json``.

What is reproducible where: every number of the run is a function of the warm start's weights, and
those come out of 1000 SFT steps on the CPU, which amplify any difference in the float kernels'
rounding into another model. The same build with torch's and MKL's AVX2 kernels instead of their
AVX-512 ones already differs after 40 steps (by 2e-7), so another kind of CPU builds another warm
start, whose greedy evaluation differs at step 0, before any training. The build pins its torch
threads (its ``threads`` parameter), and 1 or 2 threads give it bitwise the same weights, so neither
the machine's core count nor its load changes it; the run pins the actors' threads as well
(``placement.torch_threads``). Hence two tests over one run:

* the quantities that do not depend on the weights (the steps, the metric names, counts, the
  learning rate, the weight sync's sizes and versions, and the on-policy ratio, clip fraction and
  KL of a single mini-batch) are checked on every machine;
* every recorded number is compared where the warm start is bitwise the one the golden file was
  recorded with, on the same CPU kernels (the file's ``machine``); elsewhere that test is skipped,
  saying so.

The golden file was written by the step loop that preceded the rollout service (its commit is in the
file); ``LOONGSAGE_WRITE_GOLDEN=1`` rewrites it from the current code on the current machine, which
only a deliberate change of the numbers justifies.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

import pytest

GOLDEN = Path(__file__).parent / "golden" / "grpo_sync.json"
ARGS = [
    "train",
    "tiny/grpo_arith_cpu",
    "run.name=golden",
    "run.total_steps=4",
    "data_sources.0.prompts_per_step=4",
    "data_sources.0.samples_per_prompt=4",
    "evaluation.every_steps=2",
    "evaluation.max_prompts=16",
    "evaluation.pass_k=2",
    "checkpoint.every_steps=0",
    "checkpoint.export_hf=false",
    "tracking.progress=false",
    "placement.torch_threads=2",
]
NOISY = ("timing/", "perf/")
# the same on any machine: none depends on the weights (a synchronous step of one mini-batch is on
# policy, so its ratio is exactly 1 and nothing is clipped)
INDEPENDENT = (
    "rollout/trajectories",
    "rollout/failed",
    "rollout/groups_filtered",
    "rollout/refill_rounds",
    "rollout/groups_trained",
    "train/lr",
    "train/ratio",
    "train/clipfrac",
    "train/ppo_kl",
    "sync/bytes",
    "sync/buckets",
    "sync/version",
    "engine/version",
)


def _machine(run_dir: Path) -> dict:
    """What the recorded numbers hold for: the warm start's weights, bit for bit, and the CPU kernels."""
    import torch
    from safetensors.torch import load_file

    model = Path(json.loads((run_dir / "run_info.json").read_text())["model_path"])
    digest = hashlib.sha256()
    for file in sorted(model.glob("*.safetensors")):
        tensors = load_file(file)
        for name in sorted(tensors):
            digest.update(name.encode())
            digest.update(tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
    return {
        "warm_start_sha256": digest.hexdigest()[:16],
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
    }


@pytest.fixture(scope="module")
def run(launched) -> tuple[list[dict], dict]:
    """One run for both tests (and test_gateway_tiny.py's comparison): its metric rows (timings left
    out) and its machine."""
    run_dir = launched(ARGS) / "runs" / "golden"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(NOISY)} for r in rows], _machine(run_dir)


def test_sync_run_keeps_the_numbers_no_machine_changes(run):
    rows, _ = run
    golden = json.loads(GOLDEN.read_text())
    assert golden["args"] == ARGS
    assert [r["step"] for r in rows] == [r["step"] for r in golden["rows"]]
    for got, want in zip(rows, golden["rows"]):
        # metrics added since are allowed; every recorded one must be there
        assert want.keys() <= got.keys(), (got["step"], sorted(want.keys() - got.keys()))
        for key in INDEPENDENT:
            if key in want:
                assert got[key] == want[key], (got["step"], key, got[key], want[key])


def test_sync_run_reproduces_the_recorded_metrics(run):
    rows, machine = run
    if os.environ.get("LOONGSAGE_WRITE_GOLDEN") == "1":
        GOLDEN.write_text(
            json.dumps(
                {
                    "commit": os.environ.get("LOONGSAGE_COMMIT", "unknown"),
                    "args": ARGS,
                    "machine": machine,
                    "rows": rows,
                },
                indent=1,
            )
            + "\n"
        )
    golden = json.loads(GOLDEN.read_text())
    if machine != golden["machine"]:
        pytest.skip(
            f"the recorded numbers are those of another warm start or CPU kernels ({golden['machine']}; "
            f"here {machine}): only the machine-independent ones are checked"
        )
    for got, want in zip(rows, golden["rows"]):
        for key, value in want.items():
            # counts, rewards and accuracies are exact; losses and norms to float32 rounding
            assert math.isclose(got[key], value, rel_tol=1e-5, abs_tol=1e-9), (got["step"], key, got[key], value)
