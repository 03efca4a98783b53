"""The embedded teacher (MOPD): what it returns against a plain forward, and the trainer's side of
the distillation loss (student distribution on the teacher's support, micro-batch invariance)."""

from __future__ import annotations

import pytest
import torch

from loongsage.algos.divergences import JSD, FullVocabKL, TopKKL
from loongsage.algos.kl import K3
from loongsage.algos.policy_losses import PPOClip
from loongsage.core.loss import LossPlan
from loongsage.core.step.distillation import fill_teacher_tensors
from loongsage.core.tinytask.tiny_model import build_tiny_qwen3
from loongsage.core.trainer.micro_batching import micro_batches
from loongsage.core.trainer.teacher import EmbeddedTeacher
from loongsage.core.trainer.torch_trainer import TorchTrainer
from loongsage.core.types import TrainBatch


@pytest.fixture(scope="module")
def student_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("student")
    build_tiny_qwen3(path, hidden_size=32, num_layers=1, heads=2, kv_heads=1, intermediate_size=64, seed=3)
    return path


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("teacher")
    build_tiny_qwen3(path, hidden_size=32, num_layers=1, heads=2, kv_heads=1, intermediate_size=64, seed=4)
    return path


def _batch(vocab: int, B: int = 6, seed: int = 0) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(6, 13, (B,), generator=g)
    T = int(lengths.max())
    ids = torch.randint(3, vocab, (B, T), generator=g)
    attn = (torch.arange(T)[None] < lengths[:, None]).long()
    mask = attn.float().clone()
    mask[:, :4] = 0  # prompt
    mask[0, 4:] = 0  # a row with no response token at all
    return TrainBatch(
        input_ids=ids * attn,
        attention_mask=attn,
        response_mask=mask,
        rollout_logprobs=torch.zeros(B, T),
        advantages=torch.randn(B, T, generator=g) * mask,
        rewards=torch.zeros(B),
        group_ids=torch.arange(B) // 2,
        sources=["add", "sub"] * (B // 2),
    )


def _plain_logsoftmax(model_dir, batch: TrainBatch) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    return torch.nn.functional.pad(torch.log_softmax(logits[:, :-1].float(), -1), (0, 0, 1, 0))  # position t: token t


def test_scores_match_a_plain_forward(teacher_dir) -> None:
    teacher = EmbeddedTeacher(str(teacher_dir), micro_batch_tokens=20)  # several micro-batches
    batch = _batch(teacher.vocab_size)
    assert len(list(micro_batches(batch, 20))) >= 3
    ref = _plain_logsoftmax(teacher_dir, batch)
    mask = batch.response_mask.bool()
    out = teacher.score(batch)
    assert out["dist_ids"] is None and out["dist_logprobs"] is None
    token_ref = ref.gather(-1, batch.input_ids.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(out["logprobs"][mask], token_ref[mask], atol=1e-5, rtol=0)
    assert (out["logprobs"][~mask] == 0).all()  # nothing outside the response

    top = teacher.score(batch, topk=5)
    vals, ids = ref.topk(5, dim=-1)
    assert top["dist_ids"].shape == (*batch.input_ids.shape, 5) and top["dist_ids"].dtype == torch.long
    torch.testing.assert_close(top["dist_logprobs"][mask], vals[mask], atol=1e-5, rtol=0)
    assert torch.equal(top["dist_ids"][mask], ids[mask])
    assert (top["dist_ids"][~mask] == 0).all() and (top["dist_logprobs"][~mask] == 0).all()

    full = teacher.score(batch, full_vocab=True)
    assert full["dist_ids"] is None and full["dist_logprobs"].shape[-1] == teacher.vocab_size
    torch.testing.assert_close(full["dist_logprobs"][mask], ref[mask], atol=1e-5, rtol=0)


def test_bad_requests_name_what_is_allowed(teacher_dir) -> None:
    teacher = EmbeddedTeacher(str(teacher_dir))
    batch = _batch(teacher.vocab_size)
    with pytest.raises(ValueError, match="one support, not both"):
        teacher.score(batch, topk=2, full_vocab=True)
    with pytest.raises(ValueError, match=rf"topk=100000: exceeds the teacher's vocabulary \({teacher.vocab_size}"):
        teacher.score(batch, topk=100_000)
    with pytest.raises(ValueError, match=r"dtype='int8'; allowed"):
        EmbeddedTeacher(str(teacher_dir), dtype="int8")


def test_a_teacher_equal_to_the_student_gives_zero_divergence(student_dir) -> None:
    """Same weights on both sides: the teacher's log-probs are the trainer's, every divergence is 0."""
    trainer = TorchTrainer(str(student_dir))
    trainer.setup_optimizer(lr=1e-30, betas=[0.9, 0.999], eps=1e-8, weight_decay=0.0, grad_clip=1e9)
    teacher = EmbeddedTeacher(str(student_dir))
    batch = _batch(teacher.vocab_size, seed=1)
    mask = batch.response_mask.bool()
    own, _ = trainer.logprobs(batch, token_budget=10_000)
    for divergence, request in ((FullVocabKL(), {"full_vocab": True}), (TopKKL(k=7), {"topk": 7}), (K3(), {})):
        fill_teacher_tensors(batch, [(list(range(len(batch))), teacher.score(batch, **request))])
        torch.testing.assert_close(batch.teacher_logprobs[mask], own[mask], atol=1e-5, rtol=0)
        pipeline = LossPlan(policy_loss=PPOClip(), gkd_coef=1.0, divergence=divergence)
        prepared, _ = pipeline.prepare(batch)
        metrics = trainer.train_step(prepared, pipeline.closure(), 10_000)
        num, den = metrics.ratios["train/gkd"]
        assert num == pytest.approx(0.0, abs=1e-4), type(divergence).__name__
        assert den == float(mask.sum())


def _step(student_dir, batch: TrainBatch, pipeline: LossPlan, budget: int):
    trainer = TorchTrainer(str(student_dir))
    # lr ~0: the step leaves the weights alone, so gradients are compared at the same point
    trainer.setup_optimizer(lr=1e-30, betas=[0.9, 0.999], eps=1e-8, weight_decay=0.0, grad_clip=1e9)
    prepared, _ = pipeline.prepare(batch)
    metrics = trainer.train_step(prepared, pipeline.closure(), budget)
    return metrics, {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("divergence,request_", [(TopKKL(k=4), {"topk": 4}), (JSD(beta=0.3), {"full_vocab": True})])
def test_distillation_loss_is_micro_batch_invariant(student_dir, teacher_dir, divergence, request_) -> None:
    teacher = EmbeddedTeacher(str(teacher_dir))
    batch = _batch(teacher.vocab_size, seed=2)
    fill_teacher_tensors(batch, [(list(range(len(batch))), teacher.score(batch, **request_))])
    pipeline = LossPlan(policy_loss=PPOClip(), gkd_coef=0.5, divergence=divergence)
    assert pipeline.closure().needs_student_distribution
    whole, g_whole = _step(student_dir, batch, pipeline, 10_000)
    split, g_split = _step(student_dir, batch, pipeline, 14)  # about one row each
    assert whole.ratios["train/gkd"][0] > 0  # two different models: the divergence is positive
    assert whole.totals["train/loss"] == pytest.approx(split.totals["train/loss"], abs=1e-5)
    for key in ("train/gkd", "train_per_ds/add/gkd", "train_per_ds/sub/gkd"):
        assert whole.ratios[key] == pytest.approx(split.ratios[key], rel=1e-5)
    for name in g_whole:
        torch.testing.assert_close(g_whole[name], g_split[name], atol=1e-6, rtol=1e-4)
