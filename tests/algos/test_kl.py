"""k1 / k2 / k3 / low_var_kl (plain and unbiased) and KL-in-reward against hand values and float64 math."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loongsage.algos.kl import K1, K2, K3, LowVarKL, k3, kl_in_reward, low_var_kl

ESTIMATORS = [K1(), K2(), K3(), LowVarKL()]


def test_hand_values() -> None:
    x = math.log(2.0)  # pi = 2 ref on the sampled token
    lp, ref = torch.tensor([x]), torch.tensor([0.0])
    assert K1()(lp, ref).item() == pytest.approx(x)
    assert K2()(lp, ref).item() == pytest.approx(x * x / 2)
    assert K3()(lp, ref).item() == pytest.approx(0.5 - 1 + x)  # exp(-ln 2) = 1/2
    assert LowVarKL()(lp, ref).item() == pytest.approx(0.5 - 1 + x)


def test_matches_float64_math() -> None:
    g = torch.Generator().manual_seed(2)
    lp, ref = -3 * torch.rand(5, 9, generator=g), -3 * torch.rand(5, 9, generator=g)
    xs = (lp.double() - ref.double()).flatten().tolist()
    expected = {
        "k1": xs,
        "k2": [x * x / 2 for x in xs],
        "k3": [math.exp(-x) - 1 + x for x in xs],
    }
    for est, name in zip(ESTIMATORS[:3], ["k1", "k2", "k3"], strict=True):
        got = est(lp, ref).flatten().tolist()
        assert got == pytest.approx(expected[name], rel=1e-5, abs=1e-6), name


def test_low_var_kl_caps_value_and_keeps_gradient_finite() -> None:
    lp = torch.tensor([-100.0, 100.0, -12.0, 0.3], requires_grad=True)
    ref = torch.zeros(4)
    out = low_var_kl(lp, ref)
    assert out[:3].tolist() == [10.0, 10.0, 10.0]
    assert out[3].item() == pytest.approx(math.exp(-0.3) - 1 + 0.3, rel=1e-5)
    out.sum().backward()
    assert torch.isfinite(lp.grad).all()
    assert lp.grad[3].item() == pytest.approx(1 - math.exp(-0.3), rel=1e-5)  # d k3 / dx
    assert LowVarKL(bound=0.01)(lp.detach(), ref)[3].item() == pytest.approx(0.01)
    with pytest.raises(ValueError, match=r"low_var_kl\.bound"):
        LowVarKL(bound=0.0)


@settings(deadline=None, max_examples=100)
@given(
    lp=st.lists(st.floats(-30, 0, allow_nan=False, width=32), min_size=1, max_size=16),
    shift=st.lists(st.floats(-5, 5, allow_nan=False, width=32), min_size=16, max_size=16),
)
def test_k3_nonnegative_and_zero_when_equal(lp, shift) -> None:
    a = torch.tensor(lp)
    b = a + torch.tensor(shift[: len(lp)])
    assert (k3(a, b) >= 0).all()
    assert (low_var_kl(a, b) >= 0).all()
    for est in ESTIMATORS:
        assert torch.equal(est(a, a), torch.zeros_like(a))


def test_every_estimator_consumes_logprobs() -> None:
    assert {type(e).consumes for e in ESTIMATORS} == {"logprobs"}


# ------------------------------------------------------------------------------ unbiased form

UNBIASED = [K1(unbiased=True), K2(unbiased=True), K3(unbiased=True), LowVarKL(unbiased=True)]


def test_unbiased_multiplies_by_the_detached_ratio() -> None:
    g = torch.Generator().manual_seed(7)
    lp = (-3 * torch.rand(4, 6, generator=g)).requires_grad_()
    ref, old = -3 * torch.rand(4, 6, generator=g), -3 * torch.rand(4, 6, generator=g)
    for plain, unbiased in zip(ESTIMATORS, UNBIASED, strict=True):
        assert not plain.needs_old_logprobs and unbiased.needs_old_logprobs
        ratio = [
            math.exp(a - b)
            for a, b in zip(lp.detach().double().flatten().tolist(), old.double().flatten().tolist(), strict=True)
        ]
        base = plain(lp, ref)
        got = unbiased(lp, ref, old_logprobs=old)
        expected = [r * x for r, x in zip(ratio, base.detach().flatten().tolist(), strict=True)]
        assert got.detach().flatten().tolist() == pytest.approx(expected, rel=1e-5, abs=1e-7)
        # The weight is a constant: the gradient is the plain estimator's, scaled by r.
        (grad_plain,) = torch.autograd.grad(base.sum(), lp)
        (grad_unbiased,) = torch.autograd.grad(got.sum(), lp)
        torch.testing.assert_close(grad_unbiased, grad_plain * torch.tensor(ratio).view(4, 6).float())


def test_unbiased_is_plain_on_policy_and_keeps_exploded_ratios_finite() -> None:
    lp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -0.5])
    for plain, unbiased in zip(ESTIMATORS, UNBIASED, strict=True):
        assert torch.equal(unbiased(lp, ref, old_logprobs=lp), plain(lp, ref))
    far = K3(unbiased=True)(torch.tensor([0.0]), torch.tensor([-1.0]), old_logprobs=torch.tensor([-100.0]))
    assert far.item() == pytest.approx(math.exp(20) * (math.exp(-1) - 1 + 1), rel=1e-5)  # log r clamped at 20


def test_unbiased_needs_old_logprobs_and_plain_ignores_them() -> None:
    lp, ref = torch.tensor([-1.0]), torch.tensor([-2.0])
    for est in UNBIASED:
        with pytest.raises(ValueError, match=rf"^{est.name}\.unbiased=True: needs old_logprobs"):
            est(lp, ref)
    assert torch.equal(K1()(lp, ref, old_logprobs=torch.tensor([5.0])), K1()(lp, ref))


# ------------------------------------------------------------------------------ KL in the reward


def test_kl_in_reward() -> None:
    kl = torch.tensor([[0.5, -0.2, 7.0]], requires_grad=True)
    tr = torch.tensor([[1.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    out = kl_in_reward(tr, kl, 0.1, response_mask=mask)
    assert out.tolist() == [pytest.approx([0.95, 0.02, 0.0])]
    assert not out.requires_grad  # a reward: no gradient through the KL
    assert kl_in_reward(None, kl, 2.0).tolist() == [pytest.approx([-1.0, 0.4, -14.0])]
