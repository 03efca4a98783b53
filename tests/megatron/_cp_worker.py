"""Run by test_megatron_cp.py: ``python _cp_worker.py MODEL_DIR WORK_DIR CP [TP [PP]]``. ``CP x TP x
PP`` gloo processes (Megatron's CPU shims in each) run one ``megatron`` trainer replica whose every
sequence is split over ``CP`` context-parallel ranks (and its layers ``TP`` ways, in ``PP`` stages):
log-probs and entropies, a step, the log-probs after it, the exported weights, a checkpoint and its
resume. Rank 0 writes ``WORK_DIR/cp{CP}_tp{TP}_pp{PP}.pt``."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

BUDGET = 64  # tokens per micro-batch: two micro-batches


def batch():
    """Rows of 19, 16 and 13 tokens, padded on the right (as rollouts are)."""
    from _trainer_worker import right_padded_batch

    return right_padded_batch((19, 16, 13), first_trained=7, seed=0)


def run(rank: int, cp: int, tp: int, pp: int, model_dir: str, work: str, port: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=cp * tp * pp)  # as the trainer worker does
    sys.path.insert(0, str(Path(__file__).parent))
    from _trainer_worker import loss_fn

    from loongsage.megatron.trainer import MegatronTrainer

    def trainer_() -> MegatronTrainer:
        t = MegatronTrainer(model_dir, context_parallel=cp, tensor_parallel=tp, pipeline_parallel=pp)
        t.setup_optimizer(1e-3, [0.9, 0.99], 1e-8, 0.0, 1.0, 0)
        return t

    b = batch()
    trainer = trainer_()
    out: dict = {"layout": trainer.data_parallel}
    out["logprobs"], out["entropy"] = trainer.logprobs(b, BUDGET)
    out["grad_norm"] = trainer.train_step(b, loss_fn, BUDGET).gauges["train/grad_norm"]
    out["after"] = trainer.logprobs(b, BUDGET)[0]
    out["exported"] = {n: t.clone() for n, t in trainer.export_weights()}
    name = f"cp{cp}_tp{tp}_pp{pp}"
    trainer.save(Path(work) / f"ckpt_{name}")
    dist.barrier()
    resumed = trainer_()
    resumed.load(Path(work) / f"ckpt_{name}")
    out["resumed_exact"] = torch.equal(resumed.logprobs(b, BUDGET)[0], out["after"])
    g1, g2 = (t.train_step(b, loss_fn, BUDGET).gauges["train/grad_norm"] for t in (trainer, resumed))
    out["resumed_step_exact"] = g1 == g2
    outs = [None] * (cp * tp * pp)
    dist.all_gather_object(outs, out)
    if rank == 0:
        leader = next(o for o in outs if o["layout"][2])
        torch.save(
            {**leader, "exported": out["exported"], "layouts": [o["layout"] for o in outs]}, Path(work) / f"{name}.pt"
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from _ranks import one_thread, start_ranks

    one_thread()
    from loongsage.megatron.cpu import apply_cpu_shims

    apply_cpu_shims()
    model_dir, work, cp = sys.argv[1], sys.argv[2], int(sys.argv[3])
    tp = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    pp = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    from loongsage.core.placement import free_port

    port = str(free_port())
    start_ranks(run, args=(cp, tp, pp, model_dir, work, port), nprocs=cp * tp * pp)
