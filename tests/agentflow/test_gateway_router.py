"""The gateway on the core's engine router over a native engine in a Ray actor: what a run uses."""

from __future__ import annotations

import openai
import pytest

from loongsage.agentflow.chat.parsers import Qwen3ChatParser
from loongsage.agentflow.gateway.server import Gateway
from loongsage.agentflow.gateway.service import ChatService

pytestmark = pytest.mark.timeout(300)


def test_turns_of_a_session_reach_the_engine_holding_their_prefix(ray_module, tiny):
    from loongsage.core.config import load_config
    from loongsage.core.rollout import EngineRouter
    from loongsage.core.workers import EngineWorker

    ray = ray_module
    path, tokenizer = tiny
    cfg, _ = load_config("tiny/grpo_arith_cpu", ["rollout.engine={name: native, params: {max_model_len: 1024}}"])
    engine = ray.remote(EngineWorker).options(num_cpus=0, max_concurrency=100).remote(cfg, path, 0, 1)
    gateway = Gateway(ChatService(EngineRouter([engine]), tokenizer, parser=Qwen3ChatParser()))
    gateway.start_background()
    try:
        session = gateway.open_session("routed")
        client = openai.OpenAI(base_url=session.openai_base_url, api_key=session.api_key, max_retries=0)
        messages = [{"role": "user", "content": "hello"}]
        first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
        messages += [first.choices[0].message, {"role": "user", "content": "again"}]
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
        (trajectory,) = gateway.close_session_threadsafe("routed").trajectories()
    finally:
        gateway.stop_background()
    health = ray.get(engine.health.remote())
    turns = trajectory.metadata["turns"]
    assert len(turns) == 2 and trajectory.metadata["segment_categories"] == ["first"]
    # the second turn prefilled only what it appended: the first turn's prompt and reply were cached
    assert health["prefix_hit_tokens"] >= turns[1]["prompt_start"] - 1
    assert set(v for v, m in zip(trajectory.versions, trajectory.loss_mask) if m) == {0}
    ray.kill(engine)
