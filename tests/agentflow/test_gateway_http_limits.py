"""The gateway's HTTP limits against clients that never finish: a head that never ends, requests
sent byte by byte, connections that send nothing, and more connections than it keeps. Raw
sockets on loopback, as a hostile agent would send them; the official client checks that every
other session is still served."""

from __future__ import annotations

import json
import socket
import time

import openai
import pytest

from tests.agentflow.conftest import MAX_MODEL_LEN, Recorder

LIMIT_S = 1.5  # the test gateway's time to send one request
CONNECTIONS = 6


@pytest.fixture(scope="module")
def strict(tiny):
    """A gateway with a short request time and a small connection limit."""
    from loongsage.agentflow.chat.parsers import Qwen3ChatParser
    from loongsage.agentflow.gateway.engines import DirectEngine
    from loongsage.agentflow.gateway.server import Gateway
    from loongsage.agentflow.gateway.service import ChatService
    from loongsage.core.engine.native import NativeEngine

    path, tokenizer = tiny
    engine = Recorder(DirectEngine(NativeEngine(path, max_model_len=MAX_MODEL_LEN, max_batch_size=4)))
    gw = Gateway(
        ChatService(engine, tokenizer, parser=Qwen3ChatParser()),
        max_connections=CONNECTIONS,
        request_timeout_s=LIMIT_S,
    )
    gw.start_background()
    yield gw
    gw.stop_background()


def _served(gw) -> None:
    """A real client of a fresh session still gets its turn."""
    info = gw.open_session(f"ok-{time.monotonic_ns()}")
    client = openai.OpenAI(base_url=info.openai_base_url, api_key=info.api_key, max_retries=0, timeout=60)
    reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert reply.choices[0].message.role == "assistant"


def _answer(sock: socket.socket, within: float) -> tuple[int, dict | None, bool]:
    """``(status, JSON body, closed after it)`` of the one response the server writes."""
    sock.settimeout(within)
    data = b""
    try:
        while chunk := sock.recv(1 << 16):
            data += chunk
        closed = True
    except ConnectionResetError:
        closed = True
    except TimeoutError:
        closed = False
    if not data:
        return 0, None, closed
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body) if body else None, closed


@pytest.mark.parametrize("shape", ["many lines", "one line that never ends"])
def test_a_head_over_the_limit_is_a_431(strict, shape):
    """Whole header lines are counted as the parser hands them over; a line that never ends is
    kept by the parser to itself, and counted by the reads that carry it. (Sent in reads the
    server takes whole: a server closing with bytes unread would reset the connection, and the
    client could lose the answer.)"""
    with socket.create_connection((strict.host, strict.port)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n" + (b"X-Pad: " if shape != "many lines" else b""))
        for i in range(5):  # 50 KiB of head in five reads, and no end to it
            time.sleep(0.1)
            piece = b"a" * 10240
            sock.sendall(b"X-Pad-%d: " % i + piece + b"\r\n" if shape == "many lines" else piece)
        status, body, closed = _answer(sock, 10)
    assert (status, closed) == (431, True), (status, body)
    assert "over 32768 bytes" in body["error"]["message"], body


def test_a_head_that_never_ends_is_not_kept(strict):
    """64 MiB of one header line, sent as fast as it goes: refused long before its end, whatever
    becomes of the answer in the reset."""
    with socket.create_connection((strict.host, strict.port)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: ")
        sent = 0
        try:
            for _ in range(64):
                sock.sendall(b"a" * (1 << 20))
                sent += 1
        except (ConnectionResetError, BrokenPipeError):
            pass
        _, _, closed = _answer(sock, 10)
    assert closed and sent < 64
    _served(strict)


def test_blank_lines_after_a_request_do_not_hold_a_connection(strict):
    """Blank lines begin no request, yet stop the kept-alive timer: they start the request's time."""
    with socket.create_connection((strict.host, strict.port)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        sock.settimeout(10)
        assert sock.recv(1 << 16).startswith(b"HTTP/1.1 200")
        started = time.monotonic()
        sock.sendall(b"\r\n")
        status, _, closed = _answer(sock, 4 * LIMIT_S + 5)
    assert (status, closed) == (408, True) and time.monotonic() - started < 4 * LIMIT_S + 5


def test_a_request_sent_too_slowly_is_closed(strict):
    info = strict.open_session(f"slow-{time.monotonic_ns()}")
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
    with (
        socket.create_connection((strict.host, strict.port)) as idle,
        socket.create_connection((strict.host, strict.port)) as head,
        socket.create_connection((strict.host, strict.port)) as half,
    ):
        head.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # a head that never ends
        half.sendall(  # a body that never ends: the app is reading it when the time is up
            b"POST /%s/0/v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
            % (info.trajectory.encode(), info.api_key.encode(), len(body))
            + body[:10]
        )
        started = time.monotonic()
        answers = [_answer(sock, 4 * LIMIT_S + 5) for sock in (idle, head, half)]
        waited = time.monotonic() - started
    assert [(status, closed) for status, _, closed in answers] == [(408, True), (408, True), (0, True)], answers
    assert "no whole request within 1.5 s" in answers[0][1]["error"]["message"]
    assert LIMIT_S * 0.8 < waited < 4 * LIMIT_S + 5
    assert not strict.service.store.get(info.trajectory, 0).lines  # the half-sent turn never ran
    _served(strict)


def test_a_turn_that_takes_longer_than_the_request_time_is_answered(strict):
    """The limit is on sending a request, not on generating its answer, nor on a kept-alive
    connection between requests (a client's pool reuses it)."""
    info = strict.open_session(f"long-{time.monotonic_ns()}")
    client = openai.OpenAI(base_url=info.openai_base_url, api_key=info.api_key, max_retries=0, timeout=60)
    engine = strict.service.engine
    real = engine.generate

    async def slow(*args, **kwargs):
        import asyncio

        await asyncio.sleep(2 * LIMIT_S)
        return await real(*args, **kwargs)

    engine.generate = slow
    try:
        for _ in range(2):
            reply = client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
            assert reply.choices[0].finish_reason in ("stop", "length")
            time.sleep(LIMIT_S * 1.5)  # idle on the kept-alive connection: not a slow request
    finally:
        engine.generate = real


def test_connections_past_the_limit_are_503s_at_once_and_the_rest_are_served(strict):
    held = [socket.create_connection((strict.host, strict.port)) for _ in range(CONNECTIONS)]
    try:
        time.sleep(0.2)
        with socket.create_connection((strict.host, strict.port)) as extra:
            started = time.monotonic()
            status, body, closed = _answer(extra, LIMIT_S / 2)
            assert (status, closed) == (503, True) and time.monotonic() - started < LIMIT_S / 2
            assert f"holds {CONNECTIONS} connections" in body["error"]["message"]
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.2)
    _served(strict)


def test_requests_of_one_session_past_its_limit_are_429s_before_their_body_is_read(gateway):
    """A session's turns run one at a time; a client sending many at once would have every body
    read and held while they wait. Past SESSION_REQUESTS the rest are 429s, and another session
    is served meanwhile."""
    import asyncio
    import threading
    from concurrent.futures import ThreadPoolExecutor, wait

    from loongsage.agentflow.gateway.server import SESSION_REQUESTS

    info = gateway.open_session(f"many-{time.monotonic_ns()}")
    client = openai.OpenAI(base_url=info.openai_base_url, api_key=info.api_key, max_retries=0, timeout=120)
    engine, real, release = gateway.service.engine, gateway.service.engine.generate, threading.Event()

    async def held(input_ids, sampling, session=None):  # this session's turns wait until the refusals are in
        if session == f"{info.trajectory}/0":
            await asyncio.to_thread(release.wait, 60)
        return await real(input_ids, sampling, session)

    def one(k: int) -> int:
        try:
            client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": f"q{k}"}], max_tokens=1, extra_body={"x": [{}] * 1000}
            )
        except openai.RateLimitError as exc:
            assert f"has {SESSION_REQUESTS} requests in flight" in exc.message
            return 429
        return 200

    engine.generate = held
    try:
        with ThreadPoolExecutor(SESSION_REQUESTS + 4) as pool:
            futures = [pool.submit(one, k) for k in range(SESSION_REQUESTS + 4)]
            deadline = time.monotonic() + 60
            while sum(f.done() for f in futures) < 4 and time.monotonic() < deadline:
                wait(futures, timeout=0.1)
            _served(gateway)  # another session is served meanwhile
            release.set()
            statuses = [f.result() for f in futures]
    finally:
        release.set()
        engine.generate = real
    assert sorted(statuses) == [200] * SESSION_REQUESTS + [429] * 4, statuses
    assert gateway.service.store.get(info.trajectory, 0).requests == 0
