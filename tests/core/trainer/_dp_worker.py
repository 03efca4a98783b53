"""Loss, metrics and gradients of one optimizer step for every policy loss x aggregation case.

Shared by test_trainer_dp.py, which computes the single-process references, and run as one
subprocess per data-parallel rank::

    python _dp_worker.py RANK WORLD PORT MODEL_DIR DP_MODES BATCH_FILE OUT_FILE

A rank runs every case under each of the comma-separated ``DP_MODES`` (one trainer per mode) in a
single process group, and a few again with an idle rank 0 (``{dp_mode}+idle``); rank 0 saves
``{layout: {case_id: result}}`` to ``OUT_FILE``.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist

from loongsage.algos.corrections import M2PO, OPSM, ImportanceSampling
from loongsage.algos.kl import K3
from loongsage.algos.policy_losses import CISPO, GSPO, NLL, PPOClip
from loongsage.core.aggregation import AGGREGATION_MODES
from loongsage.core.loss import LossPlan
from loongsage.core.trainer.torch_trainer import TorchTrainer
from loongsage.core.types import TrainBatch

# Rows of the batch: lengths 11..13 make the token budgets below split it exactly (see SPLITS).
LENGTHS = (13, 11, 12, 11, 13, 12, 11, 13)
PROMPTS = (4, 3, 5, 11, 6, 4, 10, 3)  # row 3 has no response token, row 6 exactly one
VOCAB = 200

# Token budget -> micro-batch sizes it yields on the batch (any pair fits 2 x 13, no triple fits 26).
SPLITS = {"1x8": (10_000, [8]), "4x2": (26, [2, 2, 2, 2]), "8x1": (1, [1] * 8)}
DP_ROWS = ([0, 1, 2, 3, 4, 5], [6, 7])  # uneven: rank 1 pads with zero-weight passes
IDLE_ROWS = ([], [0, 1, 2, 3, 4, 5, 6, 7])  # fewer groups than ranks: rank 0 steps on an empty batch
DP_BUDGET = 26

POLICY_LOSSES = {
    "ppo_clip": lambda: PPOClip(clip_low=0.2, clip_high=0.28),
    "cispo": lambda: CISPO(),  # no lower bound, upper 0.28
    "nll": lambda: NLL(),
    "gspo": lambda: GSPO(),  # the paper's range (3e-4 / 4e-4)
}
EXTRAS = {
    "": {},
    "k3": {"kl": K3(), "kl_coef": 0.1},
    # masked IS at token level with a sequence veto: removes tokens and a whole row up front
    "is_mask": {"corrections": [ImportanceSampling(level="token", mode="mask", low=0.8, high=1.25, veto=0.5)]},
    # second-moment trust region: which tokens go is decided over the whole mini-batch
    "m2po": {"corrections": [M2PO(tau=0.01)]},
    # sequence masking from the current policy, applied per micro-batch
    "opsm": {"corrections": [OPSM(delta=1e-4)]},
}
LOSS_CASES = ("ppo_clip", "cispo", "nll", "gspo", "ppo_clip+k3", "ppo_clip+is_mask", "ppo_clip+m2po", "ppo_clip+opsm")


def pipeline_for(case: str, aggregation: str) -> LossPlan:
    loss, _, extra = case.partition("+")
    return LossPlan(policy_loss=POLICY_LOSSES[loss](), aggregation=aggregation, **EXTRAS[extra])


def _supported(case: str, aggregation: str) -> bool:
    allowed = POLICY_LOSSES[case.partition("+")[0]]().supported_aggregations
    return allowed is None or aggregation in allowed


CASES = [(case, mode) for case in LOSS_CASES for mode in AGGREGATION_MODES if _supported(case, mode)]
CASE_IDS = [f"{case}/{mode}" for case, mode in CASES]
IDLE_CASE_IDS = [next(i for i in CASE_IDS if i.startswith(f"{case}/")) for case in LOSS_CASES]  # one mode each


def build_batch(model_dir: str) -> TrainBatch:
    """8 right-padded rows of different lengths and prompt lengths, with old / rollout / reference
    log-probs scattered around the model's own so that ratios differ from 1 (and clip) both ways."""
    g = torch.Generator().manual_seed(5)
    B, T = len(LENGTHS), max(LENGTHS)
    pos = torch.arange(T)[None]
    attn = (pos < torch.tensor(LENGTHS)[:, None]).long()
    mask = (attn.bool() & (pos >= torch.tensor(PROMPTS)[:, None])).float()
    batch = TrainBatch(
        input_ids=torch.randint(3, VOCAB, (B, T), generator=g) * attn,
        attention_mask=attn,
        response_mask=mask,
        rollout_logprobs=torch.zeros(B, T),
        advantages=torch.randn(B, T, generator=g) * mask,
        rewards=torch.zeros(B),
        group_ids=torch.arange(B) // 4,
    )
    current, _ = TorchTrainer(model_dir).logprobs(batch, token_budget=10_000)
    noise = lambda scale: torch.randn(B, T, generator=g) * scale  # noqa: E731
    batch.old_logprobs = (current + noise(0.3)) * attn
    batch.rollout_logprobs = (batch.old_logprobs + noise(0.15)) * attn
    batch.rollout_logprobs[2, 7] = batch.old_logprobs[2, 7] + 1.0  # IS weight e^-1 < veto 0.5: row 2 vetoed
    batch.ref_logprobs = (current + noise(0.3)) * attn
    return batch


def _gathered(trainer: TorchTrainer) -> dict[str, torch.Tensor]:
    """Full gradients by parameter name (a collective under FSDP2: every rank calls)."""
    out = {}
    for name, p in trainer.model.named_parameters():
        g = p.grad
        if g is None:
            g = torch.zeros_like(p.full_tensor() if hasattr(p, "full_tensor") else p)
        elif hasattr(g, "full_tensor"):
            g = g.full_tensor()
        out[name] = g.detach().clone()
    return out


def run_case(
    trainer: TorchTrainer, batch: TrainBatch, case: str, aggregation: str, rows: list[int], budget: int
) -> dict[str, Any]:
    """One step (lr 0) on ``rows`` of ``batch``, prepared over the whole batch as the controller does.

    Returns the step's loss, grad norm, every ratio's numerator and denominator (as ``<name>_sum`` /
    ``<name>_count``) and the gradients, all summed over data-parallel ranks, and the corrections'
    metrics from ``prepare``.
    """
    pipeline = pipeline_for(case, aggregation)
    prepared, corrections = pipeline.prepare(batch)  # corrections and denominators: whole mini-batch
    metrics = trainer.train_step(prepared.select(rows), pipeline.closure(), budget)
    sums = {f"{k}_{part}": v for k, pair in metrics.ratios.items() for part, v in zip(("sum", "count"), pair)}
    sums["train/loss"] = metrics.totals["train/loss"]
    if dist.is_initialized():
        every: list[dict[str, float]] = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(every, sums)
        sums = {k: sum(s.get(k, 0.0) for s in every) for k in set().union(*every)}
    return {
        "loss": sums.pop("train/loss"),
        "grad_norm": metrics.gauges["train/grad_norm"],
        "metrics": sums,
        "corrections": corrections,
        "grads": _gathered(trainer),
    }


def new_trainer(model_dir: str, dp_mode: str = "fsdp2") -> TorchTrainer:
    trainer = TorchTrainer(model_dir, dp_mode=dp_mode)
    # lr 0 (no weight decay): every step leaves the weights alone, so one trainer serves every case
    trainer.setup_optimizer(0.0, [0.9, 0.999], 1e-8, 0.0, 1e9)
    return trainer


def main() -> None:
    rank, world, port, model_dir, dp_modes, batch_file, out_file = sys.argv[1:8]
    rank, world = int(rank), int(world)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    batch = torch.load(batch_file, weights_only=False)
    results = {}
    for dp_mode in dp_modes.split(","):
        trainer = new_trainer(model_dir, dp_mode)
        results[dp_mode] = {
            f"{case}/{mode}": run_case(trainer, batch, case, mode, DP_ROWS[rank], DP_BUDGET) for case, mode in CASES
        }
        results[f"{dp_mode}+idle"] = {
            case_id: run_case(trainer, batch, *case_id.split("/"), IDLE_ROWS[rank], DP_BUDGET)
            for case_id in IDLE_CASE_IDS
        }
        del trainer
    if rank == 0:
        torch.save(results, out_file)
    dist.barrier()  # both ranks are past their last collective before either tears gloo down
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # gloo's C++ threads can abort the interpreter's own teardown ("terminate called without an
    # active exception") after all the work is done and saved; leave without that teardown
    sys.stdout.flush()
    os._exit(0)
