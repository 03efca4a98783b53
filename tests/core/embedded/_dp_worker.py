"""One data-parallel rank of the DP-invariance test, run as a subprocess (see test_trainer_dp.py)."""

from __future__ import annotations

import sys

import numpy as np
import torch
import torch.distributed as dist

from loongsage.algos.policy_losses import PPOClip
from loongsage.core.aggregation import AGGREGATION_MODES
from loongsage.core.embedded.trainer import TorchTrainer
from loongsage.core.loss import LossPipeline
from loongsage.core.types import TrainBatch


def make_batch(B: int = 8, vocab: int = 200) -> TrainBatch:
    g = torch.Generator().manual_seed(5)
    lengths = torch.randint(6, 14, (B,), generator=g)
    T = int(lengths.max())
    attn = (torch.arange(T)[None] < lengths[:, None]).long()
    mask = attn.float().clone()
    mask[:, :4] = 0
    return TrainBatch(
        input_ids=torch.randint(3, vocab, (B, T), generator=g) * attn, attention_mask=attn, response_mask=mask,
        rollout_logprobs=torch.zeros(B, T), advantages=torch.randn(B, T, generator=g) * mask,
        rewards=torch.zeros(B), group_ids=torch.arange(B) // 4,
        old_logprobs=(torch.randn(B, T, generator=g) * 0.1 - 2.0) * mask,
    )


def step(model_dir: str, dp_mode: str, mode: str, rows: list[int], budget: int) -> dict[str, np.ndarray]:
    """One optimizer step (lr ~ 0) on ``rows`` of the batch; returns loss, grad norm and full grads."""
    trainer = TorchTrainer(model_dir, dp_mode=dp_mode)
    trainer.setup_optimizer(1e-30, [0.9, 0.999], 1e-8, 0.0, 1e9)
    pipeline = LossPipeline(policy_loss=PPOClip(clip_low=0.2, clip_high=0.28), aggregation=mode)
    prepared, _ = pipeline.prepare(make_batch())  # global weights over the whole mini-batch
    metrics = trainer.train_step(prepared.select(rows), pipeline, budget)
    loss = torch.tensor([metrics["train/loss"]])
    if dist.is_initialized():
        dist.all_reduce(loss)
    out = {"loss": loss.numpy(), "grad_norm": np.array([metrics["train/grad_norm"]])}
    for name, p in trainer.model.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        out[f"grad/{name}"] = g.detach().numpy().copy()
    return out


def main() -> None:
    rank, world, port, model_dir, dp_mode, out_prefix = sys.argv[1:7]
    rank, world = int(rank), int(world)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    rows = [0, 1, 2, 3, 4, 5] if rank == 0 else [6, 7]  # uneven: rank 0 runs more micro-batches
    for mode in AGGREGATION_MODES:
        result = step(model_dir, dp_mode, mode, rows, budget=30)
        if rank == 0:
            np.savez(f"{out_prefix}-{mode}.npz", **result)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
