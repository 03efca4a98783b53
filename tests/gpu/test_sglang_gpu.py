"""On a CUDA GPU with SGLang installed: the ``sglang`` engine against a real SGLang server.

Run on a GPU machine with ``LOONGSAGE_RUN_GPU=1 pytest tests/gpu -m gpu``. A Qwen3-shaped model with
random bf16 weights is built in place; one server serves every test of the module (start-up is the
slow part). Checked: token ids with the raw policy's log-probs close to the trainer's, abort keeping
partial output and the resumed sample continuing it, the trainer's exported weights landing (SGLang
shows no Qwen3 tensor, so: the samples after an update agree with the moved trainer, those from
before do not), a bad update refused with the version kept, pause with an update in between, memory
release and resume with the weights intact (greedy output unchanged), and a killed server reported
with its log.
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
pytest.importorskip("sglang.srt")  # the real package: tests/sglang would pass for a namespace "sglang"

from _bench import bench_module  # noqa: E402

from loongsage.core.buckets import without_aliases  # noqa: E402
from loongsage.core.types import FinishReason, GenerationRequest, SamplingParams  # noqa: E402
from loongsage.sglang.engine import SGLangEngine  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(qwen3_1024_dir):
    return qwen3_1024_dir


@pytest.fixture(scope="module")
def engine(model_dir):
    eng = SGLangEngine(
        model_dir,
        dtype="bfloat16",
        fp32_lm_head=True,
        seed=1,
        mem_fraction_static=0.3,
        cuda_graphs=False,
        max_model_len=1024,
    )
    yield eng
    eng.close()


def run(coro):
    return asyncio.run(coro)


def sample(engine: SGLangEngine, prompts: list[list[int]], new_tokens: int, tag: str) -> list:
    async def all_of_them():
        return await asyncio.gather(
            *(
                engine.generate(
                    GenerationRequest(
                        f"{tag}{i}", p, SamplingParams(temperature=1.0, max_new_tokens=new_tokens, stop_token_ids=[])
                    )
                )
                for i, p in enumerate(prompts)
            )
        )

    return [r[0] for r in run(all_of_them())]


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 32000, (length,), generator=g).tolist() for _ in range(n)]


def k3_against(trainer, prompts: list[list[int]], results: list) -> tuple[float, float]:
    """k3 KL and mean |delta| between the engine's log-probs of its samples and the trainer's."""
    measured = bench_module("sglang_overhead").k3_against(trainer, prompts, results)
    return measured["k3_kl"], measured["mean_abs_logprob_diff"]


@pytest.fixture(scope="module")
def trainer(model_dir):
    from loongsage.core.trainer.torch_trainer import TorchTrainer

    return TorchTrainer(model_dir, dtype="bfloat16", device="cuda", fp32_lm_head=True)


def test_tokens_and_logprobs_agree_with_the_trainer(engine, trainer):
    asked = prompts(16, 64, seed=3)
    results = sample(engine, asked, 64, "c")
    assert all(r.finish_reason is FinishReason.LENGTH and len(r.output_ids) == 64 for r in results)
    k3, mean_abs = k3_against(trainer, asked, results)
    print(f"sglang vs trainer: k3 {k3:.3e}, mean |d| {mean_abs:.3e}")
    # the raw policy's log-probs (temperature not folded in), within bf16 rounding of the trainer's
    assert k3 <= 1e-4 and mean_abs <= 2e-2, (k3, mean_abs)


def test_abort_keeps_partial_output_and_resume_continues_it(engine):
    async def cut():
        task = asyncio.ensure_future(
            engine.generate(GenerationRequest("a", [5, 6, 7], SamplingParams(max_new_tokens=900, stop_token_ids=[])))
        )
        await asyncio.sleep(0.5)
        aborted = await engine.abort(["a"])
        return aborted, await task

    aborted, answered = run(cut())
    partial = answered[0]
    assert partial.finish_reason is FinishReason.ABORT and 0 < len(partial.output_ids) < 900
    assert aborted[0].output_ids == partial.output_ids
    n = len(partial.output_ids)
    more = run(
        engine.generate(
            GenerationRequest(
                "a2", [5, 6, 7], SamplingParams(max_new_tokens=n + 8, stop_token_ids=[]), resume_from=partial
            )
        )
    )[0]
    assert more.output_ids[:n] == partial.output_ids
    assert len(more.output_ids) == n + 8 and more.finish_reason is FinishReason.LENGTH


def test_the_trainers_weights_land_a_bad_update_changes_nothing_and_pause_holds_requests(engine, trainer):
    asked = prompts(16, 32, seed=4)
    before = sample(engine, asked, 32, "u")
    with torch.no_grad():  # the trainer moves far from the served weights
        g = torch.Generator(device="cuda").manual_seed(5)
        for param in trainer.model.parameters():
            param.mul_(1 + 0.5 * torch.randn(param.shape, generator=g, device="cuda", dtype=param.dtype))
    version = engine.update_weights(without_aliases(trainer.export_weights()))
    assert version == engine.version
    after = sample(engine, asked, 32, "v")
    stale, _ = k3_against(trainer, asked, before)
    fresh, mean_abs = k3_against(trainer, asked, after)
    print(f"after an update: k3 {fresh:.3e} (mean |d| {mean_abs:.3e}); the samples from before it: k3 {stale:.3e}")
    # (the moved policy is sharper: its bf16 rounding shows more than at the start)
    assert fresh <= 1e-3 and stale >= 100 * max(fresh, 1e-6), (fresh, stale)
    with pytest.raises(ValueError, match="has shape"):
        engine.update_weights([("model.norm.weight", torch.zeros(3, dtype=torch.bfloat16, device="cuda"))])
    assert engine.version == version

    async def paused_update():
        task = asyncio.ensure_future(
            engine.generate(GenerationRequest("p", [9, 10], SamplingParams(max_new_tokens=400, stop_token_ids=[])))
        )
        await asyncio.sleep(0.3)
        await asyncio.to_thread(engine.pause)
        again = await asyncio.to_thread(engine.update_weights, list(without_aliases(trainer.export_weights())))
        await asyncio.sleep(0.3)
        held = not task.done()
        await asyncio.to_thread(engine.resume)
        return again, held, await task

    again, held, results = run(paused_update())
    assert again == version + 1 and held and len(results[0].output_ids) == 400
    assert engine.health()["status"] == "ok"


def test_memory_release_and_resume_keep_the_weights(engine):
    def greedy(tag: str):
        return run(
            engine.generate(
                GenerationRequest(
                    tag, [5, 6, 7, 8], SamplingParams(temperature=0.0, max_new_tokens=48, stop_token_ids=[])
                )
            )
        )[0]

    before = greedy("m0")
    engine.release_memory()
    assert engine.health()["status"] == "released"
    engine.resume_memory()
    after = greedy("m1")
    assert after.output_ids == before.output_ids
    assert max(abs(a - b) for a, b in zip(after.logprobs, before.logprobs)) <= 1e-3


def test_a_killed_server_is_reported_with_its_log(model_dir):
    eng = SGLangEngine(model_dir, dtype="bfloat16", mem_fraction_static=0.2, cuda_graphs=False, release_tags=[])
    try:
        os.killpg(eng.server.pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match=r"sglang server \(pid \d+\): .*exited with code -9; log "):
            eng.health()
    finally:
        eng.close()
