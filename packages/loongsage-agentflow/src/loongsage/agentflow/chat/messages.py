"""Messages and tools in one canonical form, whatever protocol they came in.

A canonical message is a plain dict the chat template can render and two requests can compare::

    {"role": "system" | "user" | "assistant" | "tool", "content": str,
     "tool_calls": [{"id", "type": "function", "function": {"name", "arguments": dict | str}}],  # assistant
     "reasoning_content": str,                                                                  # assistant
     "tool_call_id": str}                                                                       # tool

Optional keys are present only when set. Tool-call arguments are kept parsed (a JSON object
becomes a dict), so a client that re-serialises them with other spacing still sends the same call.
Both protocol front ends (:mod:`~loongsage.agentflow.gateway.openai_api`,
:mod:`~loongsage.agentflow.gateway.anthropic_api`) produce this form; the OpenAI shape is normalised here.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from loongsage.agentflow.chat.errors import bad_request
from loongsage.agentflow.chat.fields import without_surrogates

Message = dict[str, Any]
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


def text_of(content: Any, where: str) -> str:
    """A message's text: a string, None, or a list of text parts (other parts are refused)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}: content must be a string or a list of content parts, got {_kind(content)}", where)
    texts = []
    for i, part in enumerate(content):
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, dict):
            raise bad_request(f"{where}[{i}]: a content part must be an object, got {_kind(part)}", where)
        kind = part.get("type")
        if kind in ("text", "input_text", "output_text") and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind in ("text", "input_text", "output_text"):
            raise bad_request(f"{where}[{i}].text must be a string", where)
        else:
            raise bad_request(f"{where}[{i}]: content parts of type {kind!r} are not supported (text only)", where)
    return "".join(texts)


def parse_arguments(arguments: Any) -> dict | str:
    """Tool-call arguments as compared and rendered: a JSON object parsed, anything else as text."""
    if isinstance(arguments, dict):
        return arguments
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments)
        except (ValueError, RecursionError):
            return arguments
        # arguments are JSON inside a JSON string: an escaped lone surrogate in them is only decoded
        # here, after the body was cleaned of its own (see fields.json_body)
        return without_surrogates(value) if isinstance(value, dict) else arguments
    return json.dumps(arguments, ensure_ascii=False)


def tool_call(call_id: str, name: str, arguments: Any) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": parse_arguments(arguments)}}


def assistant(content: str, reasoning: str | None = None, tool_calls: list | None = None) -> Message:
    message: Message = {"role": "assistant", "content": content}
    if reasoning:
        message["reasoning_content"] = reasoning
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message


def openai_messages(raw: Any) -> list[Message]:
    """Canonical messages from an OpenAI ``messages`` array (one-line 400 on anything malformed)."""
    if not isinstance(raw, list) or not raw:
        raise bad_request("messages must be a non-empty array", "messages")
    return [_openai_message(m, f"messages[{i}]") for i, m in enumerate(raw)]


def _openai_message(raw: Any, where: str) -> Message:
    if not isinstance(raw, dict):
        raise bad_request(f"{where} must be an object, got {_kind(raw)}", where)
    role = _ROLES.get(raw.get("role")) if isinstance(raw.get("role"), str) else None
    if role is None:
        raise bad_request(f"{where}.role={raw.get('role')!r}: must be one of {sorted(_ROLES)}", f"{where}.role")
    content = text_of(raw.get("content"), f"{where}.content")
    if role == "assistant":
        reasoning = raw.get("reasoning_content", raw.get("reasoning"))
        if reasoning is not None and not isinstance(reasoning, str):
            raise bad_request(f"{where}.reasoning_content must be a string", where)
        return assistant(content, reasoning, _openai_calls(raw.get("tool_calls"), f"{where}.tool_calls"))
    message: Message = {"role": role, "content": content}
    if role == "tool":
        call_id = raw.get("tool_call_id")
        if not isinstance(call_id, str):
            raise bad_request(f"{where}.tool_call_id must be a string", f"{where}.tool_call_id")
        message["tool_call_id"] = call_id
    return message


def _openai_calls(raw: Any, where: str) -> list[dict[str, Any]]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise bad_request(f"{where} must be an array", where)
    calls = []
    for i, call in enumerate(raw):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f"{where}[{i}] must be an object with function.name", f"{where}[{i}]")
        if not isinstance(call.get("id", ""), str):
            raise bad_request(f"{where}[{i}].id must be a string", f"{where}[{i}].id")
        calls.append(tool_call(call.get("id", ""), fn["name"], fn.get("arguments", "{}")))
    return calls


def openai_tools(raw: Any) -> list[dict[str, Any]] | None:
    """Function tools in OpenAI's shape; hosted tools (web search, code interpreter...) are dropped:
    the policy cannot call them, and refusing them would break clients that always send them."""
    return function_tools(
        raw,
        function_type="function",
        spec_of=lambda tool: tool.get("function"),
        schema="parameters",
        path=lambda i: f"tools[{i}]",
    )


def function_tools(
    raw: Any, *, function_type: str, spec_of: Callable[[dict], Any], schema: str, path: Callable[[int], str]
) -> list[dict[str, Any]] | None:
    """The function tools of any protocol's ``tools`` array in canonical form (None when there are
    none): entries of another ``type`` are hosted or server tools, not the policy's to call, and are
    left out. ``spec_of`` finds a tool's name/description/schema object (the entry itself, or a
    nested one), ``schema`` names its JSON-schema field, ``path`` spells entry ``i`` in errors."""
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise bad_request("tools must be an array", "tools")
    tools = []
    for i, tool in enumerate(raw):
        where = path(i)
        if not isinstance(tool, dict):
            raise bad_request(f"{where} must be an object", where)
        if tool.get("type", function_type) != function_type:
            continue
        spec = spec_of(tool)
        if spec is not tool:
            where += ".function"
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not spec["name"]:
            raise bad_request(f"{where}.name must be a non-empty string", f"{where}.name")
        tools.append(function_tool(spec["name"], spec.get("description"), spec.get(schema), where))
    return tools or None


def function_tool(name: str, description: Any, parameters: Any, where: str) -> dict[str, Any]:
    fn: dict[str, Any] = {"name": name}
    if description is not None:
        if not isinstance(description, str):
            raise bad_request(f"{where}.description must be a string", where)
        fn["description"] = description
    if parameters is not None:
        if not isinstance(parameters, dict):
            raise bad_request(f"{where}.parameters must be a JSON schema object", where)
        fn["parameters"] = parameters
    return {"type": "function", "function": fn}


# ------------------------------------------------------------------------------- comparison
def same(stored: Message, sent: Message, *, reasoning_optional: bool) -> bool:
    """Whether ``sent`` is ``stored`` as a client sends it back.

    A reply's reasoning may be left out by the client only when ``reasoning_optional``; otherwise
    that reply is not the one the model generated and the turn starts a new segment.
    """
    if stored.get("role") != "assistant" or sent.get("role") != "assistant":
        return _equal(stored, sent)
    if "reasoning_content" in sent or not reasoning_optional:
        return _equal(stored, sent)
    return _equal(without_reasoning(stored), sent)


def _equal(a: Any, b: Any) -> bool:
    """JSON equality, types included: Python's ``==`` has ``true == 1 == 1.0``, so a tool call's
    ``{"flag": 1}`` sent back for the model's ``{"flag": true}`` would pass for the model's own
    message, and the line would record the client's version beside the model's tokens."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(v, b[k]) for k, v in a.items())
    if isinstance(a, list):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def without_reasoning(message: Message) -> Message:
    return {k: v for k, v in message.items() if k != "reasoning_content"}


def common_prefix(stored: list[Message], sent: list[Message], *, reasoning_optional: bool) -> int:
    n = 0
    for a, b in zip(stored, sent):
        if not same(a, b, reasoning_optional=reasoning_optional):
            break
        n += 1
    return n


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__
