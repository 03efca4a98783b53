"""The code in a model's answer: standard library only, so agent programs import it in milliseconds."""

from __future__ import annotations

import re

_FENCE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)```", re.S | re.I)
_STRIP = ("<|im_end|>", "<|endoftext|>")


def extract_code(text: str) -> str:
    """The last fenced code block of ``text``, or ``text`` itself when it has none."""
    for token in _STRIP:
        text = text.replace(token, "")
    blocks = _FENCE.findall(text)
    return blocks[-1] if blocks else text
