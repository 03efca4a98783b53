"""The embedded torch trainer backend: an HF causal LM trained in place with AdamW.

The backend owns the model, the optimizer and the mechanics of a step (micro-batching by token
budget, gradient accumulation, clipping, data-parallel gradient reduction). What the loss *is*
comes from outside as a closure (:mod:`loongsage.core.loss`), so another backend (Megatron-Core)
implements the same small surface.

Data parallelism: with ``world_size > 1`` every rank holds a full replica and the gradients are
SUM-reduced over a gloo (CPU) or NCCL (GPU) process group. Loss weights already carry the global
denominators, so the sum is exactly the full-batch gradient. Replicas rather than FSDP2 shards keep
CPU runs simple; the reduction and the invariance contract are the same.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from loongsage.core.types import TrainBatch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

LossFn = Callable[[Tensor, TrainBatch], tuple[Tensor, dict[str, tuple[float, float]]]]


def token_logprobs(logits: Tensor, input_ids: Tensor) -> Tensor:
    """Log-prob of each token given the previous ones, aligned to token positions.

    ``logits`` [B, T, V] from positions 0..T-1 predict tokens 1..T; position 0 has no prediction
    and gets 0. Computed in float32 (the FP32-head contract shared with the engine).
    """
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    picked = logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return F.pad(picked, (1, 0))


def entropy_from_logits(logits: Tensor) -> Tensor:
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    ent = -(logp.exp() * logp).sum(-1)
    return F.pad(ent, (1, 0))


def micro_batches(batch: TrainBatch, token_budget: int) -> Iterator[TrainBatch]:
    """Split rows into consecutive micro-batches whose padded size (rows x max length) fits the budget.

    Rows are trimmed to the micro-batch's own longest sequence, so short rows do not pay for long
    ones elsewhere in the batch. A single row longer than the budget still forms its own micro-batch.
    """
    lengths = batch.attention_mask.sum(-1).tolist()
    start = 0
    while start < len(lengths):
        end, longest = start, 0
        while end < len(lengths):
            new_longest = max(longest, int(lengths[end]))
            if end > start and new_longest * (end - start + 1) > token_budget:
                break
            longest, end = new_longest, end + 1
        mb = batch.select(list(range(start, end)))
        yield _trim(mb, longest)
        start = end


def _trim(batch: TrainBatch, length: int) -> TrainBatch:
    for name in TrainBatch.tensor_fields():
        value = getattr(batch, name)
        if value is not None and value.dim() == 2:
            setattr(batch, name, value[:, :length].contiguous())
    return batch


@dataclass
class TorchTrainer:
    """HF transformers causal LM, fp32 on CPU, AdamW, grad clipping, gloo/NCCL data parallel."""

    kind = "trainer"

    model_path: str
    dtype: str = "float32"
    device: str = "cpu"
    fp32_lm_head: bool = True
    gradient_checkpointing: bool = False
    num_threads: int = 0  # torch intra-op threads; 0 = torch's default

    def __post_init__(self) -> None:
        from transformers import AutoModelForCausalLM

        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype={self.dtype!r}; allowed: {', '.join(_DTYPES)}")
        if self.num_threads:
            torch.set_num_threads(self.num_threads)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=_DTYPES[self.dtype])
        self.model.to(self.device)
        if self.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        self.model.train()
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
        self.grad_clip = 1.0
        self.steps = 0

    # ------------------------------------------------------------------ setup
    def setup_optimizer(self, lr: float, betas: list[float], eps: float, weight_decay: float,
                        grad_clip: float, warmup_steps: int = 0) -> None:
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, betas=tuple(betas), eps=eps,
                                           weight_decay=weight_decay)
        warm = max(1, warmup_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: min(1.0, (s + 1) / warm))
        self.grad_clip = grad_clip

    @property
    def world_size(self) -> int:
        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

    # ------------------------------------------------------------------ forward
    def _logits(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        if not self.fp32_lm_head or self.dtype == "float32":
            return self.model(input_ids=input_ids, attention_mask=attention_mask).logits
        hidden = self.model.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        head = self.model.get_output_embeddings()
        return F.linear(hidden.float(), head.weight.float())

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch, token_budget: int) -> tuple[Tensor, Tensor]:
        """Per-token log-probs and entropies of ``batch`` under the current weights (no grad)."""
        self.model.eval()
        B, T = batch.input_ids.shape
        out_lp = torch.zeros(B, T)
        out_ent = torch.zeros(B, T)
        row = 0
        for mb in micro_batches(batch, token_budget):
            ids = mb.input_ids.to(self.device)
            logits = self._logits(ids, mb.attention_mask.to(self.device))
            n, t = ids.shape
            out_lp[row:row + n, :t] = token_logprobs(logits, ids).cpu()
            out_ent[row:row + n, :t] = entropy_from_logits(logits).cpu()
            row += n
        self.model.train()
        return out_lp, out_ent

    # ------------------------------------------------------------------ training
    def train_step(self, mini_batch: TrainBatch, loss_fn: LossFn, token_budget: int) -> dict[str, float]:
        """One optimizer step over ``mini_batch``; ``loss_fn`` returns the weighted loss *sum*.

        The loss of every micro-batch is already scaled by global denominators, so gradients are
        accumulated by plain summation and summed across data-parallel ranks.
        """
        assert self.optimizer is not None, "setup_optimizer() first"
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, list[float]] = {}
        total = 0.0
        for mb in micro_batches(mini_batch, token_budget):
            ids = mb.input_ids.to(self.device)
            logits = self._logits(ids, mb.attention_mask.to(self.device))
            lp = token_logprobs(logits, ids)
            loss, metrics = loss_fn(lp, mb)
            loss.backward()
            total += float(loss.detach())
            for key, (num, den) in metrics.items():
                acc = sums.setdefault(key, [0.0, 0.0])
                acc[0] += num
                acc[1] += den
        if self.world_size > 1:
            self._all_reduce_grads()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.steps += 1
        out = {"train/loss": total, "train/grad_norm": float(grad_norm),
               "train/lr": self.optimizer.param_groups[0]["lr"]}
        for key, (num, den) in sums.items():
            out[key + "_sum"], out[key + "_count"] = num, den
        return out

    def _all_reduce_grads(self) -> None:
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    # ------------------------------------------------------------------ weights and state
    def export_weights(self) -> Iterator[tuple[str, Tensor]]:
        """HF-named tensors of the current policy (what an engine loads)."""
        yield from self.model.state_dict().items()

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict() if self.optimizer else None,
            "scheduler": self.scheduler.state_dict() if self.scheduler else None,
            "steps": self.steps,
            "rng": rng_state(),
        }
        torch.save(state, path / "trainer.pt")

    def load(self, path: str | Path) -> None:
        state = torch.load(Path(path) / "trainer.pt", map_location=self.device, weights_only=False)
        self.model.load_state_dict(state["model"])
        if self.optimizer is not None and state["optimizer"] is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state["scheduler"] is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.steps = state["steps"]
        set_rng_state(state["rng"])

    def export_hf(self, path: str | Path, tokenizer: Any = None) -> None:
        self.model.save_pretrained(path)
        if tokenizer is not None:
            tokenizer.save_pretrained(path)

    def offload(self) -> None:
        """Nothing to free on CPU; a GPU placement moves parameters and optimizer state to host."""

    def onload(self) -> None:
        """Counterpart of :meth:`offload`."""


def rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
