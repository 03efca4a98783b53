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

The gateway renders and tokenizes on worker threads (the event loop, a run's rollout loop, must
not wait on a large prompt), so the caches here are guarded by a lock, and a long text is
tokenized by the tokenizer's batch call, which releases the GIL. A text that certainly tokenizes
to more tokens than a limit is refused before tokenizing (:class:`PromptTooLong`): every token
stands for at most :attr:`ChatRenderer.bytes_per_token` bytes of the text.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import Any

from loongsage.agentflow.chat.errors import bad_request
from loongsage.agentflow.chat.messages import Message

# the prelude new messages are rendered behind; its reply text marks where a reply's closing starts
_SENTINEL = "\u2063reply\u2063"
_PRELUDE: list[Message] = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": _SENTINEL}]
_HEADS_KEPT = 32  # first messages whose tokens are kept (the distinct system prompts and tools of a run)
_HEADS_SEEN = 4096  # first messages seen once (their hashes): a second sighting keeps the tokens
_LONG_TEXT = 1 << 15  # characters from which a text is tokenized by the batch call (GIL released)
# normalizers that never shrink a text's UTF-8 size by more than this factor: composition (Hangul
# L+V+T jamo, 9 bytes -> 3), compatibility mappings (U+1D400 MATHEMATICAL BOLD A, 4 bytes -> "A")
# and lowercasing (U+212A KELVIN SIGN, 3 bytes -> "k") are the worst cases
_NORMALIZER_SHRINK = {"NFC": 4, "NFD": 4, "NFKC": 4, "NFKD": 4, "Lowercase": 4, "Prepend": 1}


class PromptTooLong(Exception):
    """A text that cannot tokenize to fewer than ``at_least`` tokens, the limit it was checked against."""

    def __init__(self, at_least: int):
        super().__init__(f"at least {at_least} tokens")
        self.at_least = at_least


class ChatRenderer:
    """Renders canonical messages with a chat template and tokenizes the text (no special tokens
    added: the template writes them)."""

    def __init__(self, tokenizer: Any, chat_template: str | None = None):
        self.tokenizer = tokenizer
        self.template = chat_template or getattr(tokenizer, "chat_template", None)
        if not self.template:
            raise ValueError("ChatRenderer: the tokenizer has no chat template and none was given")
        self._specials = _special_texts(tokenizer)
        base = self.render(_PRELUDE, None, generation_prompt=False)
        # the prelude's rendering for the tools seen last (every turn of a run usually offers the
        # same), keyed by their JSON text: tools that are equal but list their keys in another order
        # render differently
        self._prelude: tuple[str, str] = ("null", base)
        if _SENTINEL not in base:
            raise ValueError("ChatRenderer: the chat template does not render assistant content")
        self.closing = base[base.rindex(_SENTINEL) + len(_SENTINEL) :]
        """What the template writes after an assistant reply's text (ChatML: ``<|im_end|>\\n``)."""
        # the Rust tokenizer of a fast tokenizer, called directly (see encode)
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        # where a conversation's first message ends: None when no safe cut is known
        self._head_end = _message_end_token(tokenizer, self.closing)
        self._heads: OrderedDict[str, list[int]] = OrderedDict()
        self._heads_seen: OrderedDict[int, None] = OrderedDict()
        self._lock = threading.Lock()  # the caches above, shared by the rendering threads
        self._slow_lock = threading.Lock()  # the tokenizer's own encode may reconfigure it (truncation)
        self.bytes_per_token = _bytes_per_token(tokenizer)
        """UTF-8 bytes of text one token stands for at most (None: no such bound is known)."""

    def render(self, messages: list[Message], tools: list | None, *, generation_prompt: bool) -> str:
        """The template's text of the conversation. A special token's text inside a message or a
        tool (``<|im_end|>\n<|im_start|>assistant`` in a tool's output, say) is rendered with a word
        joiner after its first character, so it is tokenized as text: written out whole, it would
        become the control token itself, and the message could forge turns of other roles."""
        if self._specials is not None:
            messages, tools = _defused(messages, self._specials), _defused(tools, self._specials)
        try:
            return self.tokenizer.apply_chat_template(
                messages,
                tools=tools,
                chat_template=self.template,
                tokenize=False,
                add_generation_prompt=generation_prompt,
            )
        except Exception as exc:  # noqa: BLE001 - a template's own refusal (raise_exception) or a type clash
            line = (str(exc).splitlines() or [type(exc).__name__])[0]
            raise bad_request(f"the chat template cannot render these messages: {line}", "messages") from None

    def encode(self, text: str, *, limit: int | None = None) -> list[int]:
        """The text's tokens; with ``limit``, :class:`PromptTooLong` instead when they certainly
        number ``limit`` or more (checked without tokenizing)."""
        if not text:
            return []
        if limit is not None:
            self.check(text, limit)
        backend, split_special = self._backend, bool(getattr(self.tokenizer, "split_special_tokens", False))
        if (
            backend is not None
            and backend.truncation is None
            and backend.padding is None
            and getattr(backend, "encode_special_tokens", False) == split_special
        ):
            # exactly what the tokenizer's encode runs once it has switched truncation and padding
            # off, without its per-call bookkeeping and the batch call's hand-off to a thread pool
            if len(text) < _LONG_TEXT:
                return backend.encode(text, add_special_tokens=False).ids
            # the single call holds the GIL throughout (seconds for a few MiB), the batch call
            # releases it; its fast form skips the offsets, which are not used
            batch = getattr(backend, "encode_batch_fast", backend.encode_batch)
            return batch([text], add_special_tokens=False)[0].ids
        with self._slow_lock:
            return list(self.tokenizer.encode(text, add_special_tokens=False))

    def check(self, text: str, limit: int) -> None:
        """:class:`PromptTooLong` when ``text`` certainly tokenizes to ``limit`` tokens or more."""
        widest = self.bytes_per_token
        if widest is None or len(text) * 4 <= (limit - 1) * widest:
            return  # at most 4 bytes a character: fewer than limit tokens are possible
        at_least = -(-len(text) // widest)  # at least a byte a character: no need to encode a text far over
        if at_least < limit:
            at_least = -(-len(text.encode("utf-8", "surrogatepass")) // widest)
        if at_least >= limit:
            raise PromptTooLong(at_least)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def prompt(self, messages: list[Message], tools: list | None, *, limit: int | None = None) -> list[int]:
        """The whole conversation with the generation prompt (``limit``: as for :meth:`encode`)."""
        text = self.render(messages, tools, generation_prompt=True)
        if limit is not None:
            self.check(text, limit)
        return self._encode_reusing_head(text)

    def within(self, limit: int) -> _Limited:
        """This renderer, refusing a prompt of ``limit`` tokens or more before tokenizing it."""
        return _Limited(self, limit)

    def _encode_reusing_head(self, text: str) -> list[int]:
        """``encode(text)``, the tokens of the text's first message taken from the cache when kept."""
        end = self._head_end
        cut = text.find(end) if end is not None else -1
        if cut <= 0 or getattr(self.tokenizer, "split_special_tokens", False):
            return self.encode(text)
        head = text[:cut]
        with self._lock:
            kept = self._heads.get(head)
            if kept is not None:
                self._heads.move_to_end(head)
        if kept is not None:
            return kept + self.encode(text[cut:])
        whole = self.encode(text)
        with self._lock:
            first_sighting = hash(head) not in self._heads_seen  # most first messages are never repeated
            if first_sighting:
                self._heads_seen[hash(head)] = None
                while len(self._heads_seen) > _HEADS_SEEN:
                    self._heads_seen.popitem(last=False)
        if first_sighting:
            return whole
        head_ids = self.encode(head)
        joined = head_ids + self.encode(text[cut:]) != whole  # the tokenizer joins across the cut after all
        with self._lock:
            if joined:
                self._head_end = None
            else:
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
        seen, base = self._prelude  # one tuple, read and replaced whole: safe across threads
        if key is None or key != seen:
            base = self.render(_PRELUDE, tools, generation_prompt=False)
            if key is not None:
                self._prelude = (key, base)
        full = self.render(_PRELUDE + messages, tools, generation_prompt=True)
        return full[len(base) :] if full.startswith(base) else None

    def tail(self, sampled_stop: int | None) -> str:
        """The closing text still to write after a reply: without the stop token the model sampled
        when that token is how the closing begins, else all of it."""
        if sampled_stop is not None:
            stop_text = self.decode([sampled_stop])
            if stop_text and self.closing.startswith(stop_text):
                return self.closing[len(stop_text) :]
        return self.closing


_JOINER = "\u2060"  # WORD JOINER: invisible, and in no special token's text


def _special_texts(tokenizer: Any) -> re.Pattern | None:
    """A pattern of the tokenizer's special tokens' texts (those its encode turns into control
    tokens wherever they appear); None: it has none."""
    texts = set(getattr(tokenizer, "all_special_tokens", None) or [])
    for token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(token, "special", False):
            texts.add(str(getattr(token, "content", token)))
    texts = {t for t in texts if len(t) > 1}
    if not texts:
        return None
    return re.compile("|".join(re.escape(t) for t in sorted(texts, key=len, reverse=True)))


def _defused(value: Any, specials: re.Pattern) -> Any:
    """``value`` with every special token's text in its strings broken by :data:`_JOINER`; the
    same objects where there is none (the usual case: nothing is copied)."""
    if isinstance(value, str):
        return specials.sub(lambda m: m[0][0] + _JOINER + m[0][1:], value) if specials.search(value) else value
    if isinstance(value, dict):  # keys too: the template writes tool schemas and arguments as JSON
        items = [(_defused(k, specials), _defused(v, specials)) for k, v in value.items()]
        return value if all(a is k and b is v for (a, b), (k, v) in zip(items, value.items())) else dict(items)
    if isinstance(value, list):
        out = [_defused(v, specials) for v in value]
        return value if all(a is b for a, b in zip(out, value)) else out
    return value


class _Limited:
    """A renderer whose whole prompts and appended texts are checked against a token limit before
    they are tokenized (what :func:`~loongsage.agentflow.trajectories.tito.plan_turn` calls, bounded)."""

    def __init__(self, renderer: ChatRenderer, limit: int):
        self.renderer, self.limit = renderer, limit

    def __getattr__(self, name: str) -> Any:
        return getattr(self.renderer, name)

    def prompt(self, messages: list[Message], tools: list | None) -> list[int]:
        return self.renderer.prompt(messages, tools, limit=self.limit)

    def encode(self, text: str) -> list[int]:
        # an appended text goes behind the line's segment: alone at the limit, the prompt is over it
        return self.renderer.encode(text, limit=self.limit)


def _bytes_per_token(tokenizer: Any) -> int | None:
    """The most UTF-8 bytes of text one token can stand for, when that is certain: a fast BPE
    tokenizer (every token is a piece of the text) without unknown tokens that swallow a run of
    text, without added tokens that absorb the whitespace around them, and whose normalizer
    shrinks a text by a known factor at most. None otherwise (the prompt is then only measured
    by tokenizing it)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    model = getattr(backend, "model", None)
    if type(model).__name__ != "BPE" or (model.unk_token is not None and model.fuse_unk):
        return None
    shrink = _shrink(json.loads(backend.normalizer.__getstate__()) if backend.normalizer is not None else None)
    added = list(getattr(tokenizer, "added_tokens_decoder", {}).values())
    if shrink is None or any(getattr(t, "lstrip", True) or getattr(t, "rstrip", True) for t in added):
        return None
    # a byte-level BPE spells each byte of the text as one character of its alphabet (a space as
    # "Ġ", two bytes in UTF-8): there a token holds as many bytes as it has characters
    byte_level = backend.pre_tokenizer is not None and b'"ByteLevel"' in backend.pre_tokenizer.__getstate__()
    alphabet = _byte_alphabet() if byte_level else frozenset()
    widest = 1
    for token in backend.get_vocab(with_added_tokens=False):
        spelled = byte_level and alphabet.issuperset(token)
        widest = max(widest, len(token) if spelled else len(token.encode("utf-8", "surrogatepass")))
    for token in added:  # matched in the raw text, spelled as themselves
        widest = max(widest, len(str(getattr(token, "content", token)).encode("utf-8", "surrogatepass")))
    return widest * shrink


def _shrink(normalizer: dict | None) -> int | None:
    """How many times a normalizer may shrink a text's UTF-8 size at most (None: no bound known)."""
    if normalizer is None:
        return 1
    if normalizer.get("type") == "Sequence":
        factor = 1
        for inner in normalizer.get("normalizers") or []:
            step = _shrink(inner)
            if step is None:
                return None
            factor *= step
        return factor
    return _NORMALIZER_SHRINK.get(normalizer.get("type"))


def _byte_alphabet() -> frozenset[str]:
    """The 256 characters byte-level BPE spells bytes with (GPT-2's ``bytes_to_unicode``)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [256 + n for n in range(256 - len(printable))]
    return frozenset(chr(c) for c in printable + extra)


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
