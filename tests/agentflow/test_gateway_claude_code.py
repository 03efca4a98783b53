"""What current Claude Code (2.1.x) sends to the Messages endpoint: a first request shaped as the
CLI writes it (system blocks with ``cache_control``, a ``role: "system"`` message inside
``messages``, tools, ``thinking``, ``context_management``, ``output_config``, ``metadata``, a
stream, ``?beta=true``), replayed as raw bytes and through the official client, and the HEAD the
CLI sends its base URL first."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import anthropic
import httpx
import pytest

from loongsage.agentflow.trajectories.store import Budget

pytestmark = pytest.mark.timeout(180)

FIRST_REQUEST = json.loads((Path(__file__).parent / "data" / "claude_code_first_request.json").read_text())
# the CLI asks for 32000 new tokens: the session's budget cuts a turn to a few dozen
BUDGET = Budget(max_context_tokens=4096, max_response_tokens=72)
HEADERS = {
    "anthropic-version": "2023-06-01",
    "x-app": "cli",
    "user-agent": "claude-cli/2.1.42 (external, cli)",
    "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,context-management-2025-06-27",
    "content-type": "application/json",
}
BLOCK_DELTAS = {"text": "text_delta", "thinking": "thinking_delta", "tool_use": "input_json_delta"}


def _open(gateway, name):
    return gateway.open_session(name, budget=BUDGET)


def _events(resp: httpx.Response) -> list[tuple[str, dict]]:
    """The ``(event, data)`` pairs of an SSE body, each event's data checked to name its event."""
    events = []
    for chunk in resp.text.split("\n\n"):
        if not chunk.strip():
            continue
        fields = dict(line.split(": ", 1) for line in chunk.split("\n"))
        data = json.loads(fields["data"])
        assert data["type"] == fields["event"], chunk
        events.append((fields["event"], data))
    return events


def _assert_well_formed(events: list[tuple[str, dict]]) -> None:
    """message_start, then each content block opened, filled and closed in index order, then one
    message_delta with the stop reason and message_stop."""
    names = [name for name, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"], names
    start = events[0][1]["message"]
    assert start["role"] == "assistant" and start["content"] == [] and start["usage"]["input_tokens"] > 0
    open_block, index = None, 0
    for name, data in events[1:-2]:
        if name == "content_block_start":
            assert open_block is None and data["index"] == index
            open_block = data["content_block"]["type"]
        elif name == "content_block_delta":
            assert data["index"] == index and data["delta"]["type"] == BLOCK_DELTAS[open_block]
        else:
            assert name == "content_block_stop" and data["index"] == index and open_block is not None
            open_block, index = None, index + 1
    assert open_block is None and index >= 1
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] in ("end_turn", "max_tokens", "tool_use", "stop_sequence")
    assert delta["usage"]["output_tokens"] >= 1


def _accumulate(events: list[tuple[str, dict]]) -> list[dict]:
    """The reply's content blocks, put together from their deltas as a client does."""
    blocks = []
    for name, data in events:
        if name == "content_block_start":
            blocks.append(dict(data["content_block"]))
            blocks[-1]["partial_json"] = ""
        elif name == "content_block_delta":
            delta, block = data["delta"], blocks[data["index"]]
            key = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "partial_json"}[
                delta["type"]
            ]
            block[key] += delta[key]
    for block in blocks:
        partial = block.pop("partial_json")
        if block["type"] == "tool_use":
            block["input"] = json.loads(partial)
    return blocks


def test_the_cli_probes_its_base_url_with_head(wide_gateway):
    info = _open(wide_gateway, "cc-head")
    assert httpx.head(info.anthropic_base_url).status_code == 200  # no key needed: it only says "open"
    wide_gateway.close_session_threadsafe(info.trajectory)
    gone = httpx.head(info.anthropic_base_url)
    assert gone.status_code == 404


def test_a_recorded_first_request_is_accepted_and_streams_a_well_formed_answer(wide_gateway):
    info = _open(wide_gateway, "cc-raw")
    resp = httpx.post(
        f"{info.anthropic_base_url}/v1/messages?beta=true",
        content=json.dumps(FIRST_REQUEST),
        headers={**HEADERS, "x-api-key": info.api_key},
        timeout=120,
    )
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = _events(resp)
    _assert_well_formed(events)
    (trajectory,) = wide_gateway.close_session_threadsafe(info.trajectory).trajectories()
    messages = trajectory.metadata["messages"]
    # the system blocks are the system prompt; the CLI's system message stays after the user turn it followed
    assert [m["role"] for m in messages[:3]] == ["system", "user", "system"]
    assert messages[0]["content"].startswith("x-anthropic-billing-header") and "Claude Code" in messages[0]["content"]
    assert "Deferred tools: WebFetch" in messages[2]["content"]
    prompt = wide_gateway.service.renderer.decode(trajectory.prompt_ids)
    assert prompt.index("add(2, 3)") < prompt.index("<|im_start|>system\n<system-reminder>\nDeferred tools")


def test_a_later_turn_keeps_the_system_message_in_place_and_extends_the_line(wide_gateway):
    info = _open(wide_gateway, "cc-two-turns")

    def post(body):
        return httpx.post(
            f"{info.anthropic_base_url}/v1/messages?beta=true",
            content=json.dumps(body),
            headers={**HEADERS, "x-api-key": info.api_key},
            timeout=120,
        )

    first = {**FIRST_REQUEST, "max_tokens": 8}
    resp = post(first)
    assert resp.status_code == 200, resp.text
    # the next request as the CLI sends it: the history (its system message where it was), the
    # reply, the results of its tool calls and a new question
    reply = _accumulate(_events(resp))
    results = [
        {"type": "tool_result", "tool_use_id": b["id"], "content": "5"} for b in reply if b["type"] == "tool_use"
    ]
    follow = copy.deepcopy(first)
    follow["messages"] += [
        {"role": "assistant", "content": reply},
        {"role": "user", "content": [*results, {"type": "text", "text": "And add(1, 1)?"}]},
    ]
    again = post(follow)
    assert again.status_code == 200, again.text
    _assert_well_formed(_events(again))
    (trajectory,) = wide_gateway.close_session_threadsafe(info.trajectory).trajectories()
    assert trajectory.metadata["segment_categories"] == ["first"] and len(trajectory.metadata["turns"]) == 2


def test_the_official_client_streams_the_same_request(wide_gateway):
    info = _open(wide_gateway, "cc-sdk")
    seen = []  # the requests the client sent
    client = anthropic.Anthropic(
        base_url=info.anthropic_base_url,
        api_key=info.api_key,
        max_retries=0,
        timeout=120,
        http_client=anthropic.DefaultHttpxClient(event_hooks={"request": [seen.append]}),
    )
    body = {k: v for k, v in FIRST_REQUEST.items() if k != "stream"}
    betas = ["claude-code-20250219", "context-management-2025-06-27"]
    with client.beta.messages.stream(**body, betas=betas, extra_query={"beta": "true"}) as stream:  # as the CLI
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert seen[0].url.params["beta"] == "true" and seen[0].url.path.endswith("/v1/messages")
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert final.role == "assistant" and final.content and final.usage.output_tokens >= 1
    assert final.stop_reason in ("end_turn", "max_tokens", "tool_use")


def test_system_messages_join_the_system_prompt_at_its_head(wide_gateway):
    info = _open(wide_gateway, "cc-head-system")
    client = anthropic.Anthropic(base_url=info.anthropic_base_url, api_key=info.api_key, max_retries=0, timeout=60)
    client.messages.create(
        model="m",
        max_tokens=2,
        system="be brief",
        messages=[
            {"role": "system", "content": "answer in French"},
            {"role": "system", "content": [{"type": "text", "text": "no lists"}]},
            {"role": "user", "content": "hi"},
        ],
    )
    (trajectory,) = wide_gateway.close_session_threadsafe(info.trajectory).trajectories()
    assert trajectory.metadata["messages"][:2] == [
        {"role": "system", "content": "be brief\n\nanswer in French\n\nno lists"},
        {"role": "user", "content": "hi"},
    ]


@pytest.mark.parametrize(
    "extra, field",
    [
        (
            {"output_config": {"effort": "low", "format": {"type": "json_schema", "schema": {"type": "object"}}}},
            "output_config.format",
        ),
        ({"output_format": {"type": "json_schema", "schema": {"type": "object"}}}, "output_format"),
        ({"output_config": "high"}, "output_config"),
        ({"messages": [{"role": "developer", "content": "x"}]}, "messages.0"),
    ],
)
def test_what_cannot_be_honoured_is_one_400(wide_gateway, extra, field):
    info = _open(wide_gateway, f"cc-refused-{field.replace('.', '-')}")
    body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], **extra}
    resp = httpx.post(f"{info.anthropic_base_url}/v1/messages", json=body, headers={"x-api-key": info.api_key})
    assert resp.status_code == 400 and resp.json()["type"] == "error"
    message = resp.json()["error"]["message"]
    assert message.startswith(field) and "\n" not in message
    if field == "messages.0":
        assert "'user', 'assistant' or 'system'" in message
