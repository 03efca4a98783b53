"""OpenAI Responses: the request's ``input`` items read into a :class:`ChatRequest`, the answer
written back as a ``response`` object or as its stream of typed events.

``input`` is a string or a list of items: messages (``role`` user / system / developer / assistant,
text content or ``input_text`` / ``output_text`` parts), ``function_call`` items (the calls the
model made, sent back) and ``function_call_output`` items (their results); ``instructions`` becomes
a leading system message. A client that sends back the output of the previous response extends the
session's line, as with chat completions (the reply's ``call_id`` is the gateway's tool-call id).
``reasoning`` items sent back are the reasoning of the assistant turn they belong to. Function tools are
flat (``{"type": "function", "name", ...}``);
hosted tools are accepted and ignored, as are ``store``, ``metadata``, ``reasoning``, ``include``,
``truncation``, ``user``, ``service_tier``, ``parallel_tool_calls``, ``prompt_cache_key``.
Refused with a 400 naming the field: ``previous_response_id`` and ``conversation`` (the gateway
keeps no server-side conversation: send the whole input), ``item_reference`` items, non-text
content, a ``text.format`` other than text.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from loongsage.agentflow.chat import fields
from loongsage.agentflow.chat.errors import bad_request
from loongsage.agentflow.chat.messages import Message, assistant, function_tools, text_of, tool_call
from loongsage.agentflow.gateway.service import ChatRequest, ChatResult

_CHUNK = 24  # characters of text per streamed delta
_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}


@dataclass
class Options:
    model: str | None
    stream: bool
    tool_choice: Any
    temperature: float
    top_p: float


def parse(body: dict[str, Any]) -> tuple[ChatRequest, Options]:
    for name in ("previous_response_id", "conversation"):
        if body.get(name) is not None:
            raise bad_request(
                f"{name}: not supported (the gateway keeps no server-side conversation; send the whole input)", name
            )
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type", "text") == "text"):
        raise bad_request("text.format: only {'type': 'text'} is supported (no constrained decoding)", "text.format")
    tool_choice = body.get("tool_choice")
    if tool_choice is not None and not (tool_choice in ("none", "auto", "required") or isinstance(tool_choice, dict)):
        raise bad_request(
            f"tool_choice={tool_choice!r}: must be 'none', 'auto', 'required' or an object", "tool_choice"
        )
    messages = input_messages(body.get("input"))
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad_request("instructions must be a string", "instructions")
        messages = [{"role": "system", "content": instructions}, *messages]
    temperature = fields.number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = fields.number(body, "top_p", 1.0, 0.0, 1.0)
    request = ChatRequest(
        messages=messages,
        tools=_tools(body.get("tools")),
        parse_tool_calls=tool_choice != "none",
        max_tokens=fields.integer(body, "max_output_tokens", None, 1, fields.TOKENS_MAX),
        temperature=temperature,
        top_p=top_p,
        top_k=fields.integer(body, "top_k", 0, 0, 1 << 20),
        min_p=fields.number(body, "min_p", 0.0, 0.0, 1.0),
        n=1,
        seed=fields.integer(body, "seed", None, -fields.SEED_MAX, fields.SEED_MAX),
        stop=[],
    )
    options = Options(
        model=fields.text(body, "model", None),
        stream=fields.flag(body, "stream"),
        tool_choice=tool_choice if tool_choice is not None else "auto",
        temperature=temperature,
        top_p=top_p,
    )
    return request, options


def input_messages(raw: Any) -> list[Message]:
    """Canonical messages from ``input``; consecutive assistant items (a message and the calls after
    it) form one assistant message, as the model wrote them in one turn."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise bad_request("input must be a string or a non-empty array of items", "input")
    out: list[Message] = []
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            role = _ROLES.get(item.get("role")) if isinstance(item.get("role"), str) else None
            if role is None:
                raise bad_request(
                    f"{where}.role={item.get('role')!r}: must be one of {sorted(_ROLES)}", f"{where}.role"
                )
            content = text_of(item.get("content"), f"{where}.content")
            if role == "assistant":
                _assistant_turn(out)["content"] += content
            else:
                out.append({"role": role, "content": content})
        elif kind == "function_call":
            for name in ("call_id", "name"):
                if not isinstance(item.get(name), str) or not item[name]:
                    raise bad_request(f"{where}.{name} must be a non-empty string", f"{where}.{name}")
            turn = _assistant_turn(out)
            turn.setdefault("tool_calls", []).append(
                tool_call(item["call_id"], item["name"], item.get("arguments", "{}"))
            )
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise bad_request(f"{where}.call_id must be a string", f"{where}.call_id")
            output = item.get("output")
            text = output if isinstance(output, str) else text_of(output, f"{where}.output")
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
        elif kind == "reasoning":  # the model's own reasoning, sent back: part of its turn
            parts = item.get("content") or item.get("summary") or []
            if not isinstance(parts, list):
                raise bad_request(f"{where}.content must be an array of reasoning parts", f"{where}.content")
            text = "".join(p.get("text", "") for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str))
            if text:
                turn = _assistant_turn(out)
                turn["reasoning_content"] = turn.get("reasoning_content", "") + text
        else:
            raise bad_request(
                f"{where}.type={kind!r}: not supported (message, function_call, function_call_output, reasoning)",
                f"{where}.type",
            )
    if not out:
        raise bad_request("input holds no message", "input")
    return out


def _assistant_turn(out: list[Message]) -> Message:
    """The assistant message the next assistant item belongs to (the last one, if nothing came after it)."""
    if not out or out[-1]["role"] != "assistant":
        out.append(assistant(""))
    return out[-1]


def _tools(raw: Any) -> list[dict[str, Any]] | None:
    # flat function tools; hosted tools (web search, file search, ...) are not the policy's to call
    return function_tools(
        raw, function_type="function", spec_of=lambda tool: tool, schema="parameters", path=lambda i: f"tools[{i}]"
    )


# ------------------------------------------------------------------------------------ answers
def _items(result: ChatResult) -> list[dict[str, Any]]:
    choice = result.choices[0]
    message, items = choice.message, []
    if message.get("reasoning_content"):
        items.append(
            {
                "type": "reasoning",
                "id": _id("rs"),
                "summary": [],
                "content": [{"type": "reasoning_text", "text": message["reasoning_content"]}],
            }
        )
    calls = message.get("tool_calls") or []
    if message["content"] or not calls:
        items.append(
            {
                "type": "message",
                "id": _id("msg"),
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": message["content"], "annotations": []}],
            }
        )
    for call in calls:
        args = call["function"]["arguments"]
        items.append(
            {
                "type": "function_call",
                "id": _id("fc"),
                "call_id": call["id"],
                "name": call["function"]["name"],
                "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False),
                "status": "completed",
            }
        )
    return items


def response(
    result: ChatResult,
    model: str,
    options: Options,
    items: list[dict[str, Any]] | None = None,
    status: str | None = None,
) -> dict[str, Any]:
    cut = result.choices[0].finish_reason == "length"
    status = status or ("incomplete" if cut else "completed")
    return {
        "id": f"resp_{result.id.split('-', 1)[-1]}",
        "object": "response",
        "created_at": result.created,
        "status": status,
        "model": model,
        "output": _items(result) if items is None else items,
        "incomplete_details": {"reason": "max_output_tokens"} if cut and status == "incomplete" else None,
        "error": None,
        "instructions": None,
        "metadata": {},
        "parallel_tool_calls": True,
        "temperature": options.temperature,
        "top_p": options.top_p,
        "tool_choice": options.tool_choice,
        "tools": [],
        "text": {"format": {"type": "text"}},
        # every field of the official client's ResponseUsage, the cache's at 0 (the engine's prefix
        # cache is not accounted for per request)
        "usage": {
            "input_tokens": result.prompt_tokens,
            "input_tokens_details": {
                "cached_tokens": 0,
                "cache_write_tokens": 0,
                "cache_write_tokens_details": {"ttl_12h_tokens": 0, "ttl_30m_tokens": 0},
            },
            "output_tokens": result.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": result.prompt_tokens + result.completion_tokens,
        },
    }


def events(result: ChatResult, model: str, options: Options) -> Iterator[tuple[str, dict[str, Any]]]:
    """The stream of one answer: created, in progress, each output item added / its deltas / done,
    then completed (or incomplete); every event numbered in ``sequence_number``."""
    final = response(result, model, options)
    seq = iter(range(1 << 30))

    def event(kind: str, **data: Any) -> tuple[str, dict[str, Any]]:
        return kind, {"type": kind, "sequence_number": next(seq), **data}

    yield event("response.created", response=response(result, model, options, items=[], status="in_progress"))
    yield event("response.in_progress", response=response(result, model, options, items=[], status="in_progress"))
    for index, item in enumerate(final["output"]):
        if item["type"] == "message":
            text = item["content"][0]["text"]
            yield event(
                "response.output_item.added", output_index=index, item={**item, "status": "in_progress", "content": []}
            )
            empty = {"type": "output_text", "text": "", "annotations": []}
            yield event(
                "response.content_part.added", item_id=item["id"], output_index=index, content_index=0, part=empty
            )
            for piece in _pieces(text):
                yield event(
                    "response.output_text.delta",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    delta=piece,
                    logprobs=[],
                )
            yield event(
                "response.output_text.done",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                text=text,
                logprobs=[],
            )
            yield event(
                "response.content_part.done",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                part=item["content"][0],
            )
        elif item["type"] == "function_call":
            yield event(
                "response.output_item.added",
                output_index=index,
                item={**item, "status": "in_progress", "arguments": ""},
            )
            for piece in _pieces(item["arguments"]):
                yield event(
                    "response.function_call_arguments.delta", item_id=item["id"], output_index=index, delta=piece
                )
            yield event(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                arguments=item["arguments"],
            )
        else:
            yield event("response.output_item.added", output_index=index, item=item)
        yield event("response.output_item.done", output_index=index, item=item)
    yield event("response.incomplete" if final["status"] == "incomplete" else "response.completed", response=final)


def _pieces(text: str) -> list[str]:
    return [text[i : i + _CHUNK] for i in range(0, len(text), _CHUNK)]


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"
