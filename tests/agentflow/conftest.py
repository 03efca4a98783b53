"""The tiny Qwen3 model and tokenizer (built offline by the core), a native engine and a gateway."""

from __future__ import annotations

import pytest

from loongsage.agentflow.chat.templates import QWEN3_TOOLS_TEMPLATE

MAX_MODEL_LEN = 1024


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """``(model folder, tokenizer)``: the embedded tiny Qwen3 with the tools chat template."""
    from loongsage.core.tinytask.tiny_model import build_tiny_qwen3

    path = tmp_path_factory.mktemp("agentflow_model")
    _, tokenizer = build_tiny_qwen3(path, max_position_embeddings=MAX_MODEL_LEN)
    tokenizer.chat_template = QWEN3_TOOLS_TEMPLATE
    return str(path), tokenizer


@pytest.fixture(scope="session")
def tokenizer(tiny):
    return tiny[1]


class Recorder:
    """An engine client that passes every call to the real engine and keeps what went in and out."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    async def generate(self, input_ids, sampling, session=None):
        results = await self.inner.generate(input_ids, sampling, session)
        self.calls.append((list(input_ids), sampling, results))
        return results

    def release_session(self, session):
        self.inner.release_session(session)


@pytest.fixture(scope="module")
def gateway(tiny):
    """A gateway on a thread of its own over a native engine in this process, with the qwen3 parser."""
    from loongsage.agentflow.chat.parsers import Qwen3ChatParser
    from loongsage.agentflow.gateway.engines import DirectEngine
    from loongsage.agentflow.gateway.server import Gateway
    from loongsage.agentflow.gateway.service import ChatService
    from loongsage.core.engine.native import NativeEngine

    path, tokenizer = tiny
    engine = Recorder(DirectEngine(NativeEngine(path, max_model_len=MAX_MODEL_LEN, max_batch_size=16)))
    gw = Gateway(ChatService(engine, tokenizer, parser=Qwen3ChatParser()), max_body_bytes=1 << 20)
    gw.start_background()
    yield gw
    gw.stop_background()


@pytest.fixture(scope="module")
def wide_gateway(tiny):
    """A gateway like ``gateway``'s over an engine with room for long prompts (4096 tokens: the
    tiny tokenizer spends about one token per 1.5 characters) and the default 8 MiB body limit."""
    from loongsage.agentflow.chat.parsers import Qwen3ChatParser
    from loongsage.agentflow.gateway.engines import DirectEngine
    from loongsage.agentflow.gateway.server import Gateway
    from loongsage.agentflow.gateway.service import ChatService
    from loongsage.core.engine.native import NativeEngine

    path, tokenizer = tiny
    engine = Recorder(DirectEngine(NativeEngine(path, max_model_len=4096, max_batch_size=8)))
    gw = Gateway(ChatService(engine, tokenizer, parser=Qwen3ChatParser()))
    gw.start_background()
    yield gw
    gw.stop_background()


_ids = iter(range(10**9))


@pytest.fixture
def session(gateway):
    """A fresh session of the module's gateway."""
    return gateway.open_session(f"traj-{next(_ids)}")


class ScriptedToolParser:
    """A deterministic chat parser for the plumbing tests (the tiny model never writes a tool call
    by itself): every completion is read as one call of ``lookup`` whose argument is the length of
    the completion's text, with that text as the reasoning."""

    kind = "chat_parser"

    def parse(self, text):
        import json

        return {
            "content": "",
            "reasoning_content": f"wrote {len(text)} characters",
            "tool_calls": [
                {"type": "function", "function": {"name": "lookup", "arguments": json.dumps({"n": len(text)})}}
            ],
        }


@pytest.fixture
def tool_parser(gateway):
    """The module's gateway reads every completion as a tool call for the length of one test."""
    saved = gateway.service.parser
    gateway.service.parser = ScriptedToolParser()
    yield
    gateway.service.parser = saved
