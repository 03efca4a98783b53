"""The tiny code task: write ``f(x)``, scored by unit tests run in a sandbox; its imperfect teacher
and warm start.

``code_fn`` (data source) asks ``Write a Python function f(x) that returns 7*x+3.`` (``a*x+b``,
``a`` from 2 to 99, ``b`` from 1 to 99); ``metadata["tests"]`` holds four asserts (``x`` = 0, 1,
-2 and a value of the record's own), which the ``code_tests`` reward runs against the model's code
in a fresh sandbox. Train and test questions are disjoint by a salted hash of ``(a, b)``.

Imperfect teacher (:func:`teacher_code`): ``def f(x):\\n    return 7*x+3``, except that with
probability ``drop_prob`` it forgets the constant term (``return 7*x``), which fails the tests. A
model fine-tuned on it ends its line after ``x`` with probability about ``drop_prob``: with
``drop_prob > 0.5`` greedy decoding forgets the term while sampling often writes it, so RL has one
decision to fix. As the arithmetic task's carry-dropping teacher, a deliberate construction for
showing RL on a CPU.

Warm start (model builder ``tiny_code_fn``): the embedded tiny Qwen3 and tokenizer, fine-tuned on
the teacher's answers to chat prompts (the core's SFT loop and model cache).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from loongsage.core.types import DataRecord

_SPLIT_SALT = b"loongsage-code-fn-split-v1"
BUILDER_VERSION = 1


def in_test_split(a: int, b: int, test_fraction: float) -> bool:
    digest = hashlib.blake2b(f"{a},{b}".encode(), key=_SPLIT_SALT, digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < test_fraction


def canonical_code(a: int, b: int) -> str:
    return f"def f(x):\n    return {a}*x+{b}"


def teacher_code(a: int, b: int, *, drop_prob: float, rng: random.Random) -> str:
    """The teacher's answer: :func:`canonical_code`, or with probability ``drop_prob`` the same
    without the constant term."""
    return f"def f(x):\n    return {a}*x" if rng.random() < drop_prob else canonical_code(a, b)


@dataclass
class CodeFnTask:
    """``code_fn``: ``Write a Python function f(x) that returns a*x+b.`` with its unit tests."""

    split: Literal["train", "test"] = "train"
    size: int = 10_000
    seed: int = 0
    test_fraction: float = 0.1
    name: str = "code_fn"

    def __post_init__(self) -> None:
        if self.split not in ("train", "test"):
            raise ValueError(f"split={self.split!r}: allowed 'train', 'test'")
        if self.size < 1:
            raise ValueError(f"size={self.size}: must be >= 1")
        if not 0 < self.test_fraction < 1:
            raise ValueError(f"test_fraction={self.test_fraction}: must be in (0, 1)")

    def __len__(self) -> int:
        return self.size

    def problem(self, index: int) -> tuple[int, int, int]:
        """``(a, b, x)`` of record ``index``: the function and the test input of its own."""
        if not 0 <= index < self.size:
            raise IndexError(f"index {index} out of range for {self.size} records")
        rng = random.Random(f"{self.seed}/{self.split}/{index}")
        while True:  # about 1 in 10 draws is a test question: a handful of draws at most
            a, b = rng.randint(2, 99), rng.randint(1, 99)
            if in_test_split(a, b, self.test_fraction) == (self.split == "test"):
                return a, b, rng.randint(3, 50)

    def __getitem__(self, index: int) -> DataRecord:
        a, b, x = self.problem(index)
        tests = [f"assert f({v}) == {a * v + b}" for v in (0, 1, -2, x)]
        return DataRecord(
            source=self.name,
            index=index,
            prompt=[{"role": "user", "content": f"Write a Python function f(x) that returns {a}*x+{b}."}],
            label=canonical_code(a, b),
            metadata={"a": a, "b": b, "tests": tests},
        )


# ------------------------------------------------------------------------------------ warm start
@dataclass
class CodeFnWarmStartParams:
    """Everything that determines the ``code_fn`` warm start (and so its cache key)."""

    name: str = "tiny-qwen3-code-fn"
    drop_prob: float = 0.6
    steps: int = 500
    batch_size: int = 64
    lr: float = 3e-3
    warmup_steps: int = 30
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    seed: int = 0
    threads: int = 2

    def __post_init__(self) -> None:
        if not 0 <= self.drop_prob <= 1:
            raise ValueError(f"drop_prob={self.drop_prob}: must be in [0, 1]")
        if self.steps < 1 or self.batch_size < 1:
            raise ValueError(f"steps={self.steps}, batch_size={self.batch_size}: must be >= 1")

    def cache_key(self) -> str:
        blob = json.dumps({"params": dataclasses.asdict(self), "builder": BUILDER_VERSION}, sort_keys=True)
        return f"{self.name}-{hashlib.sha256(blob.encode()).hexdigest()[:16]}"


def build_code_fn_warm_start(
    out_dir: str | Path, params: CodeFnWarmStartParams | None = None, *, log_every: int = 0
) -> Path:
    """The embedded tiny Qwen3 fine-tuned on the teacher's code; an HF folder with
    ``loongsage_warmstart.json``."""
    from loongsage.core.tinytask.tiny_model import build_tiny_qwen3
    from loongsage.core.tinytask.warmstart import render_prompt, run_sft, save_warm_start, sft_tensors

    params = params or CodeFnWarmStartParams()

    def make():
        torch.manual_seed(params.seed)
        model, tokenizer = build_tiny_qwen3(seed=params.seed)
        task = CodeFnTask("train", size=params.steps * params.batch_size, seed=params.seed)
        rng = random.Random(f"sft/{params.seed}")

        def step_loss(step: int) -> torch.Tensor:
            records = [task[i] for i in range(step * params.batch_size, (step + 1) * params.batch_size)]
            prompts = [render_prompt(tokenizer, r.prompt) for r in records]
            answers = [
                teacher_code(r.metadata["a"], r.metadata["b"], drop_prob=params.drop_prob, rng=rng)
                + tokenizer.eos_token
                for r in records
            ]
            input_ids, attention, labels = sft_tensors(tokenizer, prompts, answers)
            return model(input_ids=input_ids, attention_mask=attention, labels=labels).loss

        return model, tokenizer, run_sft(model, params, step_loss, log_every=log_every)

    return save_warm_start(out_dir, params, BUILDER_VERSION, make)


@dataclass
class TinyCodeFnModel(CodeFnWarmStartParams):
    """Model builder ``tiny_code_fn``: the ``code_fn`` warm start, cached by its params."""

    kind = "model_builder"

    def build(self) -> Path:
        from loongsage.core.tinytask.builds import cached_build

        params = CodeFnWarmStartParams(**dataclasses.asdict(self))
        return cached_build(params.cache_key(), lambda tmp: build_code_fn_warm_start(tmp, params))
