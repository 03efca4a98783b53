"""PPO-clip (clip-higher, dual clip), GSPO, CISPO and NLL against hand values and float64 loop formulas."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loongsage.algos.policy_losses import (
    CISPO,
    GSPO,
    NLL,
    PPOClip,
    cispo_loss,
    gspo_loss,
    nll_loss,
    ppo_clip_loss,
)
from loongsage.core.aggregation import AGGREGATION_MODES, loss_weights
from loongsage.core.types import PolicyLossInput


def reference_ppo(lp: float, old: float, a: float, lo: float, hi: float, c: float | None) -> tuple[float, float]:
    """(loss, clipped?) of one token, in float64."""
    r = math.exp(max(-20.0, min(20.0, lp - old)))
    unclipped, clipped = -a * r, -a * min(max(r, 1 - lo), 1 + hi)
    loss = max(unclipped, clipped)
    if c is not None and a < 0:
        loss = min(loss, -c * a)
    return loss, float(clipped > unclipped)


def test_hand_values() -> None:
    # Token 1: A=+1, r=e^0.5=1.65 > 1.28 -> clipped, loss -1.28.
    # Token 2: A=-1, r=0.5 < 0.8 -> clipped, loss 0.8.
    # Token 3: A=+2, r=1 -> loss -2.
    # Token 4: A=-1, r=e^2=7.39 -> loss 7.39; with dual clip c=3 -> 3.
    lp = torch.tensor([[0.5, math.log(0.5), 0.0, 2.0]])
    a = torch.tensor([[1.0, -1.0, 2.0, -1.0]])
    mask = torch.ones(1, 4)
    out = PPOClip(clip_low=0.2, clip_high=0.28)(PolicyLossInput(lp, torch.zeros(1, 4), a, mask))
    assert out.loss[0].tolist() == pytest.approx([-1.28, 0.8, -2.0, math.exp(2.0)], rel=1e-6)
    assert out.metrics["clipfrac"][0].tolist() == [1.0, 1.0, 0.0, 0.0]
    assert out.metrics["ratio"][0].tolist() == pytest.approx([math.exp(0.5), 0.5, 1.0, math.exp(2.0)], rel=1e-6)
    assert out.metrics["ppo_kl"][0].tolist() == pytest.approx([-0.5, math.log(2), 0.0, -2.0], rel=1e-6)
    assert "dual_clipfrac" not in out.metrics
    dual = PPOClip(clip_low=0.2, clip_high=0.28, clip_c=3.0)(PolicyLossInput(lp, torch.zeros(1, 4), a, mask))
    assert dual.loss[0].tolist() == pytest.approx([-1.28, 0.8, -2.0, 3.0], rel=1e-6)
    assert dual.metrics["dual_clipfrac"][0].tolist() == [0.0, 0.0, 0.0, 1.0]


@pytest.mark.parametrize("clip_c", [None, 2.5])
def test_matches_loop_formula(clip_c: float | None) -> None:
    g = torch.Generator().manual_seed(3)
    lp, old = -2 * torch.rand(6, 10, generator=g), -2 * torch.rand(6, 10, generator=g)
    a = torch.randn(6, 10, generator=g)
    mask = (torch.rand(6, 10, generator=g) < 0.7).float()
    out = ppo_clip_loss(lp, old, a, mask, clip_low=0.2, clip_high=0.28, clip_c=clip_c)
    for i in range(6):
        for t in range(10):
            loss, clipped = reference_ppo(lp[i, t].item(), old[i, t].item(), a[i, t].item(), 0.2, 0.28, clip_c)
            m = mask[i, t].item()
            assert out.loss[i, t].item() == pytest.approx(loss * m, rel=1e-5, abs=1e-6)
            assert out.metrics["clipfrac"][i, t].item() == clipped * m


def test_gradient_flows_only_through_unclipped_tokens() -> None:
    lp = torch.tensor([[0.1, 0.5, -0.5]], requires_grad=True)  # r = 1.105 (inside), 1.65 (clipped), 0.61
    a = torch.tensor([[1.0, 1.0, 1.0]])
    ppo_clip_loss(lp, torch.zeros(1, 3), a, torch.ones(1, 3)).loss.sum().backward()
    # dL/dlp = -A r where unclipped; a token with A>0 and r<1-eps is NOT clipped (pessimistic bound).
    assert lp.grad[0].tolist() == pytest.approx([-math.exp(0.1), 0.0, -math.exp(-0.5)], rel=1e-6)


def test_extreme_log_ratio_is_clamped() -> None:
    lp = torch.tensor([[80.0, -80.0]], requires_grad=True)
    out = ppo_clip_loss(lp, torch.zeros(1, 2), torch.tensor([[-1.0, 1.0]]), torch.ones(1, 2))
    assert out.metrics["ratio"][0, 0].item() == pytest.approx(math.exp(20.0), rel=1e-6)
    out.loss.sum().backward()
    assert torch.isfinite(out.loss).all() and torch.isfinite(lp.grad).all()


token = st.floats(-5, 0, allow_nan=False, width=32)
adv = st.floats(-5, 5, allow_nan=False, width=32)


@settings(deadline=None, max_examples=60)
@given(
    old=st.lists(token, min_size=1, max_size=12),
    advs=st.lists(adv, min_size=12, max_size=12),
    bits=st.lists(st.booleans(), min_size=12, max_size=12),
    clip_low=st.floats(0, 0.9),
    clip_high=st.floats(0, 5),
    clip_c=st.none() | st.floats(1.01, 10),
)
def test_ratio_one_gives_no_clipping_and_loss_minus_a(old, advs, bits, clip_low, clip_high, clip_c) -> None:
    n = len(old)
    lp = torch.tensor([old])
    a, mask = torch.tensor([advs[:n]]), torch.tensor([bits[:n]], dtype=torch.float32)
    out = PPOClip(clip_low=clip_low, clip_high=clip_high, clip_c=clip_c)(PolicyLossInput(lp, lp.clone(), a, mask))
    assert torch.equal(out.metrics["clipfrac"], torch.zeros_like(lp))
    torch.testing.assert_close(out.loss, -a * mask)
    torch.testing.assert_close(out.metrics["ratio"], mask)


@settings(deadline=None, max_examples=60)
@given(
    seed=st.integers(0, 2**16),
    garbage=st.sampled_from([1e4, -1e4, float("inf"), float("-inf"), float("nan")]),
    clip_c=st.none() | st.just(3.0),
)
def test_masked_tokens_contribute_nothing(seed, garbage, clip_c) -> None:
    g = torch.Generator().manual_seed(seed)
    lp0, old = -torch.rand(4, 6, generator=g), -torch.rand(4, 6, generator=g)
    a = torch.randn(4, 6, generator=g)
    mask = (torch.rand(4, 6, generator=g) < 0.5).float()
    pad = mask == 0

    def run(fill: float | None, loss_fn):
        lp = lp0.clone()
        if fill is not None:
            lp[pad] = fill
        lp.requires_grad_(True)
        out = loss_fn(lp)
        out.loss.sum().backward()
        return out, lp.grad

    losses = {
        "ppo": lambda lp: ppo_clip_loss(
            lp, old.masked_fill(pad, garbage), a.masked_fill(pad, garbage), mask, clip_c=clip_c
        ),
        "nll": lambda lp: nll_loss(lp, mask),
        "gspo": lambda lp: gspo_loss(
            lp, old.masked_fill(pad, garbage), a.masked_fill(pad, garbage), mask, clip_low=0.1, clip_high=0.1
        ),
        "cispo": lambda lp: cispo_loss(
            lp, old.masked_fill(pad, garbage), a.masked_fill(pad, garbage), mask, clip_low=0.2, clip_high=0.2
        ),
    }
    for fn in losses.values():
        clean, clean_grad = run(None, fn)
        dirty, dirty_grad = run(garbage, fn)
        torch.testing.assert_close(dirty.loss, clean.loss)
        torch.testing.assert_close(dirty_grad, clean_grad)
        assert torch.equal(dirty_grad[pad], torch.zeros_like(dirty_grad[pad]))
        assert torch.equal(dirty.loss[pad], torch.zeros_like(dirty.loss[pad]))
        for name, value in dirty.metrics.items():
            assert torch.isfinite(value).all(), name
            torch.testing.assert_close(value, clean.metrics[name])


def test_nll() -> None:
    lp = torch.tensor([[-0.5, -2.0, -9.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    out = NLL()(PolicyLossInput(lp, torch.zeros(1, 3), torch.zeros(1, 3), mask))
    assert out.loss[0].tolist() == [0.5, 2.0, 0.0]
    out.loss.sum().backward()
    assert lp.grad[0].tolist() == [-1.0, -1.0, 0.0]
    assert NLL.needs_old_logprobs is False and PPOClip.needs_old_logprobs is True


@pytest.mark.parametrize(
    ("factory", "params", "key"),
    [
        (PPOClip, {"clip_low": 1.0}, "ppo_clip.clip_low"),
        (PPOClip, {"clip_low": -0.1}, "ppo_clip.clip_low"),
        (PPOClip, {"clip_high": -1.0}, "ppo_clip.clip_high"),
        (PPOClip, {"clip_c": 1.0}, "ppo_clip.clip_c"),
        (GSPO, {"clip_low": 1.0}, "gspo.clip_low"),
        (GSPO, {"clip_high": -1e-4}, "gspo.clip_high"),
        (CISPO, {"clip_low": -0.1}, "cispo.clip_low"),
        (CISPO, {"clip_high": -0.1}, "cispo.clip_high"),
    ],
)
def test_params_are_validated(factory, params: dict, key: str) -> None:
    with pytest.raises(ValueError, match=rf"^{key}="):
        factory(**params)


def test_supported_aggregations() -> None:
    assert PPOClip.supported_aggregations is None and NLL.supported_aggregations is None
    assert CISPO.supported_aggregations is None
    assert GSPO.supported_aggregations == ("seq-mean-token-mean",)
    assert set(GSPO.supported_aggregations) <= set(AGGREGATION_MODES)
    assert (GSPO().clip_low, GSPO().clip_high) == (3e-4, 4e-4)  # the GSPO paper's ranges
    assert CISPO().clip_low >= 1  # MiniMax-M1: no lower bound on the IS weight


# ---------------------------------------------------------------------------------------- GSPO


def reference_gspo(lp: list[float], old: list[float], a: list[float], m: list[float], lo: float, hi: float):
    """Per-token (loss, clipped?, seq ratio) of one row, in float64 loops."""
    n = sum(1 for x in m if x)
    log_s = sum(max(-20.0, min(20.0, p - o)) for p, o, x in zip(lp, old, m, strict=True) if x) / max(n, 1)
    s = math.exp(log_s)
    out = []
    for at, x in zip(a, m, strict=True):
        unclipped, clipped = -at * s, -at * min(max(s, 1 - lo), 1 + hi)
        out.append((max(unclipped, clipped) * x, float(clipped > unclipped) * x, s * x))
    return out


def test_gspo_hand_values() -> None:
    # Row 0: log r = [0.1, 0.3] -> s = e^0.2 = 1.221 > 1 + 4e-4, A = +1: clipped, loss -(1 + 4e-4), no gradient.
    # Row 1: r = 1, A = -1: loss 1 per token, gradient 1 (= -A s).
    # Row 2: s = e^0.2, A = -1: the unclipped branch is the max (pessimistic), loss s, gradient s per token.
    lp = torch.tensor([[0.1, 0.3, 0.0], [0.0, 0.0, 0.0], [0.2, 0.2, 7.0]], requires_grad=True)
    a = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    out = GSPO()(PolicyLossInput(lp, torch.zeros(3, 3), a, mask))
    s = math.exp(0.2)
    expected = [[-(1 + 4e-4), -(1 + 4e-4), 0.0], [1.0, 1.0, 1.0], [s, s, 0.0]]
    for row, exp_row in zip(out.loss.tolist(), expected, strict=True):
        assert row == pytest.approx(exp_row, rel=1e-6)
    assert out.metrics["clipfrac"].tolist() == [[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    assert out.metrics["seq_ratio"][:, 0].tolist() == pytest.approx([s, 1.0, s], rel=1e-6)
    out.loss.sum().backward()
    assert lp.grad.tolist()[0] == [0.0, 0.0, 0.0]
    assert lp.grad.tolist()[1] == pytest.approx([1.0, 1.0, 1.0])
    assert lp.grad.tolist()[2] == pytest.approx([s, s, 0.0], rel=1e-6)


def test_gspo_matches_loop_formula() -> None:
    g = torch.Generator().manual_seed(5)
    old = -2 * torch.rand(8, 7, generator=g, dtype=torch.float64)
    lp = old + 0.1 * torch.randn(8, 7, generator=g, dtype=torch.float64)
    a = torch.randn(8, 7, generator=g, dtype=torch.float64)
    mask = (torch.rand(8, 7, generator=g) < 0.7).double()
    out = gspo_loss(lp, old, a, mask, clip_low=0.02, clip_high=0.03)
    clipped_rows = 0
    for i in range(8):
        ref = reference_gspo(lp[i].tolist(), old[i].tolist(), a[i].tolist(), mask[i].tolist(), 0.02, 0.03)
        for t, (loss, clipped, s) in enumerate(ref):
            assert out.loss[i, t].item() == pytest.approx(loss, rel=1e-9, abs=1e-12)
            assert out.metrics["clipfrac"][i, t].item() == clipped
            assert out.metrics["seq_ratio"][i, t].item() == pytest.approx(s, rel=1e-9)
        clipped_rows += any(c for _, c, _ in ref)
    assert 0 < clipped_rows < 8  # the data exercises both branches


def test_gspo_token_form_has_the_gradient_of_the_sequence_objective() -> None:
    """Under seq-mean-token-mean, sum(w * L) is GSPO's (1/B) sum_i max(-A_i s_i, -A_i clip(s_i))."""
    g = torch.Generator().manual_seed(9)
    old = -2 * torch.rand(6, 9, generator=g, dtype=torch.float64)
    lp0 = old + 0.05 * torch.randn(6, 9, generator=g, dtype=torch.float64)
    mask = (torch.rand(6, 9, generator=g) < 0.8).double()
    mask[:, 0] = 1.0
    a_seq = torch.randn(6, 1, generator=g, dtype=torch.float64)
    a = a_seq.expand(6, 9) * mask
    lo, hi = 0.01, 0.015

    lp = lp0.clone().requires_grad_(True)
    w = loss_weights(mask, "seq-mean-token-mean")
    token_form = (gspo_loss(lp, old, a, mask, clip_low=lo, clip_high=hi).loss * w).sum()
    token_form.backward()

    lp_ref = lp0.clone().requires_grad_(True)
    s = (((lp_ref - old) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True)).exp()
    sequence = torch.maximum(-a_seq * s, -a_seq * s.clamp(1 - lo, 1 + hi)).mean()
    sequence.backward()

    assert token_form.item() == pytest.approx(sequence.item(), rel=1e-12)
    torch.testing.assert_close(lp.grad, lp_ref.grad, rtol=1e-10, atol=1e-12)
    assert (lp.grad.abs().sum(-1) == 0).any() and (lp.grad.abs().sum(-1) > 0).any()  # clipped and free rows


def test_gspo_ratio_survives_low_precision_inputs() -> None:
    # bf16 cannot tell 1 from 1 + 4e-4; the ratio and the clip are computed in fp32.
    lp = torch.full((1, 4), -1.0, dtype=torch.bfloat16)
    old = lp.float() - 3.5e-4  # inside the default range only if not rounded away
    out = gspo_loss(lp, old, torch.ones(1, 4), torch.ones(1, 4))
    assert out.loss.dtype == torch.float32
    assert out.metrics["seq_ratio"][0, 0].item() == pytest.approx(math.exp(3.5e-4), rel=1e-6)
    assert out.metrics["clipfrac"].sum().item() == 0.0


@settings(deadline=None, max_examples=60)
@given(
    old=st.lists(token, min_size=2, max_size=12),
    advs=st.lists(adv, min_size=12, max_size=12),
    bits=st.lists(st.booleans(), min_size=12, max_size=12),
    rows=st.integers(1, 3),
    clip_low=st.floats(1e-3, 0.9),  # a bound at exactly 1 passes no gradient at r = 1 (torch clamp), in PPO too
    clip_high=st.floats(1e-3, 5),
)
def test_gspo_ratio_one_is_the_on_policy_ppo_gradient(old, advs, bits, rows, clip_low, clip_high) -> None:
    n = len(old) // rows * rows
    shape = (rows, n // rows)
    base = torch.tensor(old[:n]).reshape(shape)
    a, mask = torch.tensor(advs[:n]).reshape(shape), torch.tensor(bits[:n], dtype=torch.float32).reshape(shape)
    grads, losses = [], []
    for fn in (
        lambda lp: gspo_loss(lp, base, a, mask, clip_low=clip_low, clip_high=clip_high),
        lambda lp: ppo_clip_loss(lp, base, a, mask, clip_low=clip_low, clip_high=clip_high),
    ):
        lp = base.clone().requires_grad_(True)
        out = fn(lp)
        out.loss.sum().backward()
        grads.append(lp.grad)
        losses.append(out.loss.detach())
        assert torch.equal(out.metrics["clipfrac"], torch.zeros_like(base))
    torch.testing.assert_close(losses[0], -a * mask)
    torch.testing.assert_close(grads[0], grads[1])
    torch.testing.assert_close(grads[0], -a * mask)


# --------------------------------------------------------------------------------------- CISPO


def test_cispo_hand_values() -> None:
    # r = e^0.5 = 1.65 -> weight 1.28; r = 0.5 -> no lower clip by default, weight 0.5; r = 1 -> 1.
    lp = torch.tensor([[0.5 - 1.0, math.log(0.5) - 2.0, -0.7]], requires_grad=True)
    old = torch.tensor([[-1.0, -2.0, -0.7]])
    a = torch.tensor([[2.0, -1.0, 1.0]])
    out = CISPO()(PolicyLossInput(lp, old, a, torch.ones(1, 3)))
    weights = [1.28, 0.5, 1.0]
    assert out.loss[0].tolist() == pytest.approx(
        [-w * at * x for w, at, x in zip(weights, a[0].tolist(), lp[0].tolist(), strict=True)], rel=1e-6
    )
    assert out.metrics["clipfrac"][0].tolist() == [1.0, 0.0, 0.0]
    out.loss.sum().backward()
    assert lp.grad[0].tolist() == pytest.approx([-1.28 * 2.0, 0.5, -1.0], rel=1e-6)  # the clipped token keeps it
    lower = CISPO(clip_low=0.2, clip_high=0.28)(PolicyLossInput(lp.detach(), old, a, torch.ones(1, 3)))
    assert lower.metrics["clipfrac"][0].tolist() == [1.0, 1.0, 0.0]


def test_cispo_gradient_is_clipped_weight_times_advantage_times_grad_logprob() -> None:
    """Through a real softmax: grad = sum_t -clip(r_t) A_t grad log pi_t, with clip(r) from a float64 loop."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(5, 6, 11, generator=g, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, 11, (5, 6), generator=g)
    old = torch.log_softmax(logits.detach() + 0.4 * torch.randn(5, 6, 11, generator=g, dtype=torch.float64), -1)
    old = old.gather(-1, tokens[..., None])[..., 0]
    a = torch.randn(5, 6, generator=g, dtype=torch.float64)
    mask = (torch.rand(5, 6, generator=g) < 0.8).double()
    lo, hi = 0.3, 0.2

    lp = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]
    out = cispo_loss(lp, old, a, mask, clip_low=lo, clip_high=hi)
    (grad,) = torch.autograd.grad(out.loss.sum(), logits)

    clipped = [
        [min(max(math.exp(p - o), 1 - lo), 1 + hi) for p, o in zip(pr, orow, strict=True)]
        for pr, orow in zip(lp.tolist(), old.tolist(), strict=True)
    ]
    coef = -torch.tensor(clipped, dtype=torch.float64) * a * mask
    lp_again = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]
    (expected,) = torch.autograd.grad((coef * lp_again).sum(), logits)
    torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-12)
    outside = sum(
        m * (not 1 - lo <= math.exp(p - o) <= 1 + hi)
        for pr, orow, mr in zip(lp.tolist(), old.tolist(), mask.tolist(), strict=True)
        for p, o, m in zip(pr, orow, mr, strict=True)
    )
    assert 0 < outside == out.metrics["clipfrac"].sum().item()
