"""The embedded critic for PPO: the policy's transformer trunk (its own copy) with a value head.

It is the torch trainer (the trainer skeleton over an HF model: micro-batching, the optimizer, data
parallelism and checkpoints are the policy trainer's) whose model adapter scores a value per token
instead of a log-prob. Values are aligned like log-probs: position ``t`` holds V of the state that
emits token ``t`` (the hidden state at ``t - 1``), which is what GAE's
``delta_t = r_t + gamma V_{t+1} - V_t`` over response tokens expects. The head starts at zero, so
the first values are 0 and the first advantages are plain returns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from loongsage.core.contracts import Critic
from loongsage.core.model_math.dtypes import DTYPES
from loongsage.core.trainer.torch_model import TorchModel
from loongsage.core.trainer.torch_trainer import TorchTrainer
from loongsage.core.types import TrainBatch


class ValueModel(nn.Module):
    def __init__(self, backbone: nn.Module, hidden_size: int):
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        return self.value_head(hidden.float()).squeeze(-1)  # [B, T]: V after reading tokens 0..t


class ValueModelAdapter(TorchModel):
    """The torch adapter over a :class:`ValueModel`: its per-token output is the value."""

    def _load(self, model_path: str, dtype: str) -> nn.Module:
        from transformers import AutoModelForCausalLM

        policy = AutoModelForCausalLM.from_pretrained(model_path, dtype=DTYPES[dtype])
        return ValueModel(policy.model, policy.config.hidden_size)

    def _decoder_layers(self) -> list[nn.Module]:
        return list(self.model.backbone.layers)

    def sequence_logprobs(self, mb: TrainBatch, *, with_entropy: bool) -> tuple[Tensor, None]:
        # the skeleton splits rows with several segments before this: a segment's values are those
        # of the states its own tokens produced
        values = self.model(mb.input_ids.to(self.device), mb.attention_mask.to(self.device))
        return F.pad(values[:, :-1], (1, 0)), None  # position t: the state that emits token t


@dataclass
class TorchCritic(TorchTrainer, Critic):
    """``torch_critic``: value model trained with the clipped value loss (PPO)."""

    kind = "trainer"
    supports_lora: ClassVar[bool] = False  # LoRA would freeze the value head, which must train
    supports_batch_invariant: ClassVar[bool] = False
    supports_share_prompts: ClassVar[bool] = False
    adapter_class: ClassVar[type[TorchModel]] = ValueModelAdapter

    def values(self, batch: TrainBatch, token_budget: int) -> Tensor:
        return self.logprobs(batch, token_budget)[0]

    def export_hf(self, path, tokenizer=None) -> None:
        torch.save(self.adapter.hf_state(), f"{path}/critic.pt")
