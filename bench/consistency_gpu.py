"""Engine vs trainer log-probs of the same sampled tokens on one CUDA GPU (bf16, FP32 LM head).

A Qwen3-shaped model (hidden 1024, 8 layers, random bf16 weights) samples ``--batch`` prompts of
``--prompt`` tokens for ``--new-tokens`` tokens each; the torch trainer then scores the same tokens.
The figure of merit is the k3 KL between the two log-probs (what ``train/is_approx_k3_kl`` reports
in a run) against the goal of 1e-5, for:

* the engine's fast path (batched bf16 decode on its fused kernels) against the trainer's batched
  forward, and the same with the engine's torch decode path (``kernels="torch"``);
* the engine's deterministic mode against a trainer that runs one sequence per micro-batch (the
  setting in which both are the same computation, so the KL is exactly 0);
* for scale, the fast path with a bf16 LM head in the engine (what the FP32 head is there to avoid).

    python bench/consistency_gpu.py [--out PATH]

Writes ``bench/results/consistency_gpu.json`` (or ``--out``); ``tests/gpu/test_consistency_gpu.py``
asserts the bounds that hold today with the same :func:`measure`.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results" / "consistency_gpu.json"
GOAL_K3 = 1e-5
MODEL = {"hidden": 1024, "layers": 8, "vocab": 32000}


def build_model(path: str, *, hidden: int = 1024, layers: int = 8, vocab: int = 32000) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=hidden // 16,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(path)


def measure(
    path: str,
    batch: int = 32,
    prompt_len: int = 64,
    new_tokens: int = 64,
    *,
    deterministic: bool = False,
    engine_fp32_head: bool = True,
    kernels: str = "auto",
) -> dict[str, float]:
    """k3 KL and |delta log-prob| between the engine's and the trainer's log-probs of the same tokens.

    ``engine_fp32_head=False`` gives the engine a bf16 LM head against the trainer's FP32 one: the
    size of the error a broken head would cause, to size the tests' bounds against.
    """
    from loongsage.core.engine.native import NativeEngine
    from loongsage.core.trainer.torch_trainer import TorchTrainer
    from loongsage.core.types import GenerationRequest, SamplingParams, TrainBatch

    engine = NativeEngine(
        path,
        dtype="bfloat16",
        device="cuda",
        fp32_lm_head=engine_fp32_head,
        eos_token_ids=[],
        max_model_len=prompt_len + new_tokens + 8,
        deterministic=deterministic,
        kernels=kernels,
    )
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 32000, (prompt_len,), generator=g).tolist() for _ in range(batch)]
    requests = [
        GenerationRequest(f"r{i}", p, SamplingParams(temperature=1.0, max_new_tokens=new_tokens, seed=i))
        for i, p in enumerate(prompts)
    ]
    results = [r[0] for r in engine.generate_batch(requests)]
    del engine
    torch.cuda.empty_cache()

    trainer = TorchTrainer(path, dtype="bfloat16", device="cuda", fp32_lm_head=True)
    T = prompt_len + new_tokens
    ids = torch.tensor([p + r.output_ids for p, r in zip(prompts, results)])
    mask = torch.zeros(batch, T)
    mask[:, prompt_len:] = 1
    tb = TrainBatch(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        response_mask=mask,
        rollout_logprobs=torch.zeros(batch, T),
        advantages=torch.zeros(batch, T),
        rewards=torch.zeros(batch),
        group_ids=torch.arange(batch),
    )
    trainer_lp, _ = trainer.logprobs(tb, token_budget=1 if deterministic else batch * T)
    engine_lp = torch.tensor([r.logprobs for r in results])
    delta = (trainer_lp[:, prompt_len:] - engine_lp).double()
    k3 = (torch.exp(delta) - delta - 1).mean().item()
    return {
        "k3_kl": k3,
        "max_abs_logprob_diff": delta.abs().max().item(),
        "mean_abs_logprob_diff": delta.abs().mean().item(),
        "tokens": float(delta.numel()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    from _source import source_state

    source = source_state()
    with tempfile.TemporaryDirectory() as tmp:
        build_model(f"{tmp}/m", **MODEL)
        fast, exact = measure(f"{tmp}/m"), measure(f"{tmp}/m", deterministic=True)
        fast_torch = measure(f"{tmp}/m", kernels="torch")
        bf16_head = measure(f"{tmp}/m", engine_fp32_head=False)
    figures = {
        "source": source,
        "device": torch.cuda.get_device_name(),
        "model": "Qwen3-shaped, hidden 1024, 8 layers, random bf16",
        "workload": "32 prompts x 64 tokens, 64 sampled tokens each, FP32 LM head",
        "goal_k3_kl": GOAL_K3,
        "fast": {**fast, "meets_goal": fast["k3_kl"] <= GOAL_K3},
        "fast_torch_kernels": {**fast_torch, "meets_goal": fast_torch["k3_kl"] <= GOAL_K3},
        "deterministic": {**exact, "meets_goal": exact["k3_kl"] <= GOAL_K3},
        "engine_bf16_head": {**bf16_head, "meets_goal": bf16_head["k3_kl"] <= GOAL_K3},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(figures, indent=1))
    print(json.dumps(figures, indent=1))
    print("| path | k3 KL | mean abs diff | max abs diff | goal 1e-5 |\n|---|---|---|---|---|")
    for name in ("fast", "fast_torch_kernels", "deterministic", "engine_bf16_head"):
        f = figures[name]
        print(
            f"| {name} | {f['k3_kl']:.2e} | {f['mean_abs_logprob_diff']:.2e} | {f['max_abs_logprob_diff']:.2e} | "
            f"{'met' if f['meets_goal'] else 'not met'} |"
        )


if __name__ == "__main__":
    main()
