"""MOPD's distribution divergences (top-k KL, full-vocab KL, JSD): hand values, float64 formulas,
properties, masking through the loss closure, and gradients that reach the student only."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loongsage.algos.divergences import JSD, FullVocabKL, TopKJSD, TopKKL, full_vocab_kl, jsd, topk_kl
from loongsage.algos.kl import K2, K3
from loongsage.algos.policy_losses import PPOClip
from loongsage.core.loss import LossPlan
from loongsage.core.step.distillation import shape_advantages
from loongsage.core.types import TrainBatch


def _ref_kl(a: list[float], b: list[float]) -> float:
    """sum a log(a / b) in float64 over plain probabilities."""
    return sum(x * math.log(x / y) for x, y in zip(a, b, strict=True) if x > 0)


def _ref_jsd(p: list[float], q: list[float], beta: float) -> float:
    m = [beta * x + (1 - beta) * y for x, y in zip(p, q, strict=True)]
    return beta * _ref_kl(p, m) + (1 - beta) * _ref_kl(q, m)


def _renorm(x: list[float]) -> list[float]:
    s = sum(x)
    return [v / s for v in x]


def _logs(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64).log()


# ----------------------------------------------------------------------------- hand values
def test_hand_values() -> None:
    q, p = [0.5, 0.5], [0.25, 0.75]
    expected = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert full_vocab_kl(_logs(q), _logs(p)).item() == pytest.approx(expected, rel=1e-12)
    # identical one-hot-like distributions with disjoint mass: JSD reaches its bound log 2 at beta 0.5
    far = jsd(torch.tensor([0.0, -1e4]), torch.tensor([-1e4, 0.0]), beta=0.5)
    assert far.item() == pytest.approx(math.log(2), rel=1e-6)
    # top-k: both renormalised over the teacher's two tokens (full distributions had a third token)
    q3, p3 = [0.2, 0.3, 0.5], [0.6, 0.2, 0.2]
    got = topk_kl(_logs(q3[:2]), _logs(p3[:2])).item()
    assert got == pytest.approx(_ref_kl(_renorm(q3[:2]), _renorm(p3[:2])), rel=1e-12)
    # sampled-token forms (k2, k3) serve MOPD with the teacher's log-prob of the student's token
    x = math.log(2.0)
    assert K2()(torch.tensor([x]), torch.tensor([0.0])).item() == pytest.approx(x * x / 2)
    assert K3()(torch.tensor([x]), torch.tensor([0.0])).item() == pytest.approx(0.5 - 1 + x)


def test_matches_float64_formulas() -> None:
    g = torch.Generator().manual_seed(3)
    student = torch.log_softmax(3 * torch.randn(4, 5, 11, generator=g), -1)
    teacher = torch.log_softmax(3 * torch.randn(4, 5, 11, generator=g), -1)
    topk_lp, topk_ids = teacher.topk(4, dim=-1)
    student_topk = student.gather(-1, topk_ids)
    got_full = full_vocab_kl(student, teacher)
    got_jsd = jsd(student, teacher, beta=0.3)
    got_topk = topk_kl(student_topk, topk_lp)
    got_topk_jsd = jsd(student_topk, topk_lp, beta=0.3, renormalise=True)
    assert got_full.dtype == torch.float32 and got_full.shape == (4, 5)
    for b in range(4):
        for t in range(5):
            q, p = student[b, t].double().exp().tolist(), teacher[b, t].double().exp().tolist()
            qk, pk = student_topk[b, t].double().exp().tolist(), topk_lp[b, t].double().exp().tolist()
            assert got_full[b, t].item() == pytest.approx(_ref_kl(q, p), rel=1e-4, abs=1e-6)
            assert got_jsd[b, t].item() == pytest.approx(_ref_jsd(p, q, 0.3), rel=1e-4, abs=1e-6)
            assert got_topk[b, t].item() == pytest.approx(_ref_kl(_renorm(qk), _renorm(pk)), rel=1e-4, abs=1e-6)
            assert got_topk_jsd[b, t].item() == pytest.approx(
                _ref_jsd(_renorm(pk), _renorm(qk), 0.3), rel=1e-4, abs=1e-6
            )


def test_topk_over_the_whole_vocabulary_is_the_full_kl() -> None:
    g = torch.Generator().manual_seed(5)
    student = torch.log_softmax(torch.randn(3, 7, generator=g), -1)
    teacher = torch.log_softmax(torch.randn(3, 7, generator=g), -1)
    vals, ids = teacher.topk(7, dim=-1)
    torch.testing.assert_close(topk_kl(student.gather(-1, ids), vals), full_vocab_kl(student, teacher))
    torch.testing.assert_close(jsd(student.gather(-1, ids), vals, renormalise=True), jsd(student, teacher))


@settings(deadline=None, max_examples=50)
@given(
    a=st.lists(st.floats(-8, 8, allow_nan=False, width=32), min_size=14, max_size=14),
    b=st.lists(st.floats(-8, 8, allow_nan=False, width=32), min_size=14, max_size=14),
    cut=st.integers(1, 6),
    beta=st.floats(0.05, 0.95),
)
def test_parts_of_the_vocabulary_add_up_to_the_divergence(a, b, cut, beta) -> None:
    """A vocabulary split over tensor-parallel ranks: each rank's ``partial`` over its shard of the
    log-softmax, summed, is the divergence (a shard's sum may be negative: it is not clamped)."""
    q = torch.log_softmax(torch.tensor(a, dtype=torch.float64).view(2, 7), -1)
    p = torch.log_softmax(torch.tensor(b, dtype=torch.float64).view(2, 7), -1)
    for entry in (FullVocabKL(), JSD(beta=beta)):
        parts = entry.partial(q[:, :cut], p[:, :cut]) + entry.partial(q[:, cut:], p[:, cut:])
        torch.testing.assert_close(parts.clamp(min=0.0), entry(q, p), rtol=1e-9, atol=1e-12)
    assert TopKKL.__dict__.get("partial") is None  # renormalised over the top-k: no parts
    with pytest.raises(ValueError, match="part=True sums a part"):
        jsd(q, p, renormalise=True, part=True)


# ----------------------------------------------------------------------------- properties
_logits = st.lists(st.floats(-8, 8, allow_nan=False, width=32), min_size=12, max_size=12)


@settings(deadline=None, max_examples=100)
@given(a=_logits, b=_logits, beta=st.floats(0.01, 0.99))
def test_nonnegative_zero_on_equal_and_jsd_bounded(a, b, beta) -> None:
    q = torch.log_softmax(torch.tensor(a).view(2, 6), -1)
    p = torch.log_softmax(torch.tensor(b).view(2, 6), -1)
    for fn in (full_vocab_kl, topk_kl, lambda x, y: jsd(x, y, beta=beta)):
        assert (fn(q, p) >= 0).all()
        assert torch.allclose(fn(q, q), torch.zeros(2), atol=1e-6)
    bound = -beta * math.log(beta) - (1 - beta) * math.log1p(-beta)  # binary entropy H(beta) <= log 2
    assert (jsd(q, p, beta=beta) <= bound + 1e-5).all()
    assert bound <= math.log(2) + 1e-12


@settings(deadline=None, max_examples=50)
@given(a=_logits, shift=st.floats(-20, 20, allow_nan=False))
def test_topk_forms_ignore_the_mass_outside_the_support(a, shift) -> None:
    """Renormalisation: shifting all k log-probs by a constant (a different tail mass) changes nothing."""
    q = torch.tensor(a[:6])
    p = torch.tensor(a[6:])
    torch.testing.assert_close(topk_kl(q + shift, p - shift), topk_kl(q, p), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(jsd(q + shift, p, renormalise=True), jsd(q, p, renormalise=True), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("chunk", [1 << 26, 10])  # one chunk, and chunks of one position
def test_closed_form_gradients_match_autograd_through_the_formulas(monkeypatch, chunk) -> None:
    """The divergences' own backward (closed form, chunk by chunk) against autograd through the plain
    float64 formulas, on log-softmax inputs with some tokens of probability 0."""
    import loongsage.algos.divergences as divergences

    monkeypatch.setattr(divergences, "_CHUNK_ELEMENTS", chunk)
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 3, 9, generator=g, dtype=torch.float64)
    logits[0, 1, :2] = -1e4  # tokens the student puts no mass on (e^-1e4 is 0)
    teacher = torch.log_softmax(torch.randn(2, 3, 9, generator=g, dtype=torch.float64), -1)
    weights = torch.rand(2, 3, generator=g, dtype=torch.float64)

    def plain_kl(q, p):
        a = q.exp()
        return torch.where(a > 0, a * (q - p), torch.zeros_like(a)).sum(-1)

    def plain_jsd(q, p, beta):
        log_m = torch.logsumexp(torch.stack([p + math.log(beta), q + math.log1p(-beta)]), dim=0)
        return beta * plain_kl(p, log_m) + (1 - beta) * plain_kl(q, log_m)

    cases = [
        (lambda q: full_vocab_kl(q, teacher, part=True), lambda q: plain_kl(q, teacher)),
        (lambda q: jsd(q, teacher, beta=0.3, part=True), lambda q: plain_jsd(q, teacher, 0.3)),
        (
            lambda q: topk_kl(q[..., :4], teacher[..., :4]),
            lambda q: plain_kl(*(x - torch.logsumexp(x, -1, keepdim=True) for x in (q[..., :4], teacher[..., :4]))),
        ),
    ]
    for ours, plain in cases:
        grads = []
        for fn in (ours, plain):
            x = logits.clone().requires_grad_()
            value = fn(torch.log_softmax(x, -1))
            (value * weights).sum().backward()
            grads.append((value.detach(), x.grad))
        torch.testing.assert_close(grads[0][0], grads[1][0])
        torch.testing.assert_close(grads[0][1], grads[1][1])
    # a token of log-prob -inf (a masked vocabulary row) gets a zero gradient, not autograd's NaN
    x = logits.clone()
    x[0, 1, :2] = -float("inf")
    x.requires_grad_()
    jsd(torch.log_softmax(x, -1), teacher, beta=0.3).sum().backward()
    assert torch.isfinite(x.grad).all()


def test_gradient_reaches_the_student_only() -> None:
    g = torch.Generator().manual_seed(9)
    s_logits = torch.randn(2, 3, 8, generator=g, requires_grad=True)
    t_logits = torch.randn(2, 3, 8, generator=g, requires_grad=True)
    for fn in (full_vocab_kl, topk_kl, jsd):
        s_logits.grad = t_logits.grad = None
        fn(torch.log_softmax(s_logits, -1), torch.log_softmax(t_logits, -1)).sum().backward()
        assert s_logits.grad is not None and s_logits.grad.abs().sum() > 0
        assert t_logits.grad is None
    # full-vocab reverse KL: d/dz_v sum_v Q (log Q - log P) = Q_v (log Q_v - log P_v - KL)
    s = torch.randn(6, generator=g, requires_grad=True)
    p = torch.log_softmax(torch.randn(6, generator=g), -1)
    full_vocab_kl(torch.log_softmax(s, -1), p).backward()
    q = torch.log_softmax(s.detach().double(), -1)
    kl = (q.exp() * (q - p.double())).sum()
    torch.testing.assert_close(s.grad.double(), q.exp() * (q - p.double() - kl), atol=1e-6, rtol=1e-5)


def test_entries_declare_what_they_consume_and_check_params() -> None:
    assert (TopKKL.consumes, FullVocabKL.consumes, JSD.consumes, TopKJSD.consumes) == (
        "topk",
        "full_vocab",
        "full_vocab",
        "topk",
    )
    assert TopKKL(k=4).k == 4 and TopKJSD(k=2).k == 2
    for bad, match in (
        (lambda: TopKKL(k=0), r"topk_kl\.k=0"),
        (lambda: JSD(beta=1.0), r"jsd\.beta=1\.0"),
        (lambda: TopKJSD(beta=0.0), r"topk_jsd\.beta=0\.0"),
    ):
        with pytest.raises(ValueError, match=match):
            bad()
    with pytest.raises(ValueError, match="shapes must match"):
        full_vocab_kl(torch.zeros(2, 3), torch.zeros(2, 4))


# ----------------------------------------------------------------------------- through the loss closure
def _distill_batch(seed: int, *, garbage: float = 0.0) -> tuple[TrainBatch, torch.Tensor]:
    """Two rows over T=5 with responses at positions 2..4 (row 1: 2..3); teacher full-vocab log-probs."""
    g = torch.Generator().manual_seed(seed)
    B, T, V = 2, 5, 6
    mask = torch.tensor([[0, 0, 1, 1, 1], [0, 0, 1, 1, 0]], dtype=torch.float32)
    teacher = torch.log_softmax(torch.randn(B, T, V, generator=g), -1)
    teacher = torch.where(mask.unsqueeze(-1) != 0, teacher, torch.full_like(teacher, garbage))
    batch = TrainBatch(
        input_ids=torch.randint(0, V, (B, T), generator=g),
        attention_mask=torch.ones(B, T, dtype=torch.long),
        response_mask=mask,
        rollout_logprobs=torch.zeros(B, T),
        advantages=torch.zeros(B, T),
        rewards=torch.zeros(B),
        group_ids=torch.arange(B),
        loss_weights=mask / mask.sum(),
        teacher_logprobs=torch.zeros(B, T),
        teacher_dist_logprobs=teacher,
        sources=["add", "sub"],
    )
    return batch, torch.log_softmax(torch.randn(B, T - 1, V, generator=g), -1)  # student on positions 1..4


@pytest.mark.parametrize("garbage", [0.0, -3.0, 50.0])
def test_masked_positions_contribute_nothing(garbage) -> None:
    pipe = LossPlan(policy_loss=PPOClip(), gkd_coef=1.0, divergence=JSD()).closure()
    assert pipe.needs_student_distribution and pipe.teacher_support == (0, True)
    clean, student = _distill_batch(0)
    dirty, _ = _distill_batch(0, garbage=garbage)
    lp = torch.zeros(2, 5)
    loss_clean, m_clean = pipe(lp, clean, student_dist=student)
    loss_dirty, m_dirty = pipe(lp, dirty, student_dist=student)
    assert loss_dirty.item() == pytest.approx(loss_clean.item(), rel=1e-6)
    # gkd_coef = 1: the loss is exactly the token-mean of the divergence over the five response tokens
    per_token = jsd(student, clean.teacher_dist_logprobs[:, 1:])
    expected = float((per_token * clean.response_mask[:, 1:]).sum() / 5)
    assert loss_clean.item() == pytest.approx(expected, rel=1e-5)
    sums = m_clean.ratios
    assert sums["train/gkd"][1] == 5.0 and sums["train_per_ds/sub/gkd"][1] == 2.0
    assert sums["train_per_ds/add/gkd"][0] + sums["train_per_ds/sub/gkd"][0] == pytest.approx(
        sums["train/gkd"][0], rel=1e-6
    )


def test_gkd_mix_and_pg_shaping() -> None:
    batch, student = _distill_batch(1)
    lp = torch.zeros(2, 5, requires_grad=True)
    batch.advantages = batch.response_mask.clone()
    rl_only = LossPlan(policy_loss=PPOClip()).closure()
    gkd_only = LossPlan(policy_loss=PPOClip(), gkd_coef=1.0, divergence=FullVocabKL()).closure()
    mixed = LossPlan(policy_loss=PPOClip(), gkd_coef=0.25, divergence=FullVocabKL()).closure()
    rl = rl_only(lp, batch)[0].item()
    gkd = gkd_only(lp, batch, student_dist=student)[0].item()
    assert mixed(lp, batch, student_dist=student)[0].item() == pytest.approx(0.75 * rl + 0.25 * gkd, rel=1e-6)
    # PG branch: A - pg_coef * sg(log pi_s - log pi_t) on response tokens only
    batch.rollout_logprobs = torch.full((2, 5), -1.0)
    batch.teacher_logprobs = torch.full((2, 5), -3.0) * batch.response_mask
    shaped = shape_advantages(0.5, batch)
    assert torch.equal(shaped, batch.response_mask * (1.0 - 0.5 * 2.0))
    # a sampled-token divergence reads the teacher's log-prob of the token, no distribution
    k3 = LossPlan(policy_loss=PPOClip(), gkd_coef=1.0, divergence=K3()).closure()
    assert not k3.needs_student_distribution and k3.teacher_support == (0, False)
    assert LossPlan(policy_loss=PPOClip(), gkd_coef=1.0, divergence=TopKKL(k=3)).teacher_request() == (3, False)
