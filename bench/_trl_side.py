"""TRL side of ``bench/cpu_vs_trl.py``, plus the greedy-accuracy helper both sides are judged by.

Run by the driver as a subprocess (so its start-up is timed like the launcher's)::

    python bench/_trl_side.py <spec.json> <result.json>

The spec (written by the driver) carries the model folder, the exact ordered training prompts
(``steps x prompts`` records), the held-out records and every hyperparameter; nothing here picks a
setting of its own. The result holds per-step wall times, per-step rewards, greedy accuracy every
``eval_every`` steps, TRL's own logs and a few parity checks (prompt token ids, stop ids, the
effective generation config).

``greedy_accuracy`` is deliberately independent of both trainers: plain HF ``generate`` with
``do_sample=False``, the chat template with ``add_generation_prompt=True``, the response cut at the
first stop token, decoded with ``skip_special_tokens=True`` and scored by ``exact_match`` (or by a
``score`` function the caller passes).

Several data sources (``bench/async_vs_sync.py``): when ``settings["sources"]`` maps each source name
to ``{"reward": <reward spec>, "max_new_tokens": n}`` and every record carries its ``"source"``,
the one reward function TRL is given scores each completion with its own source's reward (the
framework's reward plugin, built from the spec), per-source mean rewards are recorded every step,
and held-out accuracy is measured per source with that source's max new tokens. TRL still samples
the whole batch with one temperature / top-p / max completion length (``settings``): it has no
per-source sampling.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def stop_ids(model: Any, tokenizer: Any) -> list[int]:
    """Tokenizer eos plus every eos id in the model config and generation config."""
    ids: list[int] = []
    for value in (
        tokenizer.eos_token_id,
        getattr(model.config, "eos_token_id", None),
        getattr(getattr(model, "generation_config", None), "eos_token_id", None),
    ):
        if value is None:
            continue
        for v in [value] if isinstance(value, int) else value:
            if v not in ids:
                ids.append(int(v))
    return ids


def prompt_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


@torch.no_grad()
def greedy_accuracy(
    model: Any,
    tokenizer: Any,
    records: list[dict[str, Any]],
    *,
    max_new_tokens: int,
    reward_params: dict[str, Any] | None = None,
    batch_size: int = 256,
    score: Callable[[str, dict[str, Any]], float] | None = None,
) -> dict[str, float]:
    """Held-out greedy accuracy and mean response length over ``records``: a hit is ``exact_match``
    with ``reward_params`` (default) or ``score(text, record) >= 1``."""
    from transformers import GenerationConfig

    from loongsage.algos.rewards import exact_match

    if score is None:
        params = dict(reward_params or {})

        def score(text: str, record: dict[str, Any]) -> float:
            return exact_match(text, record["label"], **params)

    stops = stop_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    gen = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=stops,
        pad_token_id=pad,
        temperature=None,
        top_p=None,
        top_k=None,
    )
    was_training = model.training
    model.eval()
    hits, lengths = 0, 0
    try:
        for start in range(0, len(records), batch_size):
            chunk = records[start : start + batch_size]
            rows = [prompt_ids(tokenizer, r["prompt"]) for r in chunk]
            width = max(len(r) for r in rows)
            ids = torch.full((len(rows), width), pad, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, r in enumerate(rows):  # left padding for batched generation
                ids[i, width - len(r) :] = torch.tensor(r)
                mask[i, width - len(r) :] = 1
            out = model.generate(
                input_ids=ids.to(model.device), attention_mask=mask.to(model.device), generation_config=gen
            )[:, width:].cpu()
            for row, record in zip(out.tolist(), chunk):
                cut = next((k + 1 for k, t in enumerate(row) if t in stops), len(row))
                response = row[:cut]
                lengths += len(response)
                text = tokenizer.decode(response, skip_special_tokens=True)
                hits += score(text, record) >= 1.0
    finally:
        model.train(was_training)
    return {"accuracy": hits / len(records), "response_length": lengths / len(records)}


def source_scorers(sources: dict[str, dict[str, Any]]) -> dict[str, Callable[[str, dict[str, Any]], float]]:
    """Per source, ``score(text, record)``: the framework's reward plugin named by the source's spec,
    applied to a trajectory holding only the decoded response (what the rewards read)."""
    from loongsage.core.plugins import load_registry
    from loongsage.core.types import DataRecord, Trajectory

    registry = load_registry()
    out = {}
    for name, src in sources.items():
        reward = registry.create("reward", src["reward"], f"{name}.reward")

        def score(text: str, record: dict[str, Any], reward: Any = reward, name: str = name) -> float:
            traj = Trajectory(
                source=name,
                group_id=0,
                sample_index=0,
                prompt_ids=[],
                response_ids=[],
                loss_mask=[],
                rollout_logprobs=[],
                versions=[],
                response_text=text,
            )
            value = reward(
                traj,
                DataRecord(
                    source=name, index=int(record.get("index", 0)), prompt=record["prompt"], label=record["label"]
                ),
            )
            if inspect.isawaitable(value):
                value = asyncio.run(value)
            return float(value)

        out[name] = score
    return out


def run(spec: dict[str, Any]) -> dict[str, Any]:
    t_import = time.perf_counter()
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from loongsage.algos.rewards import exact_match

    s = spec["settings"]
    out_dir = Path(spec["work_dir"])
    sources = s.get("sources")  # several data sources: one reward and max length each
    reward_params = s.get("reward_params")
    scorers = source_scorers(sources) if sources else {}
    eval_records = spec["eval_records"]
    t_build = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(spec["model_path"], dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(spec["model_path"])
    columns = ("prompt", "label", "source", "index") if sources else ("prompt", "label")
    train = Dataset.from_list([{k: r[k] for k in columns} for r in spec["train_records"]])

    step_rewards: list[float] = []
    step_rewards_by_source: list[dict[str, float]] = []

    def exact_match_reward(completions: list[Any], label: list[str], **_: Any) -> list[float]:
        """The framework's exact-match reward on the decoded completion (message list or text)."""
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        values = [exact_match(t, y, **reward_params) for t, y in zip(texts, label)]
        step_rewards.append(sum(values) / len(values))
        return values

    def per_source_reward(
        completions: list[Any],
        label: list[str],
        source: list[str],
        index: list[int],
        prompts: list[Any] | None = None,
        **_: Any,
    ) -> list[float]:
        """Each completion scored by its own source's reward (the framework's plugin)."""
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        values = [
            scorers[src](t, {"prompt": p, "label": y, "index": i})
            for t, y, src, i, p in zip(texts, label, source, index, prompts or [None] * len(texts))
        ]
        step_rewards.append(sum(values) / len(values))
        by: dict[str, list[float]] = {}
        for src, v in zip(source, values):
            by.setdefault(src, []).append(v)
        step_rewards_by_source.append({k: sum(v) / len(v) for k, v in by.items()})
        return values

    P, G = s["prompts"], s["samples"]
    args = GRPOConfig(
        output_dir=str(out_dir / "trainer"),
        use_cpu=True,
        bf16=False,
        fp16=False,
        seed=s["seed"],
        data_seed=s["seed"],
        max_steps=s["steps"],
        # one optimizer step per generation batch of exactly P prompts x G samples, used once
        num_generations=G,
        per_device_train_batch_size=P * G,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        shuffle_dataset=False,
        max_completion_length=s["max_new_tokens"],
        temperature=s["temperature"],
        top_p=s["top_p"],
        top_k=s["top_k"],
        min_p=s["min_p"] or None,
        learning_rate=s["lr"],
        lr_scheduler_type="constant_with_warmup" if s["warmup_steps"] else "constant",
        warmup_steps=s["warmup_steps"],
        optim="adamw_torch",
        adam_beta1=s["betas"][0],
        adam_beta2=s["betas"][1],
        adam_epsilon=s["adam_eps"],
        weight_decay=s["weight_decay"],
        max_grad_norm=s["grad_clip"],
        beta=0.0,
        epsilon=s["clip_low"],
        epsilon_high=s["clip_high"],
        loss_type="dapo",
        scale_rewards="group" if s["std_normalize"] else "none",
        mask_truncated_completions=False,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        use_vllm=False,
        # TRL's default is True; the framework's trainer does not recompute activations either
        gradient_checkpointing=False,
    )

    steps: list[dict[str, Any]] = []
    evals: list[dict[str, Any]] = []
    log_rows: list[dict[str, Any]] = []
    rollout_s: list[float] = []
    state = {"t0": 0.0}

    trainer_ref: dict[str, Any] = {}

    def evaluate(step: int) -> None:
        t = time.perf_counter()
        if sources:  # each source on its own records, with its own max new tokens and reward
            per_source = {
                name: greedy_accuracy(
                    trainer_ref["t"].model,
                    tokenizer,
                    [r for r in eval_records if r["source"] == name],
                    max_new_tokens=src["max_new_tokens"],
                    score=scorers[name],
                )
                for name, src in sources.items()
            }
            evals.append({"step": step, "per_source": per_source, "seconds": time.perf_counter() - t})
            return
        res = greedy_accuracy(
            trainer_ref["t"].model,
            tokenizer,
            eval_records,
            max_new_tokens=s["max_new_tokens"],
            reward_params=reward_params,
        )
        evals.append({"step": step, **res, "seconds": time.perf_counter() - t})

    class Timing(TrainerCallback):
        def on_train_begin(self, args, st, control, **kw):
            state["train_begin"] = time.perf_counter()
            evaluate(0)

        def on_step_begin(self, args, st, control, **kw):
            state["t0"] = time.perf_counter()

        def on_step_end(self, args, st, control, **kw):
            dt = time.perf_counter() - state["t0"]
            step = int(st.global_step)
            steps.append(
                {
                    "step": step,
                    "step_s": dt,
                    "rollout_s": rollout_s[-1] if rollout_s else float("nan"),
                    "reward_mean": step_rewards[-1] if step_rewards else float("nan"),
                    **(
                        {"reward_mean_by_source": step_rewards_by_source[-1] if step_rewards_by_source else {}}
                        if sources
                        else {}
                    ),
                }
            )
            every = s["eval_every"]
            if (every and step % every == 0) or step == s["steps"]:
                evaluate(step)

        def on_log(self, args, st, control, logs=None, **kw):
            if logs:
                log_rows.append(
                    {"step": int(st.global_step), **{k: v for k, v in logs.items() if isinstance(v, (int, float))}}
                )

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=per_source_reward if sources else exact_match_reward,
        args=args,
        train_dataset=train,
        processing_class=tokenizer,
        callbacks=[Timing()],
    )
    trainer_ref["t"] = trainer

    # time generation + scoring + advantages (TRL's "rollout" part of a step)
    inner = trainer._generate_and_score_completions

    def timed(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return inner(*a, **k)
        finally:
            rollout_s.append(time.perf_counter() - t)

    trainer._generate_and_score_completions = timed

    # parity checks: the prompt ids TRL generates from, its stop ids and effective sampling settings
    first = [r["prompt"] for r in spec["train_records"][:P]]
    parity: dict[str, Any] = {"stop_ids": [int(x) for x in trainer.eos_token_ids]}
    try:
        trl_ids = trainer._tokenize_prompts(first)[0]
        parity["prompt_ids_match_chat_template"] = all(
            list(a) == prompt_ids(tokenizer, m) for a, m in zip(trl_ids, first)
        )
    except Exception as exc:  # a private method: report rather than fail
        parity["prompt_ids_match_chat_template"] = f"not checked: {exc!r}"
    parity["uses_parse_response"] = any(
        getattr(tokenizer, k, None) is not None for k in ("response_template", "response_schema")
    )
    gc = trainer.generation_config
    parity["generation_config"] = {
        k: getattr(gc, k, None)
        for k in (
            "do_sample",
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "max_new_tokens",
            "repetition_penalty",
            "eos_token_id",
            "pad_token_id",
        )
    }
    parity["old_logprobs_recomputed"] = bool(
        args.gradient_accumulation_steps % (args.steps_per_generation * args.num_iterations) != 0
    )
    parity["generation_batch_size"] = args.generation_batch_size
    parity["gradient_checkpointing"] = bool(getattr(trainer.model, "is_gradient_checkpointing", False))
    parity["optimizer"] = None
    t_train = time.perf_counter()
    trainer.train()
    t_done = time.perf_counter()
    parity["optimizer"] = type(
        trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    ).__name__
    parity["lr_scheduler"] = str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type))
    final = out_dir / "final"
    trainer.save_model(str(final))
    tokenizer.save_pretrained(str(final))
    import transformers
    import trl

    return {
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__},
        "torch_threads": torch.get_num_threads(),
        "timing": {
            "import_s": t_build - t_import,
            "init_s": t_train - t_build,
            "train_loop_s": t_done - t_train,
            "train_begin_to_end_s": t_done - state.get("train_begin", t_train),
        },
        "steps": steps,
        "evals": evals,
        "logs": log_rows,
        "parity": parity,
        "final_model": str(final),
        "reward_calls": len(step_rewards),
    }


def main() -> int:
    # one thread per core this process may use (under taskset, fewer than the machine has), as the
    # launcher's synchronous actors get
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    spec = json.loads(Path(sys.argv[1]).read_text())
    result = run(spec)
    Path(sys.argv[2]).write_text(json.dumps(result, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
