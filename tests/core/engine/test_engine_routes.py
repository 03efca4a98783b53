"""The native engine records routed experts (R3) for a mixture-of-experts model: for every sample,
the experts each MoE layer chose for every token it fed to the model (the prompt's and the output's
but the last), exactly what a plain HF forward over the same tokens chooses. Exercised through the
batched prefill, the one-request prefill in chunks, the sibling samples sharing a prompt, decode
and a reused prefix."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
import torch

from loongsage.core.engine.native import NativeEngine
from loongsage.core.tinytask.shapes import RandomInitModel
from loongsage.core.types import GenerationRequest, SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from _engine_helpers import hf_routes  # noqa: E402


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    return str(
        RandomInitModel(preset="qwen3-moe-tiny", dtype="float32", device="cpu").build_into(
            tmp_path_factory.mktemp("moe") / "m"
        )
    )


def test_routes_are_those_of_a_plain_forward_over_the_same_tokens(moe_dir):
    from transformers import AutoModelForCausalLM

    engine = NativeEngine(moe_dir, return_routed_experts=True, eos_token_ids=[], prefill_chunk_tokens=24)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 384, (n,), generator=gen).tolist() for n in (5, 9, 30, 12)]  # 30: chunked

    async def run(batch, first=0):
        return await asyncio.gather(
            *(
                engine.generate(
                    GenerationRequest(
                        f"r{first + i}", p, SamplingParams(n=2, max_new_tokens=6, temperature=1.0, seed=first + i)
                    )
                )
                for i, p in enumerate(batch)
            )
        )

    async def turns():
        results = await run(prompts)
        # a next turn that reuses the first prompt's cached prefix
        prompts.append(prompts[0] + results[0][0].output_ids + [7, 8])
        return results + await run(prompts[-1:], first=len(results))

    results = asyncio.run(turns())
    reference = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    checked = 0
    for prompt, samples in zip(prompts, results):
        for r in samples:
            fed = prompt + r.output_ids[:-1]
            assert r.routed_experts.shape == (len(fed), 2, 2), r.routed_experts.shape
            assert torch.equal(r.routed_experts.long(), hf_routes(reference, fed)), prompt
            checked += 1
    assert checked == 10 and engine.health()["prefix_hit_tokens"] > 0


def test_a_dense_model_refuses_to_record_routes(tmp_path):
    path = RandomInitModel(preset="qwen3-0.6b", num_layers=1, dtype="float32", device="cpu")
    with pytest.raises(ValueError, match="return_routed_experts: the model has no mixture-of-experts layers"):
        NativeEngine(str(path.build_into(tmp_path / "dense")), return_routed_experts=True)
