"""Qwen3-MoE on the ``megatron`` trainer: the conversion (per-expert checkpoint files in, HF's fused
expert tensors out), the same log-probs, gradient and exports as the torch trainer, and R3 routing
replay (the routes HF's routers chose replay to the same forward; other routes change it; the
replay state does not outlive its forward; with gradient checkpointing the recomputed layers replay
them again in the backward; malformed routes are refused in one line). Megatron
runs in a process of its own (its CPU shims)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _worker_server import run_worker  # noqa: E402

WORKER = Path(__file__).with_name("_moe_worker.py")


@pytest.mark.timeout(300)
def test_qwen3_moe_trains_on_megatron_as_on_torch_and_replays_routes(tmp_path):
    run = run_worker(WORKER, str(tmp_path), timeout=280)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    r = json.loads((tmp_path / "result.json").read_text())
    assert r["logprob_diff"] < 1e-5 and r["entropy_diff"] < 1e-5, r
    assert r["export_names_equal"] and r["export_exact"] and r["export_hf_exact"], r
    assert r["grad_norm_rel_diff"] < 1e-4, r
    assert r["replay_own_routes_diff"] < 1e-5 and r["after_replay_plain_diff"] == 0.0, r
    assert r["replay_other_routes_diff"] > 1e-3, r
    assert r["replayed_step_grad_norm"] > 0, r
    assert r["recompute_grad_norm_rel_diff"] < 1e-6 and r["recompute_logprob_diff"] < 1e-6, r
    assert r["packed_replay_diff"] < 1e-5 and r["packed_replay_grad_rel_diff"] < 1e-5, r  # packed rows, R3
    assert r["bad_routes_error"].startswith("routed_experts: [3, 20, 1, 2] per micro-batch; expected"), r
    # a row of two segments replays each segment's own record, as the segments given as rows would
    assert r["segments_replay_diff"] < 1e-6 and r["segments_replay_changes"] > 1e-3, r
    assert r["segments_one_record_error"].startswith(
        "routed_experts: row 0 has 2 segments; expected one record per segment (a list), got one for the whole row"
    ), r
