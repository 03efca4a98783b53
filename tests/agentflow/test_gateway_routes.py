"""R3 through the gateway: a multi-turn conversation with a tiny Qwen3-MoE (the native engine
recording routed experts), driven by the official ``openai`` client. Each line's trajectory carries
the experts every MoE layer chose for each of its tokens but the last, from its latest turn (whose
prompt was the whole line so far): exactly what a plain HF forward over the line chooses. Sibling
samples (``n=2``) carry their own."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "core" / "engine"))
from _engine_helpers import hf_routes  # noqa: E402
from _sessions import close, openai_client  # noqa: E402


@pytest.fixture(scope="module")
def moe_gateway(tmp_path_factory):
    from transformers import AutoTokenizer

    from loongsage.agentflow.gateway.engines import DirectEngine
    from loongsage.agentflow.gateway.server import Gateway
    from loongsage.agentflow.gateway.service import ChatService
    from loongsage.core.engine.native import NativeEngine
    from loongsage.core.tinytask.shapes import RandomInitModel

    path = str(
        RandomInitModel(preset="qwen3-moe-tiny", dtype="float32", device="cpu", max_position_embeddings=512).build_into(
            tmp_path_factory.mktemp("moe") / "m"
        )
    )
    engine = NativeEngine(path, return_routed_experts=True, max_model_len=512, max_batch_size=8)
    gw = Gateway(ChatService(DirectEngine(engine), AutoTokenizer.from_pretrained(path)), max_body_bytes=1 << 20)
    gw.start_background()
    yield gw, path
    gw.stop_background()


def test_a_multi_turn_line_carries_the_routes_of_all_its_tokens(moe_gateway):
    from transformers import AutoModelForCausalLM

    gateway, path = moe_gateway
    session = gateway.open_session("r3-chat")
    client = openai_client(session)
    history = [{"role": "user", "content": "12+30="}]
    first = client.chat.completions.create(model="m", messages=history, max_tokens=6, n=2, temperature=1.0, seed=1)
    history += [
        {"role": "assistant", "content": first.choices[0].message.content or ""},
        {"role": "user", "content": "and 7?"},
    ]
    client.chat.completions.create(model="m", messages=history, max_tokens=6, temperature=1.0, seed=2)
    lines = close(gateway, session).trajectories()
    assert len(lines) == 2 and len(lines[0].metadata["turns"]) == 2 and len(lines[1].metadata["turns"]) == 1
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for line in lines:
        tokens = line.prompt_ids + line.response_ids
        routes = torch.as_tensor(line.routed_experts).long()
        assert routes.shape == (len(tokens) - 1, 2, 2), routes.shape
        assert torch.equal(routes, hf_routes(reference, tokens[:-1]))


def test_a_line_of_several_segments_carries_each_segments_routes(moe_gateway):
    """The client sends its first reply back edited: the line goes on in a second segment, whose turn
    the engine prefilled from the segment's first token. The trajectory carries one record per
    segment, each what a plain HF forward over that segment alone chooses."""
    from transformers import AutoModelForCausalLM

    gateway, path = moe_gateway
    session = gateway.open_session("r3-segments")
    client = openai_client(session)
    history = [{"role": "user", "content": "12+30="}]
    first = client.chat.completions.create(model="m", messages=history, max_tokens=6, temperature=1.0, seed=1)
    history += [
        {"role": "assistant", "content": (first.choices[0].message.content or "") + " (edited)"},
        {"role": "user", "content": "and 7?"},
    ]
    client.chat.completions.create(model="m", messages=history, max_tokens=6, temperature=1.0, seed=2)
    (line,) = close(gateway, session).trajectories()
    assert [s.kind for s in line.segments] == ["turn", "rewritten"]
    assert isinstance(line.routed_experts, list) and len(line.routed_experts) == 2
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokens = line.prompt_ids + line.response_ids
    for segment, record in zip(line.segments, line.routed_experts):
        seg = tokens[segment.start : segment.end]
        assert torch.equal(torch.as_tensor(record).long(), hf_routes(reference, seg[:-1]))
