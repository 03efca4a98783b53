"""``share_prompts``: the torch trainer computes a prompt once for the rows that begin with it, and
its log-probs, loss and gradients are those of the plain forward."""

from __future__ import annotations

import pytest
import torch

from loongsage.algos.policy_losses import PPOClip
from loongsage.core.loss import LossPlan
from loongsage.core.tinytask.shapes import grouped_train_batch
from loongsage.core.tinytask.tiny_model import build_tiny_qwen3
from loongsage.core.trainer.lora import LoraConfig
from loongsage.core.trainer.micro_batching import planned_micro_batches
from loongsage.core.trainer.shared_prompts import PromptGroups, RowPrompts
from loongsage.core.trainer.torch_model import TorchModel
from loongsage.core.trainer.torch_trainer import TorchTrainer
from loongsage.core.types import TrainBatch

VOCAB = 200


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    build_tiny_qwen3(path, hidden_size=32, num_layers=2, heads=2, kv_heads=1, intermediate_size=64, seed=3)
    return path


def _grouped_batch(seed: int = 0, prompt_lengths=(16, 20, 16, 18), samples: int = 4) -> TrainBatch:
    """GRPO's layout: ``samples`` rows per prompt, prompts of several lengths (two of length 16 with
    different tokens), responses of 2-9 tokens; one row is multi-turn (a tool's reply inside its
    response is not trained) and one trains nothing."""
    batch = grouped_train_batch(len(prompt_lengths), samples, list(prompt_lengths), (2, 9), vocab=VOCAB, seed=seed)
    mask = batch.response_mask
    mask[1, prompt_lengths[0] + 1] = 0.0  # a tool's reply inside the response: in the rest, not trained
    mask[-1] = 0.0  # a row that trains nothing
    batch.advantages *= mask
    return batch


def _step(trainer: TorchTrainer, batch: TrainBatch, budget: int):
    # lr ~0: the step leaves the weights alone, so gradients are compared at the same point
    trainer.setup_optimizer(lr=1e-30, betas=[0.9, 0.999], eps=1e-8, weight_decay=0.0, grad_clip=1e9)
    pipeline = LossPlan(policy_loss=PPOClip(clip_low=0.2, clip_high=0.28), aggregation="token-mean")
    prepared, _ = pipeline.prepare(batch)
    metrics = trainer.train_step(prepared, pipeline.closure(), budget)
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return metrics, grads


def _repeated_prompt_tokens(batch: TrainBatch) -> int:
    """What the plain forward computes again: every row's prompt beyond each prompt's first row."""
    groups = PromptGroups.of(batch.input_ids, batch.attention_mask, batch.response_mask)
    return int(groups.prompt.sum()) - int(groups.prompt[groups.leaders].sum())


@pytest.mark.parametrize("params", [{}, {"head_chunk_tokens": 7}, {"lora": LoraConfig(rank=4)}])
def test_the_shared_forward_gives_the_plain_step(model_dir, params):
    """Log-probs and entropies at every trained token, the loss and every gradient equal the plain
    forward's (float32 here: they differ by rounding only), and the step counts what it saved."""
    batch = _grouped_batch()
    torch.manual_seed(0)  # LoRA's random A: the same in both
    plain = TorchTrainer(str(model_dir), **params)
    torch.manual_seed(0)
    shared = TorchTrainer(str(model_dir), share_prompts=True, **params)
    trained = batch.response_mask.bool()

    lp, ent = shared.logprobs(batch, token_budget=10_000)
    ref_lp, ref_ent = plain.logprobs(batch, token_budget=10_000)
    torch.testing.assert_close(lp[trained], ref_lp[trained], atol=1e-5, rtol=0)
    torch.testing.assert_close(ent[trained], ref_ent[trained], atol=1e-5, rtol=0)
    groups = PromptGroups.of(batch.input_ids, batch.attention_mask, batch.response_mask)
    before_own = torch.arange(batch.input_ids.shape[1])[None] < groups.prompt[:, None]
    assert (lp[before_own] == 0).all() and (ent[before_own] == 0).all()

    whole, g_plain = _step(plain, batch, 10_000)
    metrics, g_shared = _step(shared, batch, 10_000)
    assert abs(metrics.totals["train/loss"] - whole.totals["train/loss"]) < 1e-6
    assert set(g_shared) == set(g_plain)
    for name, grad in g_plain.items():
        torch.testing.assert_close(g_shared[name], grad, atol=1e-6, rtol=1e-4, msg=name)
    assert metrics.totals["train/shared_prompt_tokens"] == _repeated_prompt_tokens(batch) > 0
    assert "train/shared_prompt_tokens" not in whole.totals


@pytest.mark.parametrize("attention", ["sdpa", "eager"])  # a boolean mask, an additive one
def test_the_shared_forward_in_double_precision(model_dir, attention):
    """In float64 the two passes' hidden states are the plain body's (exactly, under sdpa), and the gradients
    differ by float32 rounding only (HF's RMSNorm computes in float32 whatever the model's dtype)."""
    from transformers import AutoModelForCausalLM

    from loongsage.core.trainer.shared_prompts import shared_prompt_hidden

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64, attn_implementation=attention)
    assert model.config._attn_implementation == attention
    batch = _grouped_batch(seed=1)
    groups = PromptGroups.of(batch.input_ids, batch.attention_mask, batch.response_mask)
    hidden = shared_prompt_hidden(model.model, batch.input_ids, groups)
    plain = model.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
    col = torch.arange(batch.input_ids.shape[1])[None]
    read = (col >= groups.prompt[:, None] - 1) & (col < groups.length[:, None])  # what the head reads
    # sdpa: bit for bit; eager: its softmax runs in float32 over rows of other lengths
    torch.testing.assert_close(hidden[read], plain[read], atol=0 if attention == "sdpa" else 1e-6, rtol=0)
    assert (hidden[~read] == 0).all()
    upstream = torch.randn(hidden.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    grads = []
    for out in (hidden, plain):
        model.zero_grad()
        (out[read] * upstream[read]).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    for name, grad in grads[1].items():
        assert (grads[0][name] - grad).abs().max() <= 1e-6 * grad.abs().max(), name


def test_the_shared_forward_under_compiled_layers(tmp_path_factory, caplog):
    """``compile_layers``: the two passes run every decoder layer compiled (a variant per layer and
    pass; none left to run uncompiled past dynamo's recompile limit) and give the plain step, at two
    micro-batch shapes."""
    import logging

    import torch._dynamo

    deep = tmp_path_factory.mktemp("deep")
    build_tiny_qwen3(deep, hidden_size=32, num_layers=10, heads=2, kv_heads=1, intermediate_size=64, seed=3)
    torch._dynamo.reset()
    trainer = TorchTrainer(str(deep), share_prompts=True, compile_layers=True)
    captured = torch._dynamo.utils.counters["stats"]["calls_captured"]
    with caplog.at_level(logging.WARNING):
        for seed, prompts in ((2, (16, 20, 16, 18)), (6, (24, 24, 20))):
            batch = _grouped_batch(seed=seed, prompt_lengths=prompts)
            _, g_plain = _step(TorchTrainer(str(deep)), batch, 10_000)
            _, g_shared = _step(trainer, batch, 10_000)
            assert len(g_shared) == len(g_plain)
            for name, grad in g_shared.items():
                plain = g_plain[name.replace("._orig_mod", "")]
                torch.testing.assert_close(grad, plain, atol=1e-6, rtol=1e-4, msg=name)
    assert torch._dynamo.utils.counters["stats"]["calls_captured"] > captured
    assert "recompile_limit" not in caplog.text


def test_micro_batches_keep_a_prompts_rows_together(model_dir):
    """With shared prompts the planner keeps each prompt's rows in one micro-batch and packs by
    what the two passes compute, so a budget that fits two groups' rows padded to the longest
    fits more groups; the micro-batching still gives the one-batch step."""
    batch = _grouped_batch(prompt_lengths=(12, 12, 12, 12, 12, 12), samples=4, seed=3)
    budget = 4 * 4 * 21  # two groups of 4 rows as the plain forward pads them (rows <= 21 tokens)
    plain = [rows for rows, _ in planned_micro_batches(batch, budget, group_by_length=False)]
    shared = [rows for rows, _ in planned_micro_batches(batch, budget, group_by_length=False, share_prompts=True)]
    groups = batch.group_ids.tolist()
    assert all(len({groups[i] for i in rows}) * 4 == len(rows) for rows in shared)  # whole groups
    assert len(shared) < len(plain)
    prompts = RowPrompts.of(batch.input_ids, batch.attention_mask, batch.response_mask)
    assert all(prompts.two_pass_tokens(rows) <= budget for rows in shared)
    whole, g_whole = _step(TorchTrainer(str(model_dir), share_prompts=True), batch, 10_000)
    split, g_split = _step(TorchTrainer(str(model_dir), share_prompts=True), batch, budget)
    assert abs(whole.totals["train/loss"] - split.totals["train/loss"]) < 1e-6
    assert whole.totals["train/shared_prompt_tokens"] == split.totals["train/shared_prompt_tokens"]
    for name, grad in g_whole.items():
        torch.testing.assert_close(g_split[name], grad, atol=1e-6, rtol=1e-4, msg=name)


def test_distinct_prompts_keep_the_plain_plan_and_forward(model_dir):
    """Rows that share nothing: the plan is the plain one, and each micro-batch runs the plain forward
    (no two passes, nothing counted), so the step is the plain step bit for bit."""
    batch = _grouped_batch(prompt_lengths=(5, 6, 7, 8, 9, 10), samples=1, seed=4)
    for budget in (10_000, 40):
        plain = [rows for rows, _ in planned_micro_batches(batch, budget, group_by_length=True)]
        shared = [rows for rows, _ in planned_micro_batches(batch, budget, group_by_length=True, share_prompts=True)]
        assert shared == plain
    whole, g_plain = _step(TorchTrainer(str(model_dir)), batch, 40)
    metrics, g_shared = _step(TorchTrainer(str(model_dir), share_prompts=True), batch, 40)
    assert metrics.totals["train/shared_prompt_tokens"] == 0
    assert metrics.totals["train/loss"] == whole.totals["train/loss"]
    assert all(torch.equal(g_shared[name], grad) for name, grad in g_plain.items())


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"gradient_checkpointing": True}, "share_prompts: not with gradient_checkpointing; turn one"),
        ({"batch_invariant": True, "dtype": "bfloat16"}, "batch_invariant"),
    ],
)
def test_sharing_refuses_what_it_cannot_do(model_dir, params, message):
    with pytest.raises(ValueError, match=message):
        TorchTrainer(str(model_dir), share_prompts=True, **params)


def test_a_value_model_refuses_sharing(model_dir):
    from loongsage.core.trainer.critic import TorchCritic

    with pytest.raises(ValueError, match="share_prompts: not with a value model"):
        TorchCritic(str(model_dir), share_prompts=True)


def test_attention_that_ignores_a_4d_mask_is_refused(model_dir):
    class FlexModel(TorchModel):
        def _load(self, model_path, dtype):
            model = super()._load(model_path, dtype)
            model.config._attn_implementation = "flash_attention_2"
            return model

    with pytest.raises(ValueError, match=r"share_prompts: needs attention that reads a 4D mask \(sdpa, eager\)"):
        FlexModel(
            str(model_dir),
            dtype="float32",
            device="cpu",
            fp32_lm_head=True,
            gradient_checkpointing=False,
            dp_mode="replicate",
            lora=None,
            share_prompts=True,
        )


def test_the_teacher_scores_shared_prompts_as_the_plain_forward(model_dir):
    """The embedded teacher (MOPD) with ``share_prompts``: the same log-probs, top-k and full
    log-softmax at every trained token as without."""
    from loongsage.core.trainer.teacher import EmbeddedTeacher

    batch = _grouped_batch(seed=5)
    plain = EmbeddedTeacher(str(model_dir))
    shared = EmbeddedTeacher(str(model_dir), share_prompts=True)
    groups = PromptGroups.of(batch.input_ids, batch.attention_mask, batch.response_mask)
    assert groups.tokens() + 128 < batch.input_ids.numel()  # the two passes run
    trained = batch.response_mask.bool()
    for support in ({"topk": 5}, {"full_vocab": True}):
        want, got = plain.score(batch, **support), shared.score(batch, **support)
        torch.testing.assert_close(got["logprobs"], want["logprobs"], atol=1e-5, rtol=0)
        torch.testing.assert_close(got["dist_logprobs"][trained], want["dist_logprobs"][trained], atol=1e-5, rtol=0)
        if "topk" in support:  # the same tokens, where no two of them tie within rounding
            values = want["dist_logprobs"][trained]
            apart = (values[:, :-1] - values[:, 1:]).min(-1).values > 1e-4
            assert apart.sum() > len(apart) // 2
            assert torch.equal(got["dist_ids"][trained][apart], want["dist_ids"][trained][apart])


def test_the_students_distribution_under_shared_prompts(model_dir):
    """MOPD's student side: log-probs, entropies and the log-probs on a teacher's support (top-k, or
    the whole vocabulary) at every trained token equal the plain forward's."""
    from dataclasses import replace

    from loongsage.core.model_math.logprobs import response_start

    batch = _grouped_batch(seed=7)
    support = torch.randint(0, VOCAB, (*batch.input_ids.shape, 4), generator=torch.Generator().manual_seed(0))
    plain = TorchTrainer(str(model_dir)).adapter
    shared = TorchTrainer(str(model_dir), share_prompts=True).adapter
    trained = batch.response_mask.bool()
    first = max(response_start(batch.response_mask), 1)
    groups = PromptGroups.of(batch.input_ids, batch.attention_mask, batch.response_mask)
    assert groups.tokens() + 128 < batch.input_ids.numel()  # the two passes run
    for mb in (replace(batch, teacher_dist_ids=support), batch):
        with torch.no_grad():
            want, got = plain.sequence_distribution(mb, shards=False), shared.sequence_distribution(mb, shards=False)
        for w, g in zip(want[:2], got[:2]):
            torch.testing.assert_close(g[trained], w[trained], atol=1e-5, rtol=0)
        torch.testing.assert_close(got[2][trained[:, first:]], want[2][trained[:, first:]], atol=1e-5, rtol=0)
        before_own = torch.arange(batch.input_ids.shape[1])[None] < groups.prompt[:, None]
        assert (got[0][before_own] == 0).all() and (got[2][before_own[:, first:]] == 0).all()
