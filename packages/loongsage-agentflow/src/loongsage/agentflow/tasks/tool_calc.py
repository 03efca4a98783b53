"""The calculator task: questions a tiny model answers only with the tool, its teacher and its reward.

``ToolCalcTask`` (data source ``tool_calc``) asks for the value of a product of a 3-digit and a
2-digit number, alone (``What is 347*29?``, a *plain* product) or with a 3-digit term added
(``What is 347*29+118?``); the label is the exact value. A model this small cannot
multiply such numbers itself, so every right answer goes through the ``calculator`` tool: copy the
expression into a call, then copy the result into the answer. The operands have fixed widths so
that each copy is a fixed distance back (two expression lengths, a few result lengths), which a
two-layer model learns far sooner than a lookup by content among repeated digits. Each record is
a pure function of the fields and its index; train and test questions are disjoint by a salted
hash of the expression, independent of the seeds, and a test split holds distinct questions.

Imperfect teacher. :func:`teacher_messages` writes the transcripts the warm start is fine-tuned on:
``user -> assistant tool call -> tool result -> assistant answer``. It is overconfident: with
probability ``drop_prob`` it answers at once with a mental estimate, ``About 9000.`` (each number
rounded to one significant digit: 347*29 -> 300*30), which is wrong unless every number is round.
The guess always opens with the same word so that the first reply token is one decision, the word
or the ``<tool_call>`` tag, with probabilities about ``drop_prob`` and ``1 - drop_prob``. (A guess
opening with its digits spreads ``drop_prob`` over nine first tokens, each below the tag, and greedy
decoding then calls the tool anyway.) With ``drop_prob > 0.5``, greedy decoding answers directly and
wrongly while sampling often calls the tool: pass@k is far above greedy success and reinforcement
learning with :class:`ToolCalcReward` has one decision to fix. As the carry-dropping teacher of the
arithmetic task, this is a deliberate construction for showing RL on a CPU, not a claim about how
real tool-use data fails.

Reward. :func:`final_answer` is the content of the episode's last assistant message, if that
message called no tool; :func:`score` is 1.0 when its last number (see :func:`numbers`) equals the
label, else 0.0.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any, Literal

from loongsage.core.contracts import Reward
from loongsage.core.types import DataRecord, Trajectory

_SPLIT_SALT = b"loongsage-tool-calc-split-v1"
_MAX_ATTEMPTS = 1000
_DISTINCT_LIMIT = 20_000  # a test split up to this size holds distinct questions
# A number in an answer: an optional minus sign (not one between two operands, as in "3-5"),
# ASCII digits with optional thousands separators, an optional fraction. "10,081", "-12", "3.50".
_NUMBER = re.compile(r"(?<![\w.,])(?:(?<![0-9)])-)?(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?(?![0-9,]*[0-9])")
_STRIP = ("<|im_end|>", "<|endoftext|>")
_MINUS = str.maketrans({"\u2212": "-", "\uff0d": "-"})  # the minus sign and the full-width one: a sign, not text
GUESS_WORD = "About"  # every guess opens with it: one first-token decision against the tool call


def in_test_split(expression: str, test_fraction: float) -> bool:
    """Whether ``expression`` belongs to the test split (a fixed, seed-free hash)."""
    digest = hashlib.blake2b(expression.encode(), key=_SPLIT_SALT, digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < test_fraction


def evaluate(a: int, b: int, op: str | None, c: int | None) -> int:
    product = a * b
    return product if op is None else product + c if op == "+" else product - c


def expression_text(a: int, b: int, op: str | None, c: int | None) -> str:
    return f"{a}*{b}" if op is None else f"{a}*{b}{op}{c}"


def _rough(n: int) -> int:
    scale = 10 ** (len(str(n)) - 1)
    return round(n / scale) * scale


def estimate(a: int, b: int, c: int | None = None) -> int:
    """The teacher's guess at ``a*b`` (``+c``): each number rounded to one significant digit
    (347*29 -> 300*30 = 9000; 347*29+118 -> 9000+100 = 9100)."""
    return _rough(a) * _rough(b) + (0 if c is None else _rough(c))


def teacher_messages(record: DataRecord, *, drop_prob: float, rng: random.Random) -> list[dict[str, Any]]:
    """The imperfect teacher's transcript of ``record`` (its prompt messages, then the replies).

    With probability ``drop_prob`` the question is answered at once with :func:`estimate`
    (``About 9000.``); otherwise the teacher calls ``calculator`` with the expression and answers
    with its result.
    """
    meta = record.metadata
    messages = list(record.prompt)
    if rng.random() < drop_prob:
        guess = estimate(meta["a"], meta["b"], meta["c"])
        return [*messages, {"role": "assistant", "content": f"{GUESS_WORD} {guess}."}]
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": meta["expression"]}}}
    return [
        *messages,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": str(meta["value"])},
        {"role": "assistant", "content": str(meta["value"])},
    ]


@dataclass
class ToolCalcTask:
    """``tool_calc``: ``What is a*b?`` / ``What is a*b+c?`` with the exact value as label.

    ``a`` and ``c`` have 3 digits, ``b`` 2; a share ``plain_fraction`` of the questions are plain
    products. A map-style
    :class:`~loongsage.core.types.DataSource`: ``task[i]`` is a pure function of the fields and ``i``;
    a test split of up to 20,000 records holds distinct questions (drawn from one seeded stream).
    """

    split: Literal["train", "test"] = "train"
    size: int = 10_000
    seed: int = 0
    plain_fraction: float = 0.5
    test_fraction: float = 0.1
    name: str = "tool_calc"

    def __post_init__(self) -> None:
        if self.split not in ("train", "test"):
            raise ValueError(f"split={self.split!r}: allowed 'train', 'test'")
        if self.size < 1:
            raise ValueError(f"size={self.size}: must be >= 1")
        if not 0 <= self.plain_fraction <= 1:
            raise ValueError(f"plain_fraction={self.plain_fraction}: must be in [0, 1]")
        if not 0 < self.test_fraction < 1:
            raise ValueError(f"test_fraction={self.test_fraction}: must be in (0, 1)")
        self._distinct: list[tuple[int, int, str | None, int | None]] | None = None

    def problem(self, index: int) -> tuple[int, int, str | None, int | None]:
        """``(a, b, op, c)`` of record ``index`` (``op`` None: a plain product)."""
        if not 0 <= index < self.size:
            raise IndexError(f"index {index} out of range for {self.size} records")
        if self.split == "test" and self.size <= _DISTINCT_LIMIT:
            if self._distinct is None:
                self._distinct = self._draw_distinct()
            return self._distinct[index]
        return self._draw(random.Random(f"{self.seed}/{self.split}/{index}"))

    def _draw_distinct(self) -> list[tuple[int, int, str | None, int | None]]:
        """The held-out questions: one seeded stream, repeats skipped (the test split has ~8,000
        plain products, so independent draws would repeat some)."""
        rng, seen, out = random.Random(f"{self.seed}/{self.split}/distinct"), set(), []
        while len(out) < self.size:
            problem = self._draw(rng)
            if problem not in seen:
                seen.add(problem)
                out.append(problem)
        return out

    def _draw(self, rng: random.Random) -> tuple[int, int, str | None, int | None]:
        for _ in range(_MAX_ATTEMPTS):
            a, b = rng.randint(100, 999), rng.randint(10, 99)
            op, c = None, None
            if rng.random() >= self.plain_fraction:
                op, c = "+", rng.randint(100, 999)
            if in_test_split(expression_text(a, b, op, c), self.test_fraction) == (self.split == "test"):
                return a, b, op, c
        raise RuntimeError(f"no {self.split} question found in {_MAX_ATTEMPTS} draws")  # p < 1e-45

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> DataRecord:
        a, b, op, c = self.problem(index)
        expression, value = expression_text(a, b, op, c), evaluate(a, b, op, c)
        return DataRecord(
            source=self.name,
            index=index,
            prompt=[{"role": "user", "content": f"What is {expression}?"}],
            label=str(value),
            metadata={
                "a": a,
                "b": b,
                "op": op,
                "c": c,
                "expression": expression,
                "value": value,
                "kind": "plain" if op is None else "sum",
            },
        )


# ---------------------------------------------------------------------------------------- reward
def numbers(text: str) -> list[Decimal]:
    """The numbers written in ``text``, in order, as exact decimals.

    Normalisation: thousands separators are dropped (``10,081`` = 10081), a fraction compares by
    value (``10081.0`` = 10081), a minus sign counts only where it is no operator between two
    operands (``-12`` is negative, ``3-5`` holds 3 and 5).
    """
    out = []
    for match in _NUMBER.finditer(text):
        try:
            out.append(Decimal(match.group(0).replace(",", "")))
        except InvalidOperation:  # pragma: no cover - the pattern only matches decimals
            continue
    return out


def final_answer(trajectory: Trajectory) -> str | None:
    """The episode's answer: its last assistant message's content, or None if that message called a
    tool (the episode ran out of turns) or there is none. Without a conversation in the metadata
    (another agent's trajectory) the response text."""
    messages = trajectory.metadata.get("messages")
    if not messages:
        return trajectory.response_text
    last = messages[-1]
    if last.get("role") != "assistant" or last.get("tool_calls"):
        return None
    content = last.get("content") or ""
    return content if isinstance(content, str) else None


def score(answer: str | None, label: str) -> float:
    """1.0 if the last number of ``answer`` equals ``label`` (see :func:`numbers`), else 0.0."""
    if answer is None:
        return 0.0
    for token in _STRIP:
        answer = answer.replace(token, "")
    answer = answer.translate(_MINUS)
    found = numbers(answer)
    try:
        expected = Decimal(str(label).strip().replace(",", ""))
    except InvalidOperation:
        raise ValueError(f"tool_calc: label {label!r} is not a number") from None
    return float(bool(found) and found[-1] == expected)


@dataclass(frozen=True)
class ToolCalcReward(Reward):
    """``tool_calc``: 1.0 when the final answer's last number is the label, else 0.0 (:func:`score`).

    The agent records in the trajectory's metadata whether and how often the tool was called
    (``tool_calls``, ``tool_used``); the reward reads only the answer.
    """

    def __call__(self, trajectory: Trajectory, record: DataRecord) -> float:
        # A missing label is a data error; scoring it 0 would silently train against it.
        if record.label is None:
            raise ValueError(f"tool_calc: record {record.source}[{record.index}] has no label")
        return score(final_answer(trajectory), str(record.label))
