"""The asynchronous rollout's checkpoint state over real engines (Ray actors): a snapshot taken while
a weight update holds generation, restored into a new service on a fresh engine, goes on exactly as
the original service does: its buffered groups as they were, its groups cut mid-generation continued
from their tokens, every later group sampled with the same seeds."""

from __future__ import annotations

import asyncio
import copy
import sys
from pathlib import Path

import pytest

from loongsage.core.config import load_config
from loongsage.core.controller import Controller, resolve_model_path
from loongsage.core.rollout import EngineRouter, RolloutService
from loongsage.core.rollout.replay import GroupRecorder
from loongsage.core.types import FinishReason, SamplingParams
from loongsage.core.workers import EngineWorker, RewardWorker

sys.path.insert(0, str(Path(__file__).parent / "engine"))
from _engine_helpers import build_engine_test_model, prompts  # noqa: E402

TOKENS = 64  # per sample: no stop token, so every sample runs this long
B = 2  # groups per batch; two samples each: an engine of four rows runs two groups at a time


def _perturbed(model_path: str) -> dict:
    """Version 1's weights: the model's, moved a little (the same for both services)."""
    import torch
    from transformers import AutoModelForCausalLM

    state = AutoModelForCausalLM.from_pretrained(model_path).state_dict()
    gen = torch.Generator().manual_seed(5)
    return {name: t + 0.05 * torch.randn(t.shape, generator=gen) for name, t in state.items()}


def _key(group):
    """Everything a trained group carries but the log-probs (compared to a tolerance: what shares an
    engine batch moves them in the last bits)."""
    return [
        (
            t.source,
            t.group_id,
            t.sample_index,
            t.prompt_ids,
            t.response_ids,
            t.versions,
            t.loss_mask,
            t.status,
            t.reward,
            t.metadata,
        )
        for t in group
    ]


def _same_logprobs(a, b):
    return all(x.rollout_logprobs == pytest.approx(y.rollout_logprobs, abs=1e-4) for x, y in zip(a, b))


def test_a_restored_rollout_goes_on_exactly_as_the_original(ray_session, in_tmp):
    import torch

    from loongsage.core.transport import CpuTransport

    ray = ray_session
    cfg, registry = load_config(
        "tiny/grpo_arith_cpu",
        [
            "run.name=resume",
            "colocate=false",
            "data_sources.0.prompts_per_step=2",
            "data_sources.0.samples_per_prompt=2",
            f"data_sources.0.sampling.max_new_tokens={TOKENS}",
            "rollout.scheduler={name: windowed_fifo, params: {max_staleness: 2}}",
            "rollout.engine={name: native, params: {max_model_len: 256, eos_token_ids: [], max_batch_size: 4}}",
        ],
    )
    model_path = resolve_model_path(cfg, registry)
    weights = _perturbed(model_path)
    reward = ray.remote(RewardWorker).options(num_cpus=0, max_concurrency=100).remote(cfg)

    def service():
        """A service as a run builds it, on a fresh engine at version 0."""
        ctl = Controller(cfg, registry)
        ctl._build_local(model_path)
        engine = ray.remote(EngineWorker).options(num_cpus=0, max_concurrency=100).remote(cfg, model_path, 0, 1)
        return RolloutService(
            router=EngineRouter([engine]), engines=[engine], reward=reward, **ctl._rollout_parts
        ), engine

    async def original():
        rollout, engine = service()
        first, _ = await rollout.next_batch(0)  # seqs 0 and 1; 2..5 were dispatched with them
        assert [g[0].group_id for g in first] == [0, 1]
        # the engine runs two groups at a time: once the second pair is done and the third pair is a
        # quarter through, hold decoding (so that the update surely finds it there) and update the
        # weights, as a run does after training a batch
        # (and the second pair scored into the buffer: on a loaded machine its reward can lag its tokens)
        while (await engine.health.remote())["generated_tokens"] < 2 * 2 * B * TOKENS + B * TOKENS or len(
            rollout.sources["arith"].buffer
        ) < 2:
            await asyncio.sleep(0.002)
        await engine.pause.remote()
        await rollout.begin_update()  # the abort is answered while the engine holds decoding
        await engine.resume.remote()
        assert CpuTransport().push(weights.items(), [engine])["sync/version"] == 1
        state, data = await rollout.snapshot()
        rollout.end_update(1)
        batches = [await rollout.next_batch(1) for _ in range(3)]
        await rollout.close()
        ray.kill(engine)
        return (
            state,
            data,
            [b for b, _ in batches],
            [m["rollout/resumed_samples"] for _, m in batches],
            rollout.router.resumed_samples,
        )

    state, data, later, resumed, continued = asyncio.run(original())
    # the four cut samples were continued once each, and each step reports those since the one before
    assert continued == 2 * B and sum(resumed) == continued, resumed
    saved = data["sources"]["arith"]
    assert sorted(seq for seq, _ in saved["buffer"]) == [2, 3]  # finished before the update, not yet trained
    cut = [(seq, calls) for seq, _, calls in saved["in_flight"]]
    assert [seq for seq, _ in cut] == [4, 5]
    for _, calls in cut:  # one call each (a single-turn agent), cut mid-generation
        (call,) = calls
        assert all(
            r.finish_reason is FinishReason.ABORT and 0 < len(r.output_ids) < TOKENS and set(r.versions) == {0}
            for r in call.results
        )
    assert state["next_group_id"] == 6 and state["consumed"] == 1

    # through a checkpoint file, as a resumed run reads it
    torch.save(data, in_tmp / "rollout.pt")
    data = torch.load(in_tmp / "rollout.pt", weights_only=False)

    async def restored():
        rollout, engine = service()
        assert CpuTransport().push(weights.items(), [engine])["sync/version"] == 1  # never held version 0
        rollout.restore({"version": 1, **state, "rollout": data})
        batches = [(await rollout.next_batch(1))[0] for _ in range(3)]
        await rollout.close()
        ray.kill(engine)
        return batches

    again = asyncio.run(restored())
    assert [[g[0].group_id for g in b] for b in later] == [[2, 3], [4, 5], [6, 7]]
    for before, after in zip(later, again):
        for g, h in zip(before, after):
            assert _key(g) == _key(h) and _same_logprobs(g, h)
    # the cut groups carry tokens of both versions: the old ones can only come from the snapshot
    for group in again[1]:
        for t in group:
            assert t.versions[0] == 0 and t.versions[-1] == 1 and len(t.response_ids) == TOKENS


def test_a_recorder_replays_a_multi_turn_group_and_continues_its_cut_turn(ray_session, tmp_path):
    """A two-turn agent, its second turn cut by a weight update: from the recorder's snapshot, a new
    router on a fresh engine answers the first turn from the log (the engine generates nothing for
    it) and continues the cut samples from their tokens, ending exactly as the original did."""
    import torch

    from loongsage.core.transport import CpuTransport

    ray = ray_session
    model = build_engine_test_model(tmp_path / "m")
    cfg, _ = load_config(
        "tiny/grpo_arith_cpu", ["rollout.engine={name: native, params: {max_model_len: 512, eos_token_ids: []}}"]
    )
    weights = _perturbed(model)
    worker = ray.remote(EngineWorker).options(num_cpus=0, max_concurrency=100)
    (prompt,) = prompts(1, seed=3)
    short, long = (SamplingParams(temperature=1.0, max_new_tokens=n, n=2, seed=11) for n in (8, 200))

    async def agent(engine):
        first = await engine.generate(prompt, short, session="g0")
        second = await engine.generate(prompt + first[0].output_ids + [5, 6], long, session="g0")
        engine.release_session("g0")
        return first, second

    async def original():
        engine = worker.remote(cfg, model, 0, 1)
        router = EngineRouter([engine])
        recorder = GroupRecorder(router)
        task = asyncio.create_task(agent(recorder))
        while (await engine.health.remote())["generated_tokens"] < 2 * 8 + 2 * 40:  # the second turn is going
            await asyncio.sleep(0.002)
        await engine.pause.remote()
        await router.pause_for_update()
        await engine.resume.remote()
        assert CpuTransport().push(weights.items(), [engine])["sync/version"] == 1
        await router.settled()
        saved = copy.deepcopy(recorder.snapshot())
        router.resume_after_update()
        results = await task
        ray.kill(engine)
        return saved, results

    saved, (first, second) = asyncio.run(original())
    assert [len(call.results) for call in saved] == [2, 2] and saved[0].finished and not saved[1].finished
    cut = [len(r.output_ids) for r in saved[1].results]
    assert all(0 < n < 200 for n in cut)

    async def restored():
        engine = worker.remote(cfg, model, 0, 1)
        assert CpuTransport().push(weights.items(), [engine])["sync/version"] == 1
        recorder = GroupRecorder(EngineRouter([engine]), saved)
        results = await agent(recorder)
        generated = (await engine.health.remote())["generated_tokens"]
        ray.kill(engine)
        return results, generated, recorder.replayed

    (first2, second2), generated, replayed = asyncio.run(restored())
    assert replayed == 2 and generated == sum(200 - n for n in cut)  # only the cut samples' rest
    assert [r.output_ids for r in first2] == [r.output_ids for r in first]
    for a, b in zip(second, second2):
        assert a.output_ids == b.output_ids and a.versions == b.versions and len(a.output_ids) == 200
        assert a.finish_reason is b.finish_reason is FinishReason.LENGTH
        assert a.versions[0] == 0 and a.versions[-1] == 1
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)
