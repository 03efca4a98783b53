"""Anthropic Messages: the request read into a :class:`ChatRequest`, the answer written back as a
``message`` or as the Messages stream events.

Blocks map onto canonical messages: ``text`` blocks are a message's content, ``thinking`` the
reply's reasoning, ``tool_use`` its tool calls (``input`` kept parsed), and each ``tool_result``
becomes a ``tool`` message before the rest of its user turn. A ``system`` message inside
``messages`` (Claude Code 2.1 sends them; the Messages API's mid-conversation system messages) is
a system message where it stands: before the first user or assistant message it joins the system
prompt, later the template renders it in place, so a later turn still extends the line. Accepted
and ignored: ``metadata``, ``thinking``, ``service_tier``, ``cache_control``,
``context_management`` (the prompt is the history as sent), ``output_config`` but its ``format``,
block signatures, server tools. Refused with a 400: image and document blocks, a trailing
assistant message (prefill), structured output (``output_config.format``, ``output_format``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from loongsage.agentflow.chat import fields
from loongsage.agentflow.chat.errors import bad_request
from loongsage.agentflow.chat.messages import Message, assistant, function_tools, text_of, tool_call
from loongsage.agentflow.gateway.service import ChatRequest, ChatResult, Choice

_CHUNK = 24
_STOP = {"tool_calls": "tool_use", "stop": "end_turn", "length": "max_tokens", "abort": "max_tokens"}


def parse(body: dict[str, Any]) -> tuple[ChatRequest, str, bool]:
    """``(request, model, stream)``."""
    model = fields.text(body, "model")
    max_tokens = fields.integer(body, "max_tokens", None, 1, fields.TOKENS_MAX)
    if max_tokens is None:
        raise bad_request("max_tokens is required", "max_tokens")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad_request("messages must be a non-empty array", "messages")
    _no_structured_output(body)
    messages = _system(body.get("system"))
    for i, entry in enumerate(raw):
        for message in _message(entry, f"messages.{i}"):
            if message["role"] == "system" and len(messages) == 1 and messages[0]["role"] == "system":
                # still the prompt's head: one system message (many templates read only the first)
                message = {"role": "system", "content": messages.pop()["content"] + "\n\n" + message["content"]}
            messages.append(message)
    if raw[-1].get("role") == "assistant":
        raise bad_request("a final assistant message (prefill) is not supported", f"messages.{len(raw) - 1}")
    choice = body.get("tool_choice")
    if choice is not None and not (isinstance(choice, dict) and choice.get("type") in ("auto", "any", "tool", "none")):
        raise bad_request("tool_choice must be an object with type auto, any, tool or none", "tool_choice")
    request = ChatRequest(
        messages=messages,
        tools=_tools(body.get("tools")),
        parse_tool_calls=not (choice and choice.get("type") == "none"),
        max_tokens=max_tokens,
        temperature=fields.number(body, "temperature", 1.0, 0.0, 1.0),
        top_p=fields.number(body, "top_p", 1.0, 0.0, 1.0),
        top_k=fields.integer(body, "top_k", 0, 0, 1 << 20),
        stop=fields.strings(body, "stop_sequences"),
    )
    return request, model, fields.flag(body, "stream")


def _no_structured_output(body: dict[str, Any]) -> None:
    config = body.get("output_config")
    if config is not None and not isinstance(config, dict):
        raise bad_request("output_config must be an object", "output_config")
    formats = (("output_config.format", (config or {}).get("format")), ("output_format", body.get("output_format")))
    for name, value in formats:
        if value is not None:
            raise bad_request(f"{name}: structured output is not supported (no constrained decoding)", name)


def _system(raw: Any, where: str = "system") -> list[Message]:
    if raw is None:
        return []
    text = text_of(raw, where)
    return [{"role": "system", "content": text}] if text else []


def _message(raw: Any, where: str) -> list[Message]:
    if not isinstance(raw, dict) or raw.get("role") not in ("user", "assistant", "system"):
        raise bad_request(f"{where}: must be an object with role 'user', 'assistant' or 'system'", where)
    if raw["role"] == "system":
        return _system(raw.get("content"), f"{where}.content")
    content = raw.get("content")
    if isinstance(content, str):
        return [{"role": raw["role"], "content": content}]
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or an array of content blocks", f"{where}.content")
    blocks = [_block(b, f"{where}.content.{j}") for j, b in enumerate(content)]
    return _assistant(blocks) if raw["role"] == "assistant" else _user(blocks)


def _block(raw: Any, where: str) -> dict[str, Any]:
    if not isinstance(raw, dict) or not isinstance(raw.get("type"), str):
        raise bad_request(f"{where}: a content block must be an object with a type", where)
    kind = raw["type"]
    if kind in ("text", "thinking") and not isinstance(raw.get(kind), str):
        raise bad_request(f"{where}.{kind} must be a string", where)
    if kind == "tool_use" and not (
        isinstance(raw.get("id"), str) and isinstance(raw.get("name"), str) and isinstance(raw.get("input", {}), dict)
    ):
        raise bad_request(f"{where}: tool_use needs a string id and name and an object input", where)
    if kind == "tool_result":
        if not isinstance(raw.get("tool_use_id"), str):
            raise bad_request(f"{where}.tool_use_id must be a string", where)
        return {"type": kind, "id": raw["tool_use_id"], "text": text_of(raw.get("content"), f"{where}.content")}
    if kind not in ("text", "thinking", "redacted_thinking", "tool_use"):
        raise bad_request(f"{where}: content blocks of type {kind!r} are not supported (text and tools only)", where)
    return raw


def _user(blocks: list[dict[str, Any]]) -> list[Message]:
    out: list[Message] = []
    text: list[str] = []
    for b in blocks:
        if b["type"] == "tool_result":
            if text:
                out.append({"role": "user", "content": "".join(text)})
                text = []
            out.append({"role": "tool", "content": b["text"], "tool_call_id": b["id"]})
        elif b["type"] == "text":
            text.append(b["text"])
        else:
            raise bad_request(f"a user message cannot hold a {b['type']} block", "messages")
    if text or not out:
        out.append({"role": "user", "content": "".join(text)})
    return out


def _assistant(blocks: list[dict[str, Any]]) -> list[Message]:
    text = "".join(b["text"] for b in blocks if b["type"] == "text")
    reasoning = "".join(b["thinking"] for b in blocks if b["type"] == "thinking")
    calls = [tool_call(b["id"], b["name"], b.get("input", {})) for b in blocks if b["type"] == "tool_use"]
    if any(b["type"] == "tool_result" for b in blocks):
        raise bad_request("an assistant message cannot hold a tool_result block", "messages")
    return [assistant(text, reasoning or None, calls)]


def _tools(raw: Any) -> list[dict[str, Any]] | None:
    # a server tool (web search, bash, ...) has a type other than "custom": not the policy's to call
    return function_tools(
        raw, function_type="custom", spec_of=lambda tool: tool, schema="input_schema", path=lambda i: f"tools.{i}"
    )


# ------------------------------------------------------------------------------------ answers
def _blocks(choice: Choice) -> list[dict[str, Any]]:
    m = choice.message
    blocks: list[dict[str, Any]] = []
    if m.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": m["reasoning_content"], "signature": ""})
    if m["content"] or not m.get("tool_calls"):
        blocks.append({"type": "text", "text": m["content"]})
    for call in m.get("tool_calls") or []:
        args = call["function"]["arguments"]
        blocks.append(
            {
                "type": "tool_use",
                "id": call["id"],
                "name": call["function"]["name"],
                "input": args if isinstance(args, dict) else {"arguments": args},
            }
        )
    return blocks


def response(result: ChatResult, model: str) -> dict[str, Any]:
    (choice,) = result.choices
    return {
        "id": "msg_" + result.id.removeprefix("chatcmpl-"),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": _blocks(choice),
        "stop_reason": _stop_reason(choice),
        "stop_sequence": choice.stop_sequence,
        "usage": {"input_tokens": result.prompt_tokens, "output_tokens": result.completion_tokens},
    }


def _stop_reason(choice: Choice) -> str:
    return "stop_sequence" if choice.stop_sequence is not None else _STOP[choice.finish_reason]


def events(result: ChatResult, model: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(event name, data)`` of the Messages stream of one answer."""
    message = response(result, model)
    (choice,) = result.choices
    yield (
        "message_start",
        {
            "type": "message_start",
            "message": {
                **message,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {"input_tokens": result.prompt_tokens, "output_tokens": 0},
            },
        },
    )
    for i, block in enumerate(message["content"]):
        kind = block["type"]
        start = {
            "thinking": {"type": "thinking", "thinking": "", "signature": ""},
            "text": {"type": "text", "text": ""},
            "tool_use": {**block, "input": {}},
        }[kind]
        yield "content_block_start", {"type": "content_block_start", "index": i, "content_block": start}
        body, delta = {
            "thinking": (block.get("thinking"), "thinking_delta"),
            "text": (block.get("text"), "text_delta"),
            "tool_use": (json.dumps(block.get("input"), ensure_ascii=False), "input_json_delta"),
        }[kind]
        key = {"thinking_delta": "thinking", "text_delta": "text", "input_json_delta": "partial_json"}[delta]
        for j in range(0, len(body), _CHUNK):
            yield (
                "content_block_delta",
                {"type": "content_block_delta", "index": i, "delta": {"type": delta, key: body[j : j + _CHUNK]}},
            )
        yield "content_block_stop", {"type": "content_block_stop", "index": i}
    yield (
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": message["stop_reason"], "stop_sequence": choice.stop_sequence},
            "usage": {"output_tokens": result.completion_tokens},
        },
    )
    yield "message_stop", {"type": "message_stop"}
