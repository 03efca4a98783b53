"""Speed workloads: random-weight models of real shapes, and prompts of an exact token length.

A throughput run needs the compute of a real model, not its knowledge, and no download: the
``random_init`` model builder makes an HF folder with a published architecture's shape (the
``preset``), random weights from a fixed seed and the embedded tokenizer. The model declares no
end-of-sequence token, so every sample runs to ``max_new_tokens`` and the work per step is exact.
Token ids beyond the tokenizer's small vocabulary decode to nothing; rewards see empty text.

``random_digits`` is the matching data source: prompts of ``length`` random digits, which the
embedded tokenizer splits one token per digit, so a prompt is exactly ``length`` tokens (raw
prompt template).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from loongsage.core.model_math.dtypes import DTYPES
from loongsage.core.types import DataRecord, TrainBatch

# Shapes of published checkpoints (their config.json), the vocabulary included.
PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": dict(
        vocab_size=151_936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
    ),
    "qwen3-1.7b": dict(
        vocab_size=151_936,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
    ),
    "qwen3-4b": dict(
        vocab_size=151_936,
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
    ),
    # mixtures of experts (Qwen3-MoE): every layer routes each token to num_experts_per_tok experts
    "qwen3-30b-a3b": dict(
        vocab_size=151_936,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        tie_word_embeddings=False,
    ),
    "qwen3-moe-tiny": dict(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        tie_word_embeddings=False,
    ),
}
BUILDER_VERSION = 1


@dataclass
class RandomInitModel:
    """Model builder ``random_init``: a ``preset`` shape with random weights, cached by its params.

    ``num_layers`` overrides the preset's depth (a smaller model of the same width); ``device``
    is where the weights are drawn (``null``: CUDA when present; the same seed gives other numbers
    on another device, so it is part of the cache key).
    """

    kind = "model_builder"

    preset: str = "qwen3-1.7b"
    num_layers: int | None = None
    dtype: str = "bfloat16"
    seed: int = 0
    max_position_embeddings: int = 40_960
    device: str | None = None

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"preset={self.preset!r}: unknown; allowed: {', '.join(PRESETS)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: allowed: {', '.join(DTYPES)}")
        if self.num_layers is not None and not (isinstance(self.num_layers, int) and self.num_layers >= 1):
            raise ValueError(f"num_layers={self.num_layers!r}: a positive number of layers, or null for the preset's")

    def resolved_device(self) -> str:
        return self.device or ("cuda" if torch.cuda.is_available() else "cpu")

    def cache_key(self) -> str:
        params = dataclasses.asdict(self) | {"device": self.resolved_device()}
        blob = json.dumps({"params": params, "builder": BUILDER_VERSION}, sort_keys=True)
        return f"random-{self.preset}-{hashlib.sha256(blob.encode()).hexdigest()[:16]}"

    def build(self) -> Path:
        from loongsage.core.tinytask.builds import cached_build

        return cached_build(self.cache_key(), self.build_into)

    def build_into(self, out_dir: str | Path) -> Path:
        from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

        from loongsage.core.tinytask.builds import INFO_FILE
        from loongsage.core.tinytask.tiny_model import count_parameters, save_model
        from loongsage.core.tinytask.tokenizer import build_tokenizer

        shape = dict(PRESETS[self.preset])
        if self.num_layers is not None:
            shape["num_hidden_layers"] = self.num_layers
        tokenizer = build_tokenizer()
        moe = "num_experts" in shape
        config_class, model_class = (Qwen3MoeConfig, Qwen3MoeForCausalLM) if moe else (Qwen3Config, Qwen3ForCausalLM)
        extra = {"decoder_sparse_step": 1, "mlp_only_layers": []} if moe else {}
        config = config_class(
            **shape,
            **extra,
            max_position_embeddings=self.max_position_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=tokenizer.pad_token_id,
        )
        device = self.resolved_device()
        with torch.random.fork_rng(devices=[] if device == "cpu" else [torch.device(device)]):
            torch.manual_seed(self.seed)
            with torch.device(device):
                model = model_class(config).to(getattr(torch, self.dtype))
        model.generation_config = GenerationConfig(eos_token_id=None, pad_token_id=tokenizer.pad_token_id)
        out = save_model(model, tokenizer, out_dir)
        info = {
            "params": dataclasses.asdict(self),
            "builder_version": BUILDER_VERSION,
            "device": device,
            "num_parameters": count_parameters(model),
        }
        (out / INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
        return out


@dataclass
class RandomDigits:
    """Data source ``random_digits``: ``size`` prompts of ``length`` random digits (no label)."""

    length: int = 128
    size: int = 100_000
    seed: int = 0
    name: str = "random_digits"

    def __post_init__(self) -> None:
        if self.length < 1 or self.size < 1:
            raise ValueError(f"length={self.length}, size={self.size}: both must be >= 1")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> DataRecord:
        if not 0 <= index < self.size:
            raise IndexError(f"index {index} out of range for {self.size} records")
        rng = random.Random(f"{self.seed}/{index}")
        return DataRecord(source=self.name, index=index, prompt="".join(rng.choices("0123456789", k=self.length)))


def grouped_train_batch(
    prompts: int,
    samples: int,
    prompt_tokens: int | list[int],
    response_tokens: tuple[int, int],
    *,
    vocab: int,
    seed: int = 0,
) -> TrainBatch:
    """A GRPO-shaped training batch of random tokens: ``samples`` rows per prompt, each prompt's
    rows together, right-padded; ``prompt_tokens`` per prompt (one length, or one per prompt),
    responses of a length drawn from ``response_tokens`` (low, high), the response trained, random
    advantages, on-policy (the old log-probs are the training forward's own). The trainer's
    workloads (``share_prompts``' benchmark and tests)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [prompt_tokens] * prompts if isinstance(prompt_tokens, int) else list(prompt_tokens)
    rows = []
    for length in lengths:
        prompt = torch.randint(3, vocab, (length,), generator=g)
        for _ in range(samples):
            n = int(torch.randint(response_tokens[0], response_tokens[1] + 1, (1,), generator=g))
            rows.append((prompt, torch.randint(3, vocab, (n,), generator=g)))
    B, T = len(rows), max(len(p) + len(r) for p, r in rows)
    ids = torch.zeros(B, T, dtype=torch.long)
    attn = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T)
    for i, (p, r) in enumerate(rows):
        ids[i, : len(p) + len(r)] = torch.cat([p, r])
        attn[i, : len(p) + len(r)] = 1
        mask[i, len(p) : len(p) + len(r)] = 1.0
    return TrainBatch(
        input_ids=ids,
        attention_mask=attn,
        response_mask=mask,
        rollout_logprobs=torch.zeros(B, T),
        advantages=torch.randn(B, T, generator=g) * mask,
        rewards=torch.zeros(B),
        group_ids=torch.arange(B) // samples,
        old_logprobs=None,  # on-policy: the training forward's own
    )
