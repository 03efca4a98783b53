"""The engine router over real engine replicas (Ray actors): least-loaded, sticky per session."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from loongsage.core.config import load_config
from loongsage.core.rollout import EngineRouter
from loongsage.core.types import SamplingParams
from loongsage.core.workers import EngineWorker

sys.path.insert(0, str(Path(__file__).parent / "embedded"))
from _engine_helpers import build_engine_test_model, prompts  # noqa: E402


def test_router_balances_replicas_and_keeps_a_session_on_one(ray_session, tmp_path):
    ray = ray_session
    model = build_engine_test_model(tmp_path / "m")
    cfg, _ = load_config("tiny/grpo_arith_cpu",
                         ["rollout.engine={name: native, params: {max_model_len: 128, eos_token_ids: []}}"])
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
        busy = [asyncio.create_task(router.generate(p, SamplingParams(temperature=0, max_new_tokens=60)))
                for p in prompts(3, seed=62)]
        await asyncio.sleep(0)
        while router.in_flight[home] <= router.in_flight[1 - home]:  # load the session's replica most
            busy.append(asyncio.create_task(router.generate(prompts(1, seed=len(busy) + 70)[0], greedy,
                                                            session=f"filler{len(busy)}")))
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

    from loongsage.core.embedded.transport import CpuTransport

    ray = ray_session
    model = build_engine_test_model(tmp_path / "m")
    cfg, _ = load_config("tiny/grpo_arith_cpu",
                         ["rollout.engine={name: native, params: {max_model_len: 512, eos_token_ids: []}}"])
    engine = ray.remote(EngineWorker).options(num_cpus=0, max_concurrency=100).remote(cfg, model, 0, 1)
    router = EngineRouter([engine])
    from transformers import AutoModelForCausalLM

    weights = {n: t + 0.05 * torch.randn(t.shape, generator=torch.Generator().manual_seed(3))
               for n, t in AutoModelForCausalLM.from_pretrained(model).state_dict().items()}
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
    ray.kill(engine)
