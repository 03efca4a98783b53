"""Chat parsers: a model family's completion text split into message fields (``chat_parser`` kind).

``qwen3`` reads the format Qwen3 (and Hermes-style tool models) emit: an optional reasoning block
``<think>...</think>`` first (its opening tag may sit in the generation prompt instead), then the
reply, with each tool call as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``. A block
that does not parse (bad JSON, no name, cut off by the length limit) stays in the content as text:
the client sees what the model wrote, and nothing is invented.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from loongsage.core.contracts import ChatParser

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class Qwen3ChatParser(ChatParser):
    """``<think>`` reasoning and Hermes-style ``<tool_call>`` blocks (Qwen3, Qwen2.5, Hermes)."""

    reasoning: bool = True  # split a leading <think> block into reasoning_content
    tool_calls: bool = True  # turn <tool_call> blocks into tool calls

    def parse(self, text: str) -> dict[str, Any]:
        reasoning, rest = self._split_reasoning(text) if self.reasoning else (None, text)
        calls: list[dict[str, Any]] = []
        if self.tool_calls:
            rest = _TOOL_CALL.sub(lambda m: _take_call(m, calls), rest)
        return {"content": rest.strip(), "reasoning_content": reasoning, "tool_calls": calls}

    @staticmethod
    def _split_reasoning(text: str) -> tuple[str | None, str]:
        head = text.lstrip()
        if _THINK_CLOSE in text:
            before, after = text.split(_THINK_CLOSE, 1)
            before = before.lstrip()
            if before.startswith(_THINK_OPEN):
                before = before[len(_THINK_OPEN) :]
            return before.strip(), after
        if head.startswith(_THINK_OPEN):  # cut off while reasoning: all of it is reasoning
            return head[len(_THINK_OPEN) :].strip(), ""
        return None, text


def _take_call(match: re.Match, calls: list[dict[str, Any]]) -> str:
    """Record the block as a call and remove it; a block that is no call stays as text."""
    try:
        body = json.loads(match.group(1))
    except ValueError:
        return match.group(0)
    if not isinstance(body, dict) or not isinstance(body.get("name"), str) or not body["name"]:
        return match.group(0)
    args = body.get("arguments", body.get("parameters", {}))
    arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    calls.append({"type": "function", "function": {"name": body["name"], "arguments": arguments}})
    return ""
