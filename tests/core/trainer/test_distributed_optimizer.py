"""The distributed optimizer (``distributed_optimizer: true``, ZeRO-1) of the torch trainer: two
replicated ranks, each stepping its half of the float32 masters and AdamW moments, train exactly
as with the whole optimizer on both; each holds half the optimizer state; a checkpoint (the whole
vectors, gathered) resumes on one rank to the same next step; a checkpoint of the other optimizer
is refused in one line. The megatron trainer's buckets (experts apart) are in
tests/megatron/test_megatron_ep.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from loongsage.core.tinytask.tiny_model import build_tiny_qwen3

sys.path.insert(0, str(Path(__file__).parent))
from _dist_opt_worker import batch, loss_fn, trainer  # noqa: E402

WORKER = Path(__file__).with_name("_dist_opt_worker.py")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    work = tmp_path_factory.mktemp("dist_opt")
    build_tiny_qwen3(work / "m", hidden_size=32, num_layers=1, heads=2, kv_heads=1, intermediate_size=64, seed=3)
    model_dir = str(work / "m")
    proc = subprocess.run(
        [sys.executable, str(WORKER), model_dir, str(work)],
        capture_output=True,
        text=True,
        timeout=280,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return model_dir, work, torch.load(work / "dp2.pt", weights_only=False)


def test_split_optimizer_state_trains_as_the_whole_one(run):
    _, _, out = run
    whole, split = out["replicated"], out["distributed"]
    assert split["norms"] == pytest.approx(whole["norms"], rel=1e-6)
    for name, w in whole["weights"].items():
        assert (w - split["weights"][name]).abs().max() <= 1e-6, name
    assert split["owned"] == -(-split["total"] // 2)  # each rank steps half the masters and moments


def test_a_checkpoint_resumes_under_another_data_parallel_size(run):
    model_dir, work, out = run
    one = trainer(model_dir, distributed=True)  # a single rank: it owns the whole vectors
    one.load(work / "ckpt_distributed")
    norm = one.train_step(batch(), loss_fn, 24).gauges["train/grad_norm"]
    assert norm == pytest.approx(out["distributed"]["norms"][2], rel=1e-4)
    for name, p in one.model.named_parameters():  # bf16 weights: a rounding apart at most
        assert (p.detach().float() - out["distributed"]["weights"][name]).abs().max() <= 1e-2, name
    with pytest.raises(ValueError, match="^checkpoint: its optimizer state was written without the distributed "):
        trainer(model_dir, distributed=True).load(work / "ckpt_replicated")
    assert out["fsdp2_error"].startswith("distributed_optimizer: FSDP2 shards the optimizer state already;")
