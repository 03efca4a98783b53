"""The embedded critic for PPO: the policy's transformer trunk (its own copy) with a value head.

It is a :class:`TorchTrainer` whose per-token output is a value instead of a log-prob, so it shares
micro-batching, the optimizer, data parallelism and checkpoints with the policy trainer. Values are
aligned like log-probs: position ``t`` holds V of the state that emits token ``t`` (the hidden
state at ``t - 1``), which is what GAE's ``delta_t = r_t + gamma V_{t+1} - V_t`` over response
tokens expects. The head starts at zero, so the first values are 0 and the first advantages are
plain returns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from loongsage.core.contracts import Critic
from loongsage.core.embedded.trainer import _DTYPES, TorchTrainer
from loongsage.core.types import TrainBatch


class ValueModel(nn.Module):
    def __init__(self, backbone: nn.Module, hidden_size: int):
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.value_head(hidden.float()).squeeze(-1)  # [B, T]: V after reading tokens 0..t


@dataclass
class TorchCritic(TorchTrainer, Critic):
    """``torch_critic``: value model trained with the clipped value loss (PPO)."""

    kind = "trainer"
    supports_lora: ClassVar[bool] = False  # LoRA would freeze the value head, which must train

    def _load_model(self) -> nn.Module:
        from transformers import AutoModelForCausalLM

        policy = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=_DTYPES[self.dtype])
        return ValueModel(policy.model, policy.config.hidden_size)

    def _decoder_layers(self) -> list[nn.Module]:
        return list(self.model.backbone.layers)

    def _forward_sequences(self, mb: TrainBatch, *, with_entropy: bool) -> tuple[Tensor, None]:
        # the trainer's _forward splits rows with several segments before this: a segment's values
        # are those of the states its own tokens produced
        values = self.model(mb.input_ids.to(self.device), mb.attention_mask.to(self.device))
        return F.pad(values[:, :-1], (1, 0)), None  # position t: the state that emits token t

    def values(self, batch: TrainBatch, token_budget: int) -> Tensor:
        return self.logprobs(batch, token_budget)[0]

    def export_hf(self, path, tokenizer=None) -> None:
        torch.save(self._full_model_state(), f"{path}/critic.pt")
