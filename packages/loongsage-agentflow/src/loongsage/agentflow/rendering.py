"""The chat template, rendered by the gateway itself: whole prompts and appended turns.

A first turn (or a new segment) is the template's rendering of the whole conversation with the
generation prompt, tokenized once. A later turn that extends the conversation is *appended*: the
tokens of the last reply stay exactly as the engine sampled them, followed by

* the rest of the reply's closing as the template writes it (ChatML's ``"\\n"`` after the sampled
  ``<|im_end|>``; the whole ``<|im_end|>\\n`` when the reply was cut by the length limit), and
* the new messages and the generation prompt, rendered behind a fixed two-message prelude and
  stripped of the prelude's own text (so the template sees them in a conversation, as it would).

Only the new text is tokenized; its first character follows a special token or a template
boundary, so no BPE merge can cross into the model's tokens.

A whole conversation reuses the tokens of its first message (a run's sessions usually open with
the same system prompt and tools): the text is cut before the special token that closes the first
message, where no merge can cross either, and the head's tokens are kept once it has been seen
twice and its cut encoding checked against the whole one.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

from loongsage.agentflow.errors import bad_request
from loongsage.agentflow.messages import Message

# the prelude new messages are rendered behind; its reply text marks where a reply's closing starts
_SENTINEL = "\u2063reply\u2063"
_PRELUDE: list[Message] = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": _SENTINEL}]
_HEADS_KEPT = 32  # first messages whose tokens are kept (the distinct system prompts and tools of a run)
_HEADS_SEEN = 4096  # first messages seen once (their hashes): a second sighting keeps the tokens


class ChatRenderer:
    """Renders canonical messages with a chat template and tokenizes the text (no special tokens
    added: the template writes them)."""

    def __init__(self, tokenizer: Any, chat_template: str | None = None):
        self.tokenizer = tokenizer
        self.template = chat_template or getattr(tokenizer, "chat_template", None)
        if not self.template:
            raise ValueError("ChatRenderer: the tokenizer has no chat template and none was given")
        base = self.render(_PRELUDE, None, generation_prompt=False)
        # the prelude's rendering for the tools seen last (every turn of a run usually offers the
        # same), keyed by their JSON text: tools that are equal but list their keys in another order
        # render differently
        self._prelude: tuple[str, str] = ("null", base)
        if _SENTINEL not in base:
            raise ValueError("ChatRenderer: the chat template does not render assistant content")
        self.closing = base[base.rindex(_SENTINEL) + len(_SENTINEL):]
        """What the template writes after an assistant reply's text (ChatML: ``<|im_end|>\\n``)."""
        # the Rust tokenizer of a fast tokenizer, called directly (see encode)
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        # where a conversation's first message ends: None when no safe cut is known
        self._head_end = _message_end_token(tokenizer, self.closing)
        self._heads: OrderedDict[str, list[int]] = OrderedDict()
        self._heads_seen: OrderedDict[int, None] = OrderedDict()

    def render(self, messages: list[Message], tools: list | None, *, generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tools=tools, chat_template=self.template,
                                                      tokenize=False, add_generation_prompt=generation_prompt)
        except Exception as exc:  # noqa: BLE001 - a template's own refusal (raise_exception) or a type clash
            line = (str(exc).splitlines() or [type(exc).__name__])[0]
            raise bad_request(f"the chat template cannot render these messages: {line}", "messages") from None

    def encode(self, text: str) -> list[int]:
        if not text:
            return []
        backend, split_special = self._backend, bool(getattr(self.tokenizer, "split_special_tokens", False))
        if (backend is not None and backend.truncation is None and backend.padding is None
                and getattr(backend, "encode_special_tokens", False) == split_special):
            # exactly what the tokenizer's encode runs once it has switched truncation and padding
            # off, without its per-call bookkeeping and the batch call's hand-off to a thread pool
            return backend.encode(text, add_special_tokens=False).ids
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def prompt(self, messages: list[Message], tools: list | None) -> list[int]:
        """The whole conversation with the generation prompt."""
        return self._encode_reusing_head(self.render(messages, tools, generation_prompt=True))

    def _encode_reusing_head(self, text: str) -> list[int]:
        """``encode(text)``, the tokens of the text's first message taken from the cache when kept."""
        cut = text.find(self._head_end) if self._head_end is not None else -1
        if cut <= 0 or getattr(self.tokenizer, "split_special_tokens", False):
            return self.encode(text)
        head = text[:cut]
        kept = self._heads.get(head)
        if kept is not None:
            self._heads.move_to_end(head)
            return kept + self.encode(text[cut:])
        whole = self.encode(text)
        if hash(head) not in self._heads_seen:  # seen once: most first messages are never repeated
            self._heads_seen[hash(head)] = None
            while len(self._heads_seen) > _HEADS_SEEN:
                self._heads_seen.popitem(last=False)
            return whole
        head_ids = self.encode(head)
        if head_ids + self.encode(text[cut:]) != whole:  # the tokenizer joins across the cut after all
            self._head_end = None
            return whole
        self._heads[head] = head_ids
        while len(self._heads) > _HEADS_KEPT:
            self._heads.popitem(last=False)
        return whole

    def continuation(self, messages: list[Message], tools: list | None) -> str | None:
        """The text of ``messages`` and the generation prompt after a closed reply; None when the
        template does not render them append-only (it rewrote the prelude's text)."""
        try:
            key = json.dumps(tools, ensure_ascii=False)
        except (TypeError, ValueError):  # not JSON (a caller's own objects): rendered every time
            key = None
        seen, base = self._prelude
        if key is None or key != seen:
            base = self.render(_PRELUDE, tools, generation_prompt=False)
            if key is not None:
                self._prelude = (key, base)
        full = self.render(_PRELUDE + messages, tools, generation_prompt=True)
        return full[len(base):] if full.startswith(base) else None

    def tail(self, sampled_stop: int | None) -> str:
        """The closing text still to write after a reply: without the stop token the model sampled
        when that token is how the closing begins, else all of it."""
        if sampled_stop is not None:
            stop_text = self.decode([sampled_stop])
            if stop_text and self.closing.startswith(stop_text):
                return self.closing[len(stop_text):]
        return self.closing


def _message_end_token(tokenizer: Any, closing: str) -> str | None:
    """The special token a message's closing starts with (ChatML: ``<|im_end|>``) when text cut
    right before it encodes as its two pieces would: the tokenizer splits the text at that token
    first (not normalized, no whitespace stripping around it) and no other added token contains it."""
    added = [t for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if getattr(t, "content", "")]
    candidates = [t for t in added if closing.startswith(t.content)]
    if not candidates:
        return None
    token = max(candidates, key=lambda t: len(t.content))
    if any(getattr(token, flag, True) for flag in ("lstrip", "rstrip", "single_word", "normalized")):
        return None  # a flag unknown to this tokenizer counts as set
    if any(token.content in t.content and t.content != token.content for t in added):
        return None
    return token.content
