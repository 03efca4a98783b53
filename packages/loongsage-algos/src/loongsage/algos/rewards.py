"""Rule-based rewards: ``(trajectory, record) -> float``.

Each reward is a pure function over plain values plus a frozen dataclass that binds its parameters
(the fields are the recipe's ``params`` schema) and implements the hook's call.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from loongsage.core.types import DataRecord, Trajectory


def extract_answer(text: str, pattern: str | None) -> str | None:
    """The answer in ``text``: the whole text without a pattern, else the *last* match.

    The last match is taken because reasoning often quotes candidates before the final answer.
    A pattern with a group yields group 1, otherwise the whole match; no match yields None.
    """
    if pattern is None:
        return text
    matches = list(re.finditer(pattern, text))
    if not matches:
        return None
    last = matches[-1]
    return last.group(1) if last.re.groups else last.group(0)


def exact_match(response_text: str, label: object, *, strip: bool = True, extract: str | None = None) -> float:
    """1.0 if the extracted answer equals ``str(label)`` (both stripped if ``strip``), else 0.0."""
    answer = extract_answer(response_text, extract)
    if answer is None:
        return 0.0
    expected = str(label)
    if strip:
        answer, expected = answer.strip(), expected.strip()
    return 1.0 if answer == expected else 0.0


@dataclass(frozen=True)
class ExactMatch:
    """``exact_match``: string equality of the (optionally regex-extracted) answer and the label."""

    strip: bool = True
    extract: str | None = None  # regex; group 1 (or the whole match) of its last match is the answer

    def __post_init__(self) -> None:
        if self.extract is not None:
            try:
                re.compile(self.extract)
            except re.error as exc:
                raise ValueError(f"exact_match.extract={self.extract!r}: invalid regex ({exc})") from None

    def __call__(self, trajectory: Trajectory, record: DataRecord) -> float:
        # A missing label is a data error; scoring it 0 would silently train against it.
        if record.label is None:
            raise ValueError(f"exact_match: record {record.source}[{record.index}] has no label")
        return exact_match(trajectory.response_text, record.label, strip=self.strip, extract=self.extract)
