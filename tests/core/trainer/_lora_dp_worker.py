"""One data-parallel rank of the LoRA replica test, run as a subprocess (see test_lora.py)."""

from __future__ import annotations

import os
import sys

import numpy as np
import torch
import torch.distributed as dist

from loongsage.algos.policy_losses import PPOClip
from loongsage.core.loss import LossPlan
from loongsage.core.trainer.lora import LoraConfig
from loongsage.core.trainer.torch_trainer import TorchTrainer
from loongsage.core.types import TrainBatch


def lora_batch(B: int = 8, vocab: int = 200) -> TrainBatch:
    g = torch.Generator().manual_seed(5)
    lengths = torch.randint(6, 14, (B,), generator=g)
    T = int(lengths.max())
    attn = (torch.arange(T)[None] < lengths[:, None]).long()
    mask = attn.float().clone()
    mask[:, :4] = 0
    return TrainBatch(
        input_ids=torch.randint(3, vocab, (B, T), generator=g) * attn,
        attention_mask=attn,
        response_mask=mask,
        rollout_logprobs=torch.zeros(B, T),
        advantages=torch.randn(B, T, generator=g) * mask,
        rewards=torch.zeros(B),
        group_ids=torch.arange(B) // 4,
        old_logprobs=(torch.randn(B, T, generator=g) * 0.1 - 2.0) * mask,
    )


def trained_adapters(model_dir: str, rows: list[int], steps: int = 2) -> dict[str, np.ndarray]:
    """Adapters after ``steps`` optimizer steps on ``rows`` of the batch (global loss weights)."""
    trainer = TorchTrainer(model_dir, dp_mode="replicate", lora=LoraConfig(rank=4, alpha=8.0))
    trainer.setup_optimizer(1e-2, [0.9, 0.999], 1e-8, 0.0, 1e9)
    pipeline = LossPlan(policy_loss=PPOClip())
    prepared, _ = pipeline.prepare(lora_batch())
    for _ in range(steps):
        trainer.train_step(prepared.select(rows), pipeline.closure(), 30)
    return {n: p.detach().numpy().copy() for n, p in trainer.model.named_parameters() if ".lora_" in n}


def main() -> None:
    rank, world, port, model_dir, out_prefix = sys.argv[1:6]
    rank, world = int(rank), int(world)
    torch.set_num_threads(1)
    torch.manual_seed(1 + rank)  # as the trainer actors seed: the ranks' random inits differ
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    rows = [0, 1, 2, 3, 4, 5] if rank == 0 else [6, 7]  # uneven: rank 0 runs more micro-batches
    out = trained_adapters(model_dir, rows)
    try:
        TorchTrainer(model_dir, dp_mode="fsdp2", lora=LoraConfig())
        out["refused"] = np.array("")
    except ValueError as exc:
        out["refused"] = np.array(str(exc))
    np.savez(f"{out_prefix}-rank{rank}.npz", **out)
    dist.barrier()  # both ranks are past their last collective before either tears gloo down
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # gloo's C++ threads can abort the interpreter's own teardown after the work is saved (see
    # _dp_worker.py)
    sys.stdout.flush()
    os._exit(0)
