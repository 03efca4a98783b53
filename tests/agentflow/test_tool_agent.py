"""``tool_agent`` end to end on real parts: the warm-started tiny model in the embedded engine, the
gateway on loopback, the official OpenAI client, the calculator; and the warm start's RL headroom.

The warm start is the ``tiny_tool_calc`` builder's default, cached in the session's model cache
(built there once, a few minutes on two cores, when missing).
"""

from __future__ import annotations

import asyncio
from collections import defaultdict

import pytest

from loongsage.agentflow.agents.tool_agent import ToolAgent
from loongsage.agentflow.gateway.local import contexts, evaluate, local_gateway
from loongsage.agentflow.tasks.tool_calc import ToolCalcReward, ToolCalcTask
from loongsage.agentflow.tasks.warmstart import ToolCalcWarmStartParams, cached_tool_calc_warm_start
from loongsage.core.rollout.agents import AgentContext
from loongsage.core.types import SamplingParams

pytestmark = pytest.mark.timeout(1200)


@pytest.fixture(scope="module")
def warm_start(model_cache) -> str:
    return str(cached_tool_calc_warm_start(ToolCalcWarmStartParams()))


class Recorder:
    """The gateway's engine client passed through, every call kept by session."""

    def __init__(self, inner):
        self.inner, self.calls = inner, defaultdict(list)

    async def generate(self, input_ids, sampling, session=None):
        results = await self.inner.generate(input_ids, sampling, session)
        self.calls[session].append((list(input_ids), sampling, results))
        return results

    def release_session(self, session):
        self.inner.release_session(session)


def _spans(mask: list[int]) -> list[tuple[int, int, int]]:
    """``(start, end, value)`` runs of equal mask values."""
    spans, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            spans.append((start, i, mask[start]))
            start = i
    return spans


def test_multi_turn_episodes_export_the_engines_exact_tokens(warm_start):
    records = [ToolCalcTask(split="test", size=12)[i] for i in range(12)]
    agent, reward = ToolAgent(max_turns=4), ToolCalcReward()
    sampling = SamplingParams(temperature=1.0, max_new_tokens=48, n=4)

    async def main():
        async with local_gateway(warm_start, engine_client=Recorder) as gateway:
            groups = await asyncio.gather(
                *(
                    agent.run(r, c)
                    for r, c in zip(records, contexts(gateway, sampling, list(range(len(records))), seed=7))
                )
            )
            return groups, gateway.service.engine.calls, gateway.service.renderer, gateway.service.store.sessions()

    groups, calls, renderer, still_open = asyncio.run(main())
    assert still_open == []  # every session was closed
    multi_turn = 0
    for gid, (record, group) in enumerate(zip(records, groups)):
        assert [t.sample_index for t in group] == [0, 1, 2, 3]
        for t in group:
            assert (t.source, t.group_id, t.metadata["record_index"]) == ("tool_calc", gid, record.index)
            session_calls = calls[f"tool_calc-g{gid}-s{t.sample_index}/0"]
            assert len(session_calls) == t.metadata["turns"] >= 1
            # the first prompt, then every turn's tokens exactly as the engine generated them
            assert t.prompt_ids == session_calls[0][0]
            sampled = [tok for tok, m in zip(t.response_ids, t.loss_mask) if m]
            assert sampled == [tok for _, _, (out,) in session_calls for tok in out.output_ids]
            assert [lp for lp, m in zip(t.rollout_logprobs, t.loss_mask) if m] == [
                lp for _, _, (out,) in session_calls for lp in out.logprobs
            ]
            assert all(v == -1 for v, m in zip(t.versions, t.loss_mask) if not m)
            assert all(lp == 0.0 for lp, m in zip(t.rollout_logprobs, t.loss_mask) if not m)
            # each later turn's prompt is everything so far: nothing was re-tokenized
            full = t.prompt_ids + t.response_ids
            for prompt, _, _ in session_calls[1:]:
                assert full[: len(prompt)] == prompt
            messages = t.metadata["messages"]
            results = [m["content"] for m in messages if m["role"] == "tool"]
            assert len(results) == t.metadata["tool_calls"]
            # the tool results are in the tokens, unmasked: what the model read, not what it wrote
            unmasked = [renderer.decode(t.response_ids[s:e]) for s, e, m in _spans(t.loss_mask) if m == 0]
            assert len(unmasked) == len(results) and len(_spans(t.loss_mask)) == 2 * len(results) + 1
            for text, result in zip(unmasked, results):
                assert f"<tool_response>\n{result}\n</tool_response>" in text
                assert text.endswith("<|im_start|>assistant\n")
            if results:
                multi_turn += 1
                first_reply = next(m for m in messages if m["role"] == "assistant")
                assert t.metadata["tool_used"] and first_reply["tool_calls"][0]["function"]["name"] == "calculator"
            score = reward(t, record)
            assert score in (0.0, 1.0)
            if t.metadata["ended"] == "answer" and results and results[-1] == record.label:
                assert score == float(record.label in messages[-1]["content"])
    assert multi_turn >= 8  # the warm start calls the calculator in about 40% of sampled episodes


def test_an_episode_out_of_turns_scores_zero(warm_start):
    records = [ToolCalcTask(split="test", size=6)[i] for i in range(6)]

    async def main():
        async with local_gateway(warm_start) as gateway:
            ctxs = contexts(gateway, SamplingParams(temperature=1.0, max_new_tokens=48, n=4), list(range(6)), 0)
            return await asyncio.gather(*(ToolAgent(max_turns=1).run(r, c) for r, c in zip(records, ctxs)))

    out_of_turns = 0
    for record, group in zip(records, asyncio.run(main())):
        for t in group:
            assert t.metadata["turns"] == 1
            if t.metadata["tool_calls"]:
                out_of_turns += 1
                assert t.metadata["ended"] == "max_turns" and ToolCalcReward()(t, record) == 0.0
    assert out_of_turns >= 1


def test_without_a_gateway_the_agent_says_what_to_configure():
    ctx = AgentContext(engine=None, tokenizer=None, sampling=SamplingParams(n=2), group_id=0)
    with pytest.raises(RuntimeError, match=r"agent 'tool_agent': no service 'gateway' in this run") as info:
        asyncio.run(ToolAgent().run(ToolCalcTask(size=1)[0], ctx))
    assert "\n" not in str(info.value)


def test_the_warm_start_leaves_rl_headroom(warm_start):
    """Greedy success on held-out questions is far below pass@8: the teacher taught the model to
    guess most of the time, greedy decoding guesses, and sampling still calls the tool often."""
    params = ToolCalcWarmStartParams()
    records = [params.task("test", 64)[i] for i in range(64)]

    async def main():
        async with local_gateway(warm_start) as gateway:
            return await evaluate(
                ToolAgent(tools=params.tools),
                ToolCalcReward(),
                records,
                gateway,
                SamplingParams(temperature=1.0, max_new_tokens=48),
                pass_k=8,
            )

    metrics = asyncio.run(main())
    assert metrics["accuracy"] <= 0.2 and metrics["tool_use_greedy"] <= 0.2, metrics
    assert metrics["pass@8"] >= metrics["accuracy"] + 0.4 and metrics["tool_use_sampled"] >= 0.25, metrics
