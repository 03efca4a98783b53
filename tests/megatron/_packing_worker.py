"""Run by test_megatron_packing.py: ``python _packing_worker.py MODEL_DIR WORK_DIR TP PP``. ``TP x PP``
gloo processes (Megatron's CPU shims in each) run one ``megatron`` replica with its rows packed and
one with them padded, on rows of different lengths padded on the right: log-probs, entropies, the
first step's gradient norm and the log-probs after it. Rank 0 writes ``WORK_DIR/packing_tp{TP}_pp{PP}.pt``."""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path

import torch

BUDGET = 48  # tokens per micro-batch: two micro-batches of two rows


def batch():
    """Rows of 20, 13, 7 and 17 tokens, padded on the right."""
    from _trainer_worker import right_padded_batch

    return right_padded_batch((20, 13, 7, 17), first_trained=5, seed=1)


def run(rank: int, tp: int, pp: int, model_dir: str, work: str, port: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=tp * pp)
    from _trainer_worker import loss_fn

    from loongsage.megatron.trainer import MegatronTrainer

    b = batch()
    out: dict = {}
    for packed in (False, True):
        trainer = MegatronTrainer(model_dir, tensor_parallel=tp, pipeline_parallel=pp, pack_sequences=packed)
        side = {"layout": trainer.data_parallel}
        side["logprobs"], side["entropy"] = trainer.logprobs(b, BUDGET)
        trainer.setup_optimizer(1e-3, [0.9, 0.99], 1e-8, 0.0, 1.0, 0)
        side["grad_norm"] = trainer.train_step(b, loss_fn, BUDGET).gauges["train/grad_norm"]
        side["after"] = trainer.logprobs(b, BUDGET)[0]
        if packed and tp * pp == 1:  # rows padded on the left are refused in one line
            left = b.attention_mask.flip(1)
            try:
                trainer.logprobs(replace(b, attention_mask=left), BUDGET)
            except ValueError as exc:
                side["left_refused"] = str(exc)
        out["packed" if packed else "padded"] = side
    outs = [None] * (tp * pp)
    dist.all_gather_object(outs, out)
    if rank == 0:  # the leaders' answers (the last stage computes them)
        leader = next(o for o in outs if o["padded"]["layout"][2])
        torch.save({"mask": b.response_mask.bool(), **leader}, Path(work) / f"packing_tp{tp}_pp{pp}.pt")
    dist.barrier()
    dist.destroy_process_group()


sys.path.insert(0, str(Path(__file__).parent))

if __name__ == "__main__":
    from _ranks import one_thread, start_ranks

    one_thread()
    from loongsage.megatron.cpu import apply_cpu_shims

    apply_cpu_shims()
    model_dir, work, tp, pp = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    from loongsage.core.placement import free_port

    port = str(free_port())
    start_ranks(run, args=(tp, pp, model_dir, work, port), nprocs=tp * pp)
