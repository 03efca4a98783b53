"""k1 / k2 / k3 / low_var_kl against hand values and float64 math."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loongsage.algos.kl import K1, K2, K3, LowVarKL, k3, low_var_kl

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
