"""The calculator task: deterministic records, disjoint splits, the imperfect teacher, the reward."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from loongsage.agentflow.tasks.tool_calc import (
    ToolCalcReward,
    ToolCalcTask,
    estimate,
    final_answer,
    in_test_split,
    numbers,
    score,
    teacher_messages,
)
from loongsage.core.types import DataRecord, Trajectory


def test_records_are_a_pure_function_of_the_fields_and_index():
    a, b = ToolCalcTask(size=500, seed=3), ToolCalcTask(size=500, seed=3)
    assert [a[i] for i in range(0, 500, 7)] == [b[i] for i in range(0, 500, 7)]
    assert [a[i].prompt for i in range(50)] != [ToolCalcTask(size=500, seed=4)[i].prompt for i in range(50)]
    record = a[17]
    meta = record.metadata
    assert record.source == "tool_calc" and record.index == 17
    assert record.prompt == [{"role": "user", "content": f"What is {meta['expression']}?"}]
    assert int(record.label) == meta["value"] == eval(meta["expression"])  # noqa: S307 - our own digits
    with pytest.raises(IndexError):
        a[500]


def test_questions_are_products_of_a_three_and_a_two_digit_number_with_the_planned_mix():
    task = ToolCalcTask(size=2000, seed=0)
    kinds = Counter()
    for i in range(2000):
        m = task[i].metadata
        assert 100 <= m["a"] <= 999 and 10 <= m["b"] <= 99
        kinds[m["kind"]] += 1
        if m["kind"] == "sum":
            assert m["op"] == "+" and 100 <= m["c"] <= 999 and m["value"] == m["a"] * m["b"] + m["c"]
        else:
            assert m["op"] is None and m["c"] is None and m["value"] == m["a"] * m["b"]
    assert 0.45 < kinds["plain"] / 2000 < 0.55  # plain_fraction 0.5
    assert ToolCalcTask(size=10, plain_fraction=0.0)[3].metadata["kind"] == "sum"


def test_train_and_test_questions_are_disjoint_by_a_seed_free_hash():
    trains = [ToolCalcTask(split="train", size=3000, seed=s) for s in (0, 1)]
    tests = [ToolCalcTask(split="test", size=3000, seed=s) for s in (0, 1)]
    train = {task[i].metadata["expression"] for task in trains for i in range(1500)}
    test = {task[i].metadata["expression"] for task in tests for i in range(1500)}
    assert train and test and not train & test
    assert all(in_test_split(e, 0.1) for e in test) and not any(in_test_split(e, 0.1) for e in train)
    held_out = ToolCalcTask(split="test", size=2000, seed=0)
    assert len({held_out[i].metadata["expression"] for i in range(2000)}) == 2000  # distinct


def test_the_teacher_skips_the_tool_with_drop_prob_and_guesses():
    task, rng = ToolCalcTask(size=4000, seed=0), random.Random(0)
    direct = Counter()
    for i in range(4000):
        record = task[i]
        m = record.metadata
        messages = teacher_messages(record, drop_prob=0.6, rng=rng)
        assert messages[0] == record.prompt[0]
        if len(messages) == 2:
            guess = estimate(m["a"], m["b"], m["c"])
            assert messages[1] == {"role": "assistant", "content": f"About {guess}."}
            assert score(messages[1]["content"], str(guess)) == 1.0  # the reward reads the guess
            direct[m["kind"]] += 1
            direct["right"] += guess == m["value"]  # only when every number is round
        else:
            call, result, answer = messages[1:]
            assert call["tool_calls"][0]["function"] == {
                "name": "calculator",
                "arguments": {"expression": record.metadata["expression"]},
            }
            assert result == {"role": "tool", "content": record.label}
            assert answer == {"role": "assistant", "content": record.label}
    plain = sum(task[i].metadata["kind"] == "plain" for i in range(4000))
    assert 0.57 < direct["plain"] / plain < 0.63 and 0.57 < direct["sum"] / (4000 - plain) < 0.63
    assert direct["right"] <= 5
    assert estimate(347, 29) == 9000 and estimate(951, 15) == 20000 and estimate(347, 29, 118) == 9100


@pytest.mark.parametrize(
    "text, expected",
    [
        ("10081", ["10081"]),
        ("The answer is 10,081.", ["10081"]),
        ("347*29+18 = 10081", ["347", "29", "18", "10081"]),
        ("-12", ["-12"]),
        ("3-5", ["3", "5"]),
        ("x = -7", ["-7"]),
        ("10081.0", ["10081.0"]),
        ("3.50", ["3.50"]),
        ("1,2", []),
        ("5, 6", ["5", "6"]),
        ("no number", []),
        ("a1b", []),
        ("١٠٠٨١", []),
        ("(-4)", ["-4"]),
    ],
)
def test_numbers_are_read_with_one_normalisation(text, expected):
    assert [str(n) for n in numbers(text)] == expected


@pytest.mark.parametrize(
    "answer, reward",
    [
        ("10081", 1.0),
        ("10,081", 1.0),
        ("The answer is 10081.", 1.0),
        ("347*29+18 = 10081", 1.0),
        ("10081.0", 1.0),
        ("10081<|im_end|>", 1.0),
        (" 10081 \n", 1.0),
        ("10081 or 10082", 0.0),
        ("10080", 0.0),
        ("100810", 0.0),
        ("10081 is close to 9000", 0.0),
        ("", 0.0),
        (None, 0.0),
        ("-10081", 0.0),
        ("\u221210081", 0.0),  # a minus sign is a minus
        ("\uff0d10081", 0.0),
    ],
)
def test_the_score_is_the_last_number_against_the_label(answer, reward):
    assert score(answer, "10081") == reward


def _trajectory(messages, text=""):
    return Trajectory(
        source="tool_calc",
        group_id=0,
        sample_index=0,
        prompt_ids=[1],
        response_ids=[],
        loss_mask=[],
        rollout_logprobs=[],
        versions=[],
        response_text=text,
        metadata={"messages": messages} if messages else {},
    )


def test_the_reward_reads_the_final_answer_of_the_conversation():
    reward, record = ToolCalcReward(), DataRecord("tool_calc", 0, [{"role": "user", "content": "What is 3*4?"}], "12")
    call = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": {"expression": "3*4"}}}
        ],
    }
    done = [*record.prompt, call, {"role": "tool", "content": "12"}, {"role": "assistant", "content": "12"}]
    assert reward(_trajectory(done), record) == 1.0
    assert reward(_trajectory([*record.prompt, {"role": "assistant", "content": "13"}]), record) == 0.0
    # out of turns: the last reply still calls the tool, whatever its text says
    assert final_answer(_trajectory([*done[:3], {**call, "content": "12"}])) is None
    assert reward(_trajectory([*done[:3], {**call, "content": "12"}]), record) == 0.0
    assert reward(_trajectory(None, text="12"), record) == 1.0  # another agent's trajectory: its text
    with pytest.raises(ValueError, match="has no label"):
        reward(_trajectory(done), DataRecord("tool_calc", 3, "q"))


def test_the_entries_are_registered_by_the_agentflow_plugin():
    from loongsage.core.plugins import load_registry

    registry = load_registry()
    assert isinstance(registry.create("data_source", {"name": "tool_calc", "params": {"size": 4}}, "r"), ToolCalcTask)
    assert isinstance(registry.create("reward", {"name": "tool_calc"}, "r"), ToolCalcReward)
    agent = registry.create("agent", {"name": "tool_agent", "params": {"max_turns": 3, "tools": ["calculator"]}}, "a")
    assert agent.max_turns == 3
    builder = registry.create("model_builder", {"name": "tiny_tool_calc", "params": {"steps": 5}}, "model.builder")
    assert builder.kind == "model_builder" and builder.steps == 5


def test_the_recipe_draft_validates(monkeypatch):
    from pathlib import Path

    from loongsage.core.config import load_config

    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    cfg, _ = load_config("tiny/tool_calc_cpu")
    (src,) = cfg.data_sources
    assert cfg.model.builder["name"] == "tiny_tool_calc" and src.agent["name"] == "tool_agent"
    assert src.agent["params"]["tools"] == cfg.model.builder["params"].get("tools", ["calculator"])
    assert (src.reward["name"], cfg.sampling_for(src).n) == ("tool_calc", 8)
