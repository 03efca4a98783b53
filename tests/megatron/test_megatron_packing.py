"""Packed rows (``pack_sequences: true``) compute as padded ones: a micro-batch's rows of different
lengths run as one sequence of their real tokens (Megatron's ``thd`` layout, attention within each
row, positions from 0 in each), and give the padded replica's log-probs, entropies and first
gradient, alone, split over tensor-parallel ranks (sequence parallelism on) and over pipeline
stages. Each layout runs in processes of their own (Megatron's CPU shims)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "core" / "engine"))
from _engine_helpers import build_engine_test_model  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from _worker_server import run_worker  # noqa: E402

WORKER = Path(__file__).with_name("_packing_worker.py")


@pytest.mark.timeout(400)
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)])
def test_packed_rows_compute_as_padded_ones(tmp_path, tp, pp):
    model_dir = build_engine_test_model(tmp_path / "m")
    run = run_worker(WORKER, model_dir, str(tmp_path), str(tp), str(pp), timeout=380)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    r = torch.load(tmp_path / f"packing_tp{tp}_pp{pp}.pt", weights_only=False)
    mask, padded, packed = r["mask"], r["padded"], r["packed"]
    for key in ("logprobs", "entropy", "after"):
        diff = (padded[key] - packed[key])[mask].abs().max().item()
        assert diff < 1e-5, (key, diff)
    assert abs(padded["grad_norm"] - packed["grad_norm"]) < 1e-5 * padded["grad_norm"], r
    if tp * pp == 1:
        assert packed["left_refused"].startswith("pack_sequences: rows must be padded on the right only"), packed


def test_packing_is_refused_where_it_does_not_run(tmp_path):
    from loongsage.megatron.trainer import MegatronTrainer

    model_dir = build_engine_test_model(tmp_path / "m")
    for params, why in (
        ({"layer_spec": "local"}, "layer_spec=local and context_parallel=1"),
        ({"context_parallel": 2}, "layer_spec=auto and context_parallel=2"),
    ):
        with pytest.raises(
            ValueError, match=f"pack_sequences with {why}; allowed: layer_spec auto, te or sdpa with context_parallel 1"
        ):
            MegatronTrainer.preflight({"pack_sequences": True, **params}, model_dir, world_size=2)
