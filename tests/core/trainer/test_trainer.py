"""The torch trainer backend: micro-batching never changes the loss or the gradients."""

from __future__ import annotations

import pytest
import torch

from loongsage.algos.policy_losses import PPOClip
from loongsage.core.aggregation import AGGREGATION_MODES
from loongsage.core.loss import LossPlan
from loongsage.core.model_math.logprobs import token_logprobs
from loongsage.core.tinytask.tiny_model import build_tiny_qwen3
from loongsage.core.trainer.lora import LoraConfig
from loongsage.core.trainer.micro_batching import micro_batches
from loongsage.core.trainer.torch_trainer import TorchTrainer
from loongsage.core.types import TrainBatch


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    build_tiny_qwen3(path, hidden_size=32, num_layers=1, heads=2, kv_heads=1, intermediate_size=64, seed=3)
    return path


def _batch(vocab: int, B: int = 8, seed: int = 0) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(6, 14, (B,), generator=g)
    T = int(lengths.max())
    ids = torch.randint(3, vocab, (B, T), generator=g)
    attn = (torch.arange(T)[None] < lengths[:, None]).long()
    mask = attn.float().clone()
    mask[:, :4] = 0  # prompt
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


def _grads_after_step(model_dir, batch, budget, mode):
    trainer = TorchTrainer(str(model_dir))
    # lr 0: the step leaves the weights alone, so gradients are compared at the same point
    trainer.setup_optimizer(lr=0.0 + 1e-30, betas=[0.9, 0.999], eps=1e-8, weight_decay=0.0, grad_clip=1e9)
    pipeline = LossPlan(policy_loss=PPOClip(clip_low=0.2, clip_high=0.28), aggregation=mode)
    prepared, _ = pipeline.prepare(batch)
    metrics = trainer.train_step(prepared, pipeline.closure(), budget)
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return metrics, grads


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_micro_batching_is_invariant(model_dir, mode):
    batch = _batch(vocab=200)
    whole, g_whole = _grads_after_step(model_dir, batch, budget=10_000, mode=mode)
    split, g_split = _grads_after_step(model_dir, batch, budget=14, mode=mode)  # about one row each
    assert len(list(micro_batches(batch, 14))) >= 6
    assert abs(whole.totals["train/loss"] - split.totals["train/loss"]) < 1e-5
    for name in g_whole:
        torch.testing.assert_close(g_whole[name], g_split[name], atol=1e-6, rtol=1e-4)


def test_logprobs_match_a_plain_forward(model_dir):
    trainer = TorchTrainer(str(model_dir))
    batch = _batch(vocab=200, seed=1)
    lp, ent = trainer.logprobs(batch, token_budget=20)
    with torch.no_grad():
        logits = trainer.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    ref = token_logprobs(logits, batch.input_ids)
    trained = batch.response_mask.bool()  # the head runs only where a trained token is predicted
    torch.testing.assert_close(lp[trained], ref[trained], atol=1e-5, rtol=0)
    assert (ent[trained] > 0).all()
    assert (lp[:, :4] == 0).all()  # prompt positions before the first response token


def test_save_load_restores_weights_optimizer_and_step(model_dir, tmp_path):
    batch = _batch(vocab=200, seed=2)
    pipeline = LossPlan(policy_loss=PPOClip())
    a = TorchTrainer(str(model_dir))
    a.setup_optimizer(1e-3, [0.9, 0.999], 1e-8, 0.0, 1.0)
    prepared, _ = pipeline.prepare(batch)
    a.train_step(prepared, pipeline.closure(), 10_000)
    a.save(tmp_path / "ck")
    b = TorchTrainer(str(model_dir))
    b.setup_optimizer(1e-3, [0.9, 0.999], 1e-8, 0.0, 1.0)
    b.load(tmp_path / "ck")
    assert b.steps == 1
    a.train_step(prepared, pipeline.closure(), 10_000)
    b.train_step(prepared, pipeline.closure(), 10_000)
    for (n, p), (_, q) in zip(a.model.named_parameters(), b.model.named_parameters()):
        torch.testing.assert_close(p, q, atol=0, rtol=0, msg=n)


@pytest.mark.parametrize("tied", [True, False])
def test_exported_weights_are_the_state_dict_in_order_and_in_place(model_dir, tied):
    """A weight push lists the trainer's tensors without state_dict(): the same names in the same
    order, a tied output layer under both names, and the live tensors themselves (the in-place
    transport shares their memory, so a copy here would ship stale weights)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from loongsage.core.model_math.state import state_tensors

    model = Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=50,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            tie_word_embeddings=tied,
        )
    )
    expected = model.state_dict()
    listed = list(state_tensors(model))
    assert [name for name, _ in listed] == list(expected)
    assert ("lm_head.weight" in expected) and all(t.data_ptr() == expected[n].data_ptr() for n, t in listed)
    trainer = TorchTrainer(model_path=model_dir)
    exported = dict(trainer.export_weights())
    assert list(exported) == list(trainer.model.state_dict())
    params = dict(trainer.model.named_parameters())
    assert all(exported[name] is param for name, param in params.items())


def _compiled_step_matches_eager(model_dir, budgets):
    import torch._dynamo

    batch = _batch(vocab=200)
    pipeline = LossPlan(policy_loss=PPOClip(clip_low=0.2, clip_high=0.28), aggregation="token-mean")
    prepared, _ = pipeline.prepare(batch)
    torch._dynamo.reset()  # compiled code of an earlier test would be reused, not captured again
    trainer = TorchTrainer(str(model_dir), compile_layers=True)
    trainer.setup_optimizer(lr=1e-30, betas=[0.9, 0.999], eps=1e-8, weight_decay=0.0, grad_clip=1e9)
    for budget in budgets:
        eager, g_eager = _grads_after_step(model_dir, batch, budget=budget, mode="token-mean")
        trainer.model.zero_grad()
        captured = torch._dynamo.utils.counters["stats"]["calls_captured"]
        metrics = trainer.train_step(prepared, pipeline.closure(), budget)
        assert torch._dynamo.utils.counters["stats"]["calls_captured"] > captured  # the layers ran compiled
        assert abs(metrics.totals["train/loss"] - eager.totals["train/loss"]) < 1e-6
        for name, p in trainer.model.named_parameters():
            torch.testing.assert_close(p.grad, g_eager[name.replace("._orig_mod", "")], atol=1e-6, rtol=1e-4)


def test_compiled_layers_give_the_eager_step(model_dir):
    """``compile_layers``: the decoder layer runs Inductor's kernels (dynamo captures it) and the
    step's loss and gradients are the eager step's. (On CPU Inductor compiles C++: one shape here;
    the slow test below adds the dynamic-shape recompile.)"""
    _compiled_step_matches_eager(model_dir, [10_000])


def test_compiled_bf16_layers_score_the_eager_log_probs_bit_for_bit(tmp_path_factory):
    """Inductor computes a fused bf16 layer's pointwise work in float32; by default it drops the
    roundings between the eager ops, which the engine's fused kernels reproduce (then the log-probs
    here differ by about 7e-4). ``compile_layers`` keeps them: the eager forward's bits."""
    import torch._dynamo

    path = tmp_path_factory.mktemp("bf16")
    build_tiny_qwen3(path, seed=5)
    batch = _batch(vocab=200, B=4)
    eager, _ = TorchTrainer(str(path), dtype="bfloat16").logprobs(batch, token_budget=10_000)
    torch._dynamo.reset()
    compiled, _ = TorchTrainer(str(path), dtype="bfloat16", compile_layers=True).logprobs(batch, token_budget=10_000)
    assert torch.equal(compiled, eager), (compiled - eager).abs().max()


def test_every_compiled_layer_runs_compiled(tmp_path_factory, caplog):
    """The training forward keeps no KV cache: with one, each layer's attention reads it by its
    index, which dynamo takes as a constant, so the layers' shared code is compiled again per layer
    until dynamo's recompile limit (8), past which the deeper layers run uncompiled."""
    import logging

    import torch._dynamo

    deep = tmp_path_factory.mktemp("deep")
    build_tiny_qwen3(deep, hidden_size=32, num_layers=10, heads=2, kv_heads=1, intermediate_size=64, seed=3)
    torch._dynamo.reset()
    trainer = TorchTrainer(str(deep), compile_layers=True)
    trainer.setup_optimizer(lr=1e-30, betas=[0.9, 0.999], eps=1e-8, weight_decay=0.0, grad_clip=1e9)
    pipeline = LossPlan(policy_loss=PPOClip(clip_low=0.2, clip_high=0.28), aggregation="token-mean")
    prepared, _ = pipeline.prepare(_batch(vocab=200))
    with caplog.at_level(logging.WARNING):
        trainer.train_step(prepared, pipeline.closure(), 10_000)
        trainer.logprobs(prepared, token_budget=10_000)
    assert "recompile_limit" not in caplog.text


@pytest.mark.slow
def test_compiled_layers_recompile_for_new_shapes(model_dir):
    """Micro-batches of another shape (about one row each) recompile once, with dynamic shapes, and
    still give the eager step (covered for one shape by the test above)."""
    _compiled_step_matches_eager(model_dir, [10_000, 14])


def test_the_chunked_head_gives_the_one_piece_step(model_dir):
    """``head_chunk_tokens``: the FP32 head and its log-softmax a few tokens at a time give the
    one-piece head's log-probs, entropies, loss and gradients (the embedding, tied to the head,
    included)."""
    batch = _batch(vocab=200)
    whole, g_whole = _grads_after_step(model_dir, batch, budget=10_000, mode="token-mean")
    reference = TorchTrainer(str(model_dir)).logprobs(batch, token_budget=10_000)
    for chunk in (3, 64, 10_000):
        trainer = TorchTrainer(str(model_dir), head_chunk_tokens=chunk)
        lp, ent = trainer.logprobs(batch, token_budget=10_000)
        # a GEMM of 3 rows may take another CPU kernel than one of 104: a few float32 ulps apart
        torch.testing.assert_close(lp, reference[0], atol=1e-6, rtol=2e-6)
        torch.testing.assert_close(ent, reference[1], atol=1e-6, rtol=2e-6)
        trainer.setup_optimizer(lr=1e-30, betas=[0.9, 0.999], eps=1e-8, weight_decay=0.0, grad_clip=1e9)
        pipeline = LossPlan(policy_loss=PPOClip(clip_low=0.2, clip_high=0.28), aggregation="token-mean")
        prepared, _ = pipeline.prepare(batch)
        metrics = trainer.train_step(prepared, pipeline.closure(), 10_000)
        assert abs(metrics.totals["train/loss"] - whole.totals["train/loss"]) < 1e-6
        assert set(g_whole) == {n for n, p in trainer.model.named_parameters() if p.grad is not None}
        for name, p in trainer.model.named_parameters():
            torch.testing.assert_close(p.grad, g_whole[name], atol=1e-6, rtol=1e-4)


def test_the_chunked_heads_backward_is_the_log_softmaxs():
    """The written-out backward against autograd through the one-piece head (float32)."""
    from loongsage.core.model_math.chunked_head import ChunkedHeadLogprobs

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(7, 5, generator=g, requires_grad=True)
    weight = torch.randn(11, 5, generator=g, requires_grad=True)
    targets = torch.randint(0, 11, (7,), generator=g)
    upstream = torch.randn(7, generator=g)
    lp, _ = ChunkedHeadLogprobs.apply(hidden, weight, targets, 3, False)
    (lp * upstream).sum().backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    ref = torch.log_softmax(hidden @ weight.T, -1).gather(-1, targets[:, None]).squeeze(-1)
    (ref * upstream).sum().backward()
    torch.testing.assert_close(lp, ref, atol=1e-6, rtol=0)
    torch.testing.assert_close(grads[0], hidden.grad, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grads[1], weight.grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"head_chunk_tokens": -1}, "must be an integer >= 0"),
        ({"head_chunk_tokens": True}, "must be an integer >= 0"),
        ({"head_chunk_tokens": 64, "dtype": "bfloat16", "fp32_lm_head": False}, "set fp32_lm_head: true"),
    ],
)
def test_the_chunked_head_refuses_what_it_cannot_do(model_dir, params, message):
    with pytest.raises(ValueError, match=message):
        TorchTrainer(str(model_dir), **params)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({}, r"runs bf16/fp16 models on CUDA .*dtype=float32, device=cpu"),
        ({"dtype": "bfloat16"}, r"runs bf16/fp16 models on CUDA .*device=cpu"),
        ({"compile_layers": True, "head_chunk_tokens": 64}, "not with compile_layers, head_chunk_tokens; turn one"),
        ({"lora": LoraConfig(rank=4)}, "not with lora"),
    ],
)
def test_the_batch_invariant_forward_refuses_what_it_cannot_do(model_dir, params, message):
    with pytest.raises(ValueError, match=message):
        TorchTrainer(str(model_dir), batch_invariant=True, **params)
