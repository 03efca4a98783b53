"""Synthetic digit sorting: a map-style data source whose answers vary in length, and its reward.

``DigitSortTask`` yields prompts such as ``"sort 90471="`` (as a one-message chat, or raw text) with
the digits in ascending order as label (``"01479"``). A list has ``min_len`` to ``max_len`` digits
(the length uniform, then each digit uniform, repeats allowed), so with the defaults (3-20) answers
run from 4 to 21 tokens with the end-of-turn token: the embedded tokenizer splits digits into
single tokens and ``sort`` into three, so the prompt and the answer need no new vocabulary. Each
record is a pure function of the dataclass fields and its index, which exact data resumption needs.

Train/test split. Each digit string belongs to one split by a salted hash of the string,
independent of ``seed``: no test list is ever trained on, whatever the seeds of either side.

Imperfect teacher. :func:`teacher_answer` sorts correctly, except at the two ends of the sorted
list: when the smallest digit occurs more than once it writes it only once with probability
``drop_prob``, and likewise (independently) the largest digit. A model fine-tuned on its answers
learns to sort, yet where an end digit repeats it puts about ``drop_prob`` of its probability on
moving on after the first copy (after the largest digit: on ending the answer). With
``drop_prob > 0.5`` greedy decoding is wrong on every list with a repeated end digit (about 70%
of 3-20 digit lists, rising with the length) while sampling is often right: pass@k is far above
pass@1, and reinforcement learning with the task's reward has a systematic error to fix. As with
the arithmetic task's carry-dropping teacher, this is a deliberate, documented construction for
demonstrating RL on a CPU, not a claim about how real SFT data fails.

Reward. :class:`DigitSortReward` (registered as ``digit_sort``) checks a response with
:func:`score`: 1.0 if its digits, after normalisation, equal the sorted list, else 0.0; with
``partial_credit`` a wrong answer earns a share of that weight (always below 1, so a held-out
accuracy that counts rewards >= 1 stays exact-match).
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from typing import Literal

from loongsage.core.contracts import Reward
from loongsage.core.schema import ranged
from loongsage.core.types import DataRecord, Trajectory

_SPLIT_SALT = b"loongsage-sort-split-v1"
# Splits of at most this many records are drawn without repeats (a held-out set of distinct
# lists); larger ones are sampled per index and may repeat short lists.
_DISTINCT_LIMIT = 20_000
_MAX_ATTEMPTS = 10_000  # rejection-sampling bound per record (the split of some length may be empty)
MAX_LEN_LIMIT = 64  # longer lists would not fit the tiny model's context with room to answer
# Digits optionally separated by runs of spaces or commas ("01479", "0 1 4 7 9", "0, 1, 4, 7, 9").
# ASCII digits only: ``\d`` would also accept other scripts' digits.
_ANSWER = re.compile(r"[0-9](?:[ ,]*[0-9])*")
_SEPARATORS = re.compile(r"[ ,]+")
_STRIP = ("<|im_end|>", "<|endoftext|>")


def in_test_split(digits: str, test_fraction: float) -> bool:
    """Whether the digit string ``digits`` belongs to the test split (a fixed, seed-free hash)."""
    digest = hashlib.blake2b(digits.encode(), key=_SPLIT_SALT, digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < test_fraction


def sort_digits(digits: str) -> str:
    """The correct answer: the digits of ``digits`` in ascending order."""
    return "".join(sorted(digits))


def teacher_answer(digits: str, *, drop_prob: float = 0.0, rng: random.Random | None = None) -> str:
    """Sorted digits, except that a repeated smallest (largest) digit is written once with
    probability ``drop_prob``, the two ends deciding independently.

    Randomness is drawn only at an end whose digit repeats (a list of one repeated digit has one
    end), so every mistake is local: copies of an end digit go missing, the rest is correct.
    ``drop_prob=0`` gives :func:`sort_digits`.
    """
    if not digits or not digits.isascii() or not digits.isdigit():
        raise ValueError(f"digits={digits!r}: a non-empty string of 0-9")
    answer = sort_digits(digits)
    if drop_prob <= 0:
        return answer
    rng = rng or random.Random(0)
    values = sorted(set(answer))
    runs = [answer.count(d) for d in values]
    for end in [0] if len(runs) == 1 else [0, len(runs) - 1]:  # one end when all digits are equal
        if runs[end] > 1 and rng.random() < drop_prob:
            runs[end] = 1
    return "".join(d * n for d, n in zip(values, runs))


def extract_answer(response_text: str) -> str | None:
    """The digits of a response, or None if it is not a bare digit list.

    Normalisation: end-of-turn tokens and surrounding whitespace are removed, and digits may be
    separated by spaces or commas, which are dropped. Anything else (words, signs, other scripts'
    digits, a second line) makes the response unreadable: None.
    """
    text = response_text
    for token in _STRIP:
        text = text.replace(token, "")
    text = text.strip()
    if not _ANSWER.fullmatch(text):
        return None
    return _SEPARATORS.sub("", text)


def score(response_text: str, label: str, *, partial_credit: float = 0.0) -> float:
    """1.0 if the response's digits equal ``label``; else ``partial_credit`` times the share of
    positions that agree (over the longer of the two), or 0.0 for an unreadable response.

    ``partial_credit`` must be in ``[0, 1)``, so only an exact answer scores 1.
    """
    if not 0.0 <= partial_credit < 1.0:
        raise ValueError(f"partial_credit={partial_credit}: must be in [0, 1)")
    expected = str(label).strip()
    answer = extract_answer(response_text)
    if answer is None:
        return 0.0
    if answer == expected:
        return 1.0
    if partial_credit == 0.0 or not expected:
        return 0.0
    agree = sum(a == b for a, b in zip(answer, expected))
    return partial_credit * agree / max(len(answer), len(expected))


@dataclass(frozen=True)
class DigitSortReward(Reward):
    """``digit_sort``: the digit-sorting task's checker as a reward (:func:`score`).

    Exact match after normalisation by default; ``partial_credit`` > 0 gives a wrong but readable
    answer that weight times the share of positions it gets right (strictly below 1).
    """

    partial_credit: float = ranged(0.0, ge=0, lt=1, note="0 = exact match only")

    def __post_init__(self) -> None:
        if not 0.0 <= self.partial_credit < 1.0:
            raise ValueError(f"digit_sort.partial_credit={self.partial_credit}: must be in [0, 1)")

    def __call__(self, trajectory: Trajectory, record: DataRecord) -> float:
        # A missing label is a data error; scoring it 0 would silently train against it.
        if record.label is None:
            raise ValueError(f"digit_sort: record {record.source}[{record.index}] has no label")
        return score(trajectory.response_text, str(record.label), partial_credit=self.partial_credit)


@dataclass
class DigitSortTask:
    """Digit lists of ``min_len`` to ``max_len`` digits to sort in ascending order.

    A map-style :class:`~loongsage.core.types.DataSource`: ``task[i]`` is a pure function of the
    fields and ``i``. A split of at most 20,000 records holds distinct lists (the held-out set);
    a larger one samples each index independently.
    """

    min_len: int = 3
    max_len: int = 20
    split: Literal["train", "test"] = "train"
    size: int = 10_000
    seed: int = 0
    prompt_format: Literal["chat", "text"] = "chat"
    test_fraction: float = 0.1
    name: str = "digit_sort"

    def __post_init__(self) -> None:
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError(f"min_len={self.min_len}, max_len={self.max_len}: need 1 <= min_len <= max_len")
        if self.max_len > MAX_LEN_LIMIT:
            raise ValueError(f"max_len={self.max_len}: must be <= {MAX_LEN_LIMIT}")
        if self.split not in ("train", "test"):
            raise ValueError(f"split={self.split!r}: allowed 'train', 'test'")
        if self.prompt_format not in ("chat", "text"):
            raise ValueError(f"prompt_format={self.prompt_format!r}: allowed 'chat', 'text'")
        if not 0 < self.test_fraction < 1:
            raise ValueError(f"test_fraction={self.test_fraction}: must be in (0, 1)")
        if self.size < 1:
            raise ValueError(f"size={self.size}: must be >= 1")
        self._lists: list[str] | None = None
        if self.size <= _DISTINCT_LIMIT:
            self._lists = self._distinct(self.size)
        else:
            self._sample(0)  # an empty split is an error now, not at the first read

    def _belongs(self, digits: str) -> bool:
        return in_test_split(digits, self.test_fraction) == (self.split == "test")

    def _draw(self, rng: random.Random) -> str:
        for _ in range(_MAX_ATTEMPTS):
            n = rng.randint(self.min_len, self.max_len)
            digits = "".join(rng.choice("0123456789") for _ in range(n))
            if self._belongs(digits):
                return digits
        raise ValueError(
            f"split={self.split!r}: no list of {self.min_len}-{self.max_len} digits found in "
            f"{_MAX_ATTEMPTS} draws (test_fraction={self.test_fraction})"
        )

    def _sample(self, index: int) -> str:
        return self._draw(random.Random(f"{self.seed}/{self.split}/{index}"))

    def _distinct(self, count: int) -> list[str]:
        """``count`` distinct lists, drawn from one seeded stream (cycles if the split is smaller)."""
        rng, seen, lists = random.Random(f"{self.seed}/{self.split}/distinct"), set(), []
        misses = 0
        while len(lists) < count and misses < _MAX_ATTEMPTS:
            digits = self._draw(rng)
            if digits in seen:
                misses += 1
                continue
            seen.add(digits)
            lists.append(digits)
        return lists

    def problem(self, index: int) -> str:
        """The digit string of record ``index``."""
        if not 0 <= index < self.size:
            raise IndexError(f"index {index} out of range for {self.size} records")
        if self._lists is not None:
            return self._lists[index % len(self._lists)]  # cycles when size > the split's lists
        return self._sample(index)

    def render_prompt(self, digits: str) -> str | list[dict[str, str]]:
        text = f"sort {digits}="
        return [{"role": "user", "content": text}] if self.prompt_format == "chat" else text

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> DataRecord:
        digits = self.problem(index)
        return DataRecord(
            source=self.name,
            index=index,
            prompt=self.render_prompt(digits),
            label=sort_digits(digits),
            metadata={"digits": digits, "length": len(digits)},
        )

    def num_distinct(self) -> int | None:
        """Number of distinct lists in this split, when drawn without repeats (else None)."""
        return None if self._lists is None else len(self._lists)
