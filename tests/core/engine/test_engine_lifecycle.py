"""The native engine's lifecycle: resuming an aborted sample under new weights, releasing and
resuming memory, and the deterministic mode whose log-probs equal the trainer's bit for bit."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
import torch

from loongsage.core.engine.native import NativeEngine
from loongsage.core.metrics import Metrics
from loongsage.core.trainer.torch_trainer import TorchTrainer
from loongsage.core.types import FinishReason, GenerationRequest, GenerationResult, SamplingParams, TrainBatch

sys.path.insert(0, str(Path(__file__).parent))
from _engine_helpers import full_logprobs, prompts, req  # noqa: E402


def perturbed(hf_model, scale: float = 0.05, seed: int = 3) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: t + scale * torch.randn(t.shape, generator=gen) for n, t in hf_model.state_dict().items()}


def test_an_aborted_sample_resumes_with_new_weights_and_keeps_its_tokens(model_dir, hf_model):
    engine = NativeEngine(model_dir, max_model_len=256, eos_token_ids=[])
    (p,) = prompts(1, seed=31)
    new_weights = perturbed(hf_model)

    async def main():
        task = asyncio.create_task(engine.generate(req("a", p, temperature=0, max_new_tokens=40)))
        while engine.health()["generated_tokens"] < 7:
            await asyncio.sleep(0)
        (partial,) = await engine.abort(["a"])
        assert (await task) == [partial]
        engine.update_weights(new_weights.items())
        resumed = GenerationRequest("a", p, SamplingParams(temperature=0, max_new_tokens=40), resume_from=partial)
        return partial, (await engine.generate(resumed))[0]

    partial, result = asyncio.run(main())
    k = len(partial.output_ids)
    assert partial.finish_reason is FinishReason.ABORT and 7 <= k < 40
    assert result.finish_reason is FinishReason.LENGTH and len(result.output_ids) == 40  # the budget is shared
    assert result.output_ids[:k] == partial.output_ids and result.logprobs[:k] == partial.logprobs
    assert result.versions == [0] * k + [1] * (40 - k)
    # The new tokens are what the new weights generate greedily from prompt + kept tokens, with their log-probs.
    fresh = NativeEngine(model_dir, max_model_len=256, eos_token_ids=[])
    fresh.update_weights(new_weights.items())
    (expected,) = fresh.generate_batch([req("b", p + partial.output_ids, temperature=0, max_new_tokens=40 - k)])[0:1]
    assert result.output_ids[k:] == expected[0].output_ids
    updated = type(hf_model).from_pretrained(model_dir).eval()
    updated.load_state_dict(new_weights)
    torch.testing.assert_close(
        torch.tensor(result.logprobs[k:]),
        full_logprobs(updated, p + partial.output_ids, result.output_ids[k:]),
        atol=1e-5,
        rtol=0,
    )


def test_bad_resumes_fail_alone(model_dir):
    engine = NativeEngine(model_dir, max_model_len=64)
    (p,) = prompts(1, seed=32)
    done = GenerationResult("x", [5, 6], [-0.1, -0.2], [0, 0], FinishReason.STOP)
    aborted = GenerationResult("x", [5, 6], [-0.1, -0.2], [0, 0], FinishReason.ABORT)
    cases = {
        "only an aborted sample": GenerationRequest("s", p, SamplingParams(max_new_tokens=8), resume_from=done),
        "continues one sample": GenerationRequest("n", p, SamplingParams(max_new_tokens=8, n=2), resume_from=aborted),
        "nothing left": GenerationRequest("m", p, SamplingParams(max_new_tokens=2), resume_from=aborted),
        "equal lengths": GenerationRequest(
            "l",
            p,
            SamplingParams(max_new_tokens=8),
            resume_from=GenerationResult("x", [5, 6], [-0.1], [0, 0], FinishReason.ABORT),
        ),
        "too long": GenerationRequest(
            "t",
            p,
            SamplingParams(max_new_tokens=80),
            resume_from=GenerationResult("x", [5] * 60, [-0.1] * 60, [0] * 60, FinishReason.ABORT),
        ),
    }

    async def main():
        outcomes = await asyncio.gather(
            *(engine.generate(r) for r in cases.values()),
            engine.generate(req("ok", p, max_new_tokens=4)),
            return_exceptions=True,
        )
        return outcomes

    outcomes = asyncio.run(main())
    for (expected, _), got in zip(cases.items(), outcomes[:-1]):
        assert isinstance(got, ValueError) and expected in str(got) and "\n" not in str(got), (expected, got)
    assert len(outcomes[-1][0].output_ids) <= 4


def test_release_memory_frees_the_cache_and_resume_brings_it_back(model_dir, hf_model):
    engine = NativeEngine(model_dir, max_batch_size=16, max_model_len=128, seed=0)
    batch = prompts(4, seed=33)
    requests = [req(f"r{i}", q, temperature=0, max_new_tokens=6) for i, q in enumerate(batch)]
    before = engine.generate_batch(requests)
    assert engine.health()["kv_cache_bytes"] > 0

    async def busy():
        task = asyncio.create_task(engine.generate(req("busy", batch[0], max_new_tokens=100)))
        while engine.health()["running_rows"] == 0:
            await asyncio.sleep(0)
        with pytest.raises(RuntimeError, match="still waiting or running"):
            engine.release_memory()
        await engine.abort()
        await task

    asyncio.run(busy())
    engine.release_memory()
    health = engine.health()
    assert health["status"] == "released" and health["kv_cache_bytes"] == 0 and health["kv_slots"] == 0
    with pytest.raises(RuntimeError, match="memory is released; call resume_memory"):
        engine.generate_batch(requests)
    # Weights pushed while released are in place after the resume.
    assert engine.update_weights(perturbed(hf_model, seed=4).items()) == 1
    engine.resume_memory()
    assert engine.health()["status"] == "ok" and engine.health()["kv_cache_bytes"] > 0
    after = engine.generate_batch(requests)
    assert all(r.versions == [1] * len(r.output_ids) for (r,) in after)
    assert [r.output_ids for (r,) in after] != [r.output_ids for (r,) in before]


def _trainer_logprobs(model_dir: str, rows: list[tuple[list[int], list[int]]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The trainer's log-probs of the response tokens: its no-grad pass and its training forward."""
    width = max(len(p) + len(o) for p, o in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    attention, mask = torch.zeros_like(ids), torch.zeros(len(rows), width)
    for i, (p, o) in enumerate(rows):
        ids[i, : len(p) + len(o)] = torch.tensor(p + o)
        attention[i, : len(p) + len(o)] = 1
        mask[i, len(p) : len(p) + len(o)] = 1
    batch = TrainBatch(
        input_ids=ids,
        attention_mask=attention,
        response_mask=mask,
        rollout_logprobs=torch.zeros(len(rows), width),
        advantages=torch.zeros(len(rows), width),
        rewards=torch.zeros(len(rows)),
        group_ids=torch.arange(len(rows)),
        sources=["s"] * len(rows),
    )
    trainer = TorchTrainer(model_dir)
    trainer.setup_optimizer(lr=0.0, betas=[0.9, 0.999], eps=1e-8, weight_decay=0.0, grad_clip=1.0)
    no_grad, _ = trainer.logprobs(batch, token_budget=1)
    seen = []

    def loss_fn(lp, mb):
        seen.append(lp.detach())
        return (lp * mb.response_mask).sum(), Metrics()

    trainer.train_step(batch, loss_fn, token_budget=1)
    training = torch.zeros(len(rows), width)
    for i, lp in enumerate(seen):
        training[i, : lp.shape[1]] = lp[0]
    return no_grad * mask, training * mask


def test_deterministic_mode_logprobs_equal_the_trainers_exactly(model_dir):
    batch = prompts(12, seed=34, lo=3, hi=30)
    sampling = {"temperature": 1.0, "max_new_tokens": 24, "seed": 5}
    fast = NativeEngine(model_dir, max_batch_size=64, max_model_len=128, seed=0)
    exact = NativeEngine(model_dir, max_batch_size=64, max_model_len=128, seed=0, deterministic=True)
    requests = [req(f"r{i}", p, n=2, **sampling) for i, p in enumerate(batch)]
    fast_out, exact_out = fast.generate_batch(requests), exact.generate_batch(requests)
    rows, engine_lp = [], []
    for p, fast_samples, exact_samples in zip(batch, fast_out, exact_out):
        for f, e in zip(fast_samples, exact_samples):
            assert f.output_ids == e.output_ids  # only the reported log-probs change
            rows.append((p, e.output_ids))
            engine_lp.append(e.logprobs)
    no_grad, training = _trainer_logprobs(model_dir, rows)
    diffs = []
    for i, (p, o) in enumerate(rows):
        got = torch.tensor(engine_lp[i])
        assert torch.equal(got, no_grad[i, len(p) : len(p) + len(o)]), i
        assert torch.equal(got, training[i, len(p) : len(p) + len(o)]), i
        diffs.append((torch.tensor(fast_out[i // 2][i % 2].logprobs) - got).abs().max())
    # The batched fast path is close but not bitwise equal: the mode is what makes the difference 0.
    assert max(diffs) < 1e-4
