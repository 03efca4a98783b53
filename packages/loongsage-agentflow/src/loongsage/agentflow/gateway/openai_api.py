"""OpenAI chat completions: the request read into a :class:`ChatRequest`, the answer written back
as a ``chat.completion`` or as ``chat.completion.chunk`` events.

Accepted and ignored (the engine samples plainly; clients send these routinely): ``user``,
``metadata``, ``store``, ``reasoning_effort``, ``prompt_cache_key``, ``safety_identifier``,
``parallel_tool_calls``, ``service_tier``, ``frequency_penalty``, ``presence_penalty``,
``logit_bias``, ``modalities``, hosted tools. ``tool_choice`` ``"none"`` leaves tool calls as
text; ``"required"`` or a named function is not enforced (the model decides). Refused with a 400:
``top_logprobs > 0``, ``response_format`` other than text, non-text content parts.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from loongsage.agentflow.chat import fields
from loongsage.agentflow.chat.errors import bad_request
from loongsage.agentflow.chat.messages import Message, openai_messages, openai_tools
from loongsage.agentflow.gateway.service import ChatRequest, ChatResult, Choice

_CHUNK = 24  # characters of text per streamed delta


@dataclass
class Options:
    """How the answer is written (not part of the turn's identity)."""

    model: str | None
    stream: bool
    include_usage: bool
    logprobs: bool


def parse(body: dict[str, Any]) -> tuple[ChatRequest, Options]:
    tool_choice = body.get("tool_choice")
    if tool_choice is not None and not (tool_choice in ("none", "auto", "required") or isinstance(tool_choice, dict)):
        raise bad_request(
            f"tool_choice={tool_choice!r}: must be 'none', 'auto', 'required' or an object", "tool_choice"
        )
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type", "text") == "text"):
        raise bad_request(
            "response_format: only {'type': 'text'} is supported (no constrained decoding)", "response_format"
        )
    if fields.integer(body, "top_logprobs", 0, 0, 20):
        raise bad_request(
            "top_logprobs: only the sampled tokens' log-probs are available (top_logprobs=0)", "top_logprobs"
        )
    stream_options = body.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise bad_request("stream_options must be an object", "stream_options")
    max_tokens = fields.integer(body, "max_completion_tokens", None, 1, fields.TOKENS_MAX)
    request = ChatRequest(
        messages=openai_messages(body.get("messages")),
        tools=openai_tools(body.get("tools")),
        parse_tool_calls=tool_choice != "none",
        max_tokens=max_tokens or fields.integer(body, "max_tokens", None, 1, fields.TOKENS_MAX),
        temperature=fields.number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=fields.number(body, "top_p", 1.0, 0.0, 1.0),
        top_k=fields.integer(body, "top_k", 0, 0, 1 << 20),
        min_p=fields.number(body, "min_p", 0.0, 0.0, 1.0),
        n=fields.integer(body, "n", 1, 1, 1024),
        seed=fields.integer(body, "seed", None, -fields.SEED_MAX, fields.SEED_MAX),
        stop=fields.strings(body, "stop"),
    )
    options = Options(
        model=fields.text(body, "model", None),
        stream=fields.flag(body, "stream"),
        include_usage=fields.flag(stream_options or {}, "include_usage"),
        logprobs=fields.flag(body, "logprobs"),
    )
    return request, options


def message_out(message: Message) -> dict[str, Any]:
    calls = message.get("tool_calls") or []
    out: dict[str, Any] = {
        "role": "assistant",
        "content": message["content"] if message["content"] or not calls else None,
    }
    if message.get("reasoning_content"):
        out["reasoning_content"] = message["reasoning_content"]
    if calls:
        out["tool_calls"] = [_call_out(c) for c in calls]
    return out


def _call_out(call: dict[str, Any]) -> dict[str, Any]:
    args = call["function"]["arguments"]
    return {
        "id": call["id"],
        "type": "function",
        "function": {
            "name": call["function"]["name"],
            "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False),
        },
    }


def _usage(result: ChatResult) -> dict[str, int]:
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "total_tokens": result.prompt_tokens + result.completion_tokens,
    }


def _logprobs(choice: Choice, token_text: Callable[[int], str]) -> dict[str, Any]:
    return {
        "content": [
            {"token": token_text(t), "logprob": lp, "bytes": list(token_text(t).encode()), "top_logprobs": []}
            for t, lp in zip(choice.token_ids, choice.logprobs)
        ]
    }


def response(result: ChatResult, model: str, options: Options, token_text: Callable[[int], str]) -> dict[str, Any]:
    return {
        "id": result.id,
        "object": "chat.completion",
        "created": result.created,
        "model": model,
        "choices": [
            {
                "index": c.index,
                "message": message_out(c.message),
                "finish_reason": c.finish_reason,
                "logprobs": _logprobs(c, token_text) if options.logprobs else None,
            }
            for c in result.choices
        ],
        "usage": _usage(result),
    }


def chunks(result: ChatResult, model: str, options: Options, token_text: Callable[[int], str]) -> Iterator[dict]:
    """The stream of one answer: per choice its role, reasoning, content and tool-call deltas, then
    its finish reason; with ``include_usage`` a last chunk with no choices and the usage."""
    head = {"id": result.id, "object": "chat.completion.chunk", "created": result.created, "model": model}
    if options.include_usage:
        head["usage"] = None

    def chunk(index: int, delta: dict, finish: str | None = None, logprobs: Any = None) -> dict:
        return {**head, "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}

    for c in result.choices:
        yield chunk(c.index, {"role": "assistant", "content": ""})
        for piece in _pieces(c.message.get("reasoning_content") or ""):
            yield chunk(c.index, {"reasoning_content": piece})
        for piece in _pieces(c.message["content"]):
            yield chunk(c.index, {"content": piece})
        for k, call in enumerate(_call_out(x) for x in c.message.get("tool_calls") or []):
            fn = call["function"]
            yield chunk(
                c.index,
                {
                    "tool_calls": [
                        {
                            "index": k,
                            "id": call["id"],
                            "type": "function",
                            "function": {"name": fn["name"], "arguments": ""},
                        }
                    ]
                },
            )
            for piece in _pieces(fn["arguments"]):
                yield chunk(c.index, {"tool_calls": [{"index": k, "function": {"arguments": piece}}]})
        yield chunk(c.index, {}, c.finish_reason, _logprobs(c, token_text) if options.logprobs else None)
    if options.include_usage:
        yield {**head, "choices": [], "usage": _usage(result)}


def _pieces(text: str) -> list[str]:
    return [text[i : i + _CHUNK] for i in range(0, len(text), _CHUNK)]
