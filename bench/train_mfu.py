"""Training throughput and MFU on one CUDA GPU: the ``megatron`` trainer on its TE-free spec (torch's
fused attention) and on Transformer Engine's layer (where it imports), against Megatron's local
spec (unfused attention) and the ``torch`` trainer (HF + SDPA), eager and with its decoder layers
compiled (``compile_layers``: Inductor's fused kernels), and compiled with the FP32 head run 4,096
tokens at a time (``head_chunk_tokens``).

A Qwen3-1.7B-shaped model with random bf16 weights; each step is one optimizer step (AdamW, grad
clipping) over ``--rows`` rows of ``--seq`` random tokens, every token trained (one micro-batch),
through the trainers' own ``train_step``. Each side runs in a process of its own (so one side's
memory or an out-of-memory error does not touch the others), ``--warmup`` untimed steps first, then
``--repeats`` (>= 3) timed ones; medians and min-max are reported.

MFU counts the model's matmul FLOPs, 6 x (parameters in matmuls, the LM head included) x tokens,
plus causal attention's, 6 x layers x heads x head_dim x seq^2 x rows (half of the full square),
against the card's bf16 matmul rate measured in the same run. Goal: >= 45% for the megatron side.

    python bench/train_mfu.py [--rows 4] [--seq 4096] [--repeats 3] [--warmup 2] [--out-dir DIR]

Needs one CUDA GPU and Megatron-Core. Writes ``bench/results/train_mfu.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
from _source import source_state  # noqa: E402
from engine_gpu import build  # noqa: E402
from gpu_rl_step import matmul_params, matmul_tflops  # noqa: E402

SIDES = {
    "megatron": ("megatron", {"layer_spec": "sdpa"}),
    "megatron_te": ("megatron", {"layer_spec": "te"}),
    "megatron_local": ("megatron", {"layer_spec": "local"}),
    "torch": ("torch", {}),
    "torch_compiled": ("torch", {"compile_layers": True}),
    "torch_compiled_chunked_head": ("torch", {"compile_layers": True, "head_chunk_tokens": 4096}),
}
GOAL = 0.45


def side(name: str, model_path: str, rows: int, seq: int, warmup: int, repeats: int) -> dict:
    """One side, in this process: step times (seconds) and peak memory, or the error."""
    from loongsage.core.metrics import Metrics
    from loongsage.core.types import TrainBatch

    backend, params = SIDES[name]
    if backend == "megatron":
        from loongsage.megatron.trainer import MegatronTrainer as Trainer
    else:
        from loongsage.core.trainer.torch_trainer import TorchTrainer as Trainer
    trainer = Trainer(model_path, dtype="bfloat16", device="cuda", **params)
    trainer.setup_optimizer(1e-6, [0.9, 0.99], 1e-8, 0.0, 1.0, 0)
    vocab = json.loads((Path(model_path) / "config.json").read_text())["vocab_size"]
    ids = torch.randint(3, vocab, (rows, seq), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(rows, seq)
    mask[:, 0] = 0
    batch = TrainBatch(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        response_mask=mask,
        rollout_logprobs=torch.zeros(rows, seq),
        advantages=torch.ones(rows, seq),
        rewards=torch.zeros(rows),
        group_ids=torch.arange(rows),
    )

    def loss_fn(lp: torch.Tensor, mb: TrainBatch) -> tuple[torch.Tensor, Metrics]:
        return -(lp * mb.response_mask.to(lp.device)).sum() / mask.sum(), Metrics()

    times = []
    for step in range(warmup + repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        trainer.train_step(batch, loss_fn, token_budget=rows * seq)
        torch.cuda.synchronize()
        if step >= warmup:
            times.append(time.perf_counter() - start)
    return {"step_s": times, "peak_gb": torch.cuda.max_memory_allocated() / 1e9}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--sides", nargs="+", default=list(SIDES), choices=list(SIDES))
    ap.add_argument("--out-dir", default=str(BENCH / "results"))
    ap.add_argument("--side", help=argparse.SUPPRESS)  # internal: run one side here
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.repeats < 3:
        ap.error("--repeats: at least 3")
    if args.side:
        Path(args.result).write_text(
            json.dumps(side(args.side, args.model, args.rows, args.seq, args.warmup, args.repeats))
        )
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        return 0
    source = source_state()  # the commit measured, first
    peak = matmul_tflops()
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench-train-mfu-") as tmp:
        model_path = Path(tmp) / "model"
        model = build(model_path)
        del model
        torch.cuda.empty_cache()
        config = json.loads((model_path / "config.json").read_text())
        tokens = args.rows * args.seq
        flops = (
            6 * matmul_params(str(model_path)) * tokens
            + 6
            * config["num_hidden_layers"]
            * config["num_attention_heads"]
            * config["head_dim"]
            * args.seq**2
            * args.rows
        )
        for name in args.sides:
            out = Path(tmp) / f"{name}.json"
            run = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--side",
                    name,
                    "--model",
                    str(model_path),
                    "--result",
                    str(out),
                    "--rows",
                    str(args.rows),
                    "--seq",
                    str(args.seq),
                    "--warmup",
                    str(args.warmup),
                    "--repeats",
                    str(args.repeats),
                ],
                capture_output=True,
                text=True,
            )
            if run.returncode != 0:
                lines = (run.stderr or run.stdout).strip().splitlines()
                tail = [line for line in lines if "Error" in line][-1:] or lines[-1:] or ["no output"]
                results[name] = {"error": tail[0][:300]}
                print(f"{name}: failed: {tail[0][:300]}", flush=True)
                continue
            r = json.loads(out.read_text())
            step = statistics.median(r["step_s"])
            r |= {"median_s": step, "tok_s": tokens / step, "mfu": flops / step / (peak * 1e12)}
            results[name] = r
            print(
                f"{name}: {step:.3f} s/step, {tokens / step:,.0f} tok/s, MFU {r['mfu']:.1%}, "
                f"peak {r['peak_gb']:.1f} GB",
                flush=True,
            )
    result = {
        "source": source,
        "settings": {k: v for k, v in vars(args).items() if k not in ("side", "model", "result")},
        "device": torch.cuda.get_device_name(0),
        "matmul_tflops": peak,
        "flops_per_step": flops,
        "goal_mfu": GOAL,
        "sides": results,
    }
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "train_mfu.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [
        f"commit `{source['commit'][:10]}`; {result['device']}; Qwen3-1.7B shape, random bf16 weights; "
        f"{args.rows} x {args.seq} tokens per optimizer step (one micro-batch); median of {args.repeats} after "
        f"{args.warmup} warm-up steps; bf16 matmul rate measured here {peak:.0f} TFLOP/s",
        "",
        "| trainer | s/step (min-max) | tokens/s | MFU | peak GB |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error'][:120]} | | | |")
        else:
            lines.append(
                f"| {name} | {r['median_s']:.3f} ({min(r['step_s']):.3f}-{max(r['step_s']):.3f}) | "
                f"{r['tok_s']:,.0f} | {r['mfu']:.1%} | {r['peak_gb']:.1f} |"
            )
    lines.append(
        f"\nGoal: MFU >= {GOAL:.0%} for `megatron` (`megatron_te`: Transformer Engine's layer; it needs "
        "`transformer_engine` with its torch extension built for this torch)."
    )
    (out_dir / "train_mfu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
