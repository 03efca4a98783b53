"""Rule-based rewards: ``(trajectory, record) -> float`` (or an awaitable of one).

Each reward is a pure function over plain values and an entry class
(:func:`loongsage.core.entries.entry`) whose params (the function's keyword parameters, or the
class's annotated attributes) are the recipe's ``params`` and whose call reads the trajectory and
its record. A class of its own, because a reward has more to do than bind: refuse a record without
a label, wrap another reward, or hold a grader process.

Wrappers (``overlong_shaping``, ``format``) add a term to another reward. The wrapped reward is
named in the ``inner`` param as a ``{name, params}`` spec, like any registry entry; the class
attribute ``nested = {"inner": "reward"}`` tells the framework's registry to build that spec (depth
first, validated like any entry) and hand the built reward to ``bind``. An unbound wrapper whose
``inner`` is null adds its term to 0.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import re
import threading
from collections.abc import Awaitable, Callable, Mapping
from fractions import Fraction
from typing import Annotated, Any, ClassVar, Literal

from loongsage.algos.math_grader import GraderPool
from loongsage.core.contracts import Reward, RewardContext
from loongsage.core.entries import Range, entry
from loongsage.core.rewarding import call_reward
from loongsage.core.types import DataRecord, Trajectory

RewardFn = Callable[[Trajectory, DataRecord], "float | Awaitable[float]"]


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
    """1.0 if the extracted answer equals ``str(label)`` (both stripped if ``strip``), else 0.0.

    ``extract``: a regex; group 1 (or the whole match) of its last match is the answer.
    """
    answer = extract_answer(response_text, extract)
    if answer is None:
        return 0.0
    expected = str(label)
    if strip:
        answer, expected = answer.strip(), expected.strip()
    return 1.0 if answer == expected else 0.0


@entry("exact_match", exact_match)
class ExactMatch(Reward):
    """``exact_match``: string equality of the (optionally regex-extracted) answer and the label."""

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
        return self.apply(trajectory.response_text, record.label)


# ------------------------------------------------------------------------------- wrappers


def _then(value: float | Awaitable[float], fn: Callable[[float], float]) -> float | Awaitable[float]:
    """``fn(value)``, awaiting ``value`` first if the inner reward is asynchronous."""
    if inspect.isawaitable(value):

        async def later() -> float:
            return fn(float(await value))

        return later()
    return fn(float(value))


def _check_spec(owner: str, spec: Mapping[str, Any] | None) -> None:
    if spec is None:
        return
    if not isinstance(spec, Mapping) or not isinstance(spec.get("name"), str) or set(spec) - {"name", "params"}:
        raise ValueError(f"{owner}.inner={spec!r}: must be a mapping with 'name' (and optional 'params')")


class _Wrapper(Reward):
    """Holds the built inner reward of a wrapper entry (not a param: set by :meth:`bind`)."""

    name: ClassVar[str]  # set by entry()
    nested: ClassVar[dict[str, str]] = {"inner": "reward"}  # param -> registry category
    # Takes the run's context and hands it on (call_reward), in case the inner reward reads it.
    takes_context: ClassVar[bool] = True
    _inner_reward: ClassVar[RewardFn | None] = None  # shadowed per instance by bind()
    inner: dict[str, Any] | None

    def bind(self, inner: RewardFn):
        """A copy of this wrapper that calls ``inner`` (the reward the ``inner`` spec names)."""
        if not callable(inner):
            raise TypeError(f"{self.name}.bind: inner reward must be callable, got {inner!r}")
        bound = dataclasses.replace(self)
        object.__setattr__(bound, "_inner_reward", inner)
        return bound

    def _base(
        self, trajectory: Trajectory, record: DataRecord, ctx: RewardContext | None = None
    ) -> float | Awaitable[float]:
        if self._inner_reward is not None:
            return call_reward(self._inner_reward, trajectory, record, ctx)
        if self.inner is not None:
            raise RuntimeError(f"{self.name}.inner={dict(self.inner)!r}: not built; build it through the registry")
        return 0.0


def overlong_penalty(length: int, max_length: int, buffer: int) -> float:
    """DAPO's soft overlong penalty for a response of ``length`` tokens (``L_max``, ``L_c``)::

        0                                 if L <= L_max - L_c
        -(L - (L_max - L_c)) / L_c        if L_max - L_c < L <= L_max
        -1                                if L > L_max

    Continuous: it reaches -1 exactly at ``L = L_max``.
    """
    start = max_length - buffer
    if length <= start:
        return 0.0
    if length > max_length:
        return -1.0
    return -(length - start) / buffer


@entry("overlong_shaping")
class OverlongShaping(_Wrapper):
    """``overlong_shaping``: ``inner`` reward plus DAPO's overlong penalty on ``len(response_ids)``."""

    inner: dict[str, Any] | None = None  # {name, params} of the wrapped reward; null: penalty only
    max_length: Annotated[int, Range(ge=1)] = 20480  # L_max (DAPO: 20480)
    buffer: Annotated[int, Range(ge=1, note="at most max_length")] = 4096  # L_c, the band below L_max (DAPO: 4096)

    def __post_init__(self) -> None:
        _check_spec(self.name, self.inner)
        if self.buffer > self.max_length:
            raise ValueError(f"overlong_shaping.buffer={self.buffer}: must be in [1, max_length={self.max_length}]")

    def __call__(
        self, trajectory: Trajectory, record: DataRecord, ctx: RewardContext | None = None
    ) -> float | Awaitable[float]:
        penalty = overlong_penalty(len(trajectory.response_ids), self.max_length, self.buffer)
        return _then(self._base(trajectory, record, ctx), lambda base: base + penalty)


_BOX_OPEN = "\\boxed{"
_BOXED_SOMEWHERE = r"\\boxed\{.+\}"  # the format reward's default pattern


@entry("format")
class FormatReward(_Wrapper):
    """``format``: ``inner`` reward plus ``bonus`` if ``pattern`` matches the response, else ``penalty``.

    The pattern is compiled with ``re.DOTALL`` (``.`` crosses lines, as responses do) and searched
    anywhere (``full_match``: must match the whole response). ``gate``: a response that does not
    match gets ``penalty`` alone and the inner reward is not called.
    """

    pattern: str = _BOXED_SOMEWHERE
    full_match: bool = False
    bonus: float = 0.0
    penalty: float = -1.0
    gate: bool = False
    inner: dict[str, Any] | None = None  # {name, params} of the wrapped reward; null: the term alone

    def __post_init__(self) -> None:
        try:
            compiled = re.compile(self.pattern, re.DOTALL)
        except re.error as exc:
            raise ValueError(f"format.pattern={self.pattern!r}: invalid regex ({exc})") from None
        object.__setattr__(self, "_compiled", compiled)
        _check_spec(self.name, self.inner)

    def matches(self, text: str) -> bool:
        if self.pattern == _BOXED_SOMEWHERE and not self.full_match:
            # the default's meaning in one pass: the first "\boxed{" with a "}" at least one character
            # after it (a later box matches only where the first does). ``re`` would try every
            # "\boxed{" out to the end: quadratic in a response of many unclosed boxes.
            start = text.find(_BOX_OPEN)
            return start >= 0 and text.rfind("}") > start + len(_BOX_OPEN)
        compiled: re.Pattern[str] = self._compiled  # type: ignore[attr-defined]
        return (compiled.fullmatch(text) if self.full_match else compiled.search(text)) is not None

    def __call__(
        self, trajectory: Trajectory, record: DataRecord, ctx: RewardContext | None = None
    ) -> float | Awaitable[float]:
        matched = self.matches(trajectory.response_text)
        if self.gate and not matched:
            return self.penalty
        term = self.bonus if matched else self.penalty
        return _then(self._base(trajectory, record, ctx), lambda base: base + term)


# ----------------------------------------------------------------------------------- math

_BOXED = re.compile(r"\\(?:boxed|fbox)\b\s*")  # the match ends where the box's content starts
_NUMBER = re.compile(r"-?(?:\d+(?:,\d{3})*(?:\.\d+)?|\.\d+)(?:/\d+)?")
_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_TOKEN = re.compile(r"[^\s${}]+")
_EXPONENT = re.compile(r"[eE][+-]?0*(\d+)")
_WRAPPERS = re.compile(r"\\(?:text|textbf|mathrm|mathbf|operatorname)\{([^{}]*)\}")
_FRAC = re.compile(r"(-?)\\frac(?:\{([^{}]+)\}|(\d))(?:\{([^{}]+)\}|(\d))")
_DROP = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\ ", "^{\\circ}", "^\\circ", "\\%", "%", "\\$")


def extract_boxed(text: str) -> str | None:
    """The content of the *last* ``\\boxed{...}`` (or ``\\fbox``) in ``text``, braces balanced.

    ``\\boxed 5`` (no braces) yields the next token. An unclosed box is skipped for the one before
    it; None if there is no complete box. Linear in ``len(text)``.
    """
    closing: dict[int, int] = {}
    stack: list[int] = []
    for i, ch in enumerate(text):
        if ch == "{":
            stack.append(i)
        elif ch == "}" and stack:
            closing[stack.pop()] = i
    for match in reversed(list(_BOXED.finditer(text))):
        start = match.end()
        if text.startswith("{", start):
            if start in closing:
                return text[start + 1 : closing[start]]
            continue
        token = _TOKEN.match(text, start)
        if token:
            return token.group(0)
    return None


def normalize_math(text: str) -> str:
    """A canonical string for a final answer (the fallback grader's normaliser).

    Strips whitespace and surrounding ``$``, unwraps ``\\text{..}``-like macros, drops sizing and
    spacing macros, degrees and percent signs, maps ``\\dfrac``/``\\tfrac`` to ``\\frac``, drops a
    leading ``x =``, a trailing period and all remaining whitespace.
    """
    s = text.strip().rstrip(".").strip().strip("$")
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    for _ in range(3):  # nested wrappers
        s = _WRAPPERS.sub(r"\1", s)
    for token in _DROP:
        s = s.replace(token, "")
    s = re.sub(r"\s+", "", s).rstrip(".")
    s = re.sub(r"^[A-Za-z]=(?!=)", "", s)
    return s


def parse_number(text: str) -> Fraction | None:
    """An exact rational for a normalised answer: ``3``, ``-0.25``, ``1,000``, ``3/4``, ``1e3``,
    ``\\frac{3}{4}``, ``\\frac34``, ``-\\frac{1}{2}``; None if it is not a plain number."""
    m = _FRAC.fullmatch(text)
    if m:
        num, den = parse_number(m.group(2) or m.group(3)), parse_number(m.group(4) or m.group(5))
        if num is None or den is None or den == 0:
            return None
        value = num / den
        return -value if m.group(1) else value
    if _THOUSANDS.fullmatch(text):
        text = text.replace(",", "")
    if "_" in text:  # Fraction reads "1e9_999_999" (digit groups), past the exponent's guard below
        return None
    exponent = _EXPONENT.search(text)
    if exponent and len(exponent.group(1)) > 4:
        return None  # Fraction("1e999999999") would build a billion-digit integer
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def answers_equal(a: str, b: str) -> bool:
    """Exact numeric equality when both parse as numbers, else equality of the normalised strings."""
    na, nb = normalize_math(a), normalize_math(b)
    x, y = parse_number(na), parse_number(nb)
    if x is not None and y is not None:
        return x == y
    return na == nb


def math_equal_fallback(response_text: str, label: str) -> bool:
    """The fallback grader (no ``math-verify``): compare the response's final answer to ``label``.

    The response's answer is its last ``\\boxed{}``; without one, its last number or, failing that,
    the whole text. A label given as ``\\boxed{..}`` is unboxed first. Numbers compare exactly as
    fractions (``0.5 = 1/2 = \\frac{1}{2}``; ``0.333 != 1/3``); anything else as normalised strings.
    """
    gold = extract_boxed(label) or label
    boxed = extract_boxed(response_text)
    if boxed is not None:
        return answers_equal(boxed, gold)
    numbers = _NUMBER.findall(response_text)
    candidates = ([numbers[-1]] if numbers else []) + [response_text]
    return any(answers_equal(c, gold) for c in candidates)


def math_equal_verify(response_text: str, label: str, *, timeout: int = 5) -> bool:
    """Grade with ``math-verify``: parse the label (boxed unless it already has ``$`` or a box) and
    the response, then ``verify(gold, answer)``.

    ``math-verify`` times out through ``SIGALRM``, which only the main thread may use; elsewhere (a
    Ray async actor's event-loop thread) the timeout is off.
    """
    from math_verify import parse, verify

    t = timeout if timeout > 0 and threading.current_thread() is threading.main_thread() else None
    gold_text = label if ("$" in label or "\\boxed" in label) else f"\\boxed{{{label}}}"
    gold = parse(gold_text, parsing_timeout=t)
    answer = parse(response_text, parsing_timeout=t)
    return bool(gold) and bool(verify(gold, answer, timeout_seconds=t))


def math_verify_available() -> bool:
    return importlib.util.find_spec("math_verify") is not None


@entry("math")
class MathAnswer(Reward):
    """``math``: 1.0 if the response's final answer equals the label mathematically, else 0.0.

    ``backend="auto"`` grades with ``math-verify`` when it is installed and with the fallback
    normaliser (:func:`math_equal_fallback`) otherwise; ``"math_verify"`` requires the package.
    A list or tuple label accepts any of its answers. With math-verify a call returns an awaitable:
    the answer is graded in a child process (:mod:`loongsage.algos.math_grader`), up to ``graders``
    of them at once, while the reward worker awaits a batch's answers together.
    """

    backend: Literal["auto", "math_verify", "fallback"] = "auto"
    # seconds per math-verify parse/verify; main thread only
    timeout: Annotated[int, Range(ge=0, note="0 = no timeout")] = 5
    graders: Annotated[int, Range(ge=1, note="math-verify processes grading side by side")] = 4

    def __post_init__(self) -> None:
        available = math_verify_available()
        if self.backend == "math_verify" and not available:
            raise ValueError(
                "math.backend='math_verify': the math-verify package is not installed; use 'auto' or 'fallback'"
            )
        object.__setattr__(self, "_use_math_verify", self.backend != "fallback" and available)

    @property
    def uses_math_verify(self) -> bool:
        return self._use_math_verify  # type: ignore[attr-defined]

    def _grader(self) -> GraderPool:
        """math-verify in child processes (see :mod:`loongsage.algos.math_grader`), made on first use;
        a response one hangs on past three timeouts (a minute with none) scores 0."""
        pool = self.__dict__.get("_isolated")
        if pool is None:
            pool = GraderPool(self.graders, self.timeout, 3 * self.timeout + 2.0 if self.timeout > 0 else 60.0)
            object.__setattr__(self, "_isolated", pool)
        return pool

    def __call__(self, trajectory: Trajectory, record: DataRecord) -> float | Awaitable[float]:
        if record.label is None:
            raise ValueError(f"math: record {record.source}[{record.index}] has no label")
        labels = [str(x) for x in (record.label if isinstance(record.label, (list, tuple)) else [record.label])]
        if self.uses_math_verify:
            return self._graded(trajectory.response_text, labels)
        return float(any(math_equal_fallback(trajectory.response_text, label) for label in labels))

    async def _graded(self, response: str, labels: list[str]) -> float:
        pool = self._grader()
        for label in labels:  # a pool thread waits on a child's answer; the event loop goes on meanwhile
            if await pool.graded(response, label):
                return 1.0
        return 0.0
