"""Multi-step decoding: bursts of decode steps between the host's read-backs give the samples of one
step at a time, stop where a row reaches its length limit and freeze a row at its stop token."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
import torch

from loongsage.core.engine.native import NativeEngine
from loongsage.core.types import FinishReason

sys.path.insert(0, str(Path(__file__).parent))
from _engine_helpers import prompts, req  # noqa: E402


def _mixed_requests() -> list:
    """Greedy, plain and filtered sampling, seeded and not, n > 1, lengths 1 to 40."""
    settings = [
        {"temperature": 0.0},
        {"temperature": 1.0, "seed": 3},
        {"temperature": 0.7, "top_k": 40, "seed": 5},
        {"temperature": 1.0},
        {"temperature": 1.0, "top_p": 0.9, "n": 3},
    ]
    return [
        req(f"r{i}", p, max_new_tokens=1 + (7 * i) % 40, **settings[i % len(settings)])
        for i, p in enumerate(prompts(16, seed=70, lo=3, hi=30))
    ]


def _stops(model_dir) -> list[int]:
    """Stop ids that the tiny model emits now and then: the most frequent tokens of a greedy run."""
    engine = NativeEngine(model_dir, max_model_len=128, eos_token_ids=[])
    out = engine.generate_batch([req(f"s{i}", p, temperature=0, max_new_tokens=30) for i, p in enumerate(prompts(6))])
    counts = torch.bincount(torch.tensor([t for (r,) in out for t in r.output_ids]))
    return counts.topk(2).indices.tolist()


@pytest.mark.parametrize("steps_per_sync", [3, 8])
def test_bursts_give_the_samples_of_one_step_at_a_time(model_dir, steps_per_sync):
    stops = _stops(model_dir)
    common = {"max_batch_size": 6, "max_model_len": 128, "eos_token_ids": stops, "seed": 4}
    single = NativeEngine(model_dir, steps_per_sync=1, **common)
    burst = NativeEngine(model_dir, steps_per_sync=steps_per_sync, **common)
    want, got = single.generate_batch(_mixed_requests()), burst.generate_batch(_mixed_requests())
    reasons = set()
    for w_group, g_group in zip(want, got):
        for w, g in zip(w_group, g_group):
            assert g.output_ids == w.output_ids and g.finish_reason == w.finish_reason
            assert g.versions == w.versions
            torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-5, rtol=0)
            if g.finish_reason == FinishReason.STOP:
                assert g.output_ids[-1] in stops and not set(g.output_ids[:-1]) & set(stops)
            reasons.add(g.finish_reason)
    assert reasons == {FinishReason.STOP, FinishReason.LENGTH}  # rows stopped inside bursts
    made = sum(len(r.output_ids) for group in got for r in group)
    assert burst.health()["generated_tokens"] == single.health()["generated_tokens"] == made
    assert burst.health()["read_backs"] < single.health()["read_backs"]


def test_a_burst_ends_where_a_row_reaches_its_length_limit(model_dir):
    (p,) = prompts(1, seed=71)
    engine = NativeEngine(model_dir, max_model_len=128, eos_token_ids=[], steps_per_sync=8)
    (out,) = engine.generate_batch([req("a", p, temperature=1.0, seed=1, max_new_tokens=19)])[0]
    health = engine.health()
    assert len(out.output_ids) == 19 and out.finish_reason == FinishReason.LENGTH
    # the prefill's step samples the first token; then bursts of 8, 8 and 2: no step past the limit
    assert health["steps"] == 19 and health["read_backs"] == 4


def test_requests_joining_between_bursts_get_their_samples_alone(model_dir):
    (probe,) = prompts(1, seed=72)
    sampling = {"temperature": 1.0, "top_k": 40, "seed": 11, "max_new_tokens": 25, "n": 2}
    single = NativeEngine(model_dir, max_model_len=128, eos_token_ids=[])
    alone = single.generate_batch([req("t", probe, **sampling)])[0]
    engine = NativeEngine(model_dir, max_batch_size=8, max_model_len=128, eos_token_ids=[], steps_per_sync=4)

    async def crowded():
        others = [
            asyncio.create_task(engine.generate(req(f"o{i}", q, max_new_tokens=5 + 9 * (i % 4), temperature=1.0)))
            for i, q in enumerate(prompts(9, seed=73))
        ]
        while engine.health()["generated_tokens"] < 30:
            await asyncio.sleep(0)
        target = await engine.generate(req("t", probe, **sampling))
        await asyncio.gather(*others)
        return target

    joined = asyncio.run(crowded())
    assert [r.output_ids for r in joined] == [r.output_ids for r in alone]
    for a, b in zip(alone, joined):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


def test_abort_between_bursts_keeps_the_tokens_so_far(model_dir):
    engine = NativeEngine(model_dir, max_batch_size=4, max_model_len=256, eos_token_ids=[], steps_per_sync=8)
    (a,) = prompts(1, seed=74)

    async def main():
        running = asyncio.create_task(engine.generate(req("run", a, max_new_tokens=200, n=2)))
        while engine.health()["generated_tokens"] < 2 * 20:
            await asyncio.sleep(0)
        aborted = await engine.abort(["run"])
        return aborted, await running

    aborted, from_generate = asyncio.run(main())
    assert aborted == from_generate and len(aborted) == 2
    for r in aborted:
        assert r.finish_reason == FinishReason.ABORT and 20 <= len(r.output_ids) < 200
        assert len(r.logprobs) == len(r.versions) == len(r.output_ids)
    assert engine.health()["running_rows"] == 0


@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_steps_per_sync_must_be_a_positive_integer(model_dir, bad):
    with pytest.raises(ValueError, match=r"steps_per_sync=.*must be an integer >= 1 \(or None: automatic\)"):
        NativeEngine(model_dir, steps_per_sync=bad)
