"""On a CUDA GPU with SGLang installed: the ``sglang`` engine against a real SGLang server.

Run on a GPU machine with ``LOONGSAGE_RUN_GPU=1 pytest tests/gpu -m gpu``. A Qwen3-shaped model with
random bf16 weights is built in place; one server serves every test of the module (start-up is the
slow part). Checked: token ids with the raw policy's log-probs close to the trainer's, abort keeping
partial output and the resumed sample continuing it, pause with a weight update in between, weight
updates landing (the server's tensors equal the pushed ones) and a bad one refused with the version
kept, memory release and resume with the weights intact, and a killed server reported with its log.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import httpx
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
pytest.importorskip("sglang")

from loongsage.core.types import FinishReason, GenerationRequest, SamplingParams  # noqa: E402
from loongsage.sglang.engine import SGLangEngine  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(qwen3_1024_dir):
    return qwen3_1024_dir


@pytest.fixture(scope="module")
def engine(model_dir):
    eng = SGLangEngine(model_dir, dtype="bfloat16", fp32_lm_head=True, seed=1, mem_fraction_static=0.3,
                       cuda_graphs=False, context_length=1024)
    yield eng
    eng.close()


def weights(model_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {n: t.cuda() for p in sorted(Path(model_dir).glob("*.safetensors")) for n, t in load_file(str(p)).items()}


def served(engine: SGLangEngine, name: str, size: int = 64) -> torch.Tensor:
    answer = httpx.post(engine.url + "/get_weights_by_name", json={"name": name, "truncate_size": size},
                        timeout=60, trust_env=False).json()
    return torch.tensor(answer, dtype=torch.float32).flatten()


def run(coro):
    return asyncio.run(coro)


def test_tokens_and_logprobs_agree_with_the_trainer(engine, model_dir):
    from loongsage.core.embedded.trainer import TorchTrainer
    from loongsage.core.types import TrainBatch

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 32000, (64,), generator=g).tolist() for _ in range(16)]

    async def sample():
        return await asyncio.gather(*(engine.generate(GenerationRequest(
            f"c{i}", p, SamplingParams(temperature=1.0, max_new_tokens=64, stop_token_ids=[]))) for i, p in enumerate(prompts)))

    results = [r[0] for r in run(sample())]
    assert all(r.finish_reason is FinishReason.LENGTH and len(r.output_ids) == 64 for r in results)
    trainer = TorchTrainer(model_dir, dtype="bfloat16", device="cuda", fp32_lm_head=True)
    ids = torch.tensor([p + r.output_ids for p, r in zip(prompts, results)])
    mask = torch.zeros(ids.shape)
    mask[:, 64:] = 1
    batch = TrainBatch(input_ids=ids, attention_mask=torch.ones_like(ids), response_mask=mask,
                       rollout_logprobs=torch.zeros(ids.shape), advantages=torch.zeros(ids.shape),
                       rewards=torch.zeros(16), group_ids=torch.arange(16))
    lp, _ = trainer.logprobs(batch, token_budget=16 * 128)
    delta = (lp[:, 64:] - torch.tensor([r.logprobs for r in results])).double()
    k3 = (torch.exp(delta) - delta - 1).mean().item()
    print(f"sglang vs trainer: k3 {k3:.3e}, mean |d| {delta.abs().mean().item():.3e}")
    # the raw policy's log-probs (temperature not folded in), within bf16 rounding of the trainer's
    assert k3 <= 1e-4 and delta.abs().mean().item() <= 2e-2, (k3, delta.abs().mean().item())


def test_abort_keeps_partial_output_and_resume_continues_it(engine):
    async def cut():
        task = asyncio.ensure_future(engine.generate(GenerationRequest(
            "a", [5, 6, 7], SamplingParams(max_new_tokens=900, stop_token_ids=[]))))
        await asyncio.sleep(0.5)
        aborted = await engine.abort(["a"])
        return aborted, await task

    aborted, answered = run(cut())
    sample = answered[0]
    assert sample.finish_reason is FinishReason.ABORT and 0 < len(sample.output_ids) < 900
    assert aborted[0].output_ids == sample.output_ids
    more = run(engine.generate(GenerationRequest("a2", [5, 6, 7], SamplingParams(max_new_tokens=len(sample.output_ids) + 8,
                                                                                  stop_token_ids=[]), resume_from=sample)))[0]
    assert more.output_ids[:len(sample.output_ids)] == sample.output_ids
    assert len(more.output_ids) == len(sample.output_ids) + 8 and more.finish_reason is FinishReason.LENGTH


def test_updates_land_a_bad_one_changes_nothing_and_pause_holds_requests(engine, model_dir):
    pushed = {n: (t.float() * 1.01).to(t.dtype) for n, t in weights(model_dir).items()}
    version = engine.update_weights(pushed.items())
    assert version == engine.version and torch.equal(served(engine, "model.norm.weight"),
                                                      pushed["model.norm.weight"][:64].float())
    with pytest.raises(ValueError, match="has shape"):
        engine.update_weights([("model.norm.weight", torch.zeros(3, dtype=torch.bfloat16, device="cuda"))])
    assert engine.version == version

    async def paused_update():
        task = asyncio.ensure_future(engine.generate(GenerationRequest(
            "p", [9, 10], SamplingParams(max_new_tokens=400, stop_token_ids=[]))))
        await asyncio.sleep(0.3)
        await asyncio.to_thread(engine.pause)
        again = await asyncio.to_thread(engine.update_weights, pushed.items())
        await asyncio.sleep(0.3)
        held = not task.done()
        await asyncio.to_thread(engine.resume)
        return again, held, await task

    again, held, results = run(paused_update())
    assert again == version + 1 and held and len(results[0].output_ids) == 400
    assert engine.health()["status"] == "ok"


def test_memory_release_and_resume_keep_the_weights(engine):
    before = served(engine, "model.layers.0.mlp.down_proj.weight")
    engine.release_memory()
    assert engine.health()["status"] == "released"
    engine.resume_memory()
    assert torch.equal(served(engine, "model.layers.0.mlp.down_proj.weight"), before)
    out = run(engine.generate(GenerationRequest("m", [5, 6], SamplingParams(max_new_tokens=8, stop_token_ids=[]))))
    assert len(out[0].output_ids) == 8


def test_a_killed_server_is_reported_with_its_log(model_dir):
    eng = SGLangEngine(model_dir, dtype="bfloat16", mem_fraction_static=0.2, cuda_graphs=False, release_tags=[])
    try:
        os.killpg(eng.server.pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match=r"sglang server \(pid \d+\): exited with code -9; log "):
            eng.health()
    finally:
        eng.close()
