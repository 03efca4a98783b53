"""On a CUDA GPU: the native engine's CUDA-graph decode, continuous batching and memory release.

Run on a GPU machine with ``LOONGSAGE_RUN_GPU=1 pytest tests/gpu -m gpu``.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
import torch

from loongsage.core.engine.native import NativeEngine

sys.path.insert(0, str(Path(__file__).parents[1] / "core" / "engine"))
from _engine_helpers import build_engine_test_model, full_logprobs, prompts, req  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_engine_test_model(tmp_path_factory.mktemp("tiny_qwen3"))


def test_cuda_graph_decode_matches_eager_and_a_full_forward(model_dir):
    from transformers import AutoModelForCausalLM

    batch = prompts(37, seed=50, lo=3, hi=60)  # rows and lengths off every bucket boundary
    requests = [req(f"r{i}", p, temperature=0, max_new_tokens=20 + i % 7) for i, p in enumerate(batch)]
    graphed = NativeEngine(model_dir, device="cuda", max_batch_size=64, max_model_len=128)
    eager = NativeEngine(model_dir, device="cuda", max_batch_size=64, max_model_len=128, cuda_graphs=False)
    got, want = graphed.generate_batch(requests), eager.generate_batch(requests)
    assert graphed._batch.graphs.captures > 0 and eager._batch.graphs is None
    hf = AutoModelForCausalLM.from_pretrained(model_dir).cuda().eval()
    for p, (g,), (e,) in zip(batch, got, want):
        assert g.output_ids == e.output_ids
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(e.logprobs), atol=1e-4, rtol=0)
        torch.testing.assert_close(
            torch.tensor(g.logprobs), full_logprobs(hf.cpu(), p, g.output_ids), atol=1e-4, rtol=0
        )
        hf.cuda()


def test_requests_joining_a_graphed_batch_get_the_same_samples(model_dir):
    engine = NativeEngine(model_dir, device="cuda", max_batch_size=64, max_model_len=128)
    (probe,) = prompts(1, seed=51)
    sampling = {"temperature": 1.0, "top_k": 40, "seed": 11, "max_new_tokens": 30}
    (alone,) = engine.generate_batch([req("alone", probe, **sampling)])[0]

    async def crowded():
        others = [
            asyncio.create_task(engine.generate(req(f"o{i}", p, max_new_tokens=40)))
            for i, p in enumerate(prompts(20, seed=52))
        ]
        while engine.health()["generated_tokens"] < 60:
            await asyncio.sleep(0)
        result = await engine.generate(req("crowded", probe, **sampling))
        await asyncio.gather(*others)
        return result[0]

    joined = asyncio.run(crowded())
    assert joined.output_ids == alone.output_ids
    torch.testing.assert_close(torch.tensor(joined.logprobs), torch.tensor(alone.logprobs), atol=1e-4, rtol=0)


def test_release_memory_gives_the_device_back(model_dir):
    engine = NativeEngine(model_dir, device="cuda", max_batch_size=64, max_model_len=512)
    requests = [req(f"r{i}", p, temperature=0, max_new_tokens=12) for i, p in enumerate(prompts(40, seed=53))]
    before = engine.generate_batch(requests)
    held = torch.cuda.memory_allocated()
    engine.release_memory()
    released = torch.cuda.memory_allocated()
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    kv = 2 * 2 * 64 * 2 * 512 * 16 * 4  # layers x (k, v) x slots x kv heads x len x head_dim x fp32
    assert held - released >= weights + kv
    assert all(p.device.type == "cpu" for p in engine.model.parameters())
    engine.resume_memory()
    assert engine.generate_batch(requests) == before
