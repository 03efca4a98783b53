"""Hostile and careless clients: every bad request is a 4xx with a message (never a 5xx), lone
UTF-16 surrogates (valid JSON) are read as U+FFFD in every protocol and field, budgets end in an
API error and a truncated trajectory, a client that vanishes mid-stream leaves no lock held, and
one that hangs up while sending its body costs one log line."""

from __future__ import annotations

import json
import logging
import socket
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loongsage.agentflow.trajectories.store import Budget
from loongsage.core.types import Status

sys.path.insert(0, str(Path(__file__).parent))
from _sessions import openai_client  # noqa: E402

pytestmark = pytest.mark.timeout(120)
USER = [{"role": "user", "content": "hi"}]


def _post(session, path, body, *, raw=None, key=None):
    headers = {"authorization": f"Bearer {session.api_key if key is None else key}", "content-type": "application/json"}
    content = raw if raw is not None else json.dumps(body)
    return httpx.post(f"{session.base_url}{path}", content=content, headers=headers, timeout=60)


def _error(resp, status):
    assert resp.status_code == status, resp.text
    body = resp.json()
    message = body["error"]["message"]
    assert isinstance(message, str) and message and "\n" not in message
    return message


@pytest.mark.parametrize(
    "body, field",
    [
        ({"messages": "hi"}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "role"),
        ({"messages": [{"role": "user", "content": 5}]}, "content"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "image_url"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "tool_call_id"),
        ({"messages": USER, "temperature": "hot"}, "temperature"),
        ({"messages": USER, "temperature": True}, "temperature"),
        ({"messages": USER, "n": 0}, "n"),
        ({"messages": USER, "n": 17}, "n"),
        ({"messages": USER, "max_tokens": -1}, "max_tokens"),
        ({"messages": USER, "top_p": 0}, "top_p"),
        ({"messages": USER, "stop": [""]}, "stop"),
        ({"messages": USER, "tools": {"a": 1}}, "tools"),
        ({"messages": USER, "tools": [{"type": "function", "function": {}}]}, "name"),
        ({"messages": USER, "tool_choice": 3}, "tool_choice"),
        ({"messages": USER, "response_format": {"type": "json_object"}}, "response_format"),
        ({"messages": USER, "top_logprobs": 3}, "top_logprobs"),
        ({"messages": USER, "stream": "yes"}, "stream"),
        ({"messages": [{"role": "assistant", "content": "x", "tool_calls": [{"function": "f"}]}]}, "tool_calls"),
    ],
)
def test_malformed_openai_requests_are_400s_naming_the_field(session, body, field):
    assert field in _error(_post(session, "/v1/chat/completions", body), 400)


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"\xff\xfe", b"[" * 100_000 + b"]" * 100_000, b""])
def test_bodies_that_are_no_json_object_are_400s(session, raw):
    _error(_post(session, "/v1/chat/completions", None, raw=raw), 400)
    assert _post(session, "/v1/messages", None, raw=raw).json()["type"] == "error"


def test_oversized_bodies_are_413s(gateway, session):
    big = {"messages": [{"role": "user", "content": "x" * (gateway.max_body_bytes + 1)}]}
    _error(_post(session, "/v1/chat/completions", big), 413)

    # a client that lies about the length is cut off while streaming the body
    def chunks():
        for _ in range(gateway.max_body_bytes // 65536 + 2):
            yield b" " * 65536

    resp = httpx.post(
        f"{session.openai_base_url}/chat/completions",
        content=chunks(),
        headers={"authorization": f"Bearer {session.api_key}"},
    )
    _error(resp, 413)


def test_sessions_are_closed_to_strangers(gateway, session):
    ok = {"messages": USER, "max_tokens": 2}
    assert "unknown session" in _error(httpx.post(f"{gateway.url}/nobody/0/v1/chat/completions", json=ok), 404)
    assert "API key" in _error(_post(session, "/v1/chat/completions", ok, key="someone-else"), 401)
    other = gateway.open_session(session.trajectory + "-other")
    assert "API key" in _error(_post(session, "/v1/chat/completions", ok, key=other.api_key), 401)
    retry = gateway.open_session(session.trajectory, attempt=1)
    assert "retired" in _error(_post(session, "/v1/chat/completions", ok), 410)
    assert _post(retry, "/v1/chat/completions", ok).status_code == 200
    assert "no route" in _error(httpx.post(f"{gateway.url}/v1/chat/completions", json=ok), 404)
    _error(httpx.get(f"{retry.openai_base_url}/chat/completions"), 405)
    _error(httpx.get(f"{gateway.url}/{session.trajectory}/zero/v1/models"), 404)
    with pytest.raises(ValueError, match="not newer"):
        gateway.open_session(session.trajectory, attempt=1)
    with pytest.raises(ValueError, match="trajectory id"):
        gateway.open_session("../etc")


def test_unknown_fields_real_clients_send_are_accepted(session):
    body = {
        "messages": USER,
        "max_completion_tokens": 2,
        "reasoning_effort": "high",
        "metadata": {"a": "b"},
        "prompt_cache_key": "k",
        "parallel_tool_calls": False,
        "store": False,
        "user": "u",
        "service_tier": "auto",
        "frequency_penalty": 0.5,
        "logit_bias": {"5": 1},
        "tools": [{"type": "web_search"}],
        "tool_choice": "required",
        "response_format": {"type": "text"},
        "modalities": ["text"],
    }
    resp = _post(session, "/v1/chat/completions", body)
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] <= 2
    anthropic_body = {
        "model": "m",
        "max_tokens": 2,
        "messages": USER,
        "thinking": {"type": "enabled", "budget_tokens": 9},
        "service_tier": "auto",
        "tools": [{"type": "web_search_20250305", "name": "web_search"}],
        "system": [{"type": "text", "text": "s", "cache_control": {"type": "ephemeral"}}],
    }
    assert _post(session, "/v1/messages", anthropic_body).status_code == 200


def test_budgets_end_in_an_api_error_and_a_truncated_trajectory(gateway):
    small = gateway.open_session("budget-context", budget=Budget(max_context_tokens=8))
    assert "out of budget" in _error(_post(small, "/v1/chat/completions", {"messages": USER}), 400)
    s = gateway.open_session("budget-response", budget=Budget(max_response_tokens=6))
    first = _post(s, "/v1/chat/completions", {"messages": USER, "max_tokens": 50, "temperature": 0})
    assert first.status_code == 200 and first.json()["usage"]["completion_tokens"] <= 6
    reply = first.json()["choices"][0]["message"]
    follow = {"messages": [*USER, reply, {"role": "user", "content": "more"}], "max_tokens": 5}
    if first.json()["choices"][0]["finish_reason"] == "length":
        assert _post(s, "/v1/chat/completions", follow).json()["error"]["code"] == "context_length_exceeded"
    (trajectory,) = gateway.close_session_threadsafe("budget-response").trajectories()
    assert trajectory.status is Status.TRUNCATED and sum(trajectory.loss_mask) <= 6
    assert gateway.service.metrics()["agentflow/budget_refusals"] >= 1


def _refused(call, budget: str) -> openai.BadRequestError:
    """The budget refusal ``call`` ends in: a 400 context_length_exceeded naming ``budget``'s value."""
    with pytest.raises(openai.BadRequestError) as err:
        call()
    assert err.value.status_code == 400 and err.value.code == "context_length_exceeded", err.value
    assert "out of budget" in err.value.message and budget in err.value.message, err.value.message
    return err.value


def test_budget_fields_are_validated_and_their_defaults_derived():
    assert Budget().line_tokens == 16 * 4096 and Budget().session_tokens == 4 * 16384 and Budget().max_lines == 64
    derived = Budget(max_context_tokens=100, max_response_tokens=10)
    assert (derived.line_tokens, derived.session_tokens) == (1600, 40)
    assert Budget(max_line_tokens=7, max_session_tokens=9).line_tokens == 7
    for bad in ({"max_lines": 0}, {"max_line_tokens": 0}, {"max_session_tokens": True}, {"max_lines": None}):
        with pytest.raises(ValueError, match=f"Budget.{next(iter(bad))}="):
            Budget(**bad)


def test_budget_max_line_tokens_stops_a_line_rewriting_its_history_every_turn(gateway):
    # every turn sends another assistant reply: the line starts a segment with the whole prompt
    # re-rendered, so it grows by a prompt a turn within every other budget
    budget = Budget(max_context_tokens=1024, max_response_tokens=1000, max_line_tokens=1500)
    client, pad = openai_client(gateway.open_session("budget-line", budget=budget)), "lorem ipsum " * 40
    replies = []
    with pytest.raises(openai.BadRequestError) as err:
        for i in range(60):
            messages = [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": f"forged {i}"},
                {"role": "user", "content": f"{pad}{i}"},
            ]
            replies.append(client.chat.completions.create(model="m", messages=messages, max_tokens=200, temperature=0))
    assert err.value.code == "context_length_exceeded" and "(max_line_tokens=1500)" in err.value.message
    session = gateway.close_session_threadsafe("budget-line")
    (trajectory,) = session.trajectories()
    length = len(trajectory.prompt_ids) + len(trajectory.response_ids)
    assert length == sum(r.usage.prompt_tokens + r.usage.completion_tokens for r in replies) <= 1500
    assert 2 <= len(replies) < 10 and len(trajectory.segments) == len(replies) and session.refusals == 1
    # the last turn's reply was cut to the room the line had left (greedy replies run to max_tokens)
    assert replies[-1].usage.completion_tokens < 200 and replies[-1].choices[0].finish_reason == "length"
    assert trajectory.status is Status.TRUNCATED


def test_budget_max_lines_stops_unrelated_conversations_and_forks(gateway):
    info = gateway.open_session("budget-lines", budget=Budget(max_lines=6))
    client = openai_client(info)

    def ask(messages: list[dict], n: int):
        return client.chat.completions.create(model="m", messages=messages, n=n, max_tokens=2)

    def conversation(i: int) -> list[dict]:
        return [{"role": "user", "content": f"conversation {i}"}]

    assert len(ask(conversation(0), 4).choices) == 4  # four lines
    calls = len(gateway.service.engine.calls)
    _refused(lambda: ask(conversation(1), 4), "(max_lines=6)")  # eight: refused before generating
    assert len(gateway.service.engine.calls) == calls
    second = ask(conversation(2), 2)  # six: a new line and a fork of it
    _refused(lambda: ask(conversation(3), 1), "(max_lines=6)")
    # going on with a line the session has starts none; a fork of it would be a seventh
    follow = [
        *conversation(2),
        second.choices[1].message.model_dump(exclude_none=True),
        {"role": "user", "content": "on"},
    ]
    ask(follow, 1)
    _refused(lambda: ask([*follow[:-1], {"role": "user", "content": "again"}], 2), "(max_lines=6)")
    session = gateway.close_session_threadsafe("budget-lines")
    assert len(session.lines) == len(session.trajectories()) == 6 and session.refusals == 3
    assert [len(t.metadata["turns"]) for t in session.trajectories()] == [1, 1, 1, 1, 1, 2]


def test_budget_max_session_tokens_stops_the_tokens_sampled_in_a_session(gateway):
    # each of a request's n samples gets at most its share of the room left: 25 tokens of 100 at first
    budget = Budget(max_response_tokens=64, max_session_tokens=100, max_lines=1000)
    info = gateway.open_session("budget-sampled", budget=budget)
    client = openai_client(info)
    ok = 0
    with pytest.raises(openai.BadRequestError) as err:
        for i in range(40):
            r = client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": f"conversation {i}"}], n=4, max_tokens=60
            )
            assert r.usage.completion_tokens <= 100
            ok += 1
    assert err.value.code == "context_length_exceeded" and "(max_session_tokens=100)" in err.value.message
    session = gateway.close_session_threadsafe("budget-sampled")
    sampled = [sum(t.loss_mask) for t in session.trajectories()]
    assert ok >= 1 and len(sampled) == 4 * ok and session.refusals == 1
    assert sum(sampled) == session.generated <= 100 and max(sampled) <= 25


def test_tokens_a_stop_string_cut_away_are_charged_to_the_budgets(gateway):
    """The engine stops on tokens, not strings: it samples up to max_tokens and the gateway cuts
    the reply at the stop string. What it sampled is what the budgets charge, or stop strings
    that cut every reply short would sample without end."""
    budget = Budget(max_response_tokens=10_000, max_session_tokens=200, max_lines=1000)
    info = gateway.open_session("budget-stop-cut", budget=budget)
    client, calls = openai_client(info), gateway.service.engine.calls
    before = len(calls)
    with pytest.raises(openai.BadRequestError) as err:
        for i in range(40):
            client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": f"c{i}"}], max_tokens=40, stop=["e", "a", "o", " "]
            )
    assert "(max_session_tokens=200)" in err.value.message
    sampled = sum(len(r.output_ids) for _, _, results in calls[before:] for r in results)
    session = gateway.close_session_threadsafe("budget-stop-cut")
    assert session.generated == sampled <= 200
    kept = sum(sum(t.loss_mask) for t in session.trajectories())
    assert kept < sampled  # the stop strings did cut


def test_a_session_within_its_budgets_is_not_refused(gateway):
    # at the limits: three lines from one request, 12 + 8 tokens asked of a session budget of 20
    budget = Budget(max_context_tokens=1024, max_response_tokens=64, max_lines=3, max_session_tokens=20)
    info = gateway.open_session("budget-within", budget=budget)
    client = openai_client(info)
    messages = [{"role": "user", "content": "pick"}]
    first = client.chat.completions.create(model="m", messages=messages, n=3, max_tokens=4)
    reply = first.choices[2].message.model_dump(exclude_none=True)
    second = client.chat.completions.create(
        model="m", messages=[*messages, reply, {"role": "user", "content": "go on"}], max_tokens=8
    )
    session = gateway.close_session_threadsafe("budget-within")
    assert len(session.lines) == 3 and session.refusals == 0
    assert session.generated == first.usage.completion_tokens + second.usage.completion_tokens
    assert all(t.status is not Status.TRUNCATED for t in session.trajectories())


def test_a_client_gone_mid_stream_leaves_no_lock_held(gateway, session):
    body = json.dumps(
        {"messages": [{"role": "user", "content": "long"}], "max_tokens": 200, "temperature": 0, "stream": True}
    ).encode()
    host, port = gateway.host, gateway.port
    with socket.create_connection((host, port)) as sock:  # sends the request, reads nothing, hangs up
        sock.sendall(
            f"POST /{session.trajectory}/0/v1/chat/completions HTTP/1.1\r\nhost: {host}\r\n"
            f"authorization: Bearer {session.api_key}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        time.sleep(0.3)
    started = time.monotonic()
    resp = _post(session, "/v1/chat/completions", {"messages": [{"role": "user", "content": "next"}], "max_tokens": 2})
    assert resp.status_code == 200 and time.monotonic() - started < 60
    # the abandoned turn committed, and asking it again is a retry answered from memory
    again = _post(session, "/v1/chat/completions", json.loads(body) | {"stream": False})
    assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 200
    lines = gateway.close_session_threadsafe(session.trajectory).trajectories()
    assert sorted(len(t.metadata["turns"]) for t in lines) == [1, 1]


# any code point: lone UTF-16 surrogates (what a JavaScript client that cuts a string mid-emoji
# sends, valid JSON) and noncharacters too
_odd = st.sampled_from(["\ud83d", "\ude00", "\ud800", "\udfff", "\ufffe", "\uffff", "\U0010ffff", "\x00"])
# (a list joined: st.text over this union would draw from the characters strategy alone)
_strings = st.lists(st.characters(exclude_categories=()) | _odd, max_size=8).map("".join)
_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | _strings,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_strings, inner, max_size=3),
    max_leaves=10,
)
_keys = st.sampled_from(
    [
        "messages",
        "model",
        "max_tokens",
        "n",
        "tools",
        "stop",
        "temperature",
        "stream",
        "seed",
        "tool_choice",
        "system",
        "stop_sequences",
        "top_k",
        "stream_options",
        "logprobs",
        "input",
        "instructions",
        "max_output_tokens",
        "text",
        "previous_response_id",
    ]
)


# well-formed fields too (any protocol's), so odd text gets past validation into a turn
_fields = st.fixed_dictionaries(
    {"model": _strings, "max_tokens": st.just(2)},
    optional={
        "system": _strings,
        "instructions": _strings,
        "stop": st.lists(_strings.filter(bool), max_size=2),
        "stop_sequences": st.lists(_strings.filter(bool), max_size=2),
    },
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    body=st.dictionaries(_keys, _json, max_size=6) | _fields,
    messages=st.lists(
        st.dictionaries(
            st.sampled_from(["role", "content", "tool_calls", "tool_call_id"]),
            _json | st.sampled_from(["user", "assistant", "tool", "system"]),
        )
        | st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": _strings}),
        max_size=3,
    ),
    path=st.sampled_from(["/v1/chat/completions", "/v1/messages", "/v1/responses"]),
)
def test_no_body_makes_a_5xx(gateway, body, messages, path):
    session = gateway.open_session(f"fuzz-{time.monotonic_ns()}", budget=Budget(default_max_tokens=2))
    body = {**body, "messages": messages} if messages else body
    if path == "/v1/responses" and messages:
        body = {**body, "input": messages}
    body.pop("n", None) if not isinstance(body.get("n"), int) or body.get("n", 1) > 2 else None
    for cap in ("max_tokens", "max_output_tokens"):
        if isinstance(body.get(cap), int) and body[cap] > 2:
            body[cap] = 2
    resp = _post(session, path, body)
    assert resp.status_code < 500, resp.text
    if resp.status_code >= 400:
        payload = resp.json()
        assert (payload.get("error") or {}).get("message"), payload


CUT = "cut \ud83d"  # a text cut after the first half of an emoji: a lone high surrogate
PARAMS = {"type": "object", "properties": {"x\udfff": {"type": "string"}}}


@pytest.mark.parametrize(
    "path, body",
    [
        (
            "/v1/chat/completions",
            {
                "model": CUT,
                "messages": [
                    {"role": "system", "content": CUT},
                    {"role": "user", "content": [{"type": "text", "text": CUT}]},
                ],
                "stop": [CUT, "\udfff"],
                "max_tokens": 2,
                "tools": [{"type": "function", "function": {"name": "f" + CUT, "parameters": PARAMS}}],
            },
        ),
        (
            "/v1/chat/completions",
            {
                "max_tokens": 2,
                "messages": [
                    {"role": "user", "content": "go"},
                    {
                        "role": "assistant",
                        "content": "",
                        "tool_calls": [
                            {
                                "id": "c\ud800",
                                "type": "function",
                                "function": {"name": "f", "arguments": json.dumps({"x": "\ud800"})},
                            }
                        ],
                    },  # escaped twice: decoded only in arguments
                    {"role": "tool", "tool_call_id": "c\ud800", "content": "\ude00 tail"},
                ],
            },
        ),
        (
            "/v1/messages",
            {
                "model": CUT,
                "max_tokens": 2,
                "system": [{"type": "text", "text": CUT}],
                "stop_sequences": [CUT],
                "messages": [{"role": "user", "content": CUT}],
                "tools": [{"name": "t" + CUT, "input_schema": PARAMS}],
            },
        ),
        (
            "/v1/responses",
            {
                "model": CUT,
                "instructions": CUT,
                "input": [{"role": "user", "content": CUT}],
                "max_output_tokens": 2,
                "tools": [{"type": "function", "name": "t" + CUT, "parameters": PARAMS}],
            },
        ),
    ],
)
def test_lone_surrogates_are_read_as_replacement_characters(gateway, path, body):
    session = gateway.open_session(f"surrogates-{time.monotonic_ns()}")
    resp = _post(session, path, body)  # json.dumps writes each lone surrogate as its \\u escape
    assert "\\ud83d" in json.dumps(body) or "\\ud800" in json.dumps(body)
    assert resp.status_code == 200, resp.text
    (trajectory,) = gateway.close_session_threadsafe(session.trajectory).trajectories()
    recorded = json.dumps([trajectory.metadata["messages"], trajectory.metadata["tools"]], ensure_ascii=False)
    recorded.encode()  # valid text throughout: no surrogate left
    assert "\ufffd" in recorded
    if path == "/v1/chat/completions" and "tool_calls" in body["messages"][1]:
        (call,) = trajectory.metadata["messages"][1]["tool_calls"]
        assert call["id"] == "c\ufffd" and call["function"]["arguments"] == {"x": "\ufffd"}


def test_a_client_gone_while_sending_its_body_is_one_log_line(gateway, session):
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append
    loggers = [logging.getLogger(name) for name in ("uvicorn.error", "loongsage.agentflow")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    try:
        with socket.create_connection((gateway.host, gateway.port)) as sock:  # promises 1000 bytes, sends 10
            sock.sendall(
                f"POST /{session.trajectory}/0/v1/messages HTTP/1.1\r\nhost: x\r\n"
                f'x-api-key: {session.api_key}\r\ncontent-length: 1000\r\n\r\n{{"model": '.encode()
            )
            time.sleep(0.3)
        deadline = time.monotonic() + 5
        while not records and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)  # a second report, if any, comes right after the first
    finally:
        for logger, level in zip(loggers, levels):
            logger.removeHandler(handler)
            logger.setLevel(level)
    assert len(records) == 1 and records[0].exc_info is None, [(r.name, r.getMessage()) for r in records]
    assert "hung up while sending its request" in records[0].getMessage()
    assert _post(session, "/v1/chat/completions", {"messages": USER, "max_tokens": 1}).status_code == 200
