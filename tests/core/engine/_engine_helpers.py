"""Shared pieces of the native-engine tests: a tiny Qwen3 with peaked logits,
prompts, requests, the reference log-probs of a plain full-sequence forward, and the experts an
HF mixture-of-experts forward chooses (R3's reference)."""

from __future__ import annotations

import random

import torch

from loongsage.core.types import GenerationRequest, SamplingParams

VOCAB, EOS = 300, 1


def build_engine_test_model(path: str) -> str:
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=EOS,
        pad_token_id=0,
        bos_token_id=None,
        # Larger than the default 0.02 so the logits are peaked: greedy comparisons then do not
        # hinge on near-ties that differ in the last float bit between two correct implementations.
        initializer_range=0.2,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(cfg)
    model.generation_config = GenerationConfig(eos_token_id=EOS, pad_token_id=0, do_sample=False)
    model.save_pretrained(str(path))
    return str(path)


def prompts(count: int, seed: int = 0, lo: int = 3, hi: int = 20) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, VOCAB) for _ in range(rng.randrange(lo, hi))] for _ in range(count)]


def req(rid: str, ids: list[int], **sampling) -> GenerationRequest:
    return GenerationRequest(rid, ids, SamplingParams(**sampling))


def full_logprobs(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """Plain full-sequence forward: log_softmax (fp32) of each output token given its prefix."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return logp.gather(-1, torch.tensor(output)[:, None]).squeeze(-1)


def hf_routes(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """The experts each MoE layer of an HF Qwen3-MoE chooses for each of ``ids``: ``[tokens, layers, topk]``."""
    chosen = []
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda _m, _a, out: chosen.append(out[2])) for layer in model.model.layers
    ]
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]))
    for hook in hooks:
        hook.remove()
    return torch.stack(chosen, 1)
