"""Run by test_megatron_trainer.py in a process of its own (Megatron's CPU shims patch torch.cuda):
``python _trainer_worker.py MODEL_DIR WORK_DIR``; writes ``WORK_DIR/result.json``. The torch and
megatron trainers side by side on the same checkpoint and batch (rows padded on either side)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from loongsage.core.metrics import Metrics
from loongsage.core.trainer.torch_trainer import TorchTrainer
from loongsage.core.types import TrainBatch
from loongsage.megatron.trainer import MegatronTrainer


def batch() -> TrainBatch:
    ids = torch.randint(2, 100, (3, 20), generator=torch.Generator().manual_seed(0))
    attention = torch.ones_like(ids)
    attention[1, 15:] = 0  # padded on the right
    attention[2, :4] = 0  # and on the left
    response = torch.zeros(ids.shape)
    response[:, 8:] = 1
    response *= attention
    return TrainBatch(
        input_ids=ids,
        attention_mask=attention,
        response_mask=response,
        rollout_logprobs=torch.zeros(ids.shape),
        advantages=torch.ones(ids.shape) * 0.5,
        rewards=torch.zeros(3),
        group_ids=torch.arange(3),
    )


def right_padded_batch(lengths: tuple[int, ...], *, first_trained: int, seed: int) -> TrainBatch:
    """Rows of ``lengths`` random tokens padded on the right (as rollouts are), trained from
    position ``first_trained``, with advantages spread over [-1, 1]."""
    rows, width = len(lengths), max(lengths)
    ids = torch.randint(2, 100, (rows, width), generator=torch.Generator().manual_seed(seed))
    attention = torch.ones_like(ids)
    for row, length in enumerate(lengths):
        attention[row, length:] = 0
    response = torch.zeros(ids.shape)
    response[:, first_trained:] = 1
    response *= attention
    return TrainBatch(
        input_ids=ids,
        attention_mask=attention,
        response_mask=response,
        rollout_logprobs=torch.zeros(ids.shape),
        advantages=torch.linspace(-1, 1, rows * width).view(rows, width),
        rewards=torch.zeros(rows),
        group_ids=torch.arange(rows),
    )


def loss_fn(lp: torch.Tensor, mb: TrainBatch) -> tuple[torch.Tensor, Metrics]:
    return -(lp * mb.advantages * mb.response_mask).sum() / 100, Metrics()


def side_by_side(model_dir: str) -> tuple[TrainBatch, torch.Tensor, TorchTrainer, MegatronTrainer, torch.Tensor, dict]:
    """Both trainers on one checkpoint and :func:`batch`: the batch, its trained positions, the two
    trainers, Megatron's log-probs, and the comparison of log-probs, entropies and exports."""
    b, mask = batch(), batch().response_mask.bool()
    ref, ours = TorchTrainer(model_dir), MegatronTrainer(model_dir)
    out: dict[str, float | bool] = {}
    (lp_ref, ent_ref), (lp, ent) = ref.logprobs(b, 4096), ours.logprobs(b, 4096)
    out["logprob_diff"] = (lp_ref - lp)[mask].abs().max().item()
    out["entropy_diff"] = (ent_ref - ent)[mask].abs().max().item()
    exported, hf = dict(ours.export_weights()), ref.model.state_dict()
    out["export_names_equal"] = exported.keys() == hf.keys()
    out["export_exact"] = out["export_names_equal"] and all(torch.equal(exported[n], hf[n]) for n in hf)
    return b, mask, ref, ours, lp, out


def main(model_dir: str, work: str) -> None:
    b, mask, ref, ours, _, out = side_by_side(model_dir)
    for trainer in (ref, ours):
        trainer.setup_optimizer(1e-3, [0.9, 0.99], 1e-8, 0.0, 1.0, 0)
    g_ref, g = (t.train_step(b, loss_fn, 4096).gauges["train/grad_norm"] for t in (ref, ours))
    out["grad_norm_rel_diff"] = abs(g_ref - g) / g_ref
    after_ref, after = ref.logprobs(b, 4096)[0], ours.logprobs(b, 4096)[0]
    out["logprob_diff_after_step"] = (after_ref - after)[mask].abs().max().item()
    ours.save(Path(work) / "checkpoint")
    resumed = MegatronTrainer(model_dir)
    resumed.setup_optimizer(1e-3, [0.9, 0.99], 1e-8, 0.0, 1.0, 0)
    resumed.load(Path(work) / "checkpoint")
    out["resumed_exact"] = torch.equal(resumed.logprobs(b, 4096)[0], after)
    g1, g2 = (t.train_step(b, loss_fn, 4096).gauges["train/grad_norm"] for t in (ours, resumed))
    out["resumed_step_exact"] = g1 == g2  # the optimizer state came back too
    ours.export_hf(Path(work) / "hf")
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(str(Path(work) / "hf"), dtype=torch.float32).state_dict()
    live = dict(ours.export_weights())
    out["export_hf_exact"] = loaded.keys() == live.keys() and all(torch.equal(loaded[n], live[n]) for n in live)
    # bfloat16 with the FP32 head on both sides: the same rounding up to kernel order
    half_ref = TorchTrainer(model_dir, dtype="bfloat16")
    half = MegatronTrainer(model_dir, dtype="bfloat16")
    out["bf16_head_float32"] = half.adapter.logits(b.input_ids, b.attention_mask).dtype == torch.float32
    out["bf16_logprob_mean_diff"] = (
        (half_ref.logprobs(b, 4096)[0] - half.logprobs(b, 4096)[0])[mask].abs().mean().item()
    )
    # the teachers: the megatron one scores as the embedded one (log-probs, top-k, full log-softmax)
    from loongsage.core.trainer.teacher import EmbeddedTeacher
    from loongsage.megatron.teacher import MegatronTeacher

    t_ref, t = EmbeddedTeacher(model_dir), MegatronTeacher(model_dir)
    k_ref, k = t_ref.score(b, topk=3), t.score(b, topk=3)
    full_ref, full = t_ref.score(b, full_vocab=True), t.score(b, full_vocab=True)
    out["teacher_logprob_diff"] = (k_ref["logprobs"] - k["logprobs"]).abs().max().item()
    out["teacher_topk_ids_equal"] = torch.equal(k_ref["dist_ids"], k["dist_ids"])
    out["teacher_topk_diff"] = (k_ref["dist_logprobs"] - k["dist_logprobs"]).abs().max().item()
    out["teacher_full_diff"] = (full_ref["dist_logprobs"] - full["dist_logprobs"]).abs().max().item()
    out["teacher_frozen"] = not any(p.requires_grad for p in t.model.parameters())
    (Path(work) / "result.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
