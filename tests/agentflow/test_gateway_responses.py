"""The OpenAI Responses endpoint with the official ``openai`` client: plain and streamed answers,
function calls sent back with their outputs extend the session's line (tokens never re-tokenized),
and what the gateway cannot honour is one 400 naming the field."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseUsage

sys.path.insert(0, str(Path(__file__).parent))
from _conversations import LOOKUP  # noqa: E402
from _sessions import close as _close  # noqa: E402
from _sessions import openai_client as _client  # noqa: E402

TOOL = {
    "type": "function",
    "name": LOOKUP["function"]["name"],
    "description": LOOKUP["function"]["description"],
    "parameters": LOOKUP["function"]["parameters"],
}


def test_a_response_records_exactly_the_engines_tokens(gateway, session):
    calls = gateway.service.engine.calls
    before = len(calls)
    r = _client(session).responses.create(
        model="tiny",
        instructions="be brief",
        input="1+1=",
        max_output_tokens=6,
        temperature=0,
        store=False,
        metadata={"k": "v"},
        reasoning={"effort": "low"},
    )
    assert r.object == "response" and r.status in ("completed", "incomplete")
    (message,) = [item for item in r.output if item.type == "message"]
    (prompt, _, (result,)) = calls[before]
    assert r.usage.output_tokens == len(result.output_ids) and r.usage.input_tokens == len(prompt)
    assert r.output_text == message.content[0].text
    assert (r.status == "incomplete") == (r.incomplete_details is not None and r.usage.output_tokens == 6)
    assert "be brief" in gateway.service.renderer.decode(prompt)  # instructions: the system message
    (trajectory,) = _close(gateway, session).trajectories()
    assert trajectory.response_ids == result.output_ids and trajectory.loss_mask == [1] * len(result.output_ids)


def test_function_calls_and_their_outputs_extend_the_line(gateway, session, tool_parser):
    calls, client = gateway.service.engine.calls, _client(session)
    before = len(calls)
    r1 = client.responses.create(
        model="tiny",
        input=[{"role": "user", "content": "what is 2+2?"}],
        tools=[TOOL],
        max_output_tokens=6,
        temperature=0,
    )
    (call,) = [item for item in r1.output if item.type == "function_call"]
    assert call.name == "lookup" and call.call_id.startswith("call_")
    # the SDK's own output items sent back, then the call's output
    history = [
        {"role": "user", "content": "what is 2+2?"},
        *[item.model_dump(exclude_none=True) for item in r1.output],
        {"type": "function_call_output", "call_id": call.call_id, "output": "4"},
    ]
    client.responses.create(model="tiny", input=history, tools=[TOOL], max_output_tokens=6, temperature=0)
    (p1, _, (o1,)), (p2, _, _) = calls[before : before + 2]
    assert p2[: len(p1) + len(o1.output_ids)] == p1 + o1.output_ids  # the reply's tokens kept as sampled
    assert "<tool_response>\n4\n</tool_response>" in gateway.service.renderer.decode(p2[len(p1) + len(o1.output_ids) :])
    (trajectory,) = _close(gateway, session).trajectories()
    assert trajectory.metadata["segment_categories"] == ["first"] and len(trajectory.metadata["turns"]) == 2


def test_streamed_events_follow_the_responses_format(gateway, session):
    stream = _client(session).responses.create(
        model="tiny", input="count", max_output_tokens=8, temperature=0, stream=True
    )
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = [e for e in events if e.type == "response.output_text.done"]
    assert len(done) == 1 and done[0].text == text == events[-1].response.output_text
    assert "response.output_item.added" in kinds and "response.output_item.done" in kinds


@pytest.mark.parametrize(
    "extra, field",
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}}, "text.format"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content"),
        ({"input": []}, "input"),
    ],
)
def test_what_cannot_be_honoured_is_one_400(gateway, session, extra, field):
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 2, **extra}
    with pytest.raises(openai.BadRequestError) as err:
        _client(session).responses.create(**body)
    assert err.value.status_code == 400 and err.value.body["param"] == field


def test_the_usage_has_every_field_of_the_official_model(gateway, session):
    resp = httpx.post(
        f"{session.openai_base_url}/responses",
        headers={"authorization": f"Bearer {session.api_key}"},
        json={"model": "tiny", "input": "1+1=", "max_output_tokens": 2},
    )
    assert resp.status_code == 200, resp.text
    usage = ResponseUsage.model_validate(resp.json()["usage"])  # validated: every required field present
    assert usage.input_tokens_details.cache_write_tokens == 0 and usage.input_tokens_details.cached_tokens == 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    Response.model_validate(resp.json())
