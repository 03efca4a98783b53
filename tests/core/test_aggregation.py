"""Loss aggregation: global denominators make micro-batching and DP sharding invisible."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loongsage.core.aggregation import AGGREGATION_MODES, loss_weights, masked_mean


def reference_loss(loss: torch.Tensor, mask: torch.Tensor, mode: str, constant: float | None = None) -> float:
    """The aggregated loss of REFERENCE §1, written as plain float64 loops."""
    rows = [[(float(loss[i, t]), float(mask[i, t])) for t in range(loss.shape[1])] for i in range(loss.shape[0])]
    if mode == "token-mean":
        den = sum(m for row in rows for _, m in row)
        return sum(x * m for row in rows for x, m in row) / den if den else 0.0
    if mode == "seq-mean-token-sum-norm":
        c = constant if constant is not None else loss.shape[1]
        return sum(x * m for row in rows for x, m in row) / c
    per_seq = []
    for row in rows:
        n = sum(m for _, m in row)
        if n == 0:
            continue  # an empty row is padding: not a sequence
        s = sum(x * m for x, m in row)
        per_seq.append(s / n if mode == "seq-mean-token-mean" else s)
    return sum(per_seq) / len(per_seq) if per_seq else 0.0


def make_batch(b: int = 8, t: int = 6, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    lengths[3] = 0  # one row with no response tokens
    starts = torch.randint(0, 2, (b,), generator=g)  # a prompt token in front of some rows
    pos = torch.arange(t)[None, :]
    mask = ((pos >= starts[:, None]) & (pos < (starts + lengths)[:, None])).float()
    params = torch.randn(b, t, generator=g, dtype=torch.float32)
    return params, mask


def per_token_loss(theta: torch.Tensor) -> torch.Tensor:
    # Any nonlinear per-token function of the parameters will do.
    return torch.sin(theta) * theta + 0.5 * theta.square()


def accumulate(theta: torch.Tensor, weights: torch.Tensor, parts: list[list[int]]) -> tuple[float, torch.Tensor]:
    """Sum of ``sum(w * L)`` and of its gradients over micro-batches (and ranks) given as row lists."""
    grad = torch.zeros_like(theta)
    total = 0.0
    for rows in parts:
        p = theta[rows].clone().requires_grad_(True)
        micro = (weights[rows] * per_token_loss(p)).sum()
        micro.backward()
        grad[rows] += p.grad
        total += micro.item()
    return total, grad


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_weights_match_loop_formula(mode: str) -> None:
    theta, mask = make_batch()
    loss = per_token_loss(theta)
    got = (loss_weights(mask, mode) * loss).sum().item()
    assert got == pytest.approx(reference_loss(loss.double(), mask, mode), rel=1e-6, abs=1e-6)


def test_hand_values() -> None:
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(loss_weights(mask, "token-mean"), mask / 3)
    torch.testing.assert_close(
        loss_weights(mask, "seq-mean-token-mean"), torch.tensor([[0.25, 0.25, 0], [0, 0.5, 0], [0, 0, 0]])
    )
    torch.testing.assert_close(loss_weights(mask, "seq-mean-token-sum"), mask / 2)
    torch.testing.assert_close(loss_weights(mask, "seq-mean-token-sum-norm"), mask / 3)
    torch.testing.assert_close(loss_weights(mask, "seq-mean-token-sum-norm", constant=4.0), mask / 4)


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_microbatch_split_1x8_equals_4x2(mode: str) -> None:
    theta, mask = make_batch()
    w = loss_weights(mask, mode)
    one_loss, one_grad = accumulate(theta, w, [list(range(8))])
    four_loss, four_grad = accumulate(theta, w, [[0, 1], [2, 3], [4, 5], [6, 7]])
    # Two DP ranks holding interleaved rows, two micro-batches each; rank gradients summed.
    dp_loss, dp_grad = accumulate(theta, w, [[0, 2], [4, 6], [1, 3], [5, 7]])
    assert four_loss == pytest.approx(one_loss, rel=1e-6, abs=1e-7)
    assert dp_loss == pytest.approx(one_loss, rel=1e-6, abs=1e-7)
    torch.testing.assert_close(four_grad, one_grad, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(dp_grad, one_grad, rtol=1e-6, atol=1e-7)
    assert one_loss == pytest.approx(reference_loss(per_token_loss(theta).double(), mask, mode), rel=1e-5)


@settings(deadline=None, max_examples=40)
@given(
    mode=st.sampled_from(AGGREGATION_MODES),
    b=st.integers(1, 8),
    t=st.integers(1, 6),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_any_row_partition_gives_the_same_loss_and_gradient(mode, b, t, seed, data) -> None:
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(b, t, generator=g)
    mask = (torch.rand(b, t, generator=g) < 0.6).float()
    w = loss_weights(mask, mode)
    perm = data.draw(st.permutations(range(b)))
    cuts = sorted(data.draw(st.sets(st.integers(1, b - 1), max_size=b - 1))) if b > 1 else []
    parts = [list(perm[i:j]) for i, j in zip([0, *cuts], [*cuts, b], strict=True)]
    whole_loss, whole_grad = accumulate(theta, w, [list(range(b))])
    split_loss, split_grad = accumulate(theta, w, parts)
    assert math.isfinite(whole_loss)
    assert split_loss == pytest.approx(whole_loss, rel=1e-5, abs=1e-6)
    torch.testing.assert_close(split_grad, whole_grad, rtol=1e-5, atol=1e-6)
    assert whole_loss == pytest.approx(reference_loss(per_token_loss(theta).double(), mask, mode), rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_empty_rows_are_padding(mode: str) -> None:
    theta, mask = make_batch()
    loss = per_token_loss(theta)
    base = (loss_weights(mask, mode) * loss).sum()
    padded_mask = torch.cat([mask, torch.zeros(3, mask.shape[1])])
    padded_loss = torch.cat([loss, torch.full((3, mask.shape[1]), 1e3)])
    padded = (loss_weights(padded_mask, mode) * padded_loss).sum()
    torch.testing.assert_close(padded, base)
    empty = loss_weights(torch.zeros(2, 4), mode)
    assert torch.equal(empty, torch.zeros(2, 4))


def test_accepts_bool_and_long_masks() -> None:
    mask = torch.tensor([[1, 0], [1, 1]])
    for m in (mask, mask.bool()):
        w = loss_weights(m, "token-mean")
        assert w.dtype == torch.float32
        torch.testing.assert_close(w, mask.float() / 3)


def test_bad_arguments() -> None:
    mask = torch.ones(2, 3)
    with pytest.raises(ValueError, match="allowed: token-mean"):
        loss_weights(mask, "mean")
    with pytest.raises(ValueError, match="only used by seq-mean-token-sum-norm"):
        loss_weights(mask, "token-mean", constant=2.0)
    with pytest.raises(ValueError, match="must be > 0"):
        loss_weights(mask, "seq-mean-token-sum-norm", constant=0.0)
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        loss_weights(torch.ones(3), "token-mean")


def test_masked_mean() -> None:
    x = torch.tensor([[1.0, 2.0, float("nan")], [4.0, float("inf"), 6.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    out = masked_mean(x, mask)
    assert out.item() == pytest.approx(7.0 / 3)
    out.backward()
    torch.testing.assert_close(x.grad, mask / 3)
    torch.testing.assert_close(masked_mean(x.detach(), mask, dim=1), torch.tensor([1.5, 4.0]))
    torch.testing.assert_close(masked_mean(x.detach(), torch.zeros(2, 3), dim=1), torch.zeros(2))
    assert masked_mean(torch.ones(3), torch.zeros(3)).item() == 0.0


def test_consistency_metrics_average_like_the_loss():
    """token-mean: over tokens; seq-mean-*: over rows of each row's token mean; empty mask: nothing."""
    from loongsage.core.loss import consistency_metrics

    old = torch.tensor([[0.0, -1.0, -1.0, 0.0, 0.0], [0.0, -1.0, -1.0, -1.0, -1.0], [0.0] * 5])
    rollout = torch.tensor([[0.0, -1.1, -1.1, 5.0, 0.0], [0.0, -1.3, -1.3, -1.3, -1.3], [0.0, 3.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[0.0, 1, 1, 0, 0], [0.0, 1, 1, 1, 1], [0.0] * 5])  # row 2: no token
    k3 = [math.exp(d) - d - 1 for d in (0.1, 0.3)]
    token = consistency_metrics(old, rollout, mask).ratios
    assert token["train/is_approx_k3_kl"][1] == 6.0
    assert token["train/is_approx_k3_kl"][0] / 6 == pytest.approx((2 * k3[0] + 4 * k3[1]) / 6, rel=1e-5)
    assert token["train/is_logprob_abs_diff"][0] / 6 == pytest.approx((0.2 + 1.2) / 6, rel=1e-5)
    for mode in ("seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        seq = consistency_metrics(old, rollout, mask, mode).ratios
        num, den = seq["train/is_approx_k3_kl"]
        assert den == 2.0 and num / den == pytest.approx((k3[0] + k3[1]) / 2, rel=1e-5)
        assert seq["train/is_logprob_abs_diff"][0] / 2 == pytest.approx(0.2, rel=1e-5)
    assert consistency_metrics(old, rollout, torch.zeros_like(mask)).ratios == {}
