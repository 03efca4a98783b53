"""Micro-batch plans: grouping rows by length saves padding, keeps every row once, respects the
budget, is the cheapest cut of the sorted rows, and leaves uniform batches exactly as they were;
the trainer computes the same log-probs and gradients under either plan."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from loongsage.algos.policy_losses import PPOClip
from loongsage.core.loss import LossPlan
from loongsage.core.tinytask.tiny_model import build_tiny_qwen3
from loongsage.core.trainer.micro_batching import (
    PASS_OVERHEAD_TOKENS,
    by_length,
    consecutive,
    cost,
    plan_micro_batches,
)
from loongsage.core.trainer.torch_trainer import TorchTrainer
from loongsage.core.types import TrainBatch


def _check_partition(groups, lengths, budget):
    rows = sorted(i for g in groups for i in g)
    assert rows == list(range(len(lengths)))
    for g in groups:
        assert len(g) == 1 or len(g) * max(lengths[i] for i in g) <= budget


def test_two_sources_of_different_lengths_are_trained_apart():
    # arithmetic rows (~18 tokens) and sorting rows (~45) interleaved, as a mixed batch arrives
    lengths = [18 if i % 2 else 45 for i in range(128)]
    plain = consecutive(lengths, 8192)
    assert len(plain) == 1  # the whole batch padded to 45
    groups = plan_micro_batches(lengths, 8192)
    _check_partition(groups, lengths, 8192)
    assert sorted({lengths[i] for i in g}.pop() for g in groups) == [18, 45]  # each group one length
    assert cost(groups, lengths) == 64 * 18 + 64 * 45 + 2 * PASS_OVERHEAD_TOKENS
    assert cost(groups, lengths) < 0.75 * cost(plain, lengths)


def test_uniform_lengths_keep_the_consecutive_plan_in_batch_order():
    rng = random.Random(0)
    lengths = [rng.randint(16, 20) for _ in range(64)]  # saving below 10%: not worth reordering
    assert plan_micro_batches(lengths, 8192) == consecutive(lengths, 8192) == [list(range(64))]
    assert plan_micro_batches(lengths, 200) == consecutive(lengths, 200)
    assert plan_micro_batches(lengths, 8192, group_by_length=False) == [list(range(64))]


@pytest.mark.parametrize("seed", range(20))
def test_grouping_is_the_cheapest_cut_of_the_sorted_rows(seed):
    """Exact when the budget splits no segment (then a segment costs rows x longest + one pass)."""
    rng = random.Random(seed)
    n = rng.randint(1, 40)
    lengths = [rng.choice([2, 3, 5, 8, 20, 30, 64]) for _ in range(n)]
    for small in (64, 256):  # segments split by the budget: a valid partition
        _check_partition(by_length(lengths, small), lengths, small)
    budget = 100_000  # no segment needs splitting: the plan is exactly the cheapest
    groups = by_length(lengths, budget)
    _check_partition(groups, lengths, budget)
    # brute force: every way to cut the sorted order between distinct lengths, each segment then
    # split by the budget as the planner does
    order = sorted(range(n), key=lambda i: lengths[i])
    bounds = [p for p in range(1, n) if lengths[order[p]] != lengths[order[p - 1]]]
    best = None
    for k in range(len(bounds) + 1):
        for cuts in itertools.combinations(bounds, k):
            edges = [0, *cuts, n]
            plan = []
            for a, b in zip(edges, edges[1:]):
                seg = order[a:b]
                plan += [[seg[j] for j in g] for g in consecutive([lengths[i] for i in seg], budget)]
            c = cost(plan, lengths)
            best = c if best is None else min(best, c)
    assert cost(groups, lengths) <= best


def test_a_row_longer_than_the_budget_forms_its_own_micro_batch():
    lengths = [5, 300, 5, 5]
    for groups in (consecutive(lengths, 100), by_length(lengths, 100)):
        _check_partition(groups, lengths, 100)
        assert [1] in groups


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    build_tiny_qwen3(path, hidden_size=32, num_layers=1, heads=2, kv_heads=1, intermediate_size=64, seed=3)
    return path


def _mixed_batch(vocab: int, seed: int = 0) -> TrainBatch:
    """Short and long rows interleaved (two sources), right-padded."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(
        [
            6 + int(torch.randint(0, 3, (1,), generator=g))
            if i % 2
            else 30 + int(torch.randint(0, 4, (1,), generator=g))
            for i in range(16)
        ]
    )
    B, T = len(lengths), int(lengths.max())
    ids = torch.randint(3, vocab, (B, T), generator=g)
    attn = (torch.arange(T)[None] < lengths[:, None]).long()
    mask = attn.float().clone()
    mask[:, :4] = 0
    return TrainBatch(
        input_ids=ids * attn,
        attention_mask=attn,
        response_mask=mask,
        rollout_logprobs=torch.zeros(B, T),
        advantages=torch.randn(B, T, generator=g) * mask,
        rewards=torch.zeros(B),
        group_ids=torch.arange(B) // 4,
        old_logprobs=(torch.randn(B, T, generator=g) * 0.1 - 2.0) * mask,
    )


def test_the_trainer_computes_the_same_under_either_plan(model_dir):
    batch = _mixed_batch(vocab=200)
    lengths = batch.attention_mask.sum(-1).tolist()
    assert len(plan_micro_batches(lengths, 10_000)) > 1  # grouped: the case is real
    out = {}
    for grouped in (False, True):
        trainer = TorchTrainer(str(model_dir), group_by_length=grouped)
        lp, ent = trainer.logprobs(batch, token_budget=10_000)
        trainer.setup_optimizer(lr=1e-30, betas=[0.9, 0.999], eps=1e-8, weight_decay=0.0, grad_clip=1e9)
        pipeline = LossPlan(policy_loss=PPOClip(clip_low=0.2, clip_high=0.28), aggregation="token-mean")
        prepared, _ = pipeline.prepare(batch)
        metrics = trainer.train_step(prepared, pipeline.closure(), 10_000)
        grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
        out[grouped] = (lp, ent, metrics.totals["train/loss"], grads)
    (lp0, ent0, loss0, g0), (lp1, ent1, loss1, g1) = out[False], out[True]
    trained = batch.response_mask.bool()
    torch.testing.assert_close(lp1[trained], lp0[trained], atol=1e-5, rtol=0)
    torch.testing.assert_close(ent1[trained], ent0[trained], atol=1e-5, rtol=0)
    assert abs(loss1 - loss0) < 1e-5
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], atol=1e-6, rtol=1e-4)
