"""A policy model's shape, and what the throughput model needs from it.

Counted as ``bench/gpu_rl_step.py``'s ``matmul_params`` counts them: the parameters that enter a
matmul per token are every weight but the embedding lookup, with the LM head counted even when it
is tied to the embedding. A mixture of experts counts the experts a token is routed to (and the
router) per token, and every expert for the memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool = True
    experts: int = 0  # 0: a dense model
    experts_per_token: int = 0
    expert_intermediate: int = 0

    @property
    def attention_params(self) -> int:
        """q, k, v and o of one layer."""
        return self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)

    def _mlp(self, experts: int) -> int:
        if not self.experts:
            return 3 * self.hidden * self.intermediate  # gate, up, down
        return experts * 3 * self.hidden * self.expert_intermediate + self.hidden * self.experts  # + router

    @property
    def body_matmul_params(self) -> int:
        """Per token, in the decoder layers."""
        return self.layers * (self.attention_params + self._mlp(self.experts_per_token))

    @property
    def head_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def matmul_params(self) -> int:
        """Per token, the LM head included (a forward is ``2 ×`` this many FLOPs a token)."""
        return self.body_matmul_params + self.head_params

    @property
    def total_params(self) -> int:
        """Every weight (what memory and the weight push hold): all experts, the embedding, norms."""
        norms = 2 * self.hidden + 2 * self.head_dim  # per layer: two RMSNorms, q and k norms
        per_layer = self.attention_params + self._mlp(self.experts) + norms
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        return self.layers * per_layer + embeddings + self.hidden

    @property
    def attention_width(self) -> int:
        """``layers × heads × head_dim``: a causal forward over ``s`` tokens adds ``2 × this × s²``
        FLOPs of attention scores and values, a training step ``6 ×`` (``bench/train_mfu.py``'s count)."""
        return self.layers * self.heads * self.head_dim

    def weight_bytes(self, dtype_bytes: int) -> int:
        return self.total_params * dtype_bytes

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """The keys and values one token leaves in the cache: layers × kv heads × head_dim × 2."""
        return self.layers * self.kv_heads * self.head_dim * 2 * dtype_bytes

    def describe(self) -> str:
        moe = f", {self.experts} experts ({self.experts_per_token} a token)" if self.experts else ""
        return (
            f"{_count(self.total_params)} parameters ({_count(self.matmul_params)} in matmuls a token); "
            f"{self.layers} layers, hidden {self.hidden}, {self.heads} heads / {self.kv_heads} kv heads{moe}"
        )


def _count(n: int) -> str:
    """1.72B, 25.4M, 148k."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)


def shape_from_hf(config: dict[str, Any]) -> ModelShape:
    """From an HF ``config.json`` of a Qwen3 / Qwen3-MoE / Llama-style model (the keys the
    ``random_init`` presets use)."""
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    return ModelShape(
        layers=int(config["num_hidden_layers"]),
        hidden=hidden,
        heads=heads,
        kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads),
        intermediate=int(config["intermediate_size"]),
        vocab=int(config["vocab_size"]),
        tied=bool(config.get("tie_word_embeddings", False)),
        experts=experts,
        experts_per_token=int(config.get("num_experts_per_tok") or 0) if experts else 0,
        expert_intermediate=int(config.get("moe_intermediate_size") or 0) if experts else 0,
    )


WARM_START_FIELDS = ("hidden_size", "num_layers", "heads", "intermediate_size")


def shape_from_warm_start(params: dict[str, Any]) -> ModelShape:
    """The tiny Qwen3 of the warm-start builders (``tiny_arith``, ``tiny_tool_calc``, ...), from their
    params with the builder's defaults filled in: head_dim = hidden / heads, tied embeddings, the
    embedded tokenizer's ``vocab_size`` (384 unless given), kv_heads = heads unless given."""
    hidden, heads = int(params["hidden_size"]), int(params["heads"])
    return ModelShape(
        layers=int(params["num_layers"]),
        hidden=hidden,
        heads=heads,
        kv_heads=int(params.get("kv_heads") or heads),
        head_dim=hidden // heads,
        intermediate=int(params["intermediate_size"]),
        vocab=int(params.get("vocab_size") or 384),
        tied=True,
    )
