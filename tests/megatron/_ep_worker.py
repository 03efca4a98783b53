"""Run by test_megatron_ep.py: ``python _ep_worker.py MODEL_DIR WORK_DIR TP EP WORLD [PP [ETP]]``.
``WORLD`` gloo processes (Megatron's CPU shims in each) of a ``megatron`` trainer on a tiny
Qwen3-MoE, each replica split ``TP`` ways and into ``PP`` pipeline stages, the experts ``EP`` ways
(each expert split ``ETP`` ways: by default ``TP``). Data-parallel rank ``r`` holds the rows of
:func:`rows_of` ``(r)``, of different counts and lengths, and a small token budget gives the ranks
different numbers of micro-batches: log-probs (with and without replayed routes), a step, the
exported weights, a checkpoint and its resume, and the same with the distributed optimizer; a step
replaying routes with every layer recomputed in the backward. Rank 0 writes every rank's results
to ``WORK_DIR/tp{TP}_ep{EP}[_pp{PP}][_etp{ETP}].pt``."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import torch

BUDGET = 48  # tokens per micro-batch: rank 0's rows take two, rank 1's one


def rows_of(rank: int):
    sys.path.insert(0, str(Path(__file__).parent))
    from _moe_worker import EXPERTS, LAYERS, TOPK
    from _trainer_worker import batch

    b = batch()
    if rank == 1:  # fewer and shorter rows than rank 0
        b = b.select([0, 1])
        for name in ("input_ids", "attention_mask", "response_mask", "rollout_logprobs", "advantages"):
            setattr(b, name, getattr(b, name)[:, :14].contiguous())
    g = torch.Generator().manual_seed(rank)
    routes = [torch.randint(0, EXPERTS, (int(m.sum()), LAYERS, TOPK), generator=g) for m in b.attention_mask]
    return b, routes


def run(
    rank: int, tp: int, ep: int, world: int, model_dir: str, work: str, port: str, pp: int = 1, etp: int | None = None
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)  # as the trainer worker does
    sys.path.insert(0, str(Path(__file__).parent))
    from _trainer_worker import loss_fn

    from loongsage.megatron.trainer import MegatronTrainer

    def trainer_(**extra):
        return MegatronTrainer(
            model_dir, tensor_parallel=tp, expert_parallel=ep, pipeline_parallel=pp, expert_tensor_parallel=etp, **extra
        )

    trainer = trainer_()
    out: dict = {"layout": trainer.data_parallel}
    b, routes = rows_of(out["layout"][0])
    out["logprobs"], out["entropy"] = trainer.logprobs(b, BUDGET)
    out["replayed"] = trainer.logprobs(dataclasses.replace(b, routed_experts=routes), BUDGET)[0]
    trainer.setup_optimizer(1e-3, [0.9, 0.99], 1e-8, 0.0, 1.0, 0)
    out["grad_norm"] = trainer.train_step(b, loss_fn, BUDGET).gauges["train/grad_norm"]
    out["after"] = trainer.logprobs(b, BUDGET)[0]
    out["exported"] = {n: t.clone() for n, t in trainer.export_weights()}
    name = f"tp{tp}_ep{ep}" + (f"_pp{pp}" if pp > 1 else "") + (f"_etp{etp}" if etp is not None else "")
    trainer.save(Path(work) / f"ckpt_{name}")
    dist.barrier()  # the controller waits for every rank's save before anything loads
    resumed = trainer_()
    resumed.setup_optimizer(1e-3, [0.9, 0.99], 1e-8, 0.0, 1.0, 0)
    resumed.load(Path(work) / f"ckpt_{name}")
    out["resumed_exact"] = torch.equal(resumed.logprobs(b, BUDGET)[0], out["after"])
    g1, g2 = (t.train_step(b, loss_fn, BUDGET).gauges["train/grad_norm"] for t in (trainer, resumed))
    out["resumed_step_exact"] = g1 == g2  # every rank's experts' optimizer state came back
    # the distributed optimizer: the same step from split masters and moments (experts in a bucket of their own)
    split = trainer_(distributed_optimizer=True)
    split.setup_optimizer(1e-3, [0.9, 0.99], 1e-8, 0.0, 1.0, 0)
    out["split_grad_norm"] = split.train_step(b, loss_fn, BUDGET).gauges["train/grad_norm"]
    out["split_after"] = split.logprobs(b, BUDGET)[0]
    split.save(Path(work) / f"ckpt_split_{name}")
    dist.barrier()
    again = trainer_(distributed_optimizer=True)
    again.setup_optimizer(1e-3, [0.9, 0.99], 1e-8, 0.0, 1.0, 0)
    again.load(Path(work) / f"ckpt_split_{name}")
    g1, g2 = (t.train_step(b, loss_fn, BUDGET).gauges["train/grad_norm"] for t in (split, again))
    out["split_resumed_step_exact"] = g1 == g2
    # R3 with recomputation: each layer's backward recomputes it on the micro-batch's own routes
    recomputed = trainer_(gradient_checkpointing=True)
    recomputed.setup_optimizer(1e-3, [0.9, 0.99], 1e-8, 0.0, 1.0, 0)
    replayed = dataclasses.replace(b, routed_experts=routes)
    out["replayed_grad_norm"] = recomputed.train_step(replayed, loss_fn, BUDGET).gauges["train/grad_norm"]
    out["expert_rows"] = next(
        p.shape[0] for n, p in trainer.model.named_parameters() if "local_experts" in n and "fc1" in n
    )  # gate and up: 2 x moe_intermediate_size, or this rank's slice
    out["local_experts"] = sum(1 for n, _ in trainer.model.named_parameters() if "local_experts" in n and "fc1" in n)
    # two MOPD teachers held by the trainer (split as it is), rank 1 without rows of the second: its
    # teacher runs a filler there, as Megatron's expert dispatch needs every rank's forward
    from _tp_worker import distill_loss

    student = trainer_()
    for source in ("a", "b"):
        student.add_teacher([source], str(Path(work) / "teacher"))
    student.setup_optimizer(1e-3, [0.9, 0.99], 1e-8, 0.0, 1.0, 0)
    taught = dataclasses.replace(b, sources=["a", "b", "a"][: len(b)] if out["layout"][0] == 0 else ["a"] * len(b))
    out["teacher_logprobs"] = student.teacher_logprobs(taught, BUDGET)
    out["distill_grad_norm"] = student.train_step(taught, distill_loss(0), BUDGET).gauges["train/grad_norm"]
    results = [None] * world
    dist.all_gather_object(results, out)
    if rank == 0:
        torch.save(results, Path(work) / f"{name}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from _ranks import one_thread, start_ranks

    one_thread()
    from loongsage.megatron.cpu import apply_cpu_shims

    apply_cpu_shims()
    model_dir, work, tp, ep, world = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
    pp = int(sys.argv[6]) if len(sys.argv) > 6 else 1
    etp = int(sys.argv[7]) if len(sys.argv) > 7 else None
    from _tp_worker import perturbed_copy

    from loongsage.core.placement import free_port

    perturbed_copy(model_dir, Path(work) / "teacher")
    port = str(free_port())
    start_ranks(run, args=(tp, ep, world, model_dir, work, port, pp, etp), nprocs=world)
