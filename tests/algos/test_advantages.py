"""GRPO / Dr.GRPO advantages against hand values and a float64 loop formula."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loongsage.algos.advantages import GRPO, grpo_advantages
from loongsage.core.types import AdvantageInput


def reference_grpo(rewards: list[float], groups: list[int], std_normalize: bool, eps: float = 1e-6) -> list[float]:
    out = []
    for r, g in zip(rewards, groups, strict=True):
        members = [x for x, h in zip(rewards, groups, strict=True) if h == g]
        n = len(members)
        if n == 1:
            out.append(0.0)
            continue
        mean = sum(members) / n
        std = math.sqrt(sum((x - mean) ** 2 for x in members) / (n - 1))
        out.append((r - mean) / (std + eps) if std_normalize else r - mean)
    return out


REWARDS = [1.0, 0.0, 1.0, 1.0, 0.0, 5.0]
GROUPS = [7, 7, 3, 3, 3, 9]


def test_hand_values() -> None:
    rewards, groups = torch.tensor(REWARDS), torch.tensor(GROUPS)
    mask = torch.ones(6, 1)
    s2, s3 = math.sqrt(0.5), math.sqrt(1 / 3)  # unbiased stds of {1, 0} and {1, 1, 0}
    expected_std = [0.5 / s2, -0.5 / s2, (1 / 3) / s3, (1 / 3) / s3, (-2 / 3) / s3, 0.0]
    expected_dr = [0.5, -0.5, 1 / 3, 1 / 3, -2 / 3, 0.0]
    got_std = grpo_advantages(rewards, groups, mask)[:, 0].tolist()
    got_dr = grpo_advantages(rewards, groups, mask, std_normalize=False)[:, 0].tolist()
    assert got_std == pytest.approx(expected_std, rel=1e-5)
    assert got_dr == pytest.approx(expected_dr, rel=1e-6)


@pytest.mark.parametrize("std_normalize", [True, False])
def test_matches_loop_formula_and_broadcasts_over_mask(std_normalize: bool) -> None:
    g = torch.Generator().manual_seed(1)
    rewards = torch.randn(12, generator=g)
    groups = torch.tensor([5, 5, 5, 5, 2, 2, 2, 2, 11, 11, 11, 40])
    mask = (torch.rand(12, 7, generator=g) < 0.5).float()
    adv = GRPO(std_normalize=std_normalize)(AdvantageInput(rewards=rewards, group_ids=groups, response_mask=mask))
    expected = reference_grpo(rewards.tolist(), groups.tolist(), std_normalize)
    assert adv.shape == (12, 7) and adv.dtype == torch.float32
    torch.testing.assert_close(adv, torch.tensor(expected)[:, None] * mask, rtol=1e-5, atol=1e-6)


def test_all_equal_group_and_single_row_give_zero() -> None:
    adv = grpo_advantages(torch.tensor([3.0, 3.0, 3.0, 1.0]), torch.tensor([0, 0, 0, 1]), torch.ones(4, 2))
    assert torch.equal(adv, torch.zeros(4, 2))


def test_non_finite_rewards_are_left_out_of_group_statistics() -> None:
    rewards = torch.tensor([1.0, float("nan"), 0.0, float("inf")])
    adv = grpo_advantages(rewards, torch.tensor([0, 0, 0, 1]), torch.ones(4, 1), std_normalize=False)
    assert adv[:, 0].tolist() == pytest.approx([0.5, 0.0, -0.5, 0.0])


@settings(deadline=None, max_examples=60)
@given(
    data=st.lists(
        st.tuples(st.floats(-10, 10, allow_nan=False, width=32), st.integers(0, 4)), min_size=1, max_size=24
    ),
    std_normalize=st.booleans(),
)
def test_advantages_sum_to_zero_per_group(data, std_normalize) -> None:
    rewards = torch.tensor([r for r, _ in data])
    groups = torch.tensor([g for _, g in data])
    adv = grpo_advantages(rewards, groups, torch.ones(len(data), 3), std_normalize=std_normalize)
    assert torch.isfinite(adv).all()
    for g in groups.unique():
        in_group = adv[groups == g, 0].double()
        # z-scores are bounded by sqrt(n - 1), so the sum's rounding error scales with n.
        assert abs(in_group.sum().item()) <= 1e-5 * (1 + in_group.abs().sum().item())


def test_params_are_validated() -> None:
    assert GRPO.needs_values is False
    with pytest.raises(ValueError, match=r"grpo\.eps"):
        GRPO(eps=0.0)
