"""Large requests: a prompt of megabytes does not stall other sessions (rendering and tokenizing
run off the event loop, and what certainly cannot fit the budget is refused before tokenizing),
the cheap bound never refuses a prompt that fits, and the body limit is a param of the run's
gateway service."""

from __future__ import annotations

import asyncio
import copy
import json
import random
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loongsage.agentflow.chat import fields
from loongsage.agentflow.chat.templates import QWEN3_TOOLS_TEMPLATE
from loongsage.agentflow.trajectories.rendering import ChatRenderer, PromptTooLong
from loongsage.agentflow.trajectories.store import Budget

sys.path.insert(0, str(Path(__file__).parent))
from _sessions import openai_client  # noqa: E402

pytestmark = pytest.mark.timeout(300)
# what a large tool output or file holds: mostly ASCII, some other text. (Characters beyond the BMP,
# emoji, make Python store the whole text at 4 bytes a character: reading such a body's JSON on the
# event loop then takes about twice as long.)
WORDS = ["def", "return", "self.value", "=", "x+1;", "12345", "gateway", "naïve", "中文", "\n", "    "]
STALL = 0.1  # seconds another session's turn may be slowed by a large request, at most (on an idle machine)


def _text(size: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    parts, total = [], 0
    while total < size:
        word = rng.choice(WORDS)
        parts.append(word)
        total += len(word.encode()) + 1
    return " ".join(parts)


def _body(text: str) -> bytes:
    """A request for ``text`` as a client writes it: UTF-8 JSON (the official clients do not escape
    non-ASCII text)."""
    return json.dumps({"messages": [{"role": "user", "content": text}]}, ensure_ascii=False).encode()


_questions = iter(range(10**9))


def _round_trips(client, until) -> list[float]:
    """Seconds of each of the session's turns (a new question each: no retry answered from memory)
    until ``until()`` is true."""
    seconds = []
    while not until():
        question = [{"role": "user", "content": f"{next(_questions)}+1="}]
        began = time.perf_counter()
        client.chat.completions.create(model="m", messages=question, max_tokens=1)
        seconds.append(time.perf_counter() - began)
    return seconds


def _while_posting(session, body: bytes, other) -> tuple[httpx.Response, list[float], list[float]]:
    """The big request's answer, and the other session's round trips before and while it is processed."""
    warm, before = iter(range(5)), iter(range(10))
    _round_trips(other, lambda: next(warm, None) is None)
    typical = _round_trips(other, lambda: next(before, None) is None)
    answer: dict[str, httpx.Response] = {}
    sender_client = httpx.Client(timeout=240)  # made here: a new client loads its certificates (~50 ms of CPU)

    def post() -> None:
        answer["resp"] = sender_client.post(
            f"{session.openai_base_url}/chat/completions",
            content=body,
            headers={"authorization": f"Bearer {session.api_key}", "content-type": "application/json"},
        )

    sender = threading.Thread(target=post)
    sender.start()
    during = _round_trips(other, lambda: not sender.is_alive())
    sender.join()
    sender_client.close()
    return answer["resp"], typical, during


def _slowdown(body: bytes) -> float:
    """How many times longer than its CPU time the gateway's one step on the event loop for
    ``body`` (reading its JSON) takes now: about 1 on an idle machine, more where other processes
    share the cores. Wall-clock bounds are scaled by it."""
    began, cpu = time.perf_counter(), time.thread_time()
    fields.json_body(body)
    return max(1.0, (time.perf_counter() - began) / max(time.thread_time() - cpu, 1e-3))


def _assert_no_stall(gateway, name: str, text: str, check, budget: Budget | None = None) -> None:
    """Another session's turns, while a request for ``text`` is processed, take at most STALL longer
    than usual (STALL of an idle machine's time). Up to three trials, each with a text of its own (a
    text seen before could be served from the renderer's caches): a burst of other work on a shared
    machine may slow one; a stalled event loop (seconds for such a request) slows every one."""
    # the measuring client: many unrelated one-turn conversations, past a session's default line limit
    other = openai_client(gateway.open_session(f"{name}-other", budget=Budget(max_lines=1 << 20)))
    seen = []
    for trial in range(3):
        body = _body(f"trial {trial}: {text}")
        resp, before, during = _while_posting(gateway.open_session(f"{name}-{trial}", budget=budget), body, other)
        check(resp)
        typical, slowdown = sorted(before)[len(before) // 2], _slowdown(body)
        seen.append(
            {"usual": round(typical, 3), "slowdown": round(slowdown, 2), "during": [round(s, 3) for s in during]}
        )
        if during and max(during) < typical + STALL * slowdown:
            return
    pytest.fail(f"another session's turns were stalled (seconds): {seen}")


def test_a_6_mib_prompt_over_the_budget_does_not_stall_other_sessions(wide_gateway):
    text = _text(6 << 20)
    assert len(text.encode()) > 6 << 20

    def refused_before_tokenizing(resp: httpx.Response) -> None:  # the default budget: 4096 tokens
        assert resp.status_code == 400 and resp.json()["error"]["code"] == "context_length_exceeded", resp.text
        assert "prompt of at least" in resp.json()["error"]["message"]

    _assert_no_stall(wide_gateway, "load-big", text, refused_before_tokenizing)
    session = wide_gateway.close_session_threadsafe("load-big-0")
    assert session.refusals == 1 and not session.lines  # its first request: no line to mark truncated


def test_a_prompt_tokenized_whole_is_tokenized_off_the_loop(wide_gateway):
    # a budget the cheap bound cannot rule out: the 512 KiB prompt is tokenized (most of a second),
    # then refused by the engine, whose context is shorter
    text = _text(512 << 10, seed=1)

    def tokenized(resp: httpx.Response) -> None:
        assert resp.status_code == 400 and "too long for max_model_len" in resp.json()["error"]["message"], resp.text

    _assert_no_stall(wide_gateway, "load-tokenized", text, tokenized, budget=Budget(max_context_tokens=1 << 20))


def test_a_follow_up_refused_before_tokenizing_marks_its_line_truncated(wide_gateway):
    import openai

    from loongsage.core.types import Status

    info = wide_gateway.open_session("load-follow-up", budget=Budget(max_context_tokens=512))
    client = openai_client(info)
    messages = [{"role": "user", "content": "hi"}]
    first = client.chat.completions.create(model="m", messages=messages, max_tokens=2)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": _text(100_000, seed=3)},
    ]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="m", messages=messages, max_tokens=2)
    assert err.value.code == "context_length_exceeded" and "prompt of at least" in err.value.message
    (trajectory,) = wide_gateway.close_session_threadsafe("load-follow-up").trajectories()
    assert trajectory.status is Status.TRUNCATED and len(trajectory.metadata["turns"]) == 1


# ------------------------------------------------------------------------------ the cheap bound
def _renderer(tokenizer, normalizer=None) -> ChatRenderer:
    if normalizer is not None:
        tokenizer = copy.deepcopy(tokenizer)
        tokenizer.backend_tokenizer.normalizer = normalizer
    return ChatRenderer(tokenizer, QWEN3_TOOLS_TEMPLATE)


def _normalizers():
    from tokenizers import normalizers

    return [None, normalizers.NFKC(), normalizers.Sequence([normalizers.NFC(), normalizers.Lowercase()])]


# what shrinks most under normalization, what spells longest, the special tokens, runs
_PIECES = st.sampled_from(
    [
        "\U0001d400",
        "\u1100\u1161\u11a8",
        "\uff21",
        "\u212a",
        "a\u0301",
        "<|im_start|>",
        "<|im_end|>",
        "assistant",
        " ",
        "\n",
        "😀",
        "中",
        "\ufffd",
        "x" * 40,
        " " * 40,
        "0123456789",
    ]
)
_TEXTS = st.lists(_PIECES | st.text(max_size=6), max_size=60).map("".join)


@settings(max_examples=150, deadline=None)
@given(text=_TEXTS, which=st.integers(0, 2))
def test_the_bound_never_refuses_a_prompt_that_fits(tokenizer, text, which):
    if which not in _RENDERERS:
        _RENDERERS[which] = _renderer(tokenizer, _normalizers()[which])
    renderer = _RENDERERS[which]
    tokens = len(renderer.encode(text))
    renderer.check(text, tokens + 1)  # a prompt of n tokens fits a limit of n + 1: never refused
    with pytest.raises(PromptTooLong):  # what takes n + 1 of the widest tokens is refused
        renderer.check("x" * ((tokens + 1) * renderer.bytes_per_token), tokens + 1)


_RENDERERS: dict[int, ChatRenderer] = {}


def test_the_bound_is_only_used_where_it_is_certain(tokenizer):
    from tokenizers import normalizers

    assert _renderer(tokenizer).bytes_per_token == 13  # "<|endoftext|>", the tiny vocabulary's widest token
    assert _renderer(tokenizer, normalizers.NFKC()).bytes_per_token == 13 * 4
    # a normalizer that may delete any amount of text: no bound, every prompt is tokenized
    unbounded = _renderer(tokenizer, normalizers.Replace("a", ""))
    assert unbounded.bytes_per_token is None
    unbounded.check("a" * 100_000, 10)


def test_long_texts_tokenize_as_short_ones(tokenizer):
    renderer = _renderer(tokenizer)
    text = _text(100_000, seed=2)
    assert renderer.encode(text) == tokenizer.encode(text, add_special_tokens=False)


# ------------------------------------------------------------------------- the service's params
def test_the_body_limit_is_a_param_of_the_gateway_service(tiny, tmp_path):
    from loongsage.core.config import ConfigError
    from loongsage.core.plugins import load_registry

    registry = load_registry()
    spec = {"name": "gateway", "params": {"max_body_bytes": 4096, "chat_parser": None}}
    service = registry.create("service", spec, "services.0")
    with pytest.raises(ConfigError, match=r"services.0.params.max_body_bytes=0: must be >= 1"):
        registry.create("service", {"name": "gateway", "params": {"max_body_bytes": 0}}, "services.0")
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    ctx = SimpleNamespace(registry=registry, engine=None, tokenizer=tiny[1], run_dir=tmp_path, serving=None)
    try:
        gateway = asyncio.run_coroutine_threadsafe(service.start(ctx), loop).result(60)
        info = gateway.open_session("limited-body")
        headers = {"authorization": f"Bearer {info.api_key}"}
        small = {"messages": [{"role": "user", "content": "x" * 100}], "max_tokens": 1}
        big = {"messages": [{"role": "user", "content": "x" * 5000}]}
        resp = httpx.post(f"{info.openai_base_url}/chat/completions", json=big, headers=headers)
        assert resp.status_code == 413 and "limit of 4096" in resp.json()["error"]["message"]
        # a body within the limit gets past it (to the engine, absent here: a 503)
        assert httpx.post(f"{info.openai_base_url}/chat/completions", json=small, headers=headers).status_code == 503
    finally:
        asyncio.run_coroutine_threadsafe(service.stop(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
