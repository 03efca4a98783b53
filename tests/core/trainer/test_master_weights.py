"""Float32 master weights for a bfloat16 model (the torch trainer; the megatron one shares them).

At RL learning rates an AdamW step moves a weight by about ``lr``: a bfloat16 weight of size 0.02
has a last bit of 2^-14, so steps of 1e-6 vanish in rounding. With master weights the optimizer
steps float32 copies, the model holds their rounding, gradients sum over micro-batches in float32,
and a checkpoint carries the masters so a resumed run steps exactly as the first."""

from __future__ import annotations

import pytest
import torch

from loongsage.core.metrics import Metrics
from loongsage.core.tinytask.tiny_model import build_tiny_qwen3
from loongsage.core.trainer.torch_trainer import TorchTrainer
from loongsage.core.types import TrainBatch

LR = 1e-6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    build_tiny_qwen3(path, hidden_size=32, num_layers=1, heads=2, kv_heads=1, intermediate_size=64, seed=3)
    return path


def _batch() -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 200, (4, 12), generator=g)
    mask = torch.ones(4, 12)
    mask[:, :4] = 0
    return TrainBatch(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        response_mask=mask,
        rollout_logprobs=torch.zeros(4, 12),
        advantages=torch.ones(4, 12),
        rewards=torch.zeros(4),
        group_ids=torch.arange(4),
    )


def _loss(lp: torch.Tensor, mb: TrainBatch) -> tuple[torch.Tensor, Metrics]:
    return -(lp * mb.advantages * mb.response_mask).sum() / 32, Metrics()


def _trainer(model_dir, **params) -> TorchTrainer:
    trainer = TorchTrainer(str(model_dir), dtype="bfloat16", **params)
    trainer.setup_optimizer(LR, [0.9, 0.999], 1e-8, 0.0, 1e9, 0)
    return trainer


def _weights(trainer: TorchTrainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def test_bfloat16_weights_learn_at_small_learning_rates_only_through_float32_masters(model_dir):
    plain = _trainer(model_dir, master_weights=False)
    ours = _trainer(model_dir)
    start = _weights(ours)
    for _ in range(5):
        for trainer in (plain, ours):
            trainer.train_step(_batch(), _loss, 4096)
    # without masters the updates round away: five steps leave nearly every weight as it was
    changed = sum(int((p != start[n]).sum()) for n, p in _weights(plain).items())
    total = sum(p.numel() for p in start.values())
    assert changed < 0.05 * total
    moved = []
    for name, param in ours.model.named_parameters():
        master = ours.masters.holder(param)
        assert master.dtype == torch.float32 and param.grad is None  # the bf16 gradients were freed
        assert torch.equal(param.detach(), master.detach().to(torch.bfloat16))  # the model holds their rounding
        moved.append((master.detach() - start[name].float()).abs().flatten())
    moved = torch.cat(moved)
    # AdamW's steps with a steady gradient sign: about lr each, 5 steps
    assert 4 * LR < float(moved.max()) < 6 * LR
    assert int((moved > 0).sum()) > 10 * changed


def test_micro_batches_sum_their_gradients_in_float32(model_dir):
    whole, split = _trainer(model_dir), _trainer(model_dir)
    g_whole = whole.train_step(_batch(), _loss, 4096).gauges["train/grad_norm"]
    g_split = split.train_step(_batch(), _loss, 12).gauges["train/grad_norm"]  # one row per micro-batch
    grads = [m.grad for m in split.masters.masters]
    assert all(g is not None and g.dtype == torch.float32 for g in grads)
    assert g_split == pytest.approx(g_whole, rel=1e-2)  # bf16 forwards of other shapes round apart


def test_a_checkpoint_carries_the_masters(model_dir, tmp_path):
    trainer = _trainer(model_dir)
    trainer.train_step(_batch(), _loss, 4096)
    trainer.save(tmp_path / "ckpt")
    resumed = _trainer(model_dir)
    resumed.load(tmp_path / "ckpt")
    for a, b in zip(trainer.masters.masters, resumed.masters.masters):
        assert torch.equal(a.detach(), b.detach())
    g1, g2 = (t.train_step(_batch(), _loss, 4096).gauges["train/grad_norm"] for t in (trainer, resumed))
    assert g1 == g2
    for a, b in zip(trainer.masters.masters, resumed.masters.masters):
        assert torch.equal(a.detach(), b.detach())
    # a float32 model needs none
    assert TorchTrainer(str(model_dir)).masters is None
