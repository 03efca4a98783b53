"""The official Anthropic client against the running gateway (Messages, streaming, tool use)."""

from __future__ import annotations

import logging

import anthropic
import httpx
import openai
import pytest

pytestmark = pytest.mark.timeout(120)

LOOKUP = {
    "name": "lookup",
    "description": "look a number up",
    "input_schema": {"type": "object", "properties": {"n": {"type": "integer"}}},
}


def _client(session) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=session.anthropic_base_url, api_key=session.api_key, max_retries=0, timeout=60)


def test_a_message_and_its_stream(gateway, session):
    client = _client(session)
    kwargs = dict(
        model="tiny",
        max_tokens=8,
        system="be brief",
        messages=[{"role": "user", "content": "hi"}],
        metadata={"user_id": "u1"},
    )
    message = client.messages.create(**kwargs)
    assert message.type == "message" and message.role == "assistant" and message.model == "tiny"
    assert [b.type for b in message.content] == ["text"]
    assert message.stop_reason in ("end_turn", "max_tokens") and 1 <= message.usage.output_tokens <= 8
    with client.messages.stream(**kwargs) as stream:  # the same request: a retry, answered from memory
        names = [event.type for event in stream]
        final = stream.get_final_message()
    assert names[0] == "message_start" and names[-1] == "message_stop" and "content_block_delta" in names
    assert final.id == message.id and final.content[0].text == message.content[0].text
    assert final.stop_reason == message.stop_reason and final.usage.output_tokens == message.usage.output_tokens
    (trajectory,) = gateway.close_session_threadsafe(session.trajectory).trajectories()
    assert gateway.service.renderer.decode(trajectory.prompt_ids).startswith("<|im_start|>system\nbe brief<|im_end|>")


def test_tool_use_round_trip_appends(gateway, session, tool_parser):
    client = _client(session)
    messages = [{"role": "user", "content": "look up 7"}]
    first = client.messages.create(
        model="tiny", max_tokens=5, tools=[LOOKUP], messages=messages, thinking={"type": "disabled"}
    )
    assert first.stop_reason == "tool_use" and [b.type for b in first.content] == ["thinking", "tool_use"]
    use = first.content[1]
    assert use.name == "lookup" and set(use.input) == {"n"}
    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": use.id, "content": "49"},
                {"type": "text", "text": "and now?"},
            ],
        },
    ]
    with client.messages.stream(model="tiny", max_tokens=5, tools=[LOOKUP], messages=messages) as stream:
        second = stream.get_final_message()
    assert second.content[-1].type == "tool_use"
    (trajectory,) = gateway.close_session_threadsafe(session.trajectory).trajectories()
    assert trajectory.metadata["segment_categories"] == ["first"] and len(trajectory.metadata["turns"]) == 2
    tool_message = trajectory.metadata["messages"][2]
    assert tool_message == {"role": "tool", "content": "49", "tool_call_id": use.id}
    assert "<tool_response>\n49\n</tool_response>" in gateway.service.renderer.decode(trajectory.response_ids)


def test_errors_come_in_anthropic_shape(gateway, session):
    with pytest.raises(anthropic.BadRequestError) as err:
        _client(session).messages.create(
            model="tiny",
            max_tokens=4,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
                    ],
                }
            ],
        )
    assert err.value.status_code == 400 and err.value.body["type"] == "error"
    assert "image" in err.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        anthropic.Anthropic(base_url=f"{gateway.url}/nobody/0", api_key="k", max_retries=0).messages.create(
            model="tiny", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        )


class BrokenParser:
    """A chat parser that fails: a fault of the gateway itself, not of the request."""

    kind = "chat_parser"

    def parse(self, text):
        raise RuntimeError("the parser broke")


def test_route_errors_and_failures_come_in_anthropic_shape(gateway, session):
    base = session.anthropic_base_url
    for resp, status in [
        (httpx.get(f"{base}/v1/messages"), 405),  # a route's own errors
        (httpx.post(f"{gateway.url}/v1/messages", json={}), 404),
        (httpx.post(f"{base}/v1/messages/count_tokens", json={}), 404),
    ]:
        assert resp.status_code == status and resp.json()["type"] == "error", resp.text
        assert resp.json()["error"]["type"] == ("not_found_error" if status == 404 else "api_error")
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append
    loggers = [logging.getLogger(name) for name in ("uvicorn.error", "loongsage.agentflow")]
    saved = gateway.service.parser
    for logger in loggers:
        logger.addHandler(handler)
    gateway.service.parser = BrokenParser()
    try:
        with pytest.raises(anthropic.InternalServerError) as err:
            _client(session).messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(openai.InternalServerError) as openai_err:  # the other protocols keep theirs
            chat = openai.OpenAI(base_url=session.openai_base_url, api_key=session.api_key, max_retries=0).chat
            chat.completions.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": "hello"}])
    finally:
        gateway.service.parser = saved
        for logger in loggers:
            logger.removeHandler(handler)
    assert err.value.status_code == 500 and err.value.body == {
        "type": "error",
        "error": {"type": "api_error", "message": "internal error: RuntimeError"},
    }
    assert openai_err.value.body["message"] == "internal error: RuntimeError"
    # each failure is one traceback in the log, not one per layer
    assert [r.exc_info[0] for r in records if r.exc_info] == [RuntimeError, RuntimeError]
