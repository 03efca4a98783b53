"""The qwen3 chat parser: hand-written completions, and every reply the template renders parses back."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from hypothesis import given, settings

from loongsage.agentflow.chat.parsers import Qwen3ChatParser
from loongsage.agentflow.trajectories.rendering import ChatRenderer
from loongsage.core.contract_check import check_class
from loongsage.core.contracts import ChatParser
from loongsage.core.plugins import load_registry

sys.path.insert(0, str(Path(__file__).parent))
from _conversations import replies, reply_text  # noqa: E402

P = Qwen3ChatParser()


def _call(name, args):
    return {"type": "function", "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}


def test_plain_text_is_content():
    assert P.parse("  hello there\n") == {"content": "hello there", "reasoning_content": None, "tool_calls": []}


def test_reasoning_with_and_without_the_opening_tag():
    assert P.parse("<think>\nstep 1\n</think>\n\nanswer") == {
        "content": "answer",
        "reasoning_content": "step 1",
        "tool_calls": [],
    }
    # the opening tag sat in the generation prompt
    assert P.parse("step 1\n</think>\n\nanswer")["reasoning_content"] == "step 1"
    # cut off by the length limit while reasoning
    assert P.parse("<think>\nstill going") == {"content": "", "reasoning_content": "still going", "tool_calls": []}


def test_tool_calls_are_taken_out_of_the_content():
    text = (
        'Let me look.\n<tool_call>\n{"name": "search", "arguments": {"q": "ß 中"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": [2, 3]}}\n</tool_call>'
    )
    assert P.parse(text) == {
        "content": "Let me look.",
        "reasoning_content": None,
        "tool_calls": [_call("search", {"q": "ß 中"}), _call("add", {"a": 1, "b": [2, 3]})],
    }


def test_blocks_that_are_no_calls_stay_text():
    bad_json = '<tool_call>\n{"name": "f", "arguments": {</tool_call>'
    no_name = '<tool_call>{"arguments": {}}</tool_call>'
    unclosed = 'x <tool_call>\n{"name": "f", "arguments": {}}'
    for text in (bad_json, no_name, unclosed):
        assert P.parse(text) == {"content": text.strip(), "reasoning_content": None, "tool_calls": []}
    # string arguments pass through as they are
    assert P.parse('<tool_call>{"name": "f", "arguments": "raw"}</tool_call>')["tool_calls"] == [
        {"type": "function", "function": {"name": "f", "arguments": "raw"}}
    ]


def test_switches():
    text = '<think>r</think>a<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    assert Qwen3ChatParser(reasoning=False, tool_calls=False).parse(text)["content"] == text
    assert Qwen3ChatParser(tool_calls=False).parse(text)["reasoning_content"] == "r"


def test_registered_as_a_chat_parser_backend():
    registry = load_registry()
    entry = registry.entry("chat_parser", "qwen3")
    assert entry.provider.startswith("loongsage-agentflow ")
    assert check_class(Qwen3ChatParser, ChatParser) is None
    parser = registry.create("chat_parser", {"name": "qwen3", "params": {"reasoning": False}}, "gateway.parser")
    assert parser == Qwen3ChatParser(reasoning=False)


@settings(max_examples=60, deadline=None)
@given(reply=replies())
def test_every_rendered_reply_parses_back(tokenizer, reply):
    """What the template writes for a reply (reasoning, content, calls) is what the parser reads."""
    renderer = ChatRenderer(tokenizer)
    parsed = P.parse(reply_text(renderer, reply))
    assert parsed["content"] == reply["content"]
    assert parsed["reasoning_content"] == reply.get("reasoning_content")
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed["tool_calls"]]
    assert calls == [(c["function"]["name"], c["function"]["arguments"]) for c in reply.get("tool_calls", [])]
