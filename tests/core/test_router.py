"""The engine router over real engine replicas (Ray actors): least-loaded, sticky per session."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from loongsage.core.config import load_config
from loongsage.core.rollout import EngineRouter
from loongsage.core.rollout.service import mask_old_versions
from loongsage.core.types import SamplingParams, Trajectory
from loongsage.core.workers import EngineWorker

sys.path.insert(0, str(Path(__file__).parent / "engine"))
from _engine_helpers import build_engine_test_model, prompts  # noqa: E402


def test_router_balances_replicas_and_keeps_a_session_on_one(ray_session, tmp_path):
    ray = ray_session
    model = build_engine_test_model(tmp_path / "m")
    cfg, _ = load_config(
        "tiny/grpo_arith_cpu", ["rollout.engine={name: native, params: {max_model_len: 128, eos_token_ids: []}}"]
    )
    worker = ray.remote(EngineWorker)
    engines = [worker.options(num_cpus=0, max_concurrency=100).remote(cfg, model, i, 1) for i in range(2)]
    router = EngineRouter(engines)
    greedy = SamplingParams(temperature=0, max_new_tokens=6)

    async def main():
        # Sixteen independent requests in one tick: split evenly, one actor call per replica.
        await asyncio.gather(*(router.generate(p, greedy) for p in prompts(16, seed=60)))
        balanced = ray.get([e.health.remote() for e in engines])
        # A session's first turn lands on some replica; its later turns follow it there even when
        # that replica is the busier one, and reuse its prefix cache.
        (first_prompt,) = prompts(1, seed=61)
        (turn1,) = await router.generate(first_prompt, greedy, session="s")
        home = router.pick("s")
        busy = [
            asyncio.create_task(router.generate(p, SamplingParams(temperature=0, max_new_tokens=60)))
            for p in prompts(3, seed=62)
        ]
        await asyncio.sleep(0)
        while router.in_flight[home] <= router.in_flight[1 - home]:  # load the session's replica most
            busy.append(
                asyncio.create_task(
                    router.generate(prompts(1, seed=len(busy) + 70)[0], greedy, session=f"filler{len(busy)}")
                )
            )
            router._sticky[f"filler{len(busy) - 1}"] = home
            await asyncio.sleep(0)
        assert router.pick("s") == home and router.pick() == 1 - home
        second_prompt = first_prompt + turn1.output_ids + [5, 6, 7]
        (turn2,) = await router.generate(second_prompt, greedy, session="s")
        await asyncio.gather(*busy)
        router.release_session("s")
        return balanced, home, second_prompt

    balanced, home, second_prompt = asyncio.run(main())
    assert [h["prefill_rows"] for h in balanced] == [8, 8]
    after = ray.get([e.health.remote() for e in engines])
    assert after[home]["prefix_hit_tokens"] >= len(second_prompt) - 4
    assert after[1 - home]["prefix_hit_tokens"] == 0
    assert "s" not in router._sticky and router.in_flight == [0, 0]
    for e in engines:
        ray.kill(e)


def test_a_weight_update_cuts_generations_that_then_continue_from_their_tokens(ray_session, tmp_path):
    """Partial rollout: samples in flight at an update keep their tokens (old version) and go on
    with the new weights (new version) up to the same budget; the caller sees one result each."""
    import torch

    from loongsage.core.transport import CpuTransport

    ray = ray_session
    model = build_engine_test_model(tmp_path / "m")
    cfg, _ = load_config(
        "tiny/grpo_arith_cpu", ["rollout.engine={name: native, params: {max_model_len: 512, eos_token_ids: []}}"]
    )
    engine = ray.remote(EngineWorker).options(num_cpus=0, max_concurrency=100).remote(cfg, model, 0, 1)
    router = EngineRouter([engine])
    from transformers import AutoModelForCausalLM

    weights = {
        n: t + 0.05 * torch.randn(t.shape, generator=torch.Generator().manual_seed(3))
        for n, t in AutoModelForCausalLM.from_pretrained(model).state_dict().items()
    }
    budget = 300

    async def main():
        sampling = SamplingParams(temperature=1.0, max_new_tokens=budget, n=2, seed=7)
        task = asyncio.create_task(router.generate(prompts(1, seed=80)[0], sampling))
        while ray.get(engine.health.remote())["generated_tokens"] < 20:
            await asyncio.sleep(0.01)
        await router.pause_for_update()
        held = asyncio.create_task(router.generate(prompts(1, seed=81)[0], SamplingParams(max_new_tokens=4)))
        await asyncio.sleep(0.2)
        assert not held.done()  # nothing new starts while the update holds generation
        assert CpuTransport().push(weights.items(), [engine])["sync/version"] == 1
        router.resume_after_update()
        return await task, await held

    results, (after,) = asyncio.run(main())
    assert router.updates == 1 and router.resumed_samples == 2
    for r in results:
        assert r.finish_reason.value == "length" and len(r.output_ids) == budget == len(r.logprobs)
        assert r.versions[0] == 0 and r.versions[-1] == 1 and r.versions == sorted(r.versions)
        assert 0 < r.versions.count(0) < budget
    assert after.versions == [1] * 4
    # rollout.mask_old_tokens: such a sample trains only on its tokens of the newest version
    for k, r in enumerate(results):
        t = Trajectory(
            source="s",
            group_id=0,
            sample_index=k,
            prompt_ids=[1],
            response_ids=list(r.output_ids),
            loss_mask=[1] * budget,
            rollout_logprobs=list(r.logprobs),
            versions=list(r.versions),
        )
        assert mask_old_versions(t) == r.versions.count(0)
        assert t.loss_mask == [int(v == 1) for v in r.versions]
    ray.kill(engine)


def test_a_lost_engine_is_replaced_and_its_requests_sampled_again(ray_session, tmp_path):
    """Failover over real replicas: one engine is killed (SIGKILL) while it generates, then the other
    one freezes (SIGSTOP: alive to Ray, answering nothing). Each time the requests it held go again,
    with their seeds, to a replacement started in its place, and every caller gets exactly the
    tokens an undisturbed round samples; once the restarts allowed are spent, a loss fails the
    callers with one line naming the setting."""
    import os
    import signal

    from loongsage.core.rollout.recovery import EngineRecovery

    ray = ray_session
    model = build_engine_test_model(tmp_path / "m")
    cfg, _ = load_config(
        "tiny/grpo_arith_cpu", ["rollout.engine={name: native, params: {max_model_len: 512, eos_token_ids: []}}"]
    )
    worker = ray.remote(EngineWorker).options(num_cpus=0, max_concurrency=100)
    engines = [worker.remote(cfg, model, i, 1) for i in range(2)]
    router = EngineRouter(engines, health_timeout_s=4)
    started, errors = [], []

    def restart(index, lost):  # what the controller does: the old actor killed, a new one, same arguments
        ray.kill(lost)
        engine = worker.remote(cfg, model, index, 1)
        ray.get(engine.version.remote())
        started.append(engine)
        return engine

    EngineRecovery(
        router,
        restart=restart,
        load=lambda engine, version: ray.get(engine.set_version.remote(version)),
        max_restarts=2,
        on_error=errors.append,
    )
    batch = prompts(6, seed=90)
    sampling = [SamplingParams(temperature=1.0, max_new_tokens=100, n=2, seed=100 + k) for k in range(6)]

    async def round_(victim: int | None = None, sig: int = signal.SIGKILL):
        """Every request at once (three per engine); ``victim`` gets ``sig`` once it is generating."""
        for e in router.engines:  # each round computes as on fresh engines
            await e.flush_cache.remote()
        target = router.engines[victim] if victim is not None else None
        target_pid = await target.__ray_call__.remote(lambda self: os.getpid()) if target is not None else None
        before = (await target.health.remote())["generated_tokens"] if target is not None else 0
        task = asyncio.gather(*(router.generate(p, s) for p, s in zip(batch, sampling)))
        if target is not None:
            while (await target.health.remote())["generated_tokens"] < before + 20:
                await asyncio.sleep(0.01)
            os.kill(target_pid, sig)
        results = await task
        for _ in range(600):  # the lost engine's requests may have finished on the other one first
            if not router.down or errors:
                break
            await asyncio.sleep(0.1)
        return results

    async def gone(pid: int) -> bool:
        """Whether ``pid`` exits within 30 s: ``ray.kill`` asks the raylet, which kills and reaps it later."""
        for _ in range(300):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
            await asyncio.sleep(0.1)
        return False

    def same_tokens(results, reference):
        return [[r.output_ids for r in rs] for rs in results] == [[r.output_ids for r in rs] for rs in reference]

    async def main():  # one event loop for the router's whole life
        undisturbed = await round_()
        assert router.in_flight == [0, 0] and router.requests_redispatched == 0
        for results in undisturbed:
            assert [len(r.output_ids) for r in results] == [100, 100] and results[0].output_ids != results[1].output_ids

        killed = await round_(victim=1)
        assert router.engine_restarts == 1 and router.requests_redispatched == 3  # engine 1 held three
        assert router.engines[1] is started[0] and router.engines[0] is engines[0] and not router.down
        assert same_tokens(killed, undisturbed)
        for rs, ref in zip(killed, undisturbed):
            for r, r0 in zip(rs, ref):
                assert r.versions == r0.versions and r.logprobs == pytest.approx(r0.logprobs, abs=1e-5)

        frozen_pid = await router.engines[0].__ray_call__.remote(lambda self: os.getpid())
        frozen = await round_(victim=0, sig=signal.SIGSTOP)  # no error: silence, then no answer to a probe
        assert router.engine_restarts == 2 and router.requests_redispatched == 6
        assert router.engines[0] is started[1] and same_tokens(frozen, undisturbed)
        assert await gone(frozen_pid)  # the frozen actor was killed, freeing its bundle

        with pytest.raises(RuntimeError, match=r"rollout.max_engine_restarts=2 replacement\(s\) were made already"):
            await round_(victim=1)
        assert len(started) == 2 and errors and 1 in router.down

    asyncio.run(main())
    for e in router.engines:
        ray.kill(e)
