"""Supervised warm start of the tiny arithmetic model, built offline and cached.

``build_warm_start`` creates the embedded tokenizer and a tiny Qwen3, fine-tunes it on answers of
the imperfect teacher (:func:`loongsage.core.tinytask.arith.teacher_answer`) over the train split,
and saves an HF folder that any Qwen3-capable backend can load. ``cached_warm_start`` keys that
folder by a hash of the parameters and the builder version, so a recipe pays for it once.

With ``init_from`` the model is not built from a random init but fine-tuned from another cached
warm start (built first if needed), sharing its tokenizer and architecture. That is how the
distillation teachers are made cheaply: the default warm start fine-tuned on *correct* answers
(``drop_prob=0``) of one operation for a few hundred small steps.

With ``sort`` the model is also fine-tuned on the digit-sorting task
(:mod:`loongsage.core.tinytask.digit_sort`): each SFT batch mixes arithmetic answers and sorted
lists of the sorting task's own imperfect teacher, so one model learns both (tiny/mixed_async_cpu).
The field is left out of the cache key when it is null, so every warm start without it keeps its key.

Determinism: the same parameters give bitwise the same weights on the same machine and library
versions with the same ``threads`` (the thread count can change floating-point reduction order).

A build goes through :func:`~loongsage.core.tinytask.builds.cached_build` (once per cache, under a
lock, saying how far it is); :mod:`loongsage.core.tinytask.builds` has that machinery.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from loongsage.core.tinytask import digit_sort
from loongsage.core.tinytask.arith import ArithmeticTask, format_answer, teacher_answer
from loongsage.core.tinytask.builds import INFO_FILE, Progress, cached_build

# Bump whenever the output of build_warm_start changes for the same params (invalidates caches).
BUILDER_VERSION = 1
# Fields that shape the tokenizer and the network (a fine-tuned model keeps its base's).
ARCHITECTURE_FIELDS = ("vocab_size", "hidden_size", "num_layers", "heads", "kv_heads", "intermediate_size")


@dataclass(frozen=True)
class SortWarmStart:
    """The digit-sorting share of a two-task warm start (``WarmStartParams.sort``)."""

    fraction: float = 0.5  # share of every SFT batch given to sorting (the rest is arithmetic)
    min_len: int = 3  # list lengths, as DigitSortTask's
    max_len: int = 20
    drop_prob: float = 0.6  # the teacher forgets the repeats of the largest digit this often

    def __post_init__(self) -> None:
        if not 0 < self.fraction < 1:
            raise ValueError(f"sort.fraction={self.fraction}: must be in (0, 1) (both tasks share each batch)")
        if not 0 <= self.drop_prob <= 1:
            raise ValueError(f"sort.drop_prob={self.drop_prob}: must be in [0, 1]")
        if not 1 <= self.min_len <= self.max_len <= digit_sort.MAX_LEN_LIMIT:
            raise ValueError(
                f"sort.min_len={self.min_len}, sort.max_len={self.max_len}: "
                f"need 1 <= min_len <= max_len <= {digit_sort.MAX_LEN_LIMIT}"
            )


@dataclass
class WarmStartParams:
    """Everything that determines a warm-start model (and so its cache key).

    The defaults were chosen with ``bench/calibrate_tiny_arith.py``: a 148k-parameter model, about
    60 s of SFT on 2 free cores, held-out greedy accuracy about 0.31-0.41 with pass@8 about
    0.85-0.92, and GRPO (lr 1e-4, 8 prompts x 8 samples) lifting greedy accuracy above 0.9 within
    20-50 steps. ``threads`` is part of the key because it changes the floating-point results.
    """

    name: str = "tiny-qwen3-arith"
    # task
    digits: int = 2
    operations: str = "+"
    answer_format: Literal["plain", "reversed"] = "reversed"
    prompt_format: Literal["chat", "text"] = "chat"
    drop_prob: float = 0.6  # the teacher forgets a carry this often (see arith.teacher_answer)
    # tokenizer and model
    vocab_size: int = 384
    hidden_size: int = 64
    num_layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate_size: int = 256
    # supervised fine-tuning
    steps: int = 1000
    batch_size: int = 128
    lr: float = 3e-3
    warmup_steps: int = 30
    min_lr_ratio: float = 0.1  # cosine decay down to lr * min_lr_ratio
    weight_decay: float = 0.01
    seed: int = 0
    threads: int = 2
    # fine-tune from this warm start (WarmStartParams fields; {} = the defaults) instead of a random
    # init; its tokenizer and architecture are kept, so the architecture fields above must match it
    init_from: dict[str, Any] | None = None
    # also train the digit-sorting task into the same model (SortWarmStart fields; {} = its
    # defaults); null = arithmetic only
    sort: dict[str, Any] | None = None
    # where the SFT runs (e.g. cuda: seconds for a model of tens of millions of parameters);
    # null = the CPU. Left out of the cache key while null, like init_from and sort
    device: str | None = None

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps={self.steps}: must be >= 1")
        if self.sort is not None:
            self.sort_params()  # unknown keys and bad values fail here
        if self.init_from is not None:
            base = self.base()
            if base.init_from is not None:
                raise ValueError("init_from: the base must itself start from a random init (one level only)")
            for key in ARCHITECTURE_FIELDS:
                if getattr(base, key) != getattr(self, key):
                    raise ValueError(
                        f"{key}={getattr(self, key)!r}: must equal the init_from model's "
                        f"({getattr(base, key)!r}); fine-tuning keeps its architecture"
                    )

    def base(self) -> WarmStartParams:
        """The warm start ``init_from`` names (an error if it names unknown fields)."""
        if self.init_from is None:
            raise ValueError("init_from is null: this warm start starts from a random init")
        unknown = sorted(set(self.init_from) - {f.name for f in dataclasses.fields(WarmStartParams)})
        if unknown:
            raise ValueError(f"init_from.{unknown[0]}: unknown key; allowed: WarmStartParams fields")
        return WarmStartParams(**self.init_from)

    def sort_params(self) -> SortWarmStart:
        """The sorting share ``sort`` names (an error if it is null or names unknown fields)."""
        if self.sort is None:
            raise ValueError("sort is null: this warm start trains arithmetic only")
        if not isinstance(self.sort, dict):
            raise ValueError(f"sort={self.sort!r}: must be a mapping of SortWarmStart fields")
        unknown = sorted(set(self.sort) - {f.name for f in dataclasses.fields(SortWarmStart)})
        if unknown:
            raise ValueError(
                f"sort.{unknown[0]}: unknown key; allowed: "
                f"{', '.join(f.name for f in dataclasses.fields(SortWarmStart))}"
            )
        return SortWarmStart(**self.sort)

    def sort_task(self, split: Literal["train", "test"], size: int, seed: int = 0) -> digit_sort.DigitSortTask:
        """The digit-sorting data source these params were trained for (``sort`` must be set)."""
        sort = self.sort_params()
        return digit_sort.DigitSortTask(
            min_len=sort.min_len,
            max_len=sort.max_len,
            split=split,
            size=size,
            seed=seed,
            prompt_format=self.prompt_format,
        )

    def task(self, split: Literal["train", "test"], size: int, seed: int = 0) -> ArithmeticTask:
        """The arithmetic data source these params were trained for."""
        return ArithmeticTask(
            digits=self.digits,
            operations=self.operations,
            split=split,
            size=size,
            seed=seed,
            answer_format=self.answer_format,
            prompt_format=self.prompt_format,
        )

    def key_params(self) -> dict[str, Any]:
        """The fields as they enter the cache key.

        ``init_from`` and ``sort`` came after models were cached: each is left out while null (so
        the keys of warm starts that do not use them, the default's included, never change) and
        spelled out in full otherwise ({} and the spelled-out defaults name the same model).
        """
        params = dataclasses.asdict(self)
        if self.init_from is None:
            del params["init_from"]
        else:
            params["init_from"] = self.base().key_params() | {"init_from": None}  # as keyed before
        if self.device is None:
            del params["device"]
        if self.sort is None:
            del params["sort"]
        else:
            params["sort"] = dataclasses.asdict(self.sort_params())
        return params

    def cache_key(self) -> str:
        params = self.key_params()
        blob = json.dumps({"params": params, "builder": BUILDER_VERSION}, sort_keys=True)
        return f"{self.name}-{hashlib.sha256(blob.encode()).hexdigest()[:16]}"


def render_prompt(tokenizer, prompt) -> str:
    """Prompt text as the model sees it: chat messages through the chat template, text as is."""
    if isinstance(prompt, str):
        return prompt
    return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)


def lr_factor(step: int, params: Any) -> float:
    """Linear warm-up over ``params.warmup_steps``, then cosine decay to ``params.min_lr_ratio`` at
    ``params.steps`` (any warm-start params with those fields)."""
    if step < params.warmup_steps:
        return (step + 1) / params.warmup_steps
    progress = (step - params.warmup_steps) / max(1, params.steps - params.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return params.min_lr_ratio + (1 - params.min_lr_ratio) * cosine


def sft_optimizer(model, params: Any):
    """``(optimizer, scheduler)`` of the warm starts: AdamW (no weight decay on norms and other
    vectors) under :func:`lr_factor`; ``params`` has ``lr``, ``weight_decay`` and the schedule's fields."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]  # norms: no weight decay
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": params.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=params.lr,
        betas=(0.9, 0.98),
    )
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, params))


def run_sft(model, params: Any, step_loss: Callable[[int], torch.Tensor], *, log_every: int = 0) -> dict:
    """``params.steps`` optimizer steps of :func:`sft_optimizer` on ``step_loss(step)`` (gradient norm
    clipped at 1), the model in train mode meanwhile; returns ``final_loss`` (mean of the last 5% of
    steps) and ``sft_seconds``."""
    optimizer, scheduler = sft_optimizer(model, params)
    model.train()
    start, losses = time.perf_counter(), []
    progress = Progress(f"{getattr(params, 'name', 'warm start')} SFT", params.steps)
    for step in range(params.steps):
        progress.step(step)
        loss = step_loss(step)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        if log_every and (step + 1) % log_every == 0:
            recent = sum(losses[-log_every:]) / log_every
            print(
                f"sft step {step + 1}/{params.steps} loss {recent:.4f} {time.perf_counter() - start:.1f}s", flush=True
            )
    model.eval()
    tail = losses[-max(1, len(losses) // 20) :]
    return {"final_loss": sum(tail) / len(tail), "sft_seconds": time.perf_counter() - start}


def sft_batch(tokenizer, task: ArithmeticTask, indices: list[int], drop_prob: float, rng: random.Random):
    """Right-padded ``(input_ids, attention_mask, labels)``; labels are -100 except on the answer.

    The target of each prompt is the teacher's answer followed by the eos token (``<|im_end|>``),
    so the model also learns to stop.
    """
    return sft_tensors(tokenizer, *arith_examples(tokenizer, task, indices, drop_prob, rng))


def arith_examples(tokenizer, task: ArithmeticTask, indices: list[int], drop_prob: float, rng: random.Random):
    """Prompt texts and the imperfect arithmetic teacher's answers (eos appended) of ``indices``."""
    prompts, answers = [], []
    for i in indices:
        a, op, b = task.problem(i)
        prompts.append(render_prompt(tokenizer, task.render_prompt(a, op, b)))
        value = teacher_answer(a, op, b, drop_prob=drop_prob, rng=rng)
        answers.append(format_answer(value, task.answer_format) + tokenizer.eos_token)
    return prompts, answers


def sort_examples(tokenizer, task: digit_sort.DigitSortTask, indices: list[int], drop_prob: float, rng: random.Random):
    """Prompt texts and the imperfect sorting teacher's answers (eos appended) of ``indices``."""
    prompts, answers = [], []
    for i in indices:
        digits = task.problem(i)
        prompts.append(render_prompt(tokenizer, task.render_prompt(digits)))
        answers.append(digit_sort.teacher_answer(digits, drop_prob=drop_prob, rng=rng) + tokenizer.eos_token)
    return prompts, answers


def sft_tensors(tokenizer, prompts: list[str], answers: list[str]):
    """Right-padded ``(input_ids, attention_mask, labels)`` of prompt + answer texts; labels are
    -100 except on the answer tokens."""
    prompt_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    answer_ids = tokenizer(answers, add_special_tokens=False)["input_ids"]
    width = max(len(p) + len(a) for p, a in zip(prompt_ids, answer_ids))
    input_ids = torch.full((len(prompts), width), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((len(prompts), width), -100, dtype=torch.long)
    attention = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, (p, a) in enumerate(zip(prompt_ids, answer_ids)):
        n = len(p) + len(a)
        input_ids[row, :n] = torch.tensor(p + a)
        labels[row, len(p) : n] = torch.tensor(a)
        attention[row, :n] = 1
    return input_ids, attention, labels


def train_sft(model, tokenizer, params: WarmStartParams, *, log_every: int = 0) -> dict:
    """Fine-tune ``model`` in place on the imperfect teacher's answers; returns a summary.

    With ``params.sort`` each batch holds ``round(batch_size * sort.fraction)`` sorting examples
    (at least one, and at least one arithmetic example), the rest arithmetic.
    """
    torch.manual_seed(params.seed)
    rng = random.Random(f"sft/{params.seed}")
    n_sort, sorter, sort_rng = 0, None, None
    if params.sort is not None:
        sort = params.sort_params()
        n_sort = min(params.batch_size - 1, max(1, round(params.batch_size * sort.fraction)))
        sorter = params.sort_task("train", size=params.steps * n_sort, seed=params.seed)
        sort_rng = random.Random(f"sft-sort/{params.seed}")
    n_arith = params.batch_size - n_sort
    task = params.task("train", size=params.steps * n_arith, seed=params.seed)
    device = next(model.parameters()).device

    def step_loss(step: int) -> torch.Tensor:
        indices = list(range(step * n_arith, (step + 1) * n_arith))
        if sorter is None:
            input_ids, attention, labels = sft_batch(tokenizer, task, indices, params.drop_prob, rng)
        else:
            prompts, answers = arith_examples(tokenizer, task, indices, params.drop_prob, rng)
            more_prompts, more_answers = sort_examples(
                tokenizer, sorter, list(range(step * n_sort, (step + 1) * n_sort)), sort.drop_prob, sort_rng
            )
            input_ids, attention, labels = sft_tensors(tokenizer, prompts + more_prompts, answers + more_answers)
        return model(input_ids=input_ids.to(device), attention_mask=attention.to(device), labels=labels.to(device)).loss

    return run_sft(model, params, step_loss, log_every=log_every)


def build_warm_start(
    out_dir: str | Path,
    params: WarmStartParams | None = None,
    *,
    log_every: int = 0,
    cache_dir: str | Path | None = None,
) -> Path:
    """Build tokenizer + tiny Qwen3, run the SFT warm start, save the HF folder; returns ``out_dir``.

    With ``params.init_from`` the base model comes from the cache under ``cache_dir`` (default
    :func:`~loongsage.core.tinytask.builds.default_cache_dir`), built there first if missing.
    Also writes ``loongsage_warmstart.json`` (params, builder version, final loss, timings).
    """
    from loongsage.core.tinytask.tiny_model import build_tiny_qwen3

    params = params or WarmStartParams()

    def make():
        if params.init_from is not None:
            from transformers import AutoModelForCausalLM, AutoTokenizer

            base = cached_warm_start(params.base(), cache_dir, log_every=log_every)
            model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(base)
        else:
            model, tokenizer = build_tiny_qwen3(
                hidden_size=params.hidden_size,
                num_layers=params.num_layers,
                heads=params.heads,
                kv_heads=params.kv_heads,
                intermediate_size=params.intermediate_size,
                seed=params.seed,
                vocab_size=params.vocab_size,
            )
        model.to(params.device or "cpu")  # drawn on the CPU: the same init on any device
        return model, tokenizer, train_sft(model, tokenizer, params, log_every=log_every)

    return save_warm_start(out_dir, params, BUILDER_VERSION, make)


def save_warm_start(
    out_dir: str | Path, params: Any, builder_version: int, make: Callable[[], tuple[Any, Any, dict]]
) -> Path:
    """Run ``make() -> (model, tokenizer, SFT summary)`` with ``params.threads`` torch threads and
    the caller's RNG left untouched, then save the HF folder with :data:`~.builds.INFO_FILE` (the
    params, ``builder_version``, the parameter count, the build time and the summary); returns
    ``out_dir``."""
    from loongsage.core.tinytask.tiny_model import count_parameters, save_model

    threads = torch.get_num_threads()
    torch.set_num_threads(params.threads)
    try:
        with torch.random.fork_rng(devices=[]):  # leave the caller's RNG untouched
            start = time.perf_counter()
            model, tokenizer, summary = make()
            out = save_model(model, tokenizer, out_dir)
            info = {
                "params": dataclasses.asdict(params),
                "builder_version": builder_version,
                "num_parameters": count_parameters(model),
                "build_seconds": time.perf_counter() - start,
                **summary,
            }
            (out / INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    finally:
        torch.set_num_threads(threads)
    return out


def cached_warm_start(
    params: WarmStartParams | None = None, cache_dir: str | Path | None = None, *, log_every: int = 0
) -> Path:
    """Path of the warm start for ``params``, building it on first use.

    The folder is ``<cache_dir>/models/<name>-<hash of params + builder version>``, built once
    (:func:`~loongsage.core.tinytask.builds.cached_build`: in a temporary sibling renamed into
    place, concurrent builders taking turns on a lock file).
    """
    params = params or WarmStartParams()
    base = f", fine-tuned from {params.base().cache_key()}" if params.init_from is not None else ""
    what = f"{params.steps} SFT steps of {params.batch_size} examples on {params.threads} threads{base}"
    return cached_build(
        params.cache_key(),
        lambda tmp: build_warm_start(tmp, params, log_every=log_every, cache_dir=cache_dir),
        cache_dir,
        what,
    )
