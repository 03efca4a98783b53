"""Run by test_megatron_moe.py in a process of its own (Megatron's CPU shims patch torch.cuda):
``python _moe_worker.py WORK_DIR``; writes ``WORK_DIR/result.json``. A tiny Qwen3-MoE checkpoint
(per-expert files, as transformers saves it) on the torch and megatron trainers side by side, and
R3: the routes HF's routers chose, replayed on the Megatron model."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch

from loongsage.core.types import TrainBatch
from loongsage.megatron.trainer import MegatronTrainer

sys.path.insert(0, str(Path(__file__).parent))
from _trainer_worker import loss_fn, right_padded_batch, side_by_side  # noqa: E402  (the same rows, padded on either side)

EXPERTS, TOPK, LAYERS = 8, 2, 2


def build(path: Path) -> str:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=200,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=EXPERTS,
        num_experts_per_tok=TOPK,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        tie_word_embeddings=False,
        initializer_range=0.2,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        Qwen3MoeForCausalLM(config).save_pretrained(str(path))
    return str(path)


def hf_routes(model: torch.nn.Module, b: TrainBatch) -> list[torch.Tensor]:
    """Per row, the experts HF's routers chose for each of its real tokens: ``[tokens, layers, topk]``."""
    chosen: list[torch.Tensor] = []
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda _m, _a, out: chosen.append(out[2])) for layer in model.model.layers
    ]
    with torch.no_grad():
        model(input_ids=b.input_ids, attention_mask=b.attention_mask)
    for hook in hooks:
        hook.remove()
    rows, t = b.input_ids.shape
    per = torch.stack(chosen, 1).view(rows, t, LAYERS, TOPK)
    return [per[r][b.attention_mask[r].bool()] for r in range(rows)]


def segments_replayed(trainer: MegatronTrainer, b: TrainBatch) -> dict:
    """A row of two segments (tokens 0-9 and 10-19 of the batch's first row, each scored alone) with a
    route record per segment replays as the two segments given as rows of their own."""
    from loongsage.core.types import Segment

    ids = b.input_ids[:1]
    trained = torch.zeros(1, 20)
    trained[0, 5:10], trained[0, 13:20] = 1, 1  # a segment's first tokens are its prompt
    g = torch.Generator().manual_seed(4)
    records = [torch.randint(0, EXPERTS, (9, LAYERS, TOPK), generator=g) for _ in range(2)]
    row = TrainBatch(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        response_mask=trained,
        rollout_logprobs=torch.zeros(1, 20),
        advantages=torch.zeros(1, 20),
        rewards=torch.zeros(1),
        group_ids=torch.arange(1),
        segments=[[Segment(0, 10, "turn"), Segment(10, 20, "rewritten")]],
        routed_experts=[records],
    )
    apart = TrainBatch(
        input_ids=ids.view(2, 10),
        attention_mask=torch.ones(2, 10, dtype=torch.long),
        response_mask=trained.view(2, 10),
        rollout_logprobs=torch.zeros(2, 10),
        advantages=torch.zeros(2, 10),
        rewards=torch.zeros(2),
        group_ids=torch.arange(2),
        routed_experts=records,
    )
    joined = trainer.logprobs(row, 4096)[0].view(2, 10)
    separate = trainer.logprobs(apart, 4096)[0]
    unreplayed = trainer.logprobs(dataclasses.replace(row, routed_experts=[]), 4096)[0].view(2, 10)
    mask = trained.view(2, 10).bool()
    out = {
        "segments_replay_diff": (joined - separate)[mask].abs().max().item(),
        "segments_replay_changes": (joined - unreplayed)[mask].abs().max().item(),
    }
    try:
        trainer.logprobs(dataclasses.replace(row, routed_experts=[records[0]]), 4096)
        out["segments_one_record_error"] = ""
    except ValueError as exc:
        out["segments_one_record_error"] = str(exc)
    return out


def packed_replay(model_dir: str, hf_model: torch.nn.Module) -> dict:
    """Packed rows replay their own routes: routes other than HF's (so replay changes the result)
    give the padded rows' log-probs and first gradient."""
    rows = right_padded_batch((20, 13, 7), first_trained=5, seed=2)
    rows = dataclasses.replace(rows, routed_experts=[(r + 1) % EXPERTS for r in hf_routes(hf_model, rows)])
    mask, out = rows.response_mask.bool(), {}
    for packed in (False, True):
        trainer = MegatronTrainer(model_dir, pack_sequences=packed)
        trainer.setup_optimizer(1e-3, [0.9, 0.99], 1e-8, 0.0, 1.0, 0)
        out[packed] = trainer.logprobs(rows, 4096)[0], trainer.train_step(rows, loss_fn, 4096).gauges["train/grad_norm"]
    return {
        "packed_replay_diff": (out[False][0] - out[True][0])[mask].abs().max().item(),
        "packed_replay_grad_rel_diff": abs(out[False][1] - out[True][1]) / out[False][1],
    }


def main(work: str) -> None:
    model_dir = build(Path(work) / "moe")
    b, mask, ref, ours, lp, out = side_by_side(model_dir)
    # R3: HF's own routes replayed give Megatron's own forward; other routes change it
    routes = hf_routes(ref.model, b)
    replayed = ours.logprobs(dataclasses.replace(b, routed_experts=routes), 4096)[0]
    out["replay_own_routes_diff"] = (replayed - lp)[mask].abs().max().item()
    shifted = [(r + 1) % EXPERTS for r in routes]
    other = ours.logprobs(dataclasses.replace(b, routed_experts=shifted), 4096)[0]
    out["replay_other_routes_diff"] = (other - lp)[mask].abs().max().item()
    out["after_replay_plain_diff"] = (ours.logprobs(b, 4096)[0] - lp)[mask].abs().max().item()  # replay state cleared
    try:
        ours.logprobs(dataclasses.replace(b, routed_experts=[r[:, :1] for r in routes]), 4096)
        out["bad_routes_error"] = ""
    except ValueError as exc:
        out["bad_routes_error"] = str(exc)
    out.update(segments_replayed(ours, b))
    out.update(packed_replay(model_dir, ref.model))
    for trainer in (ref, ours):
        trainer.setup_optimizer(1e-3, [0.9, 0.99], 1e-8, 0.0, 1.0, 0)
    g_ref, g = (t.train_step(b, loss_fn, 4096).gauges["train/grad_norm"] for t in (ref, ours))
    out["grad_norm_rel_diff"] = abs(g_ref - g) / g_ref
    # a step on replayed routes trains the gates at those experts (their gradient flows)
    g_replayed = ours.train_step(dataclasses.replace(b, routed_experts=shifted), loss_fn, 4096).gauges
    out["replayed_step_grad_norm"] = g_replayed["train/grad_norm"]
    # with full-layer recomputation the backward routes again: replayed there too, the same gradients
    plain, recomputed = MegatronTrainer(model_dir), MegatronTrainer(model_dir, gradient_checkpointing=True)
    for trainer in (plain, recomputed):
        trainer.setup_optimizer(1e-3, [0.9, 0.99], 1e-8, 0.0, 1.0, 0)
    shifted_batch = dataclasses.replace(b, routed_experts=shifted)
    g_plain, g_recomputed = (
        t.train_step(shifted_batch, loss_fn, 4096).gauges["train/grad_norm"] for t in (plain, recomputed)
    )
    out["recompute_grad_norm_rel_diff"] = abs(g_plain - g_recomputed) / g_plain
    out["recompute_logprob_diff"] = (plain.logprobs(b, 4096)[0] - recomputed.logprobs(b, 4096)[0]).abs().max().item()
    ours.export_hf(Path(work) / "hf")
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(str(Path(work) / "hf"), dtype=torch.float32).state_dict()
    live = dict(ours.export_weights())
    out["export_hf_exact"] = loaded.keys() == live.keys() and all(torch.equal(loaded[n], live[n]) for n in live)
    (Path(work) / "result.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
