"""``code_tests`` against a corpus of forgeries: code a policy could learn to append to a wrong
solution so that it scores. Every one must score 0 (also with ``partial``) while right solutions,
in every style of test the judge takes apart, score 1; and tests it cannot judge apart from the
solution are refused in one line."""

from __future__ import annotations

import asyncio

import pytest

from loongsage.core.types import DataRecord, Trajectory
from loongsage.sandbox.code_reward import CodeTestsReward
from loongsage.sandbox.jail import jail_problem
from loongsage.sandbox.judging import JUDGE_BUILTINS, split_test

pytestmark = pytest.mark.skipif(jail_problem() is not None, reason=f"no sandbox here: {jail_problem()}")

TESTS = ["assert f(0) == 3", "assert f(2) == 17", "assert f(-1) == -4"]  # f(x) = 7x + 3
WRONG = "def f(x):\n    return 7 * x\n"

FORGERIES = {
    "patch the harness's counter": "import __main__\n__main__.passed = 10**6\n",
    "rebind exec": "import builtins\nbuiltins.exec = lambda *a, **k: None\nbuiltins.eval = lambda *a, **k: True\n",
    "print the token's line and leave": "import __main__, os\nprint(__main__.token, 3, 3, flush=True)\nos._exit(0)\n",
    "claim answers on the token's line": (
        "import __main__, json, os\n"
        "print(__main__.token, json.dumps([[['value', 'True']]] * 3), flush=True)\nos._exit(0)\n"
    ),
    "walk the frames": (
        "import sys\nframe = sys._getframe()\nwhile frame is not None:\n"
        "    frame.f_globals.update(passed=99, namespace=None)\n    frame = frame.f_back\n"
    ),
    "patch sys.modules": (
        "import sys, json\n"
        'class Liar:\n    def __getattr__(self, name):\n        return lambda *a, **k: \'[[["value", "True"]]]\'\n'
        "sys.modules['json'] = Liar()\n"
    ),
    "atexit": (
        "import atexit, os, __main__\natexit.register(lambda: (print(__main__.token, 3, 3, flush=True), os._exit(0)))\n"
    ),
    "write to fd 1": "import os, __main__\nos.write(1, f'{__main__.token} 3 3\\n'.encode())\nos._exit(0)\n",
    "signal handler": (
        "import os, signal, time, __main__\n"
        "signal.signal(signal.SIGALRM, lambda *a: (print(__main__.token, 3, 3, flush=True), os._exit(0)))\n"
        "signal.setitimer(signal.ITIMER_REAL, 0.001)\ntime.sleep(0.05)\n"
    ),
    "__del__ at shutdown": (
        "import __main__\nclass Late:\n    def __del__(self):\n        print(__main__.token, 3, 3, flush=True)\n"
        "late = Late()\n"
    ),
    "always-equal result": "class Yes:\n    def __eq__(self, other):\n        return True\n"
    "    __hash__ = object.__hash__\ndef f(x):\n    return Yes()\n",
    "always-equal int subclass": "class Yes(int):\n    def __eq__(self, other):\n        return True\n"
    "def f(x):\n    return Yes(0)\n",
    "patch AssertionError": "import builtins\nbuiltins.AssertionError = type('Never', (BaseException,), {})\n",
    "read the tests": "import sys\nprint(open(sys.argv[2]).read())\n",
}


def _score(code: str, tests=TESTS, partial: bool = False) -> tuple[float, dict]:
    trajectory = Trajectory(
        source="code",
        group_id=0,
        sample_index=0,
        prompt_ids=[1],
        response_ids=[2],
        loss_mask=[1],
        rollout_logprobs=[0.0],
        versions=[0],
        response_text=code,
    )
    record = DataRecord(source="code", index=0, prompt="", metadata={"tests": tests})
    score = asyncio.run(CodeTestsReward(timeout_s=10.0, partial=partial)(trajectory, record))
    return score, trajectory.metadata["code_tests"]


@pytest.mark.parametrize("name", list(FORGERIES))
def test_every_forgery_scores_zero(name):
    for partial in (False, True):
        score, info = _score(WRONG + FORGERIES[name], partial=partial)
        assert score == 0.0, f"{name} (partial={partial}) scored {score}: {info}"


def test_a_forgery_on_a_right_solution_does_not_lift_a_wrong_test():
    # the right f with a forgery after it: the forgery changes nothing in what is judged
    score, info = _score(
        "def f(x):\n    return 7 * x + 3\n" + FORGERIES["patch the harness's counter"],
        tests=TESTS + ["assert f(5) == 0"],
        partial=True,
    )
    assert info["passed"] == 3 and score == pytest.approx(0.75)


@pytest.mark.parametrize(
    "code, tests",
    [
        ("def f(x):\n    return 7 * x + 3\n", TESTS),
        (
            "import math\ndef area(r):\n    return math.pi * r * r\n",
            [
                "assert abs(area(1) - 3.14159) < 1e-4",
                "assert math.isclose(area(2), 12.566370614359172)",
                "assert round(area(0), 3) == 0.0",
            ],
        ),
        (
            "def evens(n):\n    return (i for i in range(0, n, 2))\n",
            [
                "assert list(evens(7)) == [0, 2, 4, 6]",
                "assert next(evens(3)) == 0",
                "assert sorted(evens(5)) == [0, 2, 4]",
            ],
        ),
        (
            "class Solution:\n    def two_sum(self, nums, target):\n        seen = {}\n"
            "        for i, n in enumerate(nums):\n            if target - n in seen:\n"
            "                return [seen[target - n], i]\n"
            "            seen[n] = i\n",
            ["assert Solution().two_sum([2, 7, 11, 15], 9) == [0, 1]", "assert Solution().two_sum([3, 3], 6)[1] == 1"],
        ),
        (
            "def words(s):\n    return {w: len(w) for w in s.split()}\n",
            [
                "assert words('a bb') == {'a': 1, 'bb': 2}",
                "assert isinstance(words(''), dict) and not words('')",
                "assert set(words('x y')) == {'x', 'y'}",
                "assert words('ab').get('ab') == 2",
                "assert [len(w) for w in sorted(words('aaa b'))] == [3, 1]",
            ],
        ),
        (
            "def f(x):\n    return float('nan') if x is None else (x, -x, None, b'\\x00', 'caf\\u00e9')\n",
            [
                "assert f(None) != f(None)",
                "assert f(2) == (2, -2, None, b'\\x00', 'café')",
                "assert f(1)[4].upper() == 'CAFÉ'",
                "assert [f(i)[1] for i in range(3)] == [0, -1, -2]",
                "assert all(f(i)[0] + i for i in range(1, 3))",
            ],
        ),
    ],
)
def test_right_solutions_score_one(code, tests):
    score, info = _score(code, tests)
    assert score == 1.0, info


def test_a_check_made_costly_by_the_policy_is_bounded():
    # 2 ** f(3) over a value the policy chose: the judge's limits end it, the test fails
    score, _ = _score(
        "def f(x):\n    return 10 ** 18\n", tests=["assert 2 ** f(3) == 8", "assert f(0) == 10**18"], partial=True
    )
    assert score == 0.5
    assert _score("def f(x):\n    return x\n", tests=["assert 2 ** f(3) == 8"])[0] == 1.0


@pytest.mark.parametrize(
    "test, why",
    [
        ("f(2) == 5", r"must be one `assert <condition>` statement"),
        ("x = f(2)\nassert x == 5", r"must be one `assert <condition>` statement"),
        ("assert f(2 ==", r"is not valid Python"),
        (
            "assert all(f(i) == i * i for i in range(5))",
            r"the comparison inside `\(f\(i\) == i \* i .*would run beside",
        ),
        ("assert g(lambda v: v == 2)", r"the comparison inside `g\(lambda v: v == 2\)` would run beside the solution"),
    ],
)
def test_tests_that_cannot_be_judged_apart_are_refused_in_one_line(test, why):
    with pytest.raises(ValueError, match=why) as info:
        split_test(test)
    assert "\n" not in str(info.value) and str(info.value).startswith("code_tests: test ")


def test_the_split_keeps_expected_values_on_the_judge_side():
    split = split_test("assert abs(f(2) - 3.25) < 1e-6 and sorted(g([3, 1])) == [1, 3]")
    assert split.probes == ("f(2)", "g([3, 1])")
    assert "3.25" in split.check and "[1, 3]" in split.check
    assert all(name.isidentifier() for name in JUDGE_BUILTINS) and all(
        name in dir(__builtins__) or name in __builtins__ for name in JUDGE_BUILTINS
    )
