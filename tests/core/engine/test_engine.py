"""The native engine: exactness against HF, sampling, versions, abort/pause, input errors, continuous
batching and prefix reuse."""

from __future__ import annotations

import asyncio
import random
import sys
from pathlib import Path

import pytest
import torch

from loongsage.core.engine.native import NativeEngine
from loongsage.core.engine.sampling import SamplingTensors, sample
from loongsage.core.types import FinishReason, SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from _engine_helpers import EOS, VOCAB, full_logprobs, prompts, req  # noqa: E402


@pytest.fixture
def engine(model_dir):
    return NativeEngine(model_dir, max_batch_size=64, max_model_len=128, seed=0)


def hf_greedy(model, batch: list[list[int]], max_new: int) -> list[list[int]]:
    width = max(map(len, batch))
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(batch):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=EOS,
            pad_token_id=0,
        )
    rows = []
    for row in out[:, width:].tolist():
        rows.append(row[: row.index(EOS) + 1] if EOS in row else row)
    return rows


def test_greedy_matches_hf_generate_in_a_mixed_batch(engine, hf_model):
    batch = prompts(8, seed=1)
    expected = hf_greedy(hf_model, batch, max_new=24)
    requests = []
    for i, p in enumerate(batch):  # sampled requests interleaved: greedy rows must not notice them
        requests.append(req(f"g{i}", p, temperature=0.0, max_new_tokens=24))
        requests.append(req(f"s{i}", p, temperature=1.0, top_p=0.9, max_new_tokens=24, n=2))
    results = engine.generate_batch(requests)
    for i in range(len(batch)):
        (greedy,) = results[2 * i]
        assert greedy.output_ids == expected[i]
        reason = FinishReason.STOP if greedy.output_ids[-1] == EOS else FinishReason.LENGTH
        assert greedy.finish_reason == reason


def test_chunked_prefill_gives_the_same_tokens(engine, model_dir):
    requests = [req(f"c{i}", p, temperature=0, max_new_tokens=12, n=2) for i, p in enumerate(prompts(5, seed=13))]
    whole = engine.generate_batch(requests)
    # Prompts split over several steps (4 tokens each), interleaved with other rows' decoding.
    chunked = NativeEngine(
        model_dir, max_batch_size=64, max_model_len=128, prefill_chunk_tokens=4, prefix_cache=False
    ).generate_batch(requests)
    for a, b in zip(whole, chunked):
        assert [r.output_ids for r in a] == [r.output_ids for r in b]
        for x, y in zip(a, b):  # other matmul shapes: equal up to float rounding
            torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5, rtol=0)


def test_logprobs_are_the_raw_policy_of_a_full_forward(engine, hf_model):
    batch = prompts(5, seed=2)
    # Temperature and filters shape the sampling only; returned log-probs stay the raw policy's.
    requests = [
        req(f"r{i}", p, temperature=1.7, top_k=20, top_p=0.8, max_new_tokens=20, n=2, seed=i)
        for i, p in enumerate(batch)
    ]
    for p, samples in zip(batch, engine.generate_batch(requests)):
        for r in samples:
            assert len(r.logprobs) == len(r.output_ids) == len(r.versions) > 0
            ref = full_logprobs(hf_model, p, r.output_ids)
            torch.testing.assert_close(torch.tensor(r.logprobs), ref, atol=1e-5, rtol=0)


def test_same_seed_same_samples_whatever_the_batch(engine):
    (p,) = prompts(1, seed=3)
    others = [req(f"o{i}", q, max_new_tokens=40, n=2) for i, q in enumerate(prompts(6, seed=4))]
    alone = engine.generate_batch([req("a", p, max_new_tokens=30, n=3, seed=7)])[0]
    crowded = engine.generate_batch(others + [req("a", p, max_new_tokens=30, n=3, seed=7)])[-1]
    other_seed = engine.generate_batch([req("a", p, max_new_tokens=30, n=3, seed=8)])[0]
    assert [r.output_ids for r in alone] == [r.output_ids for r in crowded]
    assert [r.output_ids for r in alone] != [r.output_ids for r in other_seed]
    # Sample j of a seed does not depend on n or on the length limit (a longer limit extends it).
    (longer,) = engine.generate_batch([req("a", p, max_new_tokens=45, n=2, seed=7)])
    assert [r.output_ids[:30] for r in longer] == [r.output_ids for r in alone[:2]]


def test_n_samples_share_one_prefill_and_differ(engine):
    (p,) = prompts(1, seed=5)
    before = engine.health()
    (samples,) = engine.generate_batch([req("n", p, max_new_tokens=16, n=6, seed=1)])
    after = engine.health()
    assert after["prefill_rows"] - before["prefill_rows"] == 1
    assert after["prefill_tokens"] - before["prefill_tokens"] == len(p)
    assert len(samples) == 6 and len({tuple(r.output_ids) for r in samples}) > 1


def test_stop_tokens_max_new_tokens_and_max_model_len(model_dir, engine):
    (p,) = prompts(1, seed=6)
    (greedy,) = engine.generate_batch([req("g", p, temperature=0, max_new_tokens=12)])[0]
    stop = greedy.output_ids[4]
    first = greedy.output_ids.index(stop)
    (stopped,) = engine.generate_batch([req("s", p, temperature=0, max_new_tokens=12, stop_token_ids=[stop])])[0]
    assert stopped.output_ids == greedy.output_ids[: first + 1]  # the stop token is returned
    # (abs 1e-5: "s" reuses the cached prompt of "g", so other matmul shapes)
    assert stopped.logprobs == pytest.approx(greedy.logprobs[: first + 1], abs=1e-5)
    assert stopped.finish_reason == FinishReason.STOP

    (short,) = engine.generate_batch([req("l", p, temperature=0, max_new_tokens=3)])[0]
    assert short.output_ids == greedy.output_ids[:3] and short.finish_reason == FinishReason.LENGTH

    # The model's eos stops generation too (here an engine whose eos is that token).
    eos_engine = NativeEngine(model_dir, max_model_len=128, eos_token_ids=[stop])
    (by_eos,) = eos_engine.generate_batch([req("e", p, temperature=0, max_new_tokens=12)])[0]
    assert by_eos.output_ids == stopped.output_ids and by_eos.finish_reason == FinishReason.STOP

    capped = NativeEngine(model_dir, max_model_len=len(p) + 5, eos_token_ids=[])
    (cut,) = capped.generate_batch([req("c", p, temperature=0, max_new_tokens=50)])[0]
    assert len(cut.output_ids) == 5 and cut.finish_reason == FinishReason.LENGTH


def test_update_weights_changes_outputs_and_versions(engine, hf_model):
    batch = prompts(3, seed=7)
    requests = [req(f"r{i}", p, temperature=0, max_new_tokens=10) for i, p in enumerate(batch)]
    before = engine.generate_batch(requests)
    assert engine.version == 0 and all(r.versions == [0] * len(r.output_ids) for (r,) in before)

    new = {name: t + 0.05 * torch.randn_like(t) for name, t in hf_model.state_dict().items()}
    assert "lm_head.weight" in new  # the tied alias is accepted along with the embedding
    with pytest.raises(ValueError, match="unknown tensor 'nope'") as err:
        engine.update_weights([("nope", torch.zeros(1))])
    assert "\n" not in str(err.value) and engine.version == 0
    assert engine.update_weights(new.items()) == 1 and engine.version == 1

    after = engine.generate_batch(requests)
    assert [r.output_ids for (r,) in after] != [r.output_ids for (r,) in before]
    from transformers import AutoModelForCausalLM

    updated = AutoModelForCausalLM.from_pretrained(engine.model_path).eval()
    updated.load_state_dict(new)
    for p, (r,) in zip(batch, after):
        assert r.versions == [1] * len(r.output_ids)
        torch.testing.assert_close(torch.tensor(r.logprobs), full_logprobs(updated, p, r.output_ids), atol=1e-5, rtol=0)


def test_weight_update_between_decode_steps_is_recorded_per_token(model_dir, hf_model):
    engine = NativeEngine(model_dir, max_model_len=256, eos_token_ids=[])
    (p,) = prompts(1, seed=8)

    async def main():
        task = asyncio.create_task(engine.generate(req("long", p, max_new_tokens=60, seed=0)))
        while engine.health()["generated_tokens"] < 5:
            await asyncio.sleep(0)
        engine.update_weights((n, t * 1.01) for n, t in hf_model.state_dict().items())
        return await task

    (result,) = asyncio.run(main())
    k = result.versions.index(1)
    assert 5 <= k < 60 and result.versions == [0] * k + [1] * (60 - k)


def test_abort_returns_partial_tokens(model_dir):
    engine = NativeEngine(model_dir, max_batch_size=4, max_model_len=256, eos_token_ids=[])
    a, b, c = prompts(3, seed=9)

    async def main():
        running = asyncio.create_task(engine.generate(req("run", a, max_new_tokens=200, n=4)))
        waiting = asyncio.create_task(engine.generate(req("wait", b, max_new_tokens=10)))  # batch is full
        while engine.health()["generated_tokens"] < 4 * 6:
            await asyncio.sleep(0)
        with pytest.raises(ValueError, match="unknown request id"):
            await engine.abort(["nobody"])
        aborted = await engine.abort(["run"])
        from_generate = await running
        assert await waiting  # every slot was taken: it ran once "run" left
        later = asyncio.create_task(engine.generate(req("later", c, max_new_tokens=200)))
        while engine.health()["running_rows"] == 0:
            await asyncio.sleep(0)
        everything = await engine.abort()
        return aborted, from_generate, everything, await later

    aborted, from_generate, everything, later = asyncio.run(main())
    assert aborted == from_generate and len(aborted) == 4
    for r in aborted:
        assert r.finish_reason == FinishReason.ABORT and 6 <= len(r.output_ids) < 200
        assert len(r.logprobs) == len(r.versions) == len(r.output_ids)
    assert everything == later and later[0].finish_reason == FinishReason.ABORT


def test_pause_holds_steps_until_resume(engine):
    (p,) = prompts(1, seed=10)

    async def main():
        engine.pause()
        task = asyncio.create_task(engine.generate(req("p", p, max_new_tokens=8)))
        for _ in range(20):
            await asyncio.sleep(0)
        stalled = engine.health()
        engine.resume()
        return stalled, await task

    stalled, (result,) = asyncio.run(main())
    assert stalled["status"] == "paused" and stalled["waiting_requests"] == 1 and stalled["steps"] == 0
    assert len(result.output_ids) <= 8 and engine.health()["status"] == "ok"


def test_bad_requests_fail_alone(engine):
    good = prompts(2, seed=11)
    bad = {
        "empty": req("empty", [], max_new_tokens=4),
        "too long": req("long", list(range(2, 130)), max_new_tokens=4),
        "max_new_tokens": req("zero", good[0], max_new_tokens=0),
        "temperature": req("temp", good[0], temperature=-1.0),
        "top_p": req("topp", good[0], top_p=0.0),
        "must lie in": req("vocab", [5, VOCAB + 3]),
    }

    async def main():
        calls = [engine.generate(req(f"ok{i}", p, max_new_tokens=5)) for i, p in enumerate(good)]
        calls += [engine.generate(r) for r in bad.values()]
        return await asyncio.gather(*calls, return_exceptions=True)

    outcomes = asyncio.run(main())
    assert all(isinstance(o, list) and len(o[0].output_ids) > 0 for o in outcomes[:2])
    for (needle, r), err in zip(bad.items(), outcomes[2:]):
        assert isinstance(err, ValueError) and needle in str(err) and r.request_id in str(err)
        assert "\n" not in str(err)
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.generate_batch([req("ok", good[0]), bad["max_new_tokens"]])


def test_sampler_matches_the_filtered_distribution():
    torch.manual_seed(0)
    logits = torch.randn(12) * 2
    rows = 40_000
    cases = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.6),
        SamplingParams(temperature=1.0, min_p=0.2),
        SamplingParams(temperature=0.9, top_k=6, top_p=0.8, min_p=0.05),
    ]
    for params in cases:
        st = SamplingTensors.build([params] * rows, 12, "cpu")
        tokens, logprobs = sample(logits.expand(rows, -1), st, torch.rand(rows))
        probs = torch.softmax(logits / params.temperature, -1)
        order = probs.argsort(descending=True)
        keep = torch.zeros(12, dtype=torch.bool)
        k = params.top_k or 12
        top = probs[order[:k]] / probs[order[:k]].sum()
        for rank in range(k):  # top-k, then top-p over the renormalised top-k, then min-p
            if top[:rank].sum() < params.top_p and probs[order[rank]] >= params.min_p * probs.max():
                keep[order[rank]] = True
        target = torch.where(keep, probs, 0.0)
        target /= target.sum()
        freq = torch.bincount(tokens, minlength=12).float() / rows
        assert freq[~keep].sum() == 0, params
        assert (freq - target).abs().max() < 0.015, params
        torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1)[tokens])


def test_a_row_without_filters_samples_the_same_beside_filtered_rows():
    torch.manual_seed(1)
    rows, vocab = 4000, 50
    logits, uniforms = torch.randn(rows, vocab) * 2, torch.rand(rows)
    plain = [SamplingParams(temperature=1.0)] * rows
    alone, _ = sample(logits, SamplingTensors.build(plain, vocab, "cpu"), uniforms)
    # every other row asks for a filter: the batch takes the filtered path (a sort), which must not
    # change how the plain rows turn their uniform number into a token
    mixed = [SamplingParams(temperature=1.0, top_k=5) if i % 2 else p for i, p in enumerate(plain)]
    beside, _ = sample(logits, SamplingTensors.build(mixed, vocab, "cpu"), uniforms)
    assert torch.equal(beside[::2], alone[::2])
    assert not torch.equal(beside[1::2], alone[1::2])  # the filtered rows did draw differently


def test_bfloat16_model_with_fp32_head_runs(model_dir):
    engine = NativeEngine(model_dir, dtype="bfloat16", fp32_lm_head=True)
    (samples,) = engine.generate_batch([req("bf", prompts(1, seed=12)[0], max_new_tokens=8, n=2)])
    assert all(torch.isfinite(torch.tensor(r.logprobs)).all() and len(r.output_ids) > 0 for r in samples)
    assert engine.health()["dtype"] == "bfloat16"
    # the fused decode kernels are CUDA kernels: on the CPU the torch path runs, and says why
    assert engine.health()["decode_kernels"] == "torch (device 'cpu' (the fused kernels are CUDA kernels))"


# ----------------------------------------------------------------------------- continuous batching


async def _staggered(engine, requests, gap_steps: int = 3):
    """Submit ``requests`` one every ``gap_steps`` engine steps; gather their results."""
    tasks = []
    for r in requests:
        start = engine.health()["steps"]
        tasks.append(asyncio.create_task(engine.generate(r)))
        while engine.health()["steps"] < start + gap_steps and not all(t.done() for t in tasks):
            await asyncio.sleep(0)
    return await asyncio.gather(*tasks)


@pytest.mark.parametrize("deterministic", [False, True], ids=["fast", "deterministic"])
@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 1.0, "top_k": 40, "seed": 11}])
def test_alone_or_joining_a_crowded_running_batch_gives_the_same_samples(model_dir, sampling, deterministic):
    (p,) = prompts(1, seed=20)
    target = req("t", p, max_new_tokens=25, n=2, **sampling)
    mode = {"eos_token_ids": [], "deterministic": deterministic}
    alone = NativeEngine(model_dir, max_model_len=128, **mode).generate_batch([target])[0]
    # Crowded: 8 slots, other requests of mixed lengths arriving while rows decode and finish, so
    # the target lands in a reused slot of a running batch, and rows move down as others leave.
    engine = NativeEngine(model_dir, max_batch_size=8, max_model_len=128, prefill_chunk_tokens=8, **mode)
    others = [
        req(f"o{i}", q, max_new_tokens=3 + 7 * (i % 5), temperature=1.0, n=1 + i % 2)
        for i, q in enumerate(prompts(10, seed=21))
    ]
    results = asyncio.run(_staggered(engine, others[:6] + [target] + others[6:], gap_steps=2))
    crowded = results[6]
    assert [r.output_ids for r in crowded] == [r.output_ids for r in alone]
    for a, b in zip(alone, crowded):
        if deterministic:  # batch-invariant: bit for bit
            assert a.logprobs == b.logprobs
        else:
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
    assert all(len(r[0].output_ids) == o.sampling.max_new_tokens for r, o in zip(results[:6], others[:6]))


def test_a_request_arriving_mid_decode_finishes_without_waiting_for_the_batch(model_dir):
    engine = NativeEngine(model_dir, max_batch_size=8, max_model_len=256, eos_token_ids=[])
    a, b = prompts(2, seed=22)

    async def main():
        long = asyncio.create_task(engine.generate(req("long", a, max_new_tokens=150)))
        while engine.health()["steps"] < 10:
            await asyncio.sleep(0)
        submitted = engine.health()["steps"]
        (short,) = await engine.generate(req("short", b, max_new_tokens=5))
        done = engine.health()
        await long
        return short, submitted, done

    short, submitted, done = asyncio.run(main())
    assert len(short.output_ids) == 5
    # Joined at the next step boundary: prefill + 5 tokens took ~5 steps while "long" kept decoding.
    assert done["steps"] - submitted <= 7 and done["running_rows"] == 1
    assert done["steps"] < 100


def test_a_caller_whose_next_request_takes_several_loop_rounds_joins_the_next_step(model_dir):
    """Between steps the scheduler yields while the loop has other callbacks ready, so an answer
    that goes through several loop rounds before the next request (an HTTP stack's hops) does not
    cost one step per round while another request keeps decoding."""
    engine = NativeEngine(model_dir, max_batch_size=8, max_model_len=256, eos_token_ids=[])
    a, b = prompts(2, seed=24)

    async def main():
        long = asyncio.create_task(engine.generate(req("long", a, max_new_tokens=80)))
        await engine.generate(req("first", b, max_new_tokens=3))
        answered = engine.health()["steps"]
        for _ in range(12):  # the hops, one loop round each
            await asyncio.sleep(0)
        submitted = engine.health()["steps"]
        (second,) = await engine.generate(req("second", b, max_new_tokens=2))
        await long
        return answered, submitted, second

    answered, submitted, second = asyncio.run(main())
    assert submitted == answered and len(second.output_ids) == 2


def test_a_thousand_mixed_requests_run_in_bounded_memory(model_dir):
    engine = NativeEngine(model_dir, max_batch_size=16, max_model_len=64, eos_token_ids=[EOS], prefill_chunk_tokens=32)
    rng = random.Random(23)
    requests = [
        req(
            f"m{i}",
            p,
            max_new_tokens=rng.randrange(1, 30),
            n=rng.choice([1, 1, 2]),
            temperature=rng.choice([0.0, 1.0]),
            seed=rng.choice([None, i]),
        )
        for i, p in enumerate(prompts(1000, seed=24, lo=2, hi=30))
    ]

    async def main():
        sizes, tasks = set(), []
        for k in range(0, len(requests), 100):  # waves of 100
            tasks += [asyncio.create_task(engine.generate(r)) for r in requests[k : k + 100]]
            while sum(t.done() for t in tasks) < k + 50:
                await asyncio.sleep(0)
                sizes.add(engine.health()["kv_cache_bytes"])
        return await asyncio.gather(*tasks), sizes

    results, sizes = asyncio.run(main())
    health = engine.health()
    slot_bytes = 2 * 2 * 2 * 64 * 16 * 4  # k+v, layers, kv heads, max_model_len, head_dim, fp32
    assert health["kv_slots"] <= 16 and health["kv_cache_bytes"] == 16 * slot_bytes
    assert len(sizes) <= 2 and max(sizes) == 16 * slot_bytes  # grew once to the bound, then constant
    for r, samples in zip(requests, results):
        assert len(samples) == r.sampling.n
        for s in samples:
            assert 0 < len(s.output_ids) <= r.sampling.max_new_tokens
            assert s.finish_reason == (FinishReason.STOP if s.output_ids[-1] == EOS else FinishReason.LENGTH)
    assert health["running_rows"] == 0 and health["waiting_requests"] == 0


def test_next_turn_of_a_session_prefills_only_the_new_suffix(model_dir, hf_model):
    engine = NativeEngine(model_dir, max_batch_size=4, max_model_len=128, eos_token_ids=[])
    fresh = NativeEngine(model_dir, max_batch_size=4, max_model_len=128, eos_token_ids=[], prefix_cache=False)
    (p,) = prompts(1, seed=25)
    (first,) = engine.generate_batch([req("turn1", p, max_new_tokens=10, temperature=0)])[0]
    engine.generate_batch([req(f"x{i}", q, max_new_tokens=4) for i, q in enumerate(prompts(2, seed=26))])
    turn2 = p + first.output_ids + [7, 8, 9]
    before = engine.health()
    (second,) = engine.generate_batch([req("turn2", turn2, max_new_tokens=10, temperature=0)])[0]
    after = engine.health()
    cached = len(p) + len(first.output_ids) - 1  # the last sampled token was never fed
    assert after["prefix_hit_tokens"] - before["prefix_hit_tokens"] == cached
    assert after["prefill_tokens"] - before["prefill_tokens"] == len(turn2) - cached
    (ref,) = fresh.generate_batch([req("turn2", turn2, max_new_tokens=10, temperature=0)])[0]
    assert second.output_ids == ref.output_ids
    torch.testing.assert_close(
        torch.tensor(second.logprobs), full_logprobs(hf_model, turn2, second.output_ids), atol=1e-5, rtol=0
    )
    # A flushed cache is not reused either: the next turn computes as on a fresh engine.
    assert engine.flush_cache() >= 1 and engine.flush_cache() == 0
    before = engine.health()
    (again,) = engine.generate_batch([req("turn2b", turn2, max_new_tokens=10, temperature=0)])[0]
    assert engine.health()["prefix_hit_tokens"] == before["prefix_hit_tokens"]
    assert again.output_ids == ref.output_ids and again.logprobs == ref.logprobs
    # Caches of older weights are never reused.
    engine.update_weights(hf_model.state_dict().items())
    before = engine.health()
    engine.generate_batch([req("turn3", turn2 + second.output_ids, max_new_tokens=2)])
    assert engine.health()["prefix_hit_tokens"] == before["prefix_hit_tokens"]


def test_next_turns_of_many_sessions_are_prefilled_together(model_dir, hf_model):
    # Six sessions (history lengths differ) send their next turn at once, mixed with fresh prompts:
    # one batched forward prefills every new suffix on top of its cached prefix.
    engine = NativeEngine(model_dir, max_batch_size=32, max_model_len=128, eos_token_ids=[])
    firsts = prompts(6, seed=27, lo=4, hi=30)
    turn1 = engine.generate_batch(
        [req(f"a{i}", p, max_new_tokens=3 + 2 * i, temperature=0) for i, p in enumerate(firsts)]
    )
    turn2 = [p + r.output_ids + list(range(10, 12 + i)) for i, (p, (r,)) in enumerate(zip(firsts, turn1))]
    fresh_prompts = prompts(3, seed=28)
    before = engine.health()
    requests = [req(f"b{i}", p, max_new_tokens=8, temperature=0, n=1 + i % 2) for i, p in enumerate(turn2)]
    results = engine.generate_batch(
        requests + [req(f"f{i}", p, max_new_tokens=8, temperature=0) for i, p in enumerate(fresh_prompts)]
    )
    after = engine.health()
    cached = sum(len(p) + len(r.output_ids) - 1 for p, (r,) in zip(firsts, turn1))
    assert after["prefix_hit_tokens"] - before["prefix_hit_tokens"] == cached
    assert after["prefill_tokens"] - before["prefill_tokens"] == sum(map(len, turn2 + fresh_prompts)) - cached
    assert after["prefill_forwards"] - before["prefill_forwards"] == 1
    for prompt, samples in zip(turn2 + fresh_prompts, results):
        for r in samples:  # every sample row of a session got the whole history
            assert r.output_ids == hf_greedy(hf_model, [prompt], 8)[0]
            torch.testing.assert_close(
                torch.tensor(r.logprobs), full_logprobs(hf_model, prompt, r.output_ids), atol=1e-5, rtol=0
            )


def test_a_row_that_filled_max_model_len_does_not_break_its_neighbours(model_dir, hf_model):
    # Slot 0 stops at the context limit while slot 1 keeps decoding: the finished slot's length then
    # equals max_model_len, and later decode steps must not write past the cache.
    engine = NativeEngine(model_dir, max_batch_size=4, max_model_len=32, eos_token_ids=[])
    long_prompt, short_prompt = prompts(2, seed=40, lo=20, hi=21)[0], prompts(1, seed=41, lo=3, hi=4)[0]
    results = engine.generate_batch(
        [
            req("full", long_prompt, temperature=0, max_new_tokens=100),
            req("short", short_prompt, temperature=0, max_new_tokens=25),
        ]
    )
    (full,), (short,) = results
    assert full.finish_reason == FinishReason.LENGTH and len(long_prompt) + len(full.output_ids) == 32
    assert short.finish_reason == FinishReason.LENGTH and len(short.output_ids) == 25
    assert short.output_ids == hf_greedy(hf_model, [short_prompt], 25)[0]
