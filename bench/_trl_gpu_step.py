"""TRL side of ``bench/gpu_rl_step.py``: ``GRPOTrainer`` on one GPU, timed per optimizer step.

Run by the driver as a subprocess::

    python bench/_trl_gpu_step.py <spec.json> <result.json>

The spec names the model folder (the same random-weight model our side trains), the prompts (the
same digit strings) and the workload; the result holds the wall time of every optimizer step (one
generation batch each), TRL's own per-step logs and the peak GPU memory.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch


def main(spec_path: str, result_path: str) -> int:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    spec = json.loads(Path(spec_path).read_text())
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.bfloat16)
    lengths = {len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in spec["prompts"]}
    assert lengths == {spec["prompt_tokens"]}, f"prompt lengths {lengths}"
    prompts_per_step, samples = spec["prompts_per_step"], spec["samples_per_prompt"]
    generation_batch = prompts_per_step * samples
    config = GRPOConfig(
        output_dir=str(Path(result_path).parent / "trl_out"),
        per_device_train_batch_size=spec["micro_batch_rows"],
        gradient_accumulation_steps=generation_batch // spec["micro_batch_rows"],  # one optimizer step per batch
        num_generations=samples,
        max_completion_length=spec["new_tokens"],
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        generation_kwargs={"min_new_tokens": spec["new_tokens"]},  # exactly new_tokens sampled, as ours
        beta=0.0,
        learning_rate=1e-6,
        max_grad_norm=1.0,
        epsilon=0.2,
        epsilon_high=0.28,
        loss_type="dapo",
        bf16=True,
        gradient_checkpointing=False,
        max_steps=spec["steps"],
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=1,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    data = Dataset.from_list([{"prompt": p} for p in spec["prompts"]])

    def constant_reward(completions, **_):
        return [0.0] * len(completions)

    marks: list[float] = []
    completion_lengths: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if not marks:
                torch.cuda.synchronize()
                marks.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            torch.cuda.synchronize()
            marks.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                completion_lengths.append(float(logs["completions/mean_length"]))

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=constant_reward,
        args=config,
        train_dataset=data,
        processing_class=tokenizer,
        callbacks=[Timer()],
    )
    torch.cuda.reset_peak_memory_stats()
    trainer.train()
    # TrainerCallback.on_step_end fires once per optimizer step (after gradient accumulation)
    steps = [b - a for a, b in zip(marks, marks[1:])]
    result = {
        "step_s": steps,
        "completion_mean_length": completion_lengths,
        "peak_gb": torch.cuda.max_memory_allocated() / 1e9,
        "log_history": trainer.state.log_history,
    }
    Path(result_path).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
