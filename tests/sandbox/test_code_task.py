"""The tiny code task: deterministic records with tests that the canonical code passes and the
teacher's slip fails, disjoint splits, and bad params in one line."""

from __future__ import annotations

import random

import pytest

from loongsage.sandbox.code_task import CodeFnTask, CodeFnWarmStartParams, canonical_code, teacher_code


def _passes(code: str, tests: list[str]) -> bool:
    namespace: dict = {}
    exec(code, namespace)  # the canonical code, written by this test's own task (not a model's)
    try:
        for test in tests:
            exec(test, dict(namespace))
    except AssertionError:
        return False
    return True


def test_records_are_deterministic_with_tests_the_canonical_code_passes():
    task = CodeFnTask(size=200, seed=3)
    for i in range(200):
        record = task[i]
        assert record == CodeFnTask(size=200, seed=3)[i]
        a, b = record.metadata["a"], record.metadata["b"]
        assert record.prompt[0]["content"] == f"Write a Python function f(x) that returns {a}*x+{b}."
        assert record.label == canonical_code(a, b) and len(record.metadata["tests"]) == 4
        assert _passes(record.label, record.metadata["tests"])
        assert not _passes(f"def f(x):\n    return {a}*x", record.metadata["tests"])  # the teacher's slip


def test_splits_are_disjoint_whatever_the_seeds():
    train = {(r.metadata["a"], r.metadata["b"]) for r in (CodeFnTask("train", 3000, seed=1)[i] for i in range(3000))}
    test = {(r.metadata["a"], r.metadata["b"]) for r in (CodeFnTask("test", 300, seed=2)[i] for i in range(300))}
    assert train and test and not train & test


def test_the_teacher_forgets_the_constant_with_drop_prob():
    rng = random.Random(0)
    slips = sum(teacher_code(7, 3, drop_prob=0.6, rng=rng) == "def f(x):\n    return 7*x" for _ in range(4000))
    assert 0.57 < slips / 4000 < 0.63


def test_bad_params_in_one_line():
    with pytest.raises(ValueError, match=r"split='dev': allowed 'train', 'test'"):
        CodeFnTask(split="dev")
    with pytest.raises(ValueError, match=r"drop_prob=1.5: must be in \[0, 1\]"):
        CodeFnWarmStartParams(drop_prob=1.5)
    with pytest.raises(IndexError):
        CodeFnTask(size=3)[3]
