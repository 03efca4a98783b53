"""Gateway middlewares (``loongsage_gateway_middlewares``) on a real gateway, with the official clients:
a rewriting middleware changes what the model is asked, ``rate_limit`` answers 429 in each
protocol's error shape, with Retry-After, without reaching the model, ``request_log`` writes one
line per request, failures included."""

from __future__ import annotations

import asyncio
import json

import anthropic
import openai
import pytest

from loongsage.agentflow.gateway.middlewares import RateLimit, RequestLog

MAX_MODEL_LEN = 1024  # as the package conftest's engine


class ShortAnswers:
    """Rewrites the request: a client that sends ``user: "short"`` gets one token at most."""

    def __init__(self):
        self.seen = []

    async def __call__(self, request, call_next):
        self.seen.append((request["protocol"], request["trajectory"]))
        if request["body"].get("user") == "short":
            request["body"]["max_tokens"] = 1
        return await call_next(request)


@pytest.fixture(scope="module")
def limited(tiny, tmp_path_factory):
    from loongsage.agentflow.gateway.engines import DirectEngine
    from loongsage.agentflow.gateway.server import Gateway
    from loongsage.agentflow.gateway.service import ChatService
    from loongsage.core.engine.native import NativeEngine

    path, tokenizer = tiny
    log = tmp_path_factory.mktemp("mw") / "requests.jsonl"
    rewriter = ShortAnswers()
    engine = DirectEngine(NativeEngine(path, max_model_len=MAX_MODEL_LEN, max_batch_size=8))
    gw = Gateway(
        ChatService(engine, tokenizer),
        middlewares=[RequestLog(path=str(log)), rewriter, RateLimit(requests_per_second=0.2, burst=2)],
    )
    gw.start_background()
    yield gw, log, rewriter
    gw.stop_background()


def _openai(info):
    return openai.OpenAI(base_url=info.openai_base_url, api_key=info.api_key, max_retries=0, timeout=60)


def test_a_middleware_rewrites_the_request(limited):
    gw, _, rewriter = limited
    info = gw.open_session("rewrite")
    client = _openai(info)
    long = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "1+1="}], max_tokens=12, temperature=1.0, seed=3
    )
    short = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "2+2="}], max_tokens=12, temperature=1.0, seed=3, user="short"
    )
    assert short.usage.completion_tokens == 1 and short.choices[0].finish_reason == "length"
    assert long.usage.completion_tokens > 1
    assert ("openai", "rewrite") in rewriter.seen


def test_rate_limit_answers_429_in_each_protocol_without_reaching_the_model(limited):
    gw, log, _ = limited
    info = gw.open_session("limited")
    client = _openai(info)
    turns_before = gw.service.counters["turns"]
    for k in range(2):  # the burst (different questions: an equal request would be answered as a retry)
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": f"{k}+1="}], max_tokens=2)
    with pytest.raises(openai.RateLimitError) as err:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "1+1="}], max_tokens=2)
    assert "rate limit: at most 0.2 requests per second per session" in str(err.value)
    claude = anthropic.Anthropic(base_url=info.anthropic_base_url, api_key=info.api_key, max_retries=0, timeout=60)
    with pytest.raises(anthropic.RateLimitError):
        claude.messages.create(model="m", max_tokens=2, messages=[{"role": "user", "content": "1+1="}])
    assert gw.service.counters["turns"] == turns_before + 2  # the refused ones never reached the model
    # another session has a bucket of its own
    other = _openai(gw.open_session("other"))
    lookup = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}
    other.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "1+1="}], max_tokens=2, tools=[lookup]
    )
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    mine = [r for r in rows if r["trajectory"] == "limited"]
    assert [r["status"] for r in mine] == [200, 200, 429, 429]
    assert [r["protocol"] for r in mine] == ["openai"] * 3 + ["anthropic"]
    assert mine[0]["completion_tokens"] >= 1 and mine[2]["error"].startswith("rate limit")
    assert [(r["messages"], r["tools"], r["stream"]) for r in mine] == [(1, None, False)] * 4
    assert [(r["tools"], r["status"]) for r in rows if r["trajectory"] == "other"] == [(["lookup"], 200)]


def test_request_log_needs_a_path_outside_a_run():
    with pytest.raises(ValueError, match="path: required outside a run"):
        RequestLog()


def test_rate_limit_answers_each_protocol_in_its_shape_with_retry_after(limited):
    gw, _, _ = limited
    info = gw.open_session("limited-responses")
    client = _openai(info)
    for k in range(2):  # the burst
        client.responses.create(model="m", input=f"{k}+1=", max_output_tokens=2)
    with pytest.raises(openai.RateLimitError) as err:
        client.responses.create(model="m", input="1+1=", max_output_tokens=2)
    body = err.value.response.json()  # OpenAI's shape, as the Responses API writes its errors
    assert set(body) == {"error"} and body["error"]["type"] == "rate_limit_error" and "code" in body["error"]
    assert 1 <= int(err.value.response.headers["retry-after"]) <= 5  # 0.2 requests a second: 5 s at most
    assert 0 < int(err.value.response.headers["retry-after-ms"]) <= 5000
    claude = anthropic.Anthropic(base_url=info.anthropic_base_url, api_key=info.api_key, max_retries=0, timeout=60)
    with pytest.raises(anthropic.RateLimitError) as claude_err:
        claude.messages.create(model="m", max_tokens=2, messages=[{"role": "user", "content": "1+1="}])
    assert claude_err.value.response.json()["type"] == "error"
    assert int(claude_err.value.response.headers["retry-after"]) >= 1


class BrokenParser:
    kind = "chat_parser"

    def parse(self, text):
        raise RuntimeError("the parser broke")


def test_request_log_records_failures_and_responses_input(limited):
    gw, log, _ = limited
    client = _openai(gw.open_session("logged"))
    client.responses.create(
        model="m", input=[{"role": "user", "content": "1+1="}, {"role": "user", "content": "2+2="}], max_output_tokens=2
    )
    saved, gw.service.parser = gw.service.parser, BrokenParser()
    try:
        with pytest.raises(openai.InternalServerError):
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "1+1="}], max_tokens=2)
    finally:
        gw.service.parser = saved
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    mine = [(r["protocol"], r["messages"], r["status"], r["error"]) for r in rows if r["trajectory"] == "logged"]
    assert mine == [("responses", 2, 200, None), ("openai", 1, 500, "internal error: RuntimeError")]


def test_request_log_records_a_later_middleware_that_fails(tmp_path):
    log = RequestLog(path=str(tmp_path / "requests.jsonl"))

    async def failing(request):
        raise RuntimeError("a middleware broke")

    request = {"protocol": "responses", "trajectory": "t", "attempt": 0, "body": {"input": "hi", "stream": True}}
    with pytest.raises(RuntimeError):
        asyncio.run(log(request, failing))
    (row,) = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert (row["status"], row["messages"], row["stream"]) == (500, 1, True)
    assert row["error"] == "internal error: RuntimeError"
