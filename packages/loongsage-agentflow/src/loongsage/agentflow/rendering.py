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
"""

from __future__ import annotations

import json
from typing import Any

from loongsage.agentflow.errors import bad_request
from loongsage.agentflow.messages import Message

# the prelude new messages are rendered behind; its reply text marks where a reply's closing starts
_SENTINEL = "\u2063reply\u2063"
_PRELUDE: list[Message] = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": _SENTINEL}]


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

    def render(self, messages: list[Message], tools: list | None, *, generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tools=tools, chat_template=self.template,
                                                      tokenize=False, add_generation_prompt=generation_prompt)
        except Exception as exc:  # noqa: BLE001 - a template's own refusal (raise_exception) or a type clash
            line = (str(exc).splitlines() or [type(exc).__name__])[0]
            raise bad_request(f"the chat template cannot render these messages: {line}", "messages") from None

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def prompt(self, messages: list[Message], tools: list | None) -> list[int]:
        """The whole conversation with the generation prompt."""
        return self.encode(self.render(messages, tools, generation_prompt=True))

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
