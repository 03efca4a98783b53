"""exact_match reward."""

from __future__ import annotations

import pytest

from loongsage.algos.rewards import ExactMatch, exact_match, extract_answer
from loongsage.core.types import DataRecord, Trajectory


def score(reward: ExactMatch, text: str, label: object) -> float:
    traj = Trajectory(
        source="s", group_id=0, sample_index=0, prompt_ids=[1], response_ids=[2], loss_mask=[1],
        rollout_logprobs=[0.0], versions=[0], response_text=text,
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
