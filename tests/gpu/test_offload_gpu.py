"""Trainer offload on the card (``placement.offload_trainer``): ``offload(weights=False)`` moves
AdamW's moments and the float32 masters to host memory, ``offload()`` the weights too, and
``onload()`` brings everything back; the next step is bit-identical to that of a trainer that never
moved. The torch trainer (float32 masters) and the megatron trainer (the distributed optimizer's
flat slices and gradient vector) on a bf16 Qwen3 of hidden 1024."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _batch(vocab: int):
    from loongsage.core.types import TrainBatch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (4, 256), generator=g)
    response = torch.zeros(ids.shape)
    response[:, 64:] = 1
    return TrainBatch(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        response_mask=response,
        rollout_logprobs=torch.zeros(ids.shape),
        advantages=torch.randn(ids.shape, generator=g),
        rewards=torch.zeros(4),
        group_ids=torch.arange(4),
    )


def _loss(lp, mb):
    from loongsage.core.metrics import Metrics

    return -(lp * mb.advantages * mb.response_mask).sum() / 1000, Metrics()


def _trainer(backend: str, model_dir: str):
    if backend == "torch":
        from loongsage.core.trainer.torch_trainer import TorchTrainer

        trainer = TorchTrainer(model_dir, dtype="bfloat16", device="cuda")
    else:
        from loongsage.megatron.trainer import MegatronTrainer

        trainer = MegatronTrainer(model_dir, dtype="bfloat16", device="cuda", distributed_optimizer=True)
    trainer.setup_optimizer(1e-4, [0.9, 0.99], 1e-8, 0.0, 1.0, 0)
    return trainer


@pytest.mark.parametrize("backend", ["torch", "megatron"])
def test_offload_frees_the_card_and_the_next_step_is_unchanged(qwen3_1024_dir, backend):
    if backend == "megatron":
        pytest.importorskip("megatron.core")
    b = _batch(json.loads((Path(qwen3_1024_dir) / "config.json").read_text())["vocab_size"])
    moved, still = _trainer(backend, qwen3_1024_dir), _trainer(backend, qwen3_1024_dir)
    for t in (moved, still):
        t.train_step(b, _loss, 4096)  # AdamW's moments exist from here
    n = sum(p.numel() for p in moved.model.parameters())
    moved.optimizer.zero_grad(set_to_none=True)  # the last step's gradients, which an offload drops
    torch.cuda.synchronize()
    resident = torch.cuda.memory_allocated()
    start = time.perf_counter()
    moved.offload(weights=False)
    torch.cuda.synchronize()
    optimizer_freed, optimizer_s = resident - torch.cuda.memory_allocated(), time.perf_counter() - start
    moved.offload()
    torch.cuda.synchronize()
    all_freed = resident - torch.cuda.memory_allocated()
    start = time.perf_counter()
    moved.onload()
    torch.cuda.synchronize()
    onload_s = time.perf_counter() - start
    start = time.perf_counter()  # again, as every step does: the host allocator keeps the pinned blocks
    moved.offload()
    torch.cuda.synchronize()
    again_s = time.perf_counter() - start
    moved.onload()
    torch.cuda.synchronize()
    print(
        f"{backend}: {n / 1e6:.0f}M parameters; offload(weights=False) freed {optimizer_freed / 1e9:.2f} GB in "
        f"{optimizer_s:.2f} s (pinning), offload() {all_freed / 1e9:.2f} GB; onload {onload_s:.2f} s; "
        f"offload again {again_s:.2f} s"
    )
    # bf16 weights 2 bytes a parameter; float32 masters 4 and AdamW's moments 8 (the megatron
    # trainer's flat gradient vector 4 more)
    assert optimizer_freed >= 12 * n * 0.98
    assert all_freed >= 14 * n * 0.98
    # everything came back, nothing twice (a few stray buffers of under a MB differ: measured 0.5 and 0.9 MB)
    assert abs(torch.cuda.memory_allocated() - resident) < 4 * 2**20
    g_moved, g_still = (t.train_step(b, _loss, 4096).gauges["train/grad_norm"] for t in (moved, still))
    assert g_moved == g_still
    lp_moved, lp_still = (t.logprobs(b, 4096)[0] for t in (moved, still))
    assert torch.equal(lp_moved, lp_still)
