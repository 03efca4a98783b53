"""The chat gateway as a run-scoped service, end to end through the launcher and Ray.

The ``chat`` agent reaches the policy only through the gateway's OpenAI endpoint (the official
``openai`` client over loopback HTTP); the gateway renders the model's own chat template and calls
the engine router with token ids. So the same recipe with the built-in ``single_turn`` agent (token
ids straight to the engine) must train on exactly the same tokens: every metric equal, step by step.
An asynchronous run through the gateway (turns cut at weight updates and continued) trains too.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loongsage.core.cli import main
from tests.e2e.test_sync_regression import ARGS as GOLDEN

COMMON = [
    "data_sources.0.prompts_per_step=4",
    "data_sources.0.samples_per_prompt=4",
    "run.total_steps=3",
    "evaluation.every_steps=0",
    "evaluation.max_prompts=8",
    "evaluation.pass_k=0",
    "tracking.progress=false",
    "checkpoint.export_hf=false",
]
GATEWAY = ["data_sources.0.agent={name: chat}", "+services=[{name: gateway, params: {chat_template: tokenizer}}]"]
COMPARED = (
    "rollout/reward_mean",
    "rollout/response_length_mean",
    "rollout/truncated_frac",
    "train/loss",
    "train/grad_norm",
    "train/entropy",
    "eval/arith/accuracy",
)


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_chat_agent_through_the_gateway_trains_on_the_same_tokens_as_token_ids(launched):
    """The token-id run is test_sync_regression.py's: 4 steps of 4 prompts x 4 samples, evaluated on
    16 prompts at steps 0, 2 and 4 (pass@2 at the first and last)."""
    through_gateway = [arg if arg != "run.name=golden" else "run.name=gateway" for arg in GOLDEN] + GATEWAY
    direct = _rows(launched(GOLDEN) / "runs" / "golden")
    gateway = _rows(launched(through_gateway) / "runs" / "gateway")
    assert [r["step"] for r in gateway] == [r["step"] for r in direct] == [0, 1, 2, 3, 4]
    for a, b in zip(direct, gateway):
        for key in COMPARED:
            assert (key in a) == (key in b), key
            if key in a:
                assert a[key] == b[key], (a["step"], key, a[key], b[key])
    # the gateway's counters ride along: one turn per group, evaluation's included, one segment each;
    # a step's counters are read before its evaluation runs, so the last row counts the evaluation
    # at step 0 (16 greedy groups, 16 sampled ones for pass@2), four steps of 4 prompts and the
    # evaluation at step 2 (16 greedy groups), not the last one
    last = gateway[-1]
    assert last["agentflow/turns"] == 16 + 16 + 4 * 4 + 16
    assert last["agentflow/segments/first"] == last["agentflow/turns"]
    assert last["agentflow/completion_tokens"] > 0
    assert not any(k.startswith("agentflow/") for k in direct[-1])


def test_asynchronous_training_through_the_gateway(ray_session, in_tmp):
    args = [
        "train",
        "tiny/grpo_arith_cpu",
        "run.name=gw_async",
        *COMMON,
        *GATEWAY,
        "colocate=false",
        "rollout.scheduler={name: no_window, params: {max_staleness: 1}}",
    ]
    assert main(args) == 0
    rows = [r for r in _rows(in_tmp / "runs" / "gw_async") if "train/loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["rollout/trajectories"] == 16
        assert r["rollout/staleness_max"] <= 1
    # a step whose groups all got equal rewards has no gradient; not every step can be one
    assert any(r["train/grad_norm"] > 0 for r in rows)
    assert rows[-1]["agentflow/turns"] >= 3 * 4


def test_an_agent_that_needs_the_gateway_is_refused_at_validation_without_it():
    from loongsage.core.config import load_config
    from loongsage.core.types import ConfigError

    with pytest.raises(ConfigError) as err:
        load_config("tiny/grpo_arith_cpu", ["data_sources.0.agent={name: chat}"])
    assert str(err.value) == (
        "data_sources[0].agent: agent 'chat' needs the run service 'gateway'; add services: "
        "[{name: gateway}] (services now: none)"
    )
