"""Contract tests of the ``sglang`` engine on CPU, against a stand-in server that speaks SGLang
0.5.16's HTTP API with its answer shapes and sharp edges (``sglang_contract_server.py``), started
by the engine through its real launch path as a subprocess. The proof against real SGLang is on a
GPU (tests/gpu); these pin down the engine's side of the protocol: token ids and log-probs in and
out, finish reasons, abort keeping partial output (also when the abort outruns its request), resume,
pause, update sequencing (checked names, versions, never flushing a busy cache), memory release,
and a server that dies or will not start."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import httpx
import pytest
import torch

from loongsage.core.types import FinishReason, GenerationRequest, SamplingParams
from loongsage.sglang.engine import SGLangEngine

sys.path.insert(0, str(Path(__file__).parents[1] / "core" / "engine"))
from _engine_helpers import EOS, build_engine_test_model  # noqa: E402

SERVER = str(Path(__file__).with_name("sglang_contract_server.py"))
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return build_engine_test_model(tmp_path_factory.mktemp("sglang") / "m")


def engine_for(model: str, *, token_delay: float = 0.002, **params) -> SGLangEngine:
    launch = [sys.executable, SERVER, "--token-delay", str(token_delay)]
    return SGLangEngine(model, dtype="float32", launch=launch, startup_timeout_s=60, **params)


@pytest.fixture
def engine(model):
    eng = engine_for(model)
    yield eng
    eng.close()


@pytest.fixture
def slow_engine(model):
    eng = engine_for(model, token_delay=0.02)
    yield eng
    eng.close()


def state(engine: SGLangEngine) -> dict:
    return httpx.get(engine.url + "/_contract/state", trust_env=False).json()


def request(rid: str, ids: list[int], **sampling) -> GenerationRequest:
    return GenerationRequest(rid, ids, SamplingParams(**sampling))


def test_generate_returns_token_ids_logprobs_versions_and_finish(engine):
    results = asyncio.run(engine.generate(request("a", [5, 6, 7], max_new_tokens=6, n=2)))
    assert len(results) == 2
    for r in results:
        assert r.request_id == "a" and len(r.output_ids) == len(r.logprobs) == len(r.versions)
        assert r.versions == [0] * len(r.output_ids)
        assert r.logprobs == pytest.approx([-0.5 - 0.001 * k for k in range(len(r.output_ids))])
        if r.finish_reason is FinishReason.STOP:  # the matched stop token is part of the output
            assert r.output_ids[-1] == EOS
        else:
            assert r.finish_reason is FinishReason.LENGTH and len(r.output_ids) == 6
    assert engine.health()["status"] == "ok" and state(engine)["generate"] == 2


def test_a_stop_token_id_ends_the_sample_and_stays_in_it(engine):
    first = asyncio.run(engine.generate(request("a", [5, 6, 7], max_new_tokens=6)))[0]
    stop = first.output_ids[2]
    r = asyncio.run(engine.generate(request("b", [5, 6, 7], max_new_tokens=6, stop_token_ids=[stop])))[0]
    assert r.finish_reason is FinishReason.STOP and r.output_ids == first.output_ids[:3]


def test_the_samples_of_one_turn_go_as_one_batch_each_answered_as_it_finishes(slow_engine):
    engine = slow_engine

    async def run():
        short = asyncio.ensure_future(engine.generate(request("s", [5], max_new_tokens=3, stop_token_ids=[])))
        long = asyncio.ensure_future(engine.generate(request("l", [6], max_new_tokens=60, n=3, stop_token_ids=[])))
        first = await short
        return first, long.done(), await long

    first, long_done_then, rest = asyncio.run(run())
    assert len(first[0].output_ids) == 3 and not long_done_then
    assert [len(r.output_ids) for r in rest] == [60] * 3 and len({tuple(r.logprobs) for r in rest}) == 1
    assert state(engine)["posts"] == 1 and state(engine)["generate"] == 4


def test_aborting_a_request_spares_those_whose_ids_it_prefixes(slow_engine):
    engine = slow_engine  # SGLang aborts every request whose id starts with the one named

    async def run():
        tasks = [
            asyncio.ensure_future(engine.generate(request(rid, [5], max_new_tokens=30, n=n, stop_token_ids=[])))
            for rid, n in (("a", 11), ("a#1", 1), ("a1", 1), ("a%", 1))
        ]
        await asyncio.sleep(0.2)
        aborted = await engine.abort(["a"])
        return aborted, await asyncio.gather(*tasks)

    aborted, (a, *others) = asyncio.run(run())
    assert len(aborted) == 11 and {r.finish_reason for r in a} == {FinishReason.ABORT}
    assert [(r[0].request_id, r[0].finish_reason, len(r[0].output_ids)) for r in others] == [
        ("a#1", FinishReason.LENGTH, 30),
        ("a1", FinishReason.LENGTH, 30),
        ("a%", FinishReason.LENGTH, 30),
    ]


def test_a_bad_request_fails_alone_with_the_servers_reason(engine):
    async def both():
        return await asyncio.gather(
            engine.generate(request("long", [5] * 400, max_new_tokens=200)),
            engine.generate(request("ok", [5, 6], max_new_tokens=3)),
            return_exceptions=True,
        )

    bad, good = asyncio.run(both())
    assert isinstance(bad, ValueError) and "request 'long': sglang refused it: Requested token count exceeds" in str(
        bad
    )
    assert len(good[0].output_ids) <= 3
    # sent together, the bad one ended the batch's stream: each went again alone
    assert state(engine)["posts"] == 3
    with pytest.raises(ValueError, match=r"request 'x': sampling.top_p=0: must be in \(0, 1\]"):
        asyncio.run(engine.generate(request("x", [5], top_p=0)))


def test_abort_keeps_partial_output_and_a_resumed_sample_continues_it(slow_engine):
    engine = slow_engine

    async def run():
        task = asyncio.ensure_future(engine.generate(request("r", [9], max_new_tokens=300, stop_token_ids=[])))
        await asyncio.sleep(0.4)
        aborted = await engine.abort(["r"])
        return aborted, await task

    aborted, answered = asyncio.run(run())
    assert [a.output_ids for a in aborted] == [a.output_ids for a in answered]
    cut = answered[0]
    assert cut.finish_reason is FinishReason.ABORT and 0 < len(cut.output_ids) < 300
    # the engine takes new weights, then the sample goes on from its tokens on them
    weights = {n: t + 0.5 for n, t in _weights(engine.model_path).items()}
    assert engine.update_weights(weights.items()) == 1
    budget = len(cut.output_ids) + 5
    resumed = asyncio.run(
        engine.generate(GenerationRequest("r2", [9], SamplingParams(max_new_tokens=budget), resume_from=cut))
    )[0]
    assert resumed.output_ids[: len(cut.output_ids)] == cut.output_ids and len(resumed.output_ids) <= budget
    assert resumed.versions == cut.versions + [1] * (len(resumed.output_ids) - len(cut.output_ids))
    assert resumed.logprobs[: len(cut.logprobs)] == cut.logprobs


def test_an_abort_that_outruns_its_request_is_sent_again_until_it_answers(slow_engine):
    engine = slow_engine

    async def run():
        task = asyncio.ensure_future(engine.generate(request("early", [9], max_new_tokens=500, stop_token_ids=[])))
        await asyncio.sleep(0)  # the request is registered, its POST not yet sent
        aborted = await engine.abort(None)
        return aborted, await task

    aborted, answered = asyncio.run(run())
    assert aborted[0].finish_reason is FinishReason.ABORT and len(aborted[0].output_ids) < 500
    assert state(engine)["abort_calls"] >= 1
    with pytest.raises(ValueError, match=r"abort: unknown request id\(s\) \['nope'\]"):
        asyncio.run(engine.abort(["nope"]))


def test_pause_holds_requests_and_an_update_meanwhile_never_flushes_a_busy_cache(slow_engine):
    engine = slow_engine

    async def run():
        task = asyncio.ensure_future(engine.generate(request("p", [9], max_new_tokens=30, stop_token_ids=[])))
        await asyncio.sleep(0.2)
        await asyncio.to_thread(engine.pause)
        held = len((await asyncio.to_thread(state, engine)) and engine._flights)
        # SGLang's default health check would generate a token: on a paused server it waits 20 s
        assert (await asyncio.to_thread(engine.health))["status"] == "paused"
        # an update while paused with a request held: SGLang would die flushing its busy cache
        version = await asyncio.to_thread(engine.update_weights, _weights(engine.model_path).items())
        await asyncio.sleep(0.3)
        assert not task.done()
        await asyncio.to_thread(engine.resume)
        return held, version, await task

    held, version, results = asyncio.run(run())
    assert held == 1 and version == 1 and len(results[0].output_ids) == 30
    # the tokens before and after the update are not told apart by the server: one version per answer
    assert set(results[0].versions) == {1}
    assert engine.health()["status"] == "ok" and state(engine)["paused"] is False


@pytest.fixture(params=[True, False], ids=["load_flat", "sglang_load_weights"])
def either_loader(model, request):
    eng = engine_for(model, fast_weight_load=request.param)
    yield eng
    eng.close()


def test_updates_land_change_the_outputs_and_a_bad_one_changes_nothing(either_loader):
    engine = either_loader
    before = asyncio.run(engine.generate(request("a", [5, 6], max_new_tokens=8, stop_token_ids=[])))[0]
    weights = _weights(engine.model_path)
    changed = {n: t * 1.5 for n, t in weights.items()}
    assert engine.update_weights(changed.items()) == 1
    # the float32 policy is served in bfloat16
    expected = float(sum(t.to(torch.bfloat16).double().sum() for n, t in changed.items()))
    assert state(engine)["checksum"] == pytest.approx(expected, rel=1e-9) and state(engine)["version"] == "1"
    assert state(engine)["custom_loads"] == (1 if engine.load_format else 0)
    after = asyncio.run(engine.generate(request("b", [5, 6], max_new_tokens=8, stop_token_ids=[])))[0]
    assert after.output_ids != before.output_ids and after.versions == [1] * 8
    for bad, match in [
        ({"nope.weight": torch.zeros(2)}, "unknown tensor 'nope.weight'"),
        ({"model.norm.weight": torch.zeros(3)}, r"'model.norm.weight' has shape \(3,\), the model expects"),
        (
            {"model.norm.weight": torch.zeros(64, dtype=torch.float16)},
            "is float16, the engine takes bfloat16 or float32",
        ),
    ]:
        with pytest.raises(ValueError, match=match):
            engine.update_weights(bad.items())
    assert engine.version == 1 and state(engine)["updates"] == 1
    engine.set_version(7)
    assert state(engine)["version"] == "7"
    assert asyncio.run(engine.generate(request("c", [5], max_new_tokens=2, stop_token_ids=[])))[0].versions == [7, 7]


def test_memory_release_is_refused_while_requests_run_and_generation_waits_for_resume(slow_engine):
    engine = slow_engine

    async def run():
        task = asyncio.ensure_future(engine.generate(request("m", [9], max_new_tokens=20, stop_token_ids=[])))
        await asyncio.sleep(0.2)
        with pytest.raises(RuntimeError, match=r"release_memory: 1 request\(s\) still waiting or running"):
            engine.release_memory()
        return await task

    asyncio.run(run())
    engine.release_memory()
    assert state(engine)["released"] is True and engine.health()["status"] == "released"
    with pytest.raises(RuntimeError, match="the engine's memory is released; call resume_memory"):
        asyncio.run(engine.generate(request("n", [9], max_new_tokens=2)))
    engine.resume_memory()
    assert len(asyncio.run(engine.generate(request("n", [9], max_new_tokens=2, stop_token_ids=[])))[0].output_ids) == 2


def test_a_dead_server_is_an_error_naming_its_log(slow_engine):
    engine = slow_engine

    async def run():
        task = asyncio.ensure_future(engine.generate(request("d", [9], max_new_tokens=200, stop_token_ids=[])))
        await asyncio.sleep(0.3)
        os.killpg(engine.server.pid, signal.SIGKILL)
        return await asyncio.gather(task, return_exceptions=True)

    (error,) = asyncio.run(run())
    assert isinstance(error, RuntimeError) and "POST /generate failed" in str(error) and "log " in str(error)
    with pytest.raises(
        RuntimeError, match=r"sglang server \(pid \d+\): .*exited with code -9; log .*loongsage-sglang-"
    ):
        engine.health()


def test_the_native_engines_sizing_carries_over(model):
    engine = engine_for(model, max_model_len=256, max_batch_size=8, device="cuda")
    try:  # no memory fraction: the KV pool holds max_batch_size full-length requests
        assert state(engine)["sizing"] == {"context_length": 256, "max_running_requests": 8, "max_total_tokens": 2048}
    finally:
        engine.close()
    with pytest.raises(ValueError, match=r"sglang engine: device='cpu': SGLang serves on CUDA GPUs only"):
        engine_for(model, device="cpu")


def test_a_server_that_will_not_start_names_the_exit_and_its_last_lines(model):
    with pytest.raises(
        RuntimeError, match=r"(?s)exited with code 2 before it was ready.*unrecognized arguments: --bogus"
    ):
        engine_for(model, server_args={"bogus": 1})


def _weights(model_path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {n: t for path in sorted(Path(model_path).glob("*.safetensors")) for n, t in load_file(str(path)).items()}


def test_routed_experts_come_back_for_every_token_fed_to_the_model(tmp_path, model):
    """R3 on SGLang: ``return_routed_experts`` starts the server capturing them and asks for them;
    each sample's come back as ``[tokens, layers, top-k]`` over its prompt and its output but the
    last token, alone or in a batch. A dense model is refused in one line."""
    sys.path[:0] = [str(Path(__file__).parents[1] / "megatron"), str(Path(__file__).parent)]
    from _moe_worker import EXPERTS, LAYERS, TOPK, build
    from sglang_contract_server import routes_of

    moe = build(tmp_path / "moe")
    eng = engine_for(moe, return_routed_experts=True)
    try:
        prompt = [5, 9, 11, 40]
        for n in (1, 2):
            for r in asyncio.run(eng.generate(request(f"r{n}", prompt, n=n, max_new_tokens=6))):
                assert r.output_ids
                fed = prompt + r.output_ids[:-1]
                assert r.routed_experts.shape == (len(fed), LAYERS, TOPK)
                assert r.routed_experts.tolist() == routes_of(fed, LAYERS, TOPK, EXPERTS)
    finally:
        eng.close()
    with pytest.raises(
        ValueError,
        match=r"^sglang engine: return_routed_experts=true needs a mixture-of-experts "
        r"model; .* \(Qwen3ForCausalLM\) has no experts$",
    ):
        engine_for(model, return_routed_experts=True)


class _NoServer:
    """Stands in for the server process: keeps its command line, starts nothing."""

    def __init__(self, launch, flags, *, env=None, name="sglang"):
        self.command, self.pid = [*launch, *flags], None

    def start(self) -> None:
        pass

    def wait_ready(self, url: str, timeout_s: float) -> float:
        return 0.0

    def stop(self) -> None:
        pass


def test_numerics_options_become_server_flags_and_bad_values_fail_in_one_line(model, monkeypatch):
    """``attention_backend`` and ``rl_on_policy_target`` reach SGLang as its flags; an on-policy
    server is deterministic, so every sample carries its seed (a deterministic server seeds one
    sent without with 42: the samples of a prompt would all be one). Bad values, and a backend
    that SGLang's deterministic inference refuses, fail before any server starts."""
    import loongsage.sglang.engine as engine_module

    monkeypatch.setattr(engine_module, "ServerProcess", _NoServer)
    eng = SGLangEngine(model, attention_backend="triton", rl_on_policy_target="fsdp")
    command = eng.server.command
    assert command[command.index("--attention-backend") + 1] == "triton"
    assert command[command.index("--rl-on-policy-target") + 1] == "fsdp"
    assert "--enable-deterministic-inference" in command and eng.deterministic
    seeds = [
        eng._body([5, 6], request("r", [5, 6], n=2, seed=7), 4, k)["sampling_params"]["sampling_seed"] for k in (0, 1)
    ]
    assert seeds == [7, 8]
    plain = SGLangEngine(model)
    assert not plain.deterministic
    assert not {"--attention-backend", "--rl-on-policy-target", "--enable-deterministic-inference"} & set(
        plain.server.command
    )
    assert "sampling_seed" not in plain._body([5, 6], request("r", [5, 6], seed=7), 4, 0)["sampling_params"]
    # a server made deterministic through server_args is one too
    assert SGLangEngine(model, server_args={"enable_deterministic_inference": True}).deterministic
    for params, match in (
        (
            {"attention_backend": "fa2"},
            r"^sglang engine: attention_backend='fa2': must be one of triton, torch_native, .*, intel_xpu "
            r"\(SGLang 0\.5\.16\), or null for SGLang's choice$",
        ),
        (
            {"rl_on_policy_target": "megatron"},
            r"^sglang engine: rl_on_policy_target='megatron': must be one of fsdp, or null$",
        ),
        (
            {"rl_on_policy_target": "fsdp", "attention_backend": "torch_native"},
            r"^sglang engine: attention_backend='torch_native': a deterministic server \(deterministic or "
            r"rl_on_policy_target\) takes only fa3, fa4, flashinfer, triton, ascend$",
        ),
        (
            {"deterministic": True, "server_args": {"attention_backend": "flex_attention"}},
            r"^sglang engine: attention_backend='flex_attention': a deterministic server",
        ),
    ):
        with pytest.raises(ValueError, match=match):
            SGLangEngine(model, **params)
