"""Token-in, token-out: which tokens a turn appends to a session's line, or why it starts anew.

A session holds one or more *lines* (linear token records; a request with ``n > 1`` forks one per
extra sample). A request that extends a line's conversation (its messages so far, the last reply
exactly as returned, then new messages, with the same tools) appends the line's pending closing
text and the new messages, rendered and tokenized alone; the engine is given the line's current
segment plus those tokens. Anything else renders the whole conversation as a new segment,
counted by category:

=================  ======================================================================
category           the request ...
=================  ======================================================================
first              is the session's first
new_conversation   shares not even its first message with any line (a side conversation:
                   a new line)
tools_changed      offers other tools than the line was rendered with
reasoning_dropped  sends a reply back without its reasoning (when that is not allowed)
reply_edited       sends the last reply back changed
rewound            goes on from an earlier reply of the line, or resends an earlier request
                   (a branch: a new line)
compaction         is shorter than the line's conversation (history condensed)
rewritten          changed earlier history (not right after a reply)
not_append_only    extends the line, but the template renders the new messages differently
                   in context (nothing to append)
=================  ======================================================================

Everything here is pure: lines are read, never changed (the store commits).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from loongsage.agentflow.chat.messages import Message, common_prefix, without_reasoning
from loongsage.agentflow.trajectories.rendering import ChatRenderer

CATEGORIES = (
    "first",
    "new_conversation",
    "tools_changed",
    "reasoning_dropped",
    "reply_edited",
    "rewound",
    "compaction",
    "rewritten",
    "not_append_only",
)


class LineView(Protocol):
    messages: list[Message]  # the conversation the line's tokens render, ending with its last reply
    tools: list | None
    tokens: list[int]
    tail: str  # closing text of the last reply still to write

    @property
    def segment_start(self) -> int: ...


@dataclass
class TurnPlan:
    line: int | None  # the line continued or given a new segment (None: a new line)
    appended: list[int]  # prompt tokens the line gets before the reply
    prompt: list[int]  # what the engine is given
    category: str | None  # None: the line's segment goes on; else why a new segment starts


def plan_turn(
    lines: Sequence[LineView],
    messages: list[Message],
    tools: list | None,
    renderer: ChatRenderer,
    *,
    reasoning_optional: bool = False,
) -> TurnPlan:
    for i in reversed(range(len(lines))):  # the newest line first: after a fork the sample just taken
        line = lines[i]
        if line.tools != tools or len(messages) < len(line.messages):
            continue
        if common_prefix(line.messages, messages, reasoning_optional=reasoning_optional) < len(line.messages):
            continue
        text = renderer.continuation(messages[len(line.messages) :], tools)
        if text is None:
            return _fresh(i, messages, tools, renderer, "not_append_only")
        appended = renderer.encode(line.tail + text)
        return TurnPlan(i, appended, line.tokens[line.segment_start :] + appended, None)
    if not lines:
        return _fresh(None, messages, tools, renderer, "first")
    shared = [common_prefix(line.messages, messages, reasoning_optional=reasoning_optional) for line in lines]
    best = max(range(len(lines)), key=lambda i: (shared[i], i))
    if shared[best] == 0:
        return _fresh(None, messages, tools, renderer, "new_conversation")
    category = classify(lines[best], messages, tools, reasoning_optional=reasoning_optional)
    return _fresh(None if category == "rewound" else best, messages, tools, renderer, category)


def classify(line: LineView, messages: list[Message], tools: list | None, *, reasoning_optional: bool) -> str:
    """Why ``messages`` do not extend ``line`` (one of :data:`CATEGORIES`)."""
    if line.tools != tools:
        return "tools_changed"
    k = common_prefix(line.messages, messages, reasoning_optional=reasoning_optional)
    if k < len(line.messages) and k < len(messages):
        stored, sent = line.messages[k], messages[k]
        if stored.get("role") == sent.get("role") == "assistant":
            if without_reasoning(stored) == without_reasoning(sent):
                return "reasoning_dropped"
            if k == len(line.messages) - 1:
                return "reply_edited"
    if k == len(messages) or (0 < k < len(line.messages) and line.messages[k - 1].get("role") == "assistant"):
        return "rewound"  # goes on from an earlier reply (or resends an earlier request)
    if len(messages) < len(line.messages):
        return "compaction"
    return "rewritten"


def _fresh(
    line: int | None, messages: list[Message], tools: list | None, renderer: ChatRenderer, category: str
) -> TurnPlan:
    ids = renderer.prompt(messages, tools)
    return TurnPlan(line, ids, ids, category)


def cut_at_stop(
    decode: Callable[[list[int]], str], ids: list[int], stops: Sequence[str]
) -> tuple[int, str, str | None]:
    """Where the first stop string ends: ``(tokens kept, text before the stop, the stop)``.

    The engine stops on token ids only, so stop strings are applied to its output: the kept tokens
    are the shortest prefix whose text holds the stop string (a prefix of a sample is a sample of
    the shortened generation), and the text returned ends before the stop, as OpenAI's does.
    Without a stop in the text everything is kept (``(len(ids), text, None)``).
    """
    text = decode(ids)
    hits = sorted((text.find(s), i, s) for i, s in enumerate(stops) if s and s in text)
    if not hits:
        return len(ids), text, None
    pos, _, stop = hits[0]
    lo, hi = 1, len(ids)  # the smallest prefix whose text holds the stop
    while lo < hi:
        mid = (lo + hi) // 2
        if stop in decode(ids[:mid]):
            hi = mid
        else:
            lo = mid + 1
    return lo, text[:pos], stop
