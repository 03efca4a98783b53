"""The ``code_tests`` reward against real code in the real ``local`` sandbox: right, wrong, partly
right, broken and hostile solutions, and what each leaves behind (nothing)."""

from __future__ import annotations

import asyncio
import time

import pytest

from loongsage.core.plugins import load_registry
from loongsage.core.types import DataRecord, Trajectory
from loongsage.sandbox.code_reward import CodeTestsReward, extract_code
from loongsage.sandbox.jail import jail_problem
from tests._procs import sandbox_processes

pytestmark = pytest.mark.skipif(jail_problem() is not None, reason=f"no sandbox here: {jail_problem()}")

TESTS = ["assert f(0) == 3", "assert f(2) == 17", "assert f(-1) == -4"]  # f(x) = 7x + 3


def _score(reward: CodeTestsReward, response: str, tests=TESTS) -> tuple[float, Trajectory]:
    trajectory = Trajectory(
        source="code",
        group_id=0,
        sample_index=0,
        prompt_ids=[1],
        response_ids=[2],
        loss_mask=[1],
        rollout_logprobs=[0.0],
        versions=[0],
        response_text=response,
    )
    record = DataRecord(source="code", index=0, prompt="Write f(x) = 7x + 3.", metadata={"tests": tests})
    return asyncio.run(reward(trajectory, record)), trajectory


@pytest.fixture
def reward():
    return CodeTestsReward(timeout_s=5.0)


def test_extract_code_takes_the_last_fenced_block():
    assert extract_code("def f(x):\n    return x<|im_end|>") == "def f(x):\n    return x"
    text = "First try:\n```python\ndef f(x): return 0\n```\nBetter:\n```py\ndef f(x): return 7*x+3\n```\n"
    assert extract_code(text) == "def f(x): return 7*x+3\n"


def test_right_wrong_and_partly_right_solutions(reward):
    assert _score(reward, "```python\ndef f(x):\n    return 7 * x + 3\n```")[0] == 1.0
    score, t = _score(reward, "def f(x):\n    return 7 * x")
    assert score == 0.0 and t.metadata["code_tests"] == {"passed": 0, "total": 3, "in_own_sandbox": False}
    partly = "def f(x):\n    return 3 if x == 0 else 0"
    assert _score(reward, partly)[0] == 0.0
    score, t = _score(CodeTestsReward(partial=True), partly)
    assert score == pytest.approx(1 / 3) and t.metadata["code_tests"] == {
        "passed": 1,
        "total": 3,
        "in_own_sandbox": False,
    }


@pytest.mark.parametrize(
    "code",
    [
        "def f(x) return 7*x+3",  # does not compile
        "raise SystemExit(0)",  # exits with success before any test
        "import sys\nprint('x 3 3')\nsys.stdout.flush()\nimport os\nos._exit(0)",  # forges a result line
        "print(open('token').read())",  # looks for the token file
        "import os\nos.close(1)",  # takes the harness's stdout away
        "\xff\xfe not utf-8 \udcff",  # undecodable text
    ],
)
def test_broken_and_cheating_solutions_score_zero(reward, code):
    assert _score(reward, code)[0] == 0.0


def test_hostile_solutions_are_contained_and_leave_nothing(reward):
    start = time.monotonic()
    loop = "while True:\n    pass"
    assert _score(reward, loop)[0] == 0.0
    assert time.monotonic() - start < 30  # ended at the timeout, not by the CPU limit
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    assert _score(reward, bomb)[0] == 0.0
    memory = "x = bytearray(1 << 40)\ndef f(x): return 7*x+3"
    assert _score(reward, memory)[0] == 0.0  # MemoryError at import
    orphan = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(600)\ndef f(x): return 7*x+3"
    assert _score(reward, orphan)[0] == 1.0  # the tests pass; the daemon dies with the sandbox
    assert sandbox_processes() == 0
    assert reward._backend is not None and not reward._backend._boxes  # every sandbox deleted


def test_concurrent_scoring_and_bad_records(reward):
    async def many():
        t = [
            Trajectory(
                source="code",
                group_id=i,
                sample_index=0,
                prompt_ids=[1],
                response_ids=[2],
                loss_mask=[1],
                rollout_logprobs=[0.0],
                versions=[0],
                response_text=f"def f(x): return {7 if i % 2 else 6}*x+3",
            )
            for i in range(8)
        ]
        r = DataRecord(source="code", index=0, prompt="", metadata={"tests": TESTS})
        return await asyncio.gather(*(reward(x, r) for x in t))

    assert asyncio.run(many()) == [0.0, 1.0] * 4
    with pytest.raises(ValueError, match=r"needs metadata\['tests'\], a non-empty list of Python statements"):
        _score(reward, "def f(x): return 1", tests=[])
    with pytest.raises(ValueError, match=r"code_tests.limits: .*allowed: cpu_s"):
        CodeTestsReward(limits={"gpus": 1})
    with pytest.raises(ValueError, match=r"code_tests.max_concurrency=0: must be a positive integer"):
        CodeTestsReward(max_concurrency=0)


def test_registered_as_a_reward():
    registry = load_registry([])
    reward = registry.create("reward", {"name": "code_tests", "params": {"partial": True}}, "data_sources[0].reward")
    assert isinstance(reward, CodeTestsReward) and reward.partial
