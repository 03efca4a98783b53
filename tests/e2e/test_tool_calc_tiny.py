"""``tiny/tool_calc_cpu`` through the launcher and Ray, CI-sized: multi-turn tool calling trained
through the gateway.

Each episode is the ``tool_agent`` talking to its own gateway session with the official ``openai``
client, running the calculator on the model's calls and sending the results back; the trainer
gets the gateway's token lines. Checked: the episodes were multi-turn (later turns appended to the
session's tokens, never re-tokenized), the trainer's log-probs of the sampled tokens equal the
engine's (the same tokens, the tool results masked out of the loss), and the warm start gives GRPO
a learning signal (rewards differ within groups, so there is a gradient). Whether success rises by
30 points is the full recipe's result (docs/agentflow.md), not a CI test.
"""

from __future__ import annotations

import json

import pytest

from loongsage.core.cli import main

pytestmark = pytest.mark.timeout(1500)  # the first test to need the warm start builds it (minutes)


def test_tool_calc_recipe_trains_through_the_gateway(ray_session, in_tmp):
    args = [
        "train",
        "tiny/tool_calc_cpu",
        "run.name=tool_calc",
        "run.total_steps=2",
        "data_sources.0.prompts_per_step=4",
        "data_sources.0.samples_per_prompt=4",
        "evaluation.every_steps=0",
        "evaluation.max_prompts=8",
        "evaluation.pass_k=4",
        "tracking.progress=false",
        "checkpoint.every_steps=0",
        "checkpoint.export_hf=false",
    ]
    assert main(args) == 0
    rows = [json.loads(line) for line in (in_tmp / "runs" / "tool_calc" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in trained] == [1, 2]
    for r in trained:
        assert r["rollout/trajectories"] == 16
        # token-in, token-out: the trainer scores exactly the tokens the engine sampled, in the same
        # context (tool results included, as prompt tokens); on one CPU the two agree to rounding
        assert r["train/is_logprob_abs_diff"] < 1e-4 and abs(r["train/is_approx_k3_kl"]) < 1e-6, r
    last = rows[-1]
    # episodes called the tool and came back with its result: later turns appended to their line
    assert last["agentflow/turns_appended"] > 0 and last["agentflow/turns"] > last["agentflow/turns_appended"]
    assert not any(k.startswith("agentflow/segments/") and not k.endswith("/first") and last[k] for k in last), last
    # the warm start samples the tool often enough that some episodes succeed and some fail
    assert any(0 < r["rollout/reward_mean"] < 1 for r in trained) and any(r["train/grad_norm"] > 0 for r in trained)
    evals = [r for r in rows if "eval/tool_calc/accuracy" in r]
    assert evals and all(r["eval/tool_calc/pass@4"] >= r["eval/tool_calc/accuracy"] for r in evals)
