"""Synthetic integer arithmetic: a map-style data source with exact-match answers.

``ArithmeticTask`` yields prompts such as ``"47+85="`` (as a one-message chat, or raw text) with
the answer string as label. Everything is a pure function of the dataclass fields, so a record
is reproducible from ``(params, index)`` alone, which is what exact data resumption needs.

Answer format. With ``answer_format="reversed"`` the answer digits are written least-significant
first (47+85=132 is answered ``"231"``). A left-to-right decoder then emits each digit after the
digits it depends on, which makes column addition far easier for a small transformer to learn
(Lee et al. 2023, "Teaching Arithmetic to Small Transformers"); ``"plain"`` is the usual order.

Train/test split. Each operand pair belongs to one split by a salted hash of ``(a, op, b)``,
independent of ``seed``: no test problem is ever trained on, whatever the seeds of either side.

Imperfect teacher. :func:`teacher_answer` writes the answer by column arithmetic but forgets the
carry (or borrow) of a column with probability ``drop_prob``. Supervised fine-tuning on its
answers yields a model that has learned the algorithm, yet at every column with an incoming carry
puts about ``1 - drop_prob`` of its probability on the right digit and ``drop_prob`` on the digit
without the carry. With ``drop_prob > 0.5`` greedy decoding is wrong on most problems with a carry
while sampling is often right: pass@k is far above pass@1, and reinforcement learning with an
exact-match reward has a systematic error to fix. This is a deliberate, documented construction
for demonstrating RL on a CPU in minutes, not a claim about how real SFT data fails.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from typing import Literal

from loongsage.core.types import DataRecord

_SPLIT_SALT = b"loongsage-arith-split-v1"
# Operand spaces up to this many pairs are enumerated (distinct problems per split); larger
# ones are sampled per index by rejection, which may repeat problems.
_ENUMERATE_LIMIT = 200_000
_NUMBER = re.compile(r"-?\d+")
_STRIP = ("<|im_end|>", "<|endoftext|>")


def in_test_split(a: int, op: str, b: int, test_fraction: float) -> bool:
    """Whether the problem ``a op b`` belongs to the test split (a fixed, seed-free hash)."""
    digest = hashlib.blake2b(f"{a}{op}{b}".encode(), key=_SPLIT_SALT, digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < test_fraction


def _columns(n: int, width: int) -> list[int]:
    return [(n // 10**i) % 10 for i in range(width)]


def teacher_answer(a: int, op: str, b: int, *, drop_prob: float = 0.0, rng: random.Random | None = None) -> int:
    """Column arithmetic (``+``, or ``-`` with ``a >= b``) that forgets carries/borrows.

    At every column that receives a carry (borrow), the teacher writes the digit without it with
    probability ``drop_prob``; the carry chain itself stays correct, so each mistake is local to
    one column. A final carry that is forgotten is not written. ``drop_prob=0`` gives ``a op b``.
    """
    if op not in "+-" or len(op) != 1:
        raise ValueError(f"op={op!r}: teacher_answer supports '+' and '-'")
    if op == "-" and a < b:
        raise ValueError(f"{a}-{b}: subtraction problems have a >= b")
    rng = rng or random.Random(0)
    width = max(len(str(a)), len(str(b)))
    value, carry = 0, 0
    for i, (x, y) in enumerate(zip(_columns(a, width), _columns(b, width))):
        exact = x + y + carry if op == "+" else x - y - carry
        digit = exact % 10
        if carry and drop_prob > 0 and rng.random() < drop_prob:
            digit = (x + y) % 10 if op == "+" else (x - y) % 10
        value += digit * 10**i
        carry = int(exact >= 10) if op == "+" else int(exact < 0)
    if carry and not (drop_prob > 0 and rng.random() < drop_prob):
        value += 10**width  # only "+" can end with a carry
    return value


def format_answer(value: int, answer_format: str) -> str:
    """The answer string of ``value`` (``"reversed"``: least-significant digit first)."""
    text = str(value)
    if answer_format == "reversed":
        sign, digits = ("-", text[1:]) if text.startswith("-") else ("", text)
        return sign + digits[::-1]
    if answer_format == "plain":
        return text
    raise ValueError(f"answer_format={answer_format!r}: allowed 'plain', 'reversed'")


def extract_answer(response_text: str) -> str | None:
    """The answer in a response: the whole response, stripped, if it is an integer, else None.

    Deliberately strict: the task asks for a bare number, so any extra text is a wrong answer
    (a lenient "first number" rule would reward responses that list several candidates).
    """
    text = response_text
    for token in _STRIP:
        text = text.replace(token, "")
    text = text.strip()
    return text if _NUMBER.fullmatch(text) else None


def score(response_text: str, label: str) -> float:
    """Exact-match reward: 1.0 if the extracted answer equals ``label``, else 0.0."""
    return float(extract_answer(response_text) == str(label))


@dataclass
class ArithmeticTask:
    """Integer arithmetic problems ``a op b`` with operands in ``[0, 10**digits)``.

    A map-style :class:`~loongsage.core.types.DataSource`: ``task[i]`` is a pure function of the
    fields and ``i``. Subtraction problems have ``a >= b`` (non-negative answers).
    """

    digits: int = 2
    operations: str = "+"  # characters of "+-", each problem picks one uniformly
    split: Literal["train", "test"] = "train"
    size: int = 10_000
    seed: int = 0
    answer_format: Literal["plain", "reversed"] = "reversed"
    prompt_format: Literal["chat", "text"] = "chat"
    test_fraction: float = 0.1
    name: str = "arith"

    def __post_init__(self) -> None:
        if self.digits < 1:
            raise ValueError(f"digits={self.digits}: must be >= 1")
        if not self.operations or any(op not in "+-" for op in self.operations):
            raise ValueError(f"operations={self.operations!r}: a non-empty string of '+' and '-'")
        if self.split not in ("train", "test"):
            raise ValueError(f"split={self.split!r}: allowed 'train', 'test'")
        if not 0 < self.test_fraction < 1:
            raise ValueError(f"test_fraction={self.test_fraction}: must be in (0, 1)")
        if self.size < 1:
            raise ValueError(f"size={self.size}: must be >= 1")
        format_answer(0, self.answer_format)  # validates the format
        self._problems: list[tuple[int, str, int]] | None = None
        if len(set(self.operations)) * 10 ** (2 * self.digits) <= _ENUMERATE_LIMIT:
            self._problems = self._enumerate()

    def _belongs(self, a: int, op: str, b: int) -> bool:
        return in_test_split(a, op, b, self.test_fraction) == (self.split == "test")

    def _enumerate(self) -> list[tuple[int, str, int]]:
        n = 10**self.digits
        problems = [
            (a, op, b)
            for op in sorted(set(self.operations))
            for a in range(n)
            for b in range(a + 1 if op == "-" else n)  # "-": only b <= a
            if self._belongs(a, op, b)
        ]
        random.Random(f"{self.seed}/{self.split}").shuffle(problems)
        return problems

    def _sample(self, index: int) -> tuple[int, str, int]:
        rng = random.Random(f"{self.seed}/{self.split}/{index}")
        n = 10**self.digits
        while True:
            op = rng.choice(self.operations)
            a, b = rng.randrange(n), rng.randrange(n)
            if op == "-" and a < b:
                a, b = b, a
            if self._belongs(a, op, b):
                return a, op, b

    def problem(self, index: int) -> tuple[int, str, int]:
        """The operands and operator of record ``index``."""
        if not 0 <= index < self.size:
            raise IndexError(f"index {index} out of range for {self.size} records")
        if self._problems is not None:
            return self._problems[index % len(self._problems)]  # cycles when size > universe
        return self._sample(index)

    def render_prompt(self, a: int, op: str, b: int) -> str | list[dict[str, str]]:
        text = f"{a}{op}{b}="
        return [{"role": "user", "content": text}] if self.prompt_format == "chat" else text

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> DataRecord:
        a, op, b = self.problem(index)
        value = a + b if op == "+" else a - b
        return DataRecord(
            source=self.name,
            index=index,
            prompt=self.render_prompt(a, op, b),
            label=format_answer(value, self.answer_format),
            metadata={"a": a, "op": op, "b": b, "value": value},
        )

    def num_distinct(self) -> int | None:
        """Number of distinct problems in this split, when enumerated (else None)."""
        return None if self._problems is None else len(self._problems)
