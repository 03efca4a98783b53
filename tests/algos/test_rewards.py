"""Rewards: exact_match, math, and the overlong_shaping / format wrappers."""

from __future__ import annotations

import asyncio
import importlib.machinery
import inspect
import re
import sys
import threading
import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loongsage.algos import rewards as rewards_module
from loongsage.algos.math_grader import GraderPool, IsolatedGrader
from loongsage.algos.rewards import (
    ExactMatch,
    FormatReward,
    MathAnswer,
    OverlongShaping,
    exact_match,
    extract_answer,
    extract_boxed,
    math_equal_fallback,
    math_equal_verify,
    normalize_math,
    overlong_penalty,
    parse_number,
)
from loongsage.core.contracts import RewardContext
from loongsage.core.plugins import load_registry
from loongsage.core.rewarding import call_reward
from loongsage.core.types import ConfigError, DataRecord, RewardInfraError, Trajectory


def score(reward: ExactMatch, text: str, label: object) -> float:
    traj = Trajectory(
        source="s",
        group_id=0,
        sample_index=0,
        prompt_ids=[1],
        response_ids=[2],
        loss_mask=[1],
        rollout_logprobs=[0.0],
        versions=[0],
        response_text=text,
    )
    return reward(traj, DataRecord(source="s", index=3, prompt="p", label=label))


def test_whole_response() -> None:
    assert score(ExactMatch(), " 42\n", "42") == 1.0
    assert score(ExactMatch(), "42", 42) == 1.0  # labels compare as strings
    assert score(ExactMatch(), "42.0", 42) == 0.0
    assert score(ExactMatch(strip=False), " 42", "42") == 0.0
    assert score(ExactMatch(strip=False), "42", "42") == 1.0


def test_extract_takes_the_last_match() -> None:
    boxed = ExactMatch(extract=r"\\boxed\{([^}]*)\}")
    assert score(boxed, r"maybe \boxed{3}, no: \boxed{ 7 }", "7") == 1.0
    assert score(boxed, r"\boxed{7} then \boxed{3}", "7") == 0.0
    assert score(boxed, "no box at all: 7", "7") == 0.0
    assert score(ExactMatch(extract=r"-?\d+"), "2 + 3 = 5", "5") == 1.0  # no group: whole match


def test_function_form() -> None:
    assert exact_match("#### 12", "12", extract=r"####\s*(\S+)") == 1.0
    assert extract_answer("abc", None) == "abc"
    assert extract_answer("abc", r"\d") is None


def test_errors() -> None:
    with pytest.raises(ValueError, match=r"exact_match\.extract"):
        ExactMatch(extract="(")
    with pytest.raises(ValueError, match=r"s\[3\] has no label"):
        score(ExactMatch(), "1", None)


# ------------------------------------------------------------------------------ wrappers


def traj_of(length: int, text: str = "") -> Trajectory:
    return Trajectory(
        source="s",
        group_id=0,
        sample_index=0,
        prompt_ids=[1],
        response_ids=[2] * length,
        loss_mask=[1] * length,
        rollout_logprobs=[0.0] * length,
        versions=[0] * length,
        response_text=text,
    )


RECORD = DataRecord(source="s", index=0, prompt="p", label="7")


def create(spec, path="reward"):
    """Build through the real registry (which builds nested rewards depth first)."""
    return load_registry().create("reward", spec, path)


def test_overlong_penalty_hand_values() -> None:
    # L_max 20, L_c 4: no penalty up to 16, linear to -1 at 20, -1 beyond.
    got = [overlong_penalty(n, 20, 4) for n in (0, 16, 17, 18, 20, 21, 500)]
    assert got == pytest.approx([0.0, 0.0, -0.25, -0.5, -1.0, -1.0, -1.0])
    assert overlong_penalty(10, 10, 10) == -1.0 and overlong_penalty(1, 10, 10) == pytest.approx(-0.1)


@settings(deadline=None, max_examples=200)
@given(length=st.integers(0, 200), max_length=st.integers(1, 100), data=st.data())
def test_overlong_penalty_matches_formula_and_is_monotone(length, max_length, data) -> None:
    buffer = data.draw(st.integers(1, max_length))
    start = max_length - buffer
    expected = 0.0 if length <= start else (-1.0 if length > max_length else -(length - start) / buffer)
    got = overlong_penalty(length, max_length, buffer)
    assert got == pytest.approx(expected) and -1.0 <= got <= 0.0
    assert overlong_penalty(length + 1, max_length, buffer) <= got


def test_overlong_shaping_wraps_a_built_inner_reward() -> None:
    spec = {"name": "overlong_shaping", "params": {"inner": {"name": "exact_match"}, "max_length": 10, "buffer": 4}}
    reward = create(spec)
    assert [reward(traj_of(n, "7"), RECORD) for n in (6, 7, 10, 11)] == pytest.approx([1.0, 0.75, 0.0, 0.0])
    assert reward(traj_of(8, "6"), RECORD) == pytest.approx(-0.5)
    alone = OverlongShaping(max_length=10, buffer=4)  # no inner: the penalty alone
    assert alone(traj_of(9, "7"), RECORD) == pytest.approx(-0.75)


def test_unbuilt_inner_is_an_error_and_bind_copies() -> None:
    unbuilt = OverlongShaping(inner={"name": "exact_match"})
    with pytest.raises(RuntimeError, match=r"^overlong_shaping\.inner=\{'name': 'exact_match'\}: not built"):
        unbuilt(traj_of(1, "7"), RECORD)
    bound = unbuilt.bind(ExactMatch())
    assert bound == unbuilt and bound(traj_of(1, "7"), RECORD) == 1.0
    with pytest.raises(RuntimeError):
        unbuilt(traj_of(1, "7"), RECORD)  # bind returned a copy
    with pytest.raises(TypeError, match=r"overlong_shaping\.bind"):
        unbuilt.bind("exact_match")  # type: ignore[arg-type]


def declared(fn, *, takes_context: bool = False):
    """A plain function as the registry hands a reward over: with its contract's flag declared."""
    fn.takes_context = takes_context
    return fn


def test_wrappers_await_an_async_inner_and_pass_infra_errors_through() -> None:
    async def judge(trajectory: Trajectory, record: DataRecord) -> float:
        return 2.0

    value = OverlongShaping(max_length=10, buffer=4).bind(declared(judge))(traj_of(8), RECORD)
    assert asyncio.run(value) == pytest.approx(1.5)

    def broken(trajectory: Trajectory, record: DataRecord) -> float:
        raise RewardInfraError("sandbox died")

    with pytest.raises(RewardInfraError):
        FormatReward().bind(declared(broken))(traj_of(1, r"\boxed{7}"), RECORD)


def test_a_reward_taking_ctx_gets_the_context_through_wrappers() -> None:
    seen: list[object] = []

    async def in_sandbox(trajectory: Trajectory, record: DataRecord, ctx: RewardContext) -> float:
        seen.append(ctx.services.get("sandboxes"))
        return 1.0

    ctx = RewardContext(services={"sandboxes": "handle"})
    wrapped = FormatReward(pattern="7", bonus=0.5).bind(
        OverlongShaping(max_length=10, buffer=4).bind(declared(in_sandbox, takes_context=True))
    )
    assert wrapped.takes_context and in_sandbox.takes_context and not ExactMatch().takes_context
    assert asyncio.run(call_reward(wrapped, traj_of(8, "7"), RECORD, ctx)) == pytest.approx(1.0)  # 1 - 0.5 + 0.5
    assert seen == ["handle"]  # once, through both wrappers
    # without a context (a reward called outside the reward worker) it gets an empty one
    assert asyncio.run(call_reward(in_sandbox, traj_of(1), RECORD, None)) == 1.0 and seen[-1] is None
    assert call_reward(ExactMatch(), traj_of(1, "7"), RECORD, ctx) == 1.0  # two-argument rewards as before


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(["\\boxed{", "\\boxed", "}", "{", "x", "\n", "\\"]), max_size=12))
def test_the_default_format_pattern_is_read_in_one_pass_as_re_reads_it(pieces: list[str]) -> None:
    """The default pattern is checked without ``re`` (whose search is quadratic in a response of
    many unclosed boxes); it says what ``re.search`` says, on any arrangement of its pieces."""
    text = "".join(pieces)
    default = FormatReward()
    assert default.matches(text) == (re.search(default.pattern, text, re.DOTALL) is not None), text


def _scored(value):
    """A reward's value, awaited where it is an awaitable (math-verify grades in a child process)."""
    return asyncio.run(value) if inspect.isawaitable(value) else value


def test_format_reward() -> None:
    boxed, plain = traj_of(1, "so \\boxed{7}\n"), traj_of(1, "so 7")
    default = FormatReward()
    assert default(boxed, RECORD) == 0.0 and default(plain, RECORD) == -1.0
    think = FormatReward(pattern=r"<think>.*</think>.*", full_match=True, bonus=0.5, penalty=0.0)
    assert think(traj_of(1, "<think>a\nb</think>\nanswer"), RECORD) == 0.5  # DOTALL: . crosses lines
    assert think(traj_of(1, "x <think>a</think>"), RECORD) == 0.0  # full match required
    nested = create({"name": "format", "params": {"inner": {"name": "math"}, "bonus": 0.1}})
    assert _scored(nested(boxed, RECORD)) == pytest.approx(1.1)
    assert _scored(nested(plain, RECORD)) == pytest.approx(0.0)

    calls = []

    def counted(trajectory: Trajectory, record: DataRecord) -> float:
        calls.append(1)
        return 1.0

    gated = FormatReward(gate=True, penalty=-0.5).bind(declared(counted))
    assert gated(plain, RECORD) == -0.5 and not calls
    assert gated(boxed, RECORD) == 1.0 and calls == [1]
    with pytest.raises(ValueError, match=r"^format\.pattern='\(': invalid regex"):
        FormatReward(pattern="(")
    with pytest.raises(ValueError, match=r"^format\.inner=\{'params': \{\}\}: must be a mapping with 'name'"):
        FormatReward(inner={"params": {}})


def test_nested_wrappers_build_depth_first() -> None:
    spec = {
        "name": "format",
        "params": {
            "bonus": 0.5,
            "penalty": 0.0,
            "inner": {
                "name": "overlong_shaping",
                "params": {"max_length": 10, "buffer": 2, "inner": {"name": "math"}},
            },
        },
    }
    reward = create(spec)
    bad = {"name": "format", "params": {"inner": {"name": "overlong_shaping", "params": {"inner": {"name": "nope"}}}}}
    with pytest.raises(ConfigError, match=r"^reward\.params\.inner\.params\.inner\.name: unknown reward 'nope'"):
        create(bad)
    assert _scored(reward(traj_of(9, r"\boxed{7.0}"), RECORD)) == pytest.approx(1.0 - 0.5 + 0.5)
    with pytest.raises(ValueError, match=r"^overlong_shaping\.buffer=11: "):
        OverlongShaping(max_length=10, buffer=11)
    with pytest.raises(ValueError, match=r"^overlong_shaping\.max_length=0: "):
        OverlongShaping(max_length=0)


# ------------------------------------------------------------------------------ math


@pytest.mark.parametrize(
    ("response", "label", "expected"),
    [
        (r"so \boxed{\frac{1}{2}}", "0.5", True),
        (r"\boxed{\dfrac{3}{4}}", r"\frac34", True),
        (r"\boxed{-\frac{1}{2}}", "-1/2", True),
        (r"first \boxed{3}, finally \boxed{ 7 }", "7", True),  # the last box counts
        (r"\boxed{7} then \boxed{3}", "7", False),
        (r"\boxed{\text{(B)}}", "(B)", True),
        (r"\boxed{1,000}", "1000", True),
        (r"\boxed{x = 5}", "5", True),
        (r"$\boxed{90^\circ}$", "90", True),
        (r"\boxed{0.333}", "1/3", False),  # exact comparison
        (r"\boxed{\{1, 2\}}", r"\{1,2\}", True),  # non-numeric: normalised strings
        ("The answer is 12.", "12", True),  # no box: the last number
        ("2 + 3 = 5, not 6", "5", False),
        ("x+1", "x + 1", True),  # no number: the whole text
        (r"\boxed{7", "7", True),  # unclosed box: falls back to the last number
        (r"\boxed{5}", r"\boxed{5}", True),  # boxed labels are unboxed
    ],
)
def test_fallback_grader(response: str, label: str, expected: bool) -> None:
    assert math_equal_fallback(response, label) is expected


def test_fallback_helpers() -> None:
    assert extract_boxed(r"\boxed{\frac{a}{b}} and \fbox{2}") == "2"
    assert extract_boxed(r"\boxed{\frac{a}{b}}") == r"\frac{a}{b}"
    assert extract_boxed(r"\boxed 42 done") == "42"
    assert extract_boxed("none") is None
    assert normalize_math(r" $\left( 1, 2 \right)$. ") == "(1,2)"
    assert parse_number("1e3") == 1000 and parse_number(r"\frac{1}{0}") is None and parse_number("x") is None
    assert parse_number("nan") is None and parse_number("inf") is None


def test_math_reward_fallback_backend() -> None:
    reward = MathAnswer(backend="fallback")
    assert not reward.uses_math_verify
    assert reward(traj_of(1, r"\boxed{0.50}"), DataRecord(source="s", index=0, prompt="p", label=0.5)) == 1.0
    assert reward(traj_of(1, r"\boxed{3}"), DataRecord(source="s", index=0, prompt="p", label=["2", "3"])) == 1.0
    assert reward(traj_of(1, r"\boxed{4}"), DataRecord(source="s", index=0, prompt="p", label=["2", "3"])) == 0.0
    with pytest.raises(ValueError, match=r"s\[4\] has no label"):
        reward(traj_of(1, "1"), DataRecord(source="s", index=4, prompt="p"))
    with pytest.raises(ValueError, match=r"^math\.timeout=-1: "):
        MathAnswer(timeout=-1)


def test_math_reward_uses_math_verify_when_importable(monkeypatch) -> None:
    calls: dict[str, list] = {"parse": [], "verify": []}
    fake = types.ModuleType("math_verify")
    fake.__spec__ = importlib.machinery.ModuleSpec("math_verify", None)

    def parse(text, parsing_timeout=5):
        calls["parse"].append((text, parsing_timeout))
        return [text.replace(r"\boxed{", "").rstrip("}")]

    def verify(gold, target, timeout_seconds=5):
        calls["verify"].append(timeout_seconds)
        return gold == target

    fake.parse, fake.verify = parse, verify
    monkeypatch.setitem(sys.modules, "math_verify", fake)
    reward = MathAnswer()
    assert reward.uses_math_verify and MathAnswer(backend="math_verify").uses_math_verify
    assert math_equal_verify(r"\boxed{7}", "7") is True
    assert calls["parse"] == [(r"\boxed{7}", 5), (r"\boxed{7}", 5)]  # bare labels are boxed
    assert calls["verify"] == [5]
    # Off the main thread the SIGALRM timeout is switched off (the grader's own process grades on its
    # main thread; its parent bounds the wall clock).
    out = []
    worker = threading.Thread(target=lambda: out.append(math_equal_verify("8", "7")))
    worker.start()
    worker.join()
    assert out == [False] and calls["verify"][-1] is None
    assert not MathAnswer(backend="fallback").uses_math_verify


def test_a_response_that_hangs_math_verify_scores_zero_and_grading_goes_on() -> None:
    import select
    import time

    pytest.importorskip("math_verify")
    reward = MathAnswer(backend="math_verify")
    assert asyncio.run(reward(traj_of(1, r"\boxed{7}"), RECORD)) == 1.0  # starts a grader process
    start = time.monotonic()
    # SymPy starts an integer power that never ends, inside one C call: only a kill stops it
    assert asyncio.run(reward(traj_of(1, r"\boxed{9^{9^{9^{9}}}}"), RECORD)) == 0.0
    assert time.monotonic() - start < 60
    reward._grader().close()
    # without math-verify's own timeout only the kill stops it; a fresh grader takes over
    grader = IsolatedGrader(timeout=0, deadline_s=3.0)
    assert grader.grade(r"\boxed{7}", "7") is True
    start = time.monotonic()
    assert grader.grade(r"\boxed{9^{9^{9^{9}}}}", "7") is False
    assert time.monotonic() - start < 20 and grader.kills == 1
    assert grader.grade(r"the answer is \boxed{7}", "7") is True
    # after a kill a spare child is kept started: the next hang costs the deadline, not a start-up too
    spare = grader.spare.proc
    assert spare is not None and spare.poll() is None and grader.starts == 2
    assert select.select([spare.stdout], [], [], 120)[0]  # its imports done, while nothing is graded
    assert grader.grade(r"\boxed{9^{9^{9^{9}}}}", "7") is False
    assert grader.grade(r"\boxed{7}", "7") is True and grader._proc is spare and grader.kills == 2
    assert grader.spare.proc is not None and grader.spare.proc is not spare  # and another one is on its way
    grader.close()
    assert spare.poll() is not None and grader.spare.proc is None


def test_math_verify_backend_requires_the_package(monkeypatch) -> None:
    monkeypatch.setattr(rewards_module, "math_verify_available", lambda: False)
    assert not MathAnswer().uses_math_verify
    with pytest.raises(ValueError, match=r"^math\.backend='math_verify': the math-verify package is not installed"):
        MathAnswer(backend="math_verify")


def test_real_math_verify_if_installed() -> None:
    pytest.importorskip("math_verify")
    reward = MathAnswer(backend="math_verify")
    half = DataRecord(source="s", index=0, prompt="p", label="0.5")
    assert asyncio.run(reward(traj_of(1, r"so \boxed{\frac{1}{2}}"), half)) == 1.0
    assert asyncio.run(reward(traj_of(1, r"\boxed{3}"), RECORD)) == 0.0
    reward._grader().close()


def test_a_pools_graders_share_one_spare_child() -> None:
    """After kills in two graders the pool keeps one spare child for both, not one each: at most
    ``size + 1`` children (the hangs here are stopped only by the kill: no math-verify timeout)."""
    pytest.importorskip("math_verify")
    pool = GraderPool(2, timeout=0, deadline_s=3.0)

    def live() -> int:
        return sum(c is not None and c.poll() is None for c in [g._proc for g in pool.graders] + [pool.spare.proc])

    try:
        for grader in pool.graders:
            assert grader.grade(r"\boxed{9^{9^{9^{9}}}}", "7") is False
        assert pool.kills == 2 and live() == 1  # both children killed, one spare started for both
        spare = pool.spare.proc
        assert pool.graders[0].grade(r"\boxed{7}", "7") is True and pool.graders[0]._proc is spare
        assert pool.graders[1].grade(r"\boxed{7}", "7") is True
        assert live() == 3 and pool.starts == 4  # a child each, and one spare behind them
    finally:
        pool.close()
    assert live() == 0


def test_math_verify_grades_a_batchs_answers_side_by_side() -> None:
    """The reward worker awaits a batch's rewards together; math-verify answers are graded by up to
    ``graders`` child processes at once: two responses that hang SymPy are in two children at the
    same time (one child would take them one after the other), each stopped by math-verify's timeout
    or killed at its deadline."""
    pytest.importorskip("math_verify")
    reward = MathAnswer(backend="math_verify", timeout=1, graders=2)  # a deadline of 5 s an answer
    pool = reward._grader()
    assert pool.starts == 0  # no child before the first answer
    hang = traj_of(1, r"\boxed{9^{9^{9^{9}}}}")

    async def batch() -> tuple[list[float], set[int]]:
        tasks = [asyncio.ensure_future(reward(hang, RECORD)) for _ in range(2)]
        together: set[int] = set()
        while not all(t.done() for t in tasks):
            live = {g._proc.pid for g in pool.graders if g._proc is not None and g._proc.poll() is None}
            if pool._free.qsize() == 0 and len(live) == 2:
                together = live  # both graders taken, each with a child of its own
            await asyncio.sleep(0.02)
        return [t.result() for t in tasks], together

    scores, together = asyncio.run(batch())
    assert scores == [0.0, 0.0] and len(together) == 2
    assert asyncio.run(reward(traj_of(1, r"\boxed{7}"), RECORD)) == 1.0  # grading goes on
    pool.close()


def test_fallback_grader_stays_fast_on_hostile_text() -> None:
    import time

    start = time.perf_counter()
    assert extract_boxed(r"\boxed{" * 20000) is None  # many unclosed boxes: one linear pass
    assert parse_number("1e999999999") is None  # would be a billion-digit integer
    assert math_equal_fallback(r"\boxed{1e999999999}", "1") is False
    # digit groups: Fraction reads them, and the exponent's digits would hide behind the first "_"
    assert parse_number("1e9_999_999") is None and parse_number(r"\frac{1}{1e-99_999_999}") is None
    assert math_equal_fallback(r"\boxed{1e99_999_999}", "1") is False
    assert math_equal_fallback(r"\boxed{10_2}", "102") is False  # a subscript, not 102
    assert parse_number("2.5e-3") == parse_number("1/400")
    assert time.perf_counter() - start < 2.0
