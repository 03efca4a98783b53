"""Run by test_distributed_optimizer.py: ``python _dist_opt_worker.py MODEL_DIR WORK_DIR``. Two gloo
ranks of the torch trainer (``dp_mode: replicate``, bfloat16 on float32 masters), with and without
the distributed optimizer, on uneven halves of one batch: three steps, a checkpoint after the
second. Rank 0 writes ``WORK_DIR/dp2.pt``."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

ROWS = ([0, 1, 2], [3])  # uneven: rank 1 runs zero-weight passes to match rank 0's micro-batches


def batch():
    from loongsage.core.types import TrainBatch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 200, (4, 12), generator=g)
    mask = torch.ones(4, 12)
    mask[:, :4] = 0
    return TrainBatch(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        response_mask=mask,
        rollout_logprobs=torch.zeros(4, 12),
        advantages=torch.randn(4, 12, generator=g) * mask,
        rewards=torch.zeros(4),
        group_ids=torch.arange(4),
    )


def loss_fn(lp, mb):
    from loongsage.core.metrics import Metrics

    return -(lp * mb.advantages * mb.response_mask).sum() / 32, Metrics()


def trainer(model_dir: str, distributed: bool):
    from loongsage.core.trainer.torch_trainer import TorchTrainer

    t = TorchTrainer(model_dir, dtype="bfloat16", dp_mode="replicate", distributed_optimizer=distributed)
    t.setup_optimizer(1e-3, [0.9, 0.99], 1e-8, 0.01, 1.0, 0)
    return t


def run(rank: int, model_dir: str, work: str, port: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=2)
    rows = batch().select(ROWS[rank])
    out: dict = {}
    for name, distributed in (("replicated", False), ("distributed", True)):
        t = trainer(model_dir, distributed)
        norms = [t.train_step(rows, loss_fn, 24).gauges["train/grad_norm"] for _ in range(2)]
        t.save(Path(work) / f"ckpt_{name}")
        norms.append(t.train_step(rows, loss_fn, 24).gauges["train/grad_norm"])
        out[name] = {"norms": norms, "weights": {n: p.detach().float().clone() for n, p in t.model.named_parameters()}}
        if distributed:
            out[name]["owned"] = sum(b.master.numel() for b in t.dist_opt.buckets)
            out[name]["total"] = sum(b.numel for b in t.dist_opt.buckets)
    from loongsage.core.trainer.torch_trainer import TorchTrainer

    try:
        TorchTrainer(model_dir, dp_mode="fsdp2", distributed_optimizer=True)
        out["fsdp2_error"] = ""
    except ValueError as exc:
        out["fsdp2_error"] = str(exc)
    if rank == 0:
        torch.save(out, Path(work) / "dp2.pt")
    dist.barrier()  # both ranks are past their last collective before either tears gloo down
    dist.destroy_process_group()
    # gloo's C++ threads can abort the interpreter's own teardown after the work is saved (see
    # _dp_worker.py): the spawned rank leaves without it, exit code 0
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    from loongsage.core.placement import free_port

    torch.multiprocessing.spawn(run, args=(sys.argv[1], sys.argv[2], str(free_port())), nprocs=2)
