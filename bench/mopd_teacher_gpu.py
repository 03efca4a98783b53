"""One MOPD distillation step on one CUDA GPU over the full vocabulary: a teacher held by the trainer
(``teacher: {name: trainer}``) against a teacher worker shipping its distribution in the batch, and
against TRL's GKD step (student and teacher in one process, TRL's own ``GKDTrainer.compute_loss``).

Student and teacher are Qwen3-1.7B-shaped (151,936-token vocabulary) with different random bf16
weights; a step is ``--rows`` rows of ``--seq`` tokens, the last ``--seq - --prompt`` of each
trained, with the generalised JSD (beta 0.5) as the whole loss (token mean, as TRL's), then
gradient clipping and AdamW. Sides:

* ``held``: the ``megatron`` trainer holding the teacher; the step computes each micro-batch's
  teacher distribution beside the student's (``train_step``), plus, timed apart, the teacher's
  log-probs of the sampled tokens the PG branch reads (``teacher_logprobs``).
* ``worker``: the ``megatron`` teacher scores the batch (``score(full_vocab=True)``: its
  log-softmax to host memory, as a teacher actor returns it), then the trainer steps on the
  shipped distribution (moved back to the card micro-batch by micro-batch).
* ``trl``: TRL 1.16's ``GKDTrainer.compute_loss`` on the HF student and teacher (bf16 logits over
  every position, the prompt masked by ``labels``), backward, clipping, torch's AdamW.

Each side runs in a process of its own, ``--warmup`` untimed steps, then ``--repeats`` (>= 3)
timed ones; medians and min-max, peak memory, the first step's loss (the three agree up to TRL's
bf16 log-softmax), and the bytes a step moves through the host.

    python bench/mopd_teacher_gpu.py [--rows 4] [--seq 2048] [--prompt 512] [--repeats 3] [--warmup 2]

Needs one CUDA GPU, Megatron-Core and TRL. Writes ``bench/results/mopd_teacher_gpu.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
from _source import source_state  # noqa: E402
from engine_gpu import qwen3_1_7b_config  # noqa: E402

SIDES = ("held", "worker", "trl")
BETA = 0.5


def build(path: Path, seed: int) -> None:
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(qwen3_1_7b_config()).to(torch.bfloat16)
    model.save_pretrained(str(path))


def batch(rows: int, seq: int, prompt: int, vocab: int):
    from loongsage.core.types import TrainBatch

    ids = torch.randint(3, vocab, (rows, seq), generator=torch.Generator().manual_seed(0))
    response = torch.zeros(rows, seq)
    response[:, prompt:] = 1
    return TrainBatch(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        response_mask=response,
        rollout_logprobs=torch.zeros(rows, seq),
        advantages=torch.zeros(rows, seq),
        rewards=torch.zeros(rows),
        group_ids=torch.arange(rows),
        sources=["s"] * rows,
    )


def jsd_loss(tokens: float):
    """The loss our sides train on: the token mean of the generalised JSD over the trained tokens."""
    from loongsage.algos.divergences import JSD
    from loongsage.core.contracts import LossFunction
    from loongsage.core.metrics import Metrics

    divergence = JSD(beta=BETA)

    class Distill(LossFunction):
        needs_student_distribution = True
        reads_vocab_shards = True
        teacher_support = (0, True)

        def __call__(self, lp, mb, student_dist=None, vocab_sum=None):
            t = student_dist.shape[1]
            teacher = mb.teacher_dist_logprobs[:, -t:].to(student_dist.device)
            div = divergence(student_dist, teacher)
            mask = mb.response_mask[:, -t:].to(div.device)
            return (div * mask).sum() / tokens, Metrics()

    return Distill()


def ours(name: str, student: str, teacher: str, b, warmup: int, repeats: int) -> dict:
    from loongsage.megatron.teacher import MegatronTeacher
    from loongsage.megatron.trainer import MegatronTrainer

    trainer = MegatronTrainer(student, dtype="bfloat16", device="cuda")
    trainer.setup_optimizer(1e-6, [0.9, 0.99], 1e-8, 0.0, 1.0, 0)
    worker = None
    if name == "held":
        trainer.add_teacher(["s"], teacher)
    else:
        worker = MegatronTeacher(teacher, dtype="bfloat16", device="cuda")
    loss = jsd_loss(float(b.response_mask.sum()))
    budget = b.input_ids.numel()  # one micro-batch, as TRL's step
    times, extra, first_loss, host_bytes = [], [], None, 0
    for step in range(warmup + repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        if name == "held":
            trainer.teacher_logprobs(b, budget)  # the PG branch's log-probs, before the advantages
            torch.cuda.synchronize()
            side_s = time.perf_counter() - start
            metrics = trainer.train_step(b, loss, budget)
        else:
            scored = worker.score(b, full_vocab=True)
            host_bytes = scored["dist_logprobs"].numel() * scored["dist_logprobs"].element_size()
            torch.cuda.synchronize()
            side_s = time.perf_counter() - start
            metrics = trainer.train_step(
                replace(b, teacher_logprobs=scored["logprobs"], teacher_dist_logprobs=scored["dist_logprobs"]),
                loss,
                budget,
            )
        torch.cuda.synchronize()
        if first_loss is None:
            first_loss = metrics.totals["train/loss"]
        if step >= warmup:
            times.append(time.perf_counter() - start)
            extra.append(side_s)
    return {
        "step_s": times,
        "teacher_s": extra,
        "peak_gb": torch.cuda.max_memory_allocated() / 1e9,
        "first_loss": first_loss,
        "host_bytes": host_bytes,
    }


def trl(student: str, teacher: str, b, warmup: int, repeats: int) -> dict:
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM
    from trl.experimental.gkd.gkd_trainer import GKDTrainer

    model = AutoModelForCausalLM.from_pretrained(student, dtype=torch.bfloat16, attn_implementation="sdpa").cuda()
    model.train()
    frozen = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.bfloat16, attn_implementation="sdpa").cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0)
    this = SimpleNamespace(teacher_model=frozen, beta=BETA, generalized_jsd_loss=GKDTrainer.generalized_jsd_loss)
    labels = b.input_ids.masked_fill(b.response_mask == 0, -100)
    inputs = {"input_ids": b.input_ids.cuda(), "attention_mask": b.attention_mask.cuda(), "labels": labels.cuda()}
    times, first_loss = [], None
    for step in range(warmup + repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = GKDTrainer.compute_loss(this, model, inputs)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        torch.cuda.synchronize()
        if first_loss is None:
            first_loss = float(loss)
        if step >= warmup:
            times.append(time.perf_counter() - start)
    return {
        "step_s": times,
        "peak_gb": torch.cuda.max_memory_allocated() / 1e9,
        "first_loss": first_loss,
        "host_bytes": 0,
    }


def run_side(args: argparse.Namespace) -> dict:
    vocab = json.loads((Path(args.student) / "config.json").read_text())["vocab_size"]
    b = batch(args.rows, args.seq, args.prompt, vocab)
    if args.side == "trl":
        return trl(args.student, args.teacher, b, args.warmup, args.repeats)
    return ours(args.side, args.student, args.teacher, b, args.warmup, args.repeats)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--sides", nargs="+", default=list(SIDES), choices=SIDES)
    ap.add_argument("--out-dir", default=str(BENCH / "results"))
    ap.add_argument("--side", help=argparse.SUPPRESS)  # internal: run one side here
    ap.add_argument("--student", help=argparse.SUPPRESS)
    ap.add_argument("--teacher", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.repeats < 3:
        ap.error("--repeats: at least 3")
    if args.side:
        Path(args.result).write_text(json.dumps(run_side(args)))
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        return 0
    source = source_state()  # the commit measured, first
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench-mopd-") as tmp:
        student, teacher = Path(tmp) / "student", Path(tmp) / "teacher"
        build(student, 0)
        build(teacher, 1)
        torch.cuda.empty_cache()
        for name in args.sides:
            out = Path(tmp) / f"{name}.json"
            run = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--side",
                    name,
                    "--student",
                    str(student),
                    "--teacher",
                    str(teacher),
                    "--result",
                    str(out),
                    "--rows",
                    str(args.rows),
                    "--seq",
                    str(args.seq),
                    "--prompt",
                    str(args.prompt),
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
            r["median_s"] = statistics.median(r["step_s"])
            results[name] = r
            print(
                f"{name}: {r['median_s']:.3f} s/step, peak {r['peak_gb']:.1f} GB, first loss {r['first_loss']:.5f}",
                flush=True,
            )
    result = {
        "source": source,
        "settings": {k: v for k, v in vars(args).items() if k not in ("side", "student", "teacher", "result")},
        "device": torch.cuda.get_device_name(0),
        "sides": results,
    }
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "mopd_teacher_gpu.json").write_text(json.dumps(result, indent=1) + "\n")
    trained = args.rows * (args.seq - args.prompt)
    lines = [
        f"commit `{source['commit'][:10]}`; {result['device']}; Qwen3-1.7B shape (151,936-token vocabulary), "
        f"student and teacher random bf16; {args.rows} x {args.seq} tokens a step, {trained} trained; generalised "
        f"JSD (beta {BETA}) over the full vocabulary; median of {args.repeats} after {args.warmup} warm-up steps",
        "",
        "| side | s/step (min-max) | of which teacher outside the step | peak GB | host bytes a step | first loss |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error'][:120]} | | | | |")
            continue
        teacher_s = f"{statistics.median(r['teacher_s']):.3f}" if "teacher_s" in r else "-"
        lines.append(
            f"| {name} | {r['median_s']:.3f} ({min(r['step_s']):.3f}-{max(r['step_s']):.3f}) | {teacher_s} | "
            f"{r['peak_gb']:.1f} | {r['host_bytes'] / 1e9:.2f} GB | {r['first_loss']:.5f} |"
        )
    if "held" in results and "trl" in results and "error" not in results["held"] and "error" not in results["trl"]:
        lines.append(
            f"\nheld / TRL step time: {results['held']['median_s'] / results['trl']['median_s']:.2f}x "
            "(the held side also scores the sampled tokens for the PG branch, which TRL's GKD does not)"
        )
    (out_dir / "mopd_teacher_gpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
