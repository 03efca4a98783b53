"""``megatron`` teacher: a frozen Megatron-Core GPT model scoring the student's tokens (MOPD).

The embedded teacher's scoring (micro-batches, segments scored alone, top-k or the full
log-softmax) over the Megatron trainer's forward: the same model build, weight conversion and
head (:func:`loongsage.megatron.forward.gpt_logits`). Forward only, no gradient. Registered by its
own entry point, since a plugin's backends table holds one entry per name and the trainer is
``megatron`` too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from loongsage.core.hookspecs import Factories, hookimpl
from loongsage.core.trainer.teacher import EmbeddedTeacher
from loongsage.megatron.forward import gpt_logits
from loongsage.megatron.weights import load_gpt, read_config


@dataclass
class MegatronTeacher(EmbeddedTeacher):
    """``megatron`` (kind ``teacher``): one whole Megatron-Core model per teacher worker."""

    layer_spec: str = "auto"  # as the trainer's (:class:`~loongsage.megatron.trainer.MegatronTrainer`)
    pack_sequences: bool = False

    def _load_model(self) -> tuple[torch.nn.Module, int]:
        config = read_config(self.model_path)
        model = load_gpt(
            self.model_path,
            config,
            dtype=self.dtype,
            device=self.device,
            spec=self.layer_spec,
            fp32_lm_head=self.fp32_lm_head,
            packed=self.pack_sequences,
        )
        return model.to(self.device), int(config["vocab_size"])

    def _logits(self, input_ids: Tensor, attention_mask: Tensor, first: int) -> Tensor:
        return gpt_logits(self.model, input_ids, attention_mask, first, vocab=self.vocab_size)


@hookimpl
def loongsage_backends() -> Factories:
    return {"megatron": MegatronTeacher}
