"""Run by test_megatron_tp.py and test_megatron_pp.py: ``python _tp_worker.py MODEL_DIR WORK_DIR TP
[PP]``. ``TP x PP`` gloo processes (Megatron's CPU shims in each) run one ``megatron`` trainer
replica split ``TP`` ways and into ``PP`` pipeline stages on the trainer worker's batch, one row
per micro-batch: log-probs, a step, the exported weights, a checkpoint and its resume. Rank 0
writes ``WORK_DIR/tp{TP}[_pp{PP}].pt``."""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path

import torch

BUDGET = 24  # tokens per micro-batch: one row each, three micro-batches in the pipeline


def distill_loss(topk: int):
    """MOPD's GKD branch in small, plus the worker's policy-gradient loss: per trained position the
    reverse KL over the teacher's full distribution (``topk`` 0; under tensor parallelism summed over
    the vocabulary's shards, by ``full_vocab_kl``'s parts) or over its top-k."""
    from _trainer_worker import loss_fn

    from loongsage.algos.divergences import FullVocabKL, TopKKL
    from loongsage.core.contracts import LossFunction
    from loongsage.core.metrics import Metrics

    divergence = TopKKL(k=topk) if topk else FullVocabKL()

    class Distill(LossFunction):
        needs_student_distribution = True
        reads_vocab_shards = not topk
        teacher_support = (topk, not topk)

        def __call__(self, lp, mb, student_dist=None, vocab_sum=None):
            t = student_dist.shape[1]
            teacher = mb.teacher_dist_logprobs[:, -t:].to(student_dist.device)
            if vocab_sum is None:
                kl = divergence(student_dist, teacher)
            else:
                kl = vocab_sum(divergence.partial(student_dist, teacher)).clamp(min=0.0)
            mask = mb.response_mask[:, -t:].to(kl.device)
            return (kl * mask).sum() / 100 + loss_fn(lp, mb)[0], Metrics()

    return Distill()


def perturbed_copy(model_dir: str, out: Path) -> str:
    """A teacher: the model with seeded noise on every weight (the same vocabulary, other outputs)."""
    if not out.exists():
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(torch.randn(param.shape, generator=gen) * 0.05)
        model.save_pretrained(out)
    return str(out)


def run(rank: int, tp: int, pp: int, model_dir: str, work: str, port: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=tp * pp)  # as the trainer worker does
    sys.path.insert(0, str(Path(__file__).parent))
    from _trainer_worker import batch, loss_fn

    from loongsage.megatron.trainer import MegatronTrainer

    b = batch()
    trainer = MegatronTrainer(model_dir, tensor_parallel=tp, pipeline_parallel=pp)
    out: dict = {"layout": trainer.data_parallel}
    out["logprobs"], out["entropy"] = trainer.logprobs(b, BUDGET)
    trainer.setup_optimizer(1e-3, [0.9, 0.99], 1e-8, 0.0, 1.0, 0)
    out["grad_norm"] = trainer.train_step(b, loss_fn, BUDGET).gauges["train/grad_norm"]
    out["after"] = trainer.logprobs(b, BUDGET)[0]
    out["exported"] = {n: t.clone() for n, t in trainer.export_weights()}
    name = f"tp{tp}" + (f"_pp{pp}" if pp > 1 else "")
    trainer.save(Path(work) / f"ckpt_{name}")
    dist.barrier()  # the controller waits for every rank's save before anything loads
    resumed = MegatronTrainer(model_dir, tensor_parallel=tp, pipeline_parallel=pp)
    resumed.setup_optimizer(1e-3, [0.9, 0.99], 1e-8, 0.0, 1.0, 0)
    resumed.load(Path(work) / f"ckpt_{name}")
    out["resumed_exact"] = torch.equal(resumed.logprobs(b, BUDGET)[0], out["after"])
    g1, g2 = (t.train_step(b, loss_fn, BUDGET).gauges["train/grad_norm"] for t in (trainer, resumed))
    out["resumed_step_exact"] = g1 == g2
    # bfloat16 on float32 masters: they carry the shards' marks, so the norm counts every shard
    half = MegatronTrainer(model_dir, tensor_parallel=tp, pipeline_parallel=pp, dtype="bfloat16")
    half.setup_optimizer(1e-3, [0.9, 0.99], 1e-8, 0.0, 1.0, 0)
    out["bf16_grad_norm"] = half.train_step(b, loss_fn, BUDGET).gauges["train/grad_norm"]
    split = MegatronTrainer(
        model_dir, tensor_parallel=tp, pipeline_parallel=pp, dtype="bfloat16", distributed_optimizer=True
    )
    split.setup_optimizer(1e-3, [0.9, 0.99], 1e-8, 0.0, 1.0, 0)
    out["bf16_split_grad_norm"] = split.train_step(b, loss_fn, BUDGET).gauges["train/grad_norm"]
    out["bf16_masters"] = half.masters is not None and all(m.dtype == torch.float32 for m in half.masters.masters)
    # MOPD with a teacher held by the trainer, split as the policy: its log-probs, then a step on its
    # full distribution and one on its top-k (the vocabulary shards gathered for the divergence)
    student = MegatronTrainer(model_dir, tensor_parallel=tp, pipeline_parallel=pp)
    student.add_teacher(["s"], str(Path(work) / "teacher"))
    student.setup_optimizer(1e-3, [0.9, 0.99], 1e-8, 0.0, 1.0, 0)
    taught = replace(b, sources=["s"] * len(b))
    out["teacher_logprobs"] = student.teacher_logprobs(taught, BUDGET)
    out["distill_grad_norms"] = [
        student.train_step(taught, distill_loss(k), BUDGET).gauges["train/grad_norm"] for k in (0, 5)
    ]
    # the same first step on a teacher worker's whole distribution, shipped in the batch (each
    # tensor-parallel rank takes its shard of it)
    from loongsage.core.trainer.teacher import EmbeddedTeacher

    scored = EmbeddedTeacher(str(Path(work) / "teacher")).score(taught, full_vocab=True)
    shipped = MegatronTrainer(model_dir, tensor_parallel=tp, pipeline_parallel=pp)
    shipped.setup_optimizer(1e-3, [0.9, 0.99], 1e-8, 0.0, 1.0, 0)
    out["shipped_grad_norm"] = shipped.train_step(
        replace(taught, teacher_dist_logprobs=scored["dist_logprobs"]), distill_loss(0), BUDGET
    ).gauges["train/grad_norm"]
    outs = [None] * (tp * pp)
    dist.all_gather_object(outs, out)
    if rank == 0:  # the leader's answers (the last stage computes them); rank 0's exports
        leader = next(o for o in outs if o["layout"][2])
        torch.save(
            {
                **leader,
                "exported": out["exported"],
                "layouts": [o["layout"] for o in outs],
                "others_exported": [o["exported"] for o in outs[1:]],
            },
            Path(work) / f"{name}.pt",
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from _ranks import one_thread, start_ranks

    one_thread()
    from loongsage.megatron.cpu import apply_cpu_shims

    apply_cpu_shims()
    model_dir, work, tp = sys.argv[1], sys.argv[2], int(sys.argv[3])
    pp = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    from loongsage.core.placement import free_port

    perturbed_copy(model_dir, Path(work) / "teacher")
    port = str(free_port())
    start_ranks(run, args=(tp, pp, model_dir, work, port), nprocs=tp * pp)
