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


def test_whole_step_graphs_in_bursts_decode_as_eager_single_steps(model_dir):
    """bf16 on the fused kernels: forward, sampling and bookkeeping replay as one graph, eight
    steps per read-back; filtered rows take the captured forward and the torch sampler."""
    from transformers import AutoModelForCausalLM

    from loongsage.core.types import FinishReason

    batch = prompts(40, seed=55, lo=3, hi=60)
    common = {"device": "cuda", "dtype": "bfloat16", "max_batch_size": 64, "max_model_len": 256, "kernels": "triton"}
    common["prefix_cache"] = False  # a second run of the same prompts prefills them alike
    greedy = [req(f"g{i}", p, temperature=0, max_new_tokens=5 + 3 * i) for i, p in enumerate(batch)]
    # stop ids the model does emit: the two most frequent tokens of a greedy run without stops
    free = NativeEngine(model_dir, eos_token_ids=[], cuda_graphs=False, steps_per_sync=1, **common)
    counts = torch.bincount(torch.tensor([t for (r,) in free.generate_batch(greedy) for t in r.output_ids]))
    stops = counts.topk(2).indices.tolist()
    graphed = NativeEngine(model_dir, eos_token_ids=stops, **common)
    eager = NativeEngine(model_dir, eos_token_ids=stops, cuda_graphs=False, steps_per_sync=1, **common)
    # greedy (the peaked test model has no near-ties): the same tokens, stops and lengths
    got, want = graphed.generate_batch(greedy), eager.generate_batch(greedy)
    for (g,), (w,) in zip(got, want):
        assert g.output_ids == w.output_ids and g.finish_reason == w.finish_reason and g.versions == w.versions
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=2e-2, rtol=0)
    assert {r.finish_reason for (r,) in got} == {FinishReason.STOP, FinishReason.LENGTH}
    # sampled, plain and filtered: reproducible, each token's log-prob as near a full forward's as
    # the eager steps' are, rows cut exactly at a stop token or the length limit
    sampled = [req(f"s{i}", p, temperature=1.0, seed=i, max_new_tokens=40) for i, p in enumerate(batch)]
    sampled += [req(f"f{i}", p, temperature=0.8, top_k=20, seed=i, max_new_tokens=30) for i, p in enumerate(batch[:6])]
    first = graphed.generate_batch(sampled)
    assert graphed.generate_batch(sampled) == first
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    graphed_dev = _deviation(hf, batch + batch[:6], first)
    eager_dev = _deviation(hf, batch + batch[:6], eager.generate_batch(sampled))
    assert graphed_dev.mean() <= 2 * eager_dev.mean() + 1e-4, (graphed_dev.mean(), eager_dev.mean())
    for (r,), q in zip(first, sampled):
        stopped = r.finish_reason == FinishReason.STOP
        assert not set(r.output_ids[:-1]) & set(stops) and (r.output_ids[-1] in stops) == stopped
        assert stopped or len(r.output_ids) == q.sampling.max_new_tokens
    assert {key[0] for key in graphed._batch.graphs._graphs} == {"_decode_step", "_decode_forward"}
    assert graphed.health()["read_backs"] < graphed.health()["steps"] / 3


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


def _deviation(hf, batch: list[list[int]], results) -> torch.Tensor:
    """|engine log-prob - full bf16 forward's log-prob| of every sampled token."""
    return torch.cat(
        [(torch.tensor(r.logprobs) - full_logprobs(hf, p, r.output_ids)).abs() for p, (r,) in zip(batch, results)]
    )


def test_fused_decode_kernels_are_as_close_to_a_full_forward_as_the_torch_path(model_dir):
    from transformers import AutoModelForCausalLM

    batch = prompts(37, seed=54, lo=3, hi=60)
    requests = [req(f"r{i}", p, temperature=1.0, seed=i, max_new_tokens=40) for i, p in enumerate(batch)]
    common = {"device": "cuda", "dtype": "bfloat16", "max_batch_size": 64, "max_model_len": 512}
    fused = NativeEngine(model_dir, kernels="triton", **common)
    plain = NativeEngine(model_dir, kernels="torch", **common)
    assert fused.health()["decode_kernels"] == "triton" and plain.health()["decode_kernels"] == "torch (kernels=torch)"
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()  # the reference, on the host
    got, ref = fused.generate_batch(requests), plain.generate_batch(requests)
    fused_dev, plain_dev = _deviation(hf, batch, got), _deviation(hf, batch, ref)
    # bf16 decode against a bf16 full forward: the same rounding noise on both paths
    assert fused_dev.mean() <= 2 * plain_dev.mean() + 1e-4, (fused_dev.mean(), plain_dev.mean())
    assert fused_dev.max() <= max(4 * plain_dev.max(), 0.05)

    # The merged projections are views of the HF parameters: an in-place update by HF name reaches
    # them, and a release/resume (a device move) re-merges.
    new = [(n, t * 1.01) for n, t in fused.named_weights() if t.is_floating_point()]
    fused.update_weights(new)
    plain.update_weights(new)
    hf.load_state_dict({n: t.cpu() for n, t in new}, strict=False)
    fused.release_memory()
    fused.resume_memory()
    assert all(torch.equal(dict(fused.named_weights())[n], t) for n, t in new)
    again = fused.generate_batch(requests)
    assert again != got
    assert (
        _deviation(hf, batch, again).mean() <= 2 * _deviation(hf, batch, plain.generate_batch(requests)).mean() + 1e-4
    )


def test_shared_prefix_decode_in_graphs_is_as_close_to_a_full_forward_as_each_row_alone(model_dir):
    """GRPO's shape: groups of 8 samples over prompts of 64 to 130 tokens, decoded in whole-step
    graphs with the prompts read once per tile: as close to a bf16 full forward as the rows each
    reading their whole cache, the tiles' tables updated as groups finish."""
    from transformers import AutoModelForCausalLM

    batch = prompts(12, seed=57, lo=64, hi=130)
    requests = [req(f"r{i}", p, temperature=1.0, seed=i, n=8, max_new_tokens=20 + 5 * i) for i, p in enumerate(batch)]
    common = {"device": "cuda", "dtype": "bfloat16", "max_batch_size": 64, "max_model_len": 256, "kernels": "triton"}
    shared = NativeEngine(model_dir, shared_prefix_decode=True, **common)
    alone = NativeEngine(model_dir, **common)
    assert shared.health()["decode_kernels"] == "triton, shared prefixes"
    got, ref = shared.generate_batch(requests), alone.generate_batch(requests)
    assert shared._batch.graphs.captures > 0
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    prompts_by_sample = [p for p in batch for _ in range(8)]
    got_dev = _deviation(hf, prompts_by_sample, [[r] for group in got for r in group])
    ref_dev = _deviation(hf, prompts_by_sample, [[r] for group in ref for r in group])
    assert got_dev.mean() <= 1.5 * ref_dev.mean() + 1e-4, (got_dev.mean(), ref_dev.mean())
    assert got_dev.max() <= max(2 * ref_dev.max(), 0.05)


def test_fused_decode_splits_long_rows_over_several_programs(model_dir):
    """Few rows and long contexts: the attention's columns are split and merged (flash decoding)."""
    from loongsage.core.engine.fused.attention import decode_attention, splits_for

    torch.manual_seed(0)
    rows, heads, kv, dim, length = 3, 16, 8, 128, 4096
    assert splits_for(rows, kv, length, 264) > 1
    q = torch.randn(rows, heads, dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(4, kv, length, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    lengths = torch.tensor([1, 2000, 4096], device="cuda")
    got = decode_attention(q, k[:rows], v[:rows], lengths, dim**-0.5, length).float().view(rows, heads, dim)
    mask = (torch.arange(length, device="cuda")[None, :] < lengths[:, None])[:, None, None, :]
    want = torch.nn.functional.scaled_dot_product_attention(
        q.float()[:, :, None],
        k[:rows].float().repeat_interleave(2, 1),
        v[:rows].float().repeat_interleave(2, 1),
        attn_mask=mask,
        scale=dim**-0.5,
    )[:, :, 0]
    assert ((got - want).norm() / want.norm()) < 1e-2


def test_fp8_weights_sample_near_the_bf16_policy_and_a_release_frees_every_copy(model_dir):
    from transformers import AutoModelForCausalLM

    batch = prompts(24, seed=56, lo=3, hi=60)
    requests = [req(f"r{i}", p, temperature=1.0, seed=i, max_new_tokens=30) for i, p in enumerate(batch)]
    common = {"device": "cuda", "dtype": "bfloat16", "max_batch_size": 64, "max_model_len": 256, "kernels": "triton"}
    fp8 = NativeEngine(model_dir, quantization="fp8", **common)
    bf16 = NativeEngine(model_dir, **common)
    assert fp8.health()["decode_kernels"] == "triton, fp8 weights"
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    got, ref = fp8.generate_batch(requests), bf16.generate_batch(requests)
    fp8_dev, bf16_dev = _deviation(hf, batch, got), _deviation(hf, batch, ref)
    # e4m3 weights and activations: further from the bf16 policy than bf16 rounding, still near it
    assert bf16_dev.mean() < fp8_dev.mean() < 0.5, (fp8_dev.mean(), bf16_dev.mean())

    # a release frees the merged bf16 buffers and the float8 copies too (the fused decoder held them)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    fp8.release_memory()
    weights = sum(p.numel() * p.element_size() for p in fp8.model.parameters())
    assert held - torch.cuda.memory_allocated() >= weights
    fp8.resume_memory()
    assert fp8.generate_batch(requests) == got
