"""The synchronous path keeps today's numbers: a short tiny GRPO run through the launcher with a fixed
seed reproduces the per-step metrics recorded in ``golden/grpo_sync.json``.

The golden file was written by the step loop that preceded the rollout service (its commit is in the
file); ``LOONGSAGE_WRITE_GOLDEN=1`` rewrites it from the current code, which only a deliberate change
of the numbers justifies.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from loongsage.core.cli import main

GOLDEN = Path(__file__).parent / "golden" / "grpo_sync.json"
ARGS = ["train", "tiny/grpo_arith_cpu", "run.name=golden", "run.total_steps=4", "data_sources.0.prompts_per_step=4",
        "data_sources.0.samples_per_prompt=4", "evaluation.every_steps=2", "evaluation.max_prompts=16",
        "evaluation.pass_k=2", "checkpoint.every_steps=0", "checkpoint.export_hf=false", "tracking.progress=false"]
NOISY = ("timing/", "perf/")


def _rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(NOISY)} for r in rows]


def test_sync_run_reproduces_the_recorded_metrics(ray_session, in_tmp):
    assert main(ARGS) == 0
    rows = _rows(in_tmp / "runs" / "golden")
    if os.environ.get("LOONGSAGE_WRITE_GOLDEN") == "1":
        GOLDEN.write_text(json.dumps({"commit": os.environ.get("LOONGSAGE_COMMIT", "unknown"), "args": ARGS,
                                      "rows": rows}, indent=1))
    golden = json.loads(GOLDEN.read_text())
    assert golden["args"] == ARGS
    assert [r["step"] for r in rows] == [r["step"] for r in golden["rows"]]
    for got, want in zip(rows, golden["rows"]):
        # metrics added since are allowed; every recorded one must be there with its value
        assert want.keys() <= got.keys(), (got["step"], sorted(want.keys() - got.keys()))
        for key, value in want.items():
            # counts, rewards and accuracies are exact; losses and norms to float32 rounding
            assert math.isclose(got[key], value, rel_tol=1e-5, abs_tol=1e-9), (got["step"], key, got[key], value)
