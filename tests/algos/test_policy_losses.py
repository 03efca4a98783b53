"""PPO-clip (clip-higher, dual clip) and NLL against hand values and a float64 loop formula."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loongsage.algos.policy_losses import NLL, PPOClip, nll_loss, ppo_clip_loss
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
        "ppo": lambda lp: ppo_clip_loss(lp, old.masked_fill(pad, garbage), a.masked_fill(pad, garbage), mask,
                                        clip_c=clip_c),
        "nll": lambda lp: nll_loss(lp, mask),
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
    ("params", "key"),
    [({"clip_low": 1.0}, "clip_low"), ({"clip_low": -0.1}, "clip_low"), ({"clip_high": -1.0}, "clip_high"),
     ({"clip_c": 1.0}, "clip_c")],
)
def test_params_are_validated(params: dict, key: str) -> None:
    with pytest.raises(ValueError, match=rf"ppo_clip\.{key}"):
        PPOClip(**params)
