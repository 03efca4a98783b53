"""Tiny Qwen3-architecture models built offline, for CPU recipes and tests.

The model is a genuine ``transformers`` ``Qwen3ForCausalLM`` (so every code path that serves a
real Qwen3 checkpoint — HF generate, weight sync, log-prob recomputation — runs unchanged), only
very small, randomly initialised from a fixed seed, and paired with the embedded tokenizer.
"""

from __future__ import annotations

from pathlib import Path

import torch


def tiny_qwen3_config(
    tokenizer,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate_size: int = 256,
    head_dim: int | None = None,
    max_position_embeddings: int = 256,
    tie_word_embeddings: bool = True,
    rope_theta: float = 10000.0,
):
    """A ``Qwen3Config`` sized by the arguments, with token ids taken from ``tokenizer``."""
    from transformers import Qwen3Config

    if heads % kv_heads:
        raise ValueError(f"heads={heads} must be a multiple of kv_heads={kv_heads}")
    head_dim = head_dim or hidden_size // heads
    return Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        # Tied embeddings: at this size the (vocab x hidden) matrices are a large share of the
        # parameters, and tying them is what Qwen3's small checkpoints do too.
        tie_word_embeddings=tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        use_cache=True,
    )


def build_tiny_qwen3(
    out_dir: str | Path | None = None,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate_size: int = 256,
    head_dim: int | None = None,
    max_position_embeddings: int = 256,
    seed: int = 0,
    tokenizer=None,
    vocab_size: int = 384,
    tokenizer_seed: int = 0,
):
    """Build a randomly initialised ``Qwen3ForCausalLM`` and its tokenizer; same seed, same weights.

    ``tokenizer`` defaults to :func:`loongsage.core.tinytask.tokenizer.build_tokenizer` with
    ``vocab_size`` and ``tokenizer_seed``. With ``out_dir`` the model (safetensors) and the
    tokenizer are saved there, loadable with ``AutoModelForCausalLM.from_pretrained(out_dir)`` and
    ``AutoTokenizer.from_pretrained(out_dir)``. Returns ``(model, tokenizer)``; the model is float32
    on CPU in eval mode.
    """
    from transformers import GenerationConfig, Qwen3ForCausalLM

    from loongsage.core.tinytask.tokenizer import build_tokenizer

    if tokenizer is None:
        tokenizer = build_tokenizer(vocab_size=vocab_size, seed=tokenizer_seed)
    config = tiny_qwen3_config(
        tokenizer,
        hidden_size=hidden_size,
        num_layers=num_layers,
        heads=heads,
        kv_heads=kv_heads,
        intermediate_size=intermediate_size,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
    )
    # A private generator state: building a model must not depend on, or disturb, the caller's RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    )
    model.eval()
    if out_dir is not None:
        save_model(model, tokenizer, out_dir)
    return model, tokenizer


def save_model(model, tokenizer, out_dir: str | Path) -> Path:
    """Save model (safetensors) and tokenizer into one HF folder; returns the folder."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    return out


def count_parameters(model) -> int:
    """Number of distinct parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in model.parameters())
