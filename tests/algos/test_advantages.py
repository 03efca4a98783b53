"""Advantage estimators (GRPO, RLOO, REINFORCE++, GAE) against hand values and float64 loop formulas."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loongsage.algos.advantages import (
    GAE,
    GRPO,
    RLOO,
    ReinforcePP,
    discounted_cumsum,
    gae_advantages,
    gae_returns,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)
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
    data=st.lists(st.tuples(st.floats(-10, 10, allow_nan=False, width=32), st.integers(0, 4)), min_size=1, max_size=24),
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


# ------------------------------------------------------------------------------ helpers


def right_padded_mask(prompt_lens: list[int], response_lens: list[int], T: int) -> torch.Tensor:
    """[B, T] mask that is 1 on each row's response span [p, p + r), 0 on prompt and padding."""
    mask = torch.zeros(len(prompt_lens), T)
    for i, (p, r) in enumerate(zip(prompt_lens, response_lens, strict=True)):
        mask[i, p : p + r] = 1.0
    return mask


def masked_positions(mask: torch.Tensor, i: int) -> list[int]:
    return [t for t in range(mask.shape[1]) if mask[i, t] != 0]


def whiten(returns: dict[tuple[int, int], float], eps: float) -> dict[tuple[int, int], float]:
    xs = list(returns.values())
    if not xs:
        return {}
    mean = sum(xs) / len(xs)
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs))
    return {k: (x - mean) / (std + eps) for k, x in returns.items()}


def as_tensor(values: dict[tuple[int, int], float], shape: tuple[int, int]) -> torch.Tensor:
    out = torch.zeros(shape, dtype=torch.float64)
    for (i, t), x in values.items():
        out[i, t] = x
    return out


# ------------------------------------------------------------------------------ GRPO scope


def test_grpo_batch_scope_uses_batch_statistics() -> None:
    rewards, groups = torch.tensor(REWARDS), torch.tensor(GROUPS)
    mask = torch.ones(6, 2)
    got = GRPO(scope="batch")(AdvantageInput(rewards=rewards, group_ids=groups, response_mask=mask))
    expected = reference_grpo(REWARDS, [0] * 6, std_normalize=True)  # one group: the batch
    torch.testing.assert_close(got, torch.tensor(expected)[:, None].expand(6, 2), rtol=1e-5, atol=1e-6)
    mean = sum(REWARDS) / 6
    dr = grpo_advantages(rewards, groups, mask, std_normalize=False, scope="batch")[:, 0]
    assert dr.tolist() == pytest.approx([r - mean for r in REWARDS], rel=1e-6)
    assert GRPO().scope == "group"  # default unchanged
    with pytest.raises(ValueError, match=r"grpo\.scope"):
        GRPO(scope="global")  # type: ignore[arg-type]


def test_grpo_batch_scope_skips_non_finite_rows() -> None:
    rewards = torch.tensor([1.0, float("nan"), 3.0])
    adv = grpo_advantages(rewards, torch.tensor([0, 1, 2]), torch.ones(3, 1), std_normalize=False, scope="batch")
    assert adv[:, 0].tolist() == pytest.approx([-1.0, 0.0, 1.0])


# ------------------------------------------------------------------------------ RLOO


def reference_rloo(rewards: list[float], groups: list[int]) -> list[float]:
    out = []
    pairs = list(zip(rewards, groups, strict=True))
    for i, (r, g) in enumerate(pairs):
        others = [x for j, (x, h) in enumerate(pairs) if h == g and j != i and math.isfinite(x)]
        out.append(r - sum(others) / len(others) if others and math.isfinite(r) else 0.0)
    return out


def test_rloo_hand_values() -> None:
    adv = rloo_advantages(torch.tensor(REWARDS), torch.tensor(GROUPS), torch.ones(6, 1))[:, 0]
    # {1, 0}: 1 - 0, 0 - 1; {1, 1, 0}: 1 - 1/2, 1 - 1/2, 0 - 1; {5}: alone -> 0
    assert adv.tolist() == pytest.approx([1.0, -1.0, 0.5, 0.5, -1.0, 0.0])


def test_rloo_matches_loop_formula_with_nan_rows_and_mask() -> None:
    g = torch.Generator().manual_seed(3)
    rewards = torch.randn(10, generator=g)
    rewards[4] = float("nan")
    groups = torch.tensor([1, 1, 1, 4, 4, 4, 4, 8, 8, 9])
    mask = right_padded_mask([2, 1, 3, 0, 2, 1, 1, 2, 0, 3], [3, 4, 2, 5, 1, 4, 3, 2, 6, 2], 7)
    adv = RLOO()(AdvantageInput(rewards=rewards, group_ids=groups, response_mask=mask))
    expected = torch.tensor(reference_rloo(rewards.tolist(), groups.tolist()))[:, None] * mask
    torch.testing.assert_close(adv, expected, rtol=1e-5, atol=1e-6)
    assert RLOO.needs_values is False


@settings(deadline=None, max_examples=60)
@given(
    data=st.lists(st.tuples(st.floats(-10, 10, allow_nan=False, width=32), st.integers(0, 3)), min_size=1, max_size=20),
)
def test_rloo_advantages_of_a_group_sum_to_zero(data) -> None:
    rewards = torch.tensor([r for r, _ in data])
    groups = torch.tensor([g for _, g in data])
    adv = rloo_advantages(rewards, groups, torch.ones(len(data), 2))
    for g in groups.unique():
        in_group = adv[groups == g, 0].double()
        assert abs(in_group.sum().item()) <= 1e-5 * (1 + in_group.abs().sum().item())


# ------------------------------------------------------------------------------ discounted sums


def loop_discounted_cumsum(x: torch.Tensor, c: float) -> torch.Tensor:
    out = torch.zeros_like(x)
    for i in range(x.shape[0]):
        acc = 0.0
        for t in reversed(range(x.shape[1])):
            acc = float(x[i, t]) + c * acc
            out[i, t] = acc
    return out


@pytest.mark.parametrize("T", [1, 63, 64, 65, 200])
@pytest.mark.parametrize("c", [0.0, 0.5, 0.97, 1.0])
def test_discounted_cumsum_matches_loop_across_block_boundaries(T: int, c: float) -> None:
    x = torch.randn(2, T, generator=torch.Generator().manual_seed(T), dtype=torch.float64)
    torch.testing.assert_close(discounted_cumsum(x, c), loop_discounted_cumsum(x, c), rtol=1e-10, atol=1e-10)


# ------------------------------------------------------------------------------ REINFORCE++


def reference_reinforce_pp(
    rewards: list[float],
    groups: list[int],
    mask: torch.Tensor,
    token_rewards: torch.Tensor | None,
    gamma: float,
    baseline: bool,
    eps: float = 1e-6,
) -> torch.Tensor:
    B = len(rewards)
    valid = []
    for i in range(B):
        ok = math.isfinite(rewards[i])
        if token_rewards is not None:
            ok = ok and all(math.isfinite(float(token_rewards[i, t])) for t in masked_positions(mask, i))
        valid.append(ok)
    R = list(rewards)
    if baseline:
        for i in range(B):
            members = [rewards[j] for j in range(B) if groups[j] == groups[i] and valid[j]]
            R[i] = rewards[i] - sum(members) / len(members) if valid[i] else 0.0
    returns: dict[tuple[int, int], float] = {}
    for i in range(B):
        if not valid[i]:
            continue
        pos = masked_positions(mask, i)
        acc = 0.0
        for k in reversed(range(len(pos))):
            r = float(token_rewards[i, pos[k]]) if token_rewards is not None else 0.0
            if k == len(pos) - 1:
                r += R[i]
            acc = r + gamma * acc
            returns[(i, pos[k])] = acc
    return as_tensor(whiten(returns, eps), tuple(mask.shape))


def test_reinforce_pp_hand_values() -> None:
    # Two rows, gamma 1, no token rewards: returns are [1, 1 | 0, 0, 0, 0] over six valid tokens,
    # mean 1/3, population std sqrt(2)/3.
    mask = right_padded_mask([1, 0], [2, 4], 5)
    adv = reinforce_pp_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), mask)
    hi, lo = (2 / 3) / (math.sqrt(2) / 3), (-1 / 3) / (math.sqrt(2) / 3)
    expected = torch.tensor([[0, hi, hi, 0, 0], [lo, lo, lo, lo, 0]])
    torch.testing.assert_close(adv, expected.float(), rtol=1e-5, atol=1e-6)
    # baseline: group mean 1/2 first -> returns [1/2, 1/2 | -1/2 x4], then whitened the same way.
    base = reinforce_pp_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), mask, baseline=True)
    torch.testing.assert_close(base, expected.float(), rtol=1e-5, atol=1e-6)
    # gamma 0.5 with a token reward: row [tr 1, R 2 at the last token] -> returns [1 + 0.5 * 2, 2].
    one = right_padded_mask([0], [2], 3)
    tr = torch.tensor([[1.0, 0.0, 9.0]])  # 9.0 is outside the mask: ignored
    got = reinforce_pp_advantages(torch.tensor([2.0]), torch.tensor([0]), one, token_rewards=tr, gamma=0.5)
    assert got[0].tolist() == pytest.approx([0.0, 0.0, 0.0], abs=1e-5)  # returns [2, 2]: equal -> 0
    tr = torch.tensor([[3.0, 0.0, 9.0]])
    got = reinforce_pp_advantages(torch.tensor([2.0]), torch.tensor([0]), one, token_rewards=tr, gamma=0.5)
    assert got[0].tolist() == pytest.approx([1.0, -1.0, 0.0], abs=1e-5)  # returns [4, 2]


@pytest.mark.parametrize("baseline", [False, True])
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_pp_matches_loop_formula(baseline: bool, gamma: float) -> None:
    g = torch.Generator().manual_seed(4)
    B, T = 9, 12
    rewards = torch.randn(B, generator=g)
    rewards[2] = float("nan")
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 3])
    mask = right_padded_mask([2, 0, 3, 1, 4, 0, 2, 5, 1], [5, 9, 2, 8, 3, 12, 6, 7, 4], T)
    mask[1, 4] = 0.0  # a tool token inside the response
    token_rewards = 0.1 * torch.randn(B, T, generator=g)
    token_rewards[mask == 0] = float("nan")  # garbage outside the mask must not leak
    got = ReinforcePP(gamma=gamma, baseline=baseline)(
        AdvantageInput(
            rewards=rewards,
            group_ids=groups,
            response_mask=mask,
            token_rewards=token_rewards,
        )
    )
    expected = reference_reinforce_pp(rewards.tolist(), groups.tolist(), mask, token_rewards, gamma, baseline)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-5)


@settings(deadline=None, max_examples=50)
@given(
    rows=st.lists(
        st.tuples(st.floats(-5, 5, allow_nan=False, width=32), st.integers(0, 2), st.integers(0, 3), st.integers(0, 6)),
        min_size=1,
        max_size=10,
    ),
    baseline=st.booleans(),
    gamma=st.sampled_from([1.0, 0.95, 0.5]),
)
def test_reinforce_pp_has_zero_mean_over_valid_tokens(rows, baseline, gamma) -> None:
    rewards = torch.tensor([r for r, *_ in rows])
    groups = torch.tensor([g for _, g, *_ in rows])
    mask = right_padded_mask([p for *_, p, _ in rows], [n for *_, n in rows], 10)
    adv = reinforce_pp_advantages(rewards, groups, mask, gamma=gamma, baseline=baseline).double()
    assert torch.isfinite(adv).all()
    assert torch.equal(adv[mask == 0], torch.zeros_like(adv[mask == 0]))
    n = int(mask.sum())
    if n:
        assert abs(adv[mask != 0].sum().item()) <= 1e-4 * (1 + adv.abs().sum().item())


def test_reinforce_pp_params() -> None:
    with pytest.raises(ValueError, match=r"reinforce_pp\.gamma"):
        ReinforcePP(gamma=1.5)
    with pytest.raises(ValueError, match=r"reinforce_pp\.eps"):
        ReinforcePP(eps=0.0)
    assert ReinforcePP.needs_values is False


# ------------------------------------------------------------------------------ GAE


def reference_gae(
    rewards: list[float],
    values: torch.Tensor,
    mask: torch.Tensor,
    token_rewards: torch.Tensor | None,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    adv: dict[tuple[int, int], float] = {}
    ret: dict[tuple[int, int], float] = {}
    for i, R in enumerate(rewards):
        pos = masked_positions(mask, i)
        n = len(pos)
        r = [float(token_rewards[i, t]) if token_rewards is not None else 0.0 for t in pos]
        if n:
            r[-1] += R
        v = [float(values[i, t]) for t in pos] + [0.0]
        for k in range(n):
            a = sum((gamma * lam) ** (j - k) * (r[j] + gamma * v[j + 1] - v[j]) for j in range(k, n))
            adv[(i, pos[k])] = a
            ret[(i, pos[k])] = a + v[k]
    shape = tuple(mask.shape)
    return as_tensor(adv, shape), as_tensor(ret, shape)


def test_gae_hand_values() -> None:
    # One row of three response tokens after one prompt token; gamma 0.5, lam 0.5.
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.0]])
    values = torch.tensor([[7.0, 1.0, 2.0, 4.0, 7.0]])
    # delta = r + 0.5 V' - V: [0 + 1 - 1, 0 + 2 - 2, 8 + 0 - 4] = [0, 0, 4]; (gamma lam) = 1/4.
    adv = gae_advantages(torch.tensor([8.0]), values, mask, gamma=0.5, lam=0.5)
    assert adv[0].tolist() == pytest.approx([0.0, 0.25, 1.0, 4.0, 0.0])
    ret = gae_returns(torch.tensor([8.0]), values, mask, gamma=0.5, lam=0.5)
    assert ret[0].tolist() == pytest.approx([0.0, 1.25, 3.0, 8.0, 0.0])


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_gae_matches_loop_formula_on_ragged_rows(gamma: float, lam: float) -> None:
    g = torch.Generator().manual_seed(5)
    B, T = 6, 90  # rows longer than one 64-token block
    rewards = torch.randn(B, generator=g)
    mask = right_padded_mask([3, 0, 10, 1, 5, 2], [80, 90, 20, 1, 0, 70], T)
    mask[0, 40:45] = 0.0  # tool tokens inside the response
    values = torch.randn(B, T, generator=g)
    token_rewards = 0.05 * torch.randn(B, T, generator=g)
    values[mask == 0] = float("nan")
    token_rewards[mask == 0] = float("inf")
    inp = AdvantageInput(
        rewards=rewards, group_ids=torch.arange(B), response_mask=mask, token_rewards=token_rewards, values=values
    )
    est = GAE(gamma=gamma, lam=lam)
    exp_adv, exp_ret = reference_gae(rewards.tolist(), values, mask, token_rewards, gamma, lam)
    torch.testing.assert_close(est(inp).double(), exp_adv, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(est.returns(inp).double(), exp_ret, rtol=1e-4, atol=1e-5)


@settings(deadline=None, max_examples=50)
@given(
    rows=st.lists(
        st.tuples(st.floats(-5, 5, allow_nan=False, width=32), st.integers(0, 3), st.integers(0, 6)),
        min_size=1,
        max_size=8,
    ),
    seed=st.integers(0, 2**16),
)
def test_gae_with_unit_gamma_lambda_is_reward_to_go_minus_value(rows, seed) -> None:
    rewards = torch.tensor([r for r, *_ in rows])
    mask = right_padded_mask([p for _, p, _ in rows], [n for *_, n in rows], 10)
    values = torch.randn(len(rows), 10, generator=torch.Generator().manual_seed(seed))
    token_rewards = torch.randn(len(rows), 10, generator=torch.Generator().manual_seed(seed + 1)) * mask
    adv = gae_advantages(rewards, values, mask, token_rewards=token_rewards).double()
    # reward-to-go: suffix sum of token rewards, plus the sequence reward on every token.
    to_go = token_rewards.double().flip(1).cumsum(1).flip(1) + rewards.double()[:, None]
    expected = (to_go - values.double()) * mask
    torch.testing.assert_close(adv, expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(adv[mask == 0], torch.zeros_like(adv[mask == 0]))
    ret = gae_returns(rewards, values, mask, token_rewards=token_rewards).double()
    torch.testing.assert_close(ret, to_go * mask, rtol=1e-4, atol=1e-4)


def test_gae_non_finite_row_and_normalize() -> None:
    mask = right_padded_mask([0, 1, 0], [3, 2, 4], 4)
    values = torch.tensor([[0.5, 0.1, 0.2, 9.0], [9.0, 0.3, float("nan"), 9.0], [0.0, 0.1, 0.2, 0.3]])
    rewards = torch.tensor([1.0, 0.0, float("nan")])
    adv = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.9)
    assert adv[1].tolist() == [0.0] * 4 and adv[2].tolist() == [0.0] * 4  # NaN value, NaN reward
    alone = gae_advantages(rewards[:1], values[:1], mask[:1], gamma=0.9, lam=0.9)
    torch.testing.assert_close(adv[:1], alone)  # the bad rows changed nothing for the good one
    ret = gae_returns(rewards, values, mask, gamma=0.9, lam=0.9)
    assert ret[2].tolist() == pytest.approx([0.0, 0.1, 0.2, 0.3])  # left-out row: returns = V
    norm = GAE(gamma=0.9, lam=0.9, normalize=True)(
        AdvantageInput(
            rewards=rewards,
            group_ids=torch.arange(3),
            response_mask=mask,
            values=values,
        )
    )
    assert torch.isfinite(norm).all() and abs(norm[0, :3].sum().item()) < 1e-5  # only row 0 is valid


def test_gae_params_and_missing_values() -> None:
    assert GAE.needs_values is True
    with pytest.raises(ValueError, match=r"gae: AdvantageInput\.values is None"):
        GAE()(AdvantageInput(rewards=torch.ones(1), group_ids=torch.zeros(1), response_mask=torch.ones(1, 2)))
    for kwargs, key in [({"gamma": -0.1}, "gamma"), ({"lam": 1.1}, "lam"), ({"eps": 0.0}, "eps")]:
        with pytest.raises(ValueError, match=rf"gae\.{key}="):
            GAE(**kwargs)


# ------------------------------------------------------------------------------ all estimators


ESTIMATORS = [
    GRPO(),
    GRPO(scope="batch"),
    GRPO(std_normalize=False),
    RLOO(),
    ReinforcePP(),
    ReinforcePP(baseline=True, gamma=0.9),
    GAE(gamma=0.95, lam=0.9),
]


@pytest.mark.parametrize("est", ESTIMATORS, ids=repr)
def test_zero_outside_mask_and_finite_with_garbage_padding(est) -> None:
    g = torch.Generator().manual_seed(6)
    mask = right_padded_mask([1, 2, 0, 3], [3, 1, 5, 0], 6)
    garbage = torch.full((4, 6), float("nan"))
    inp = AdvantageInput(
        rewards=torch.tensor([1.0, 0.0, 2.0, 1.0]),
        group_ids=torch.tensor([0, 0, 1, 1]),
        response_mask=mask,
        token_rewards=torch.where(mask != 0, 0.1 * torch.randn(4, 6, generator=g), garbage),
        values=torch.where(mask != 0, torch.randn(4, 6, generator=g), garbage),
    )
    adv = est(inp)
    assert adv.shape == (4, 6) and torch.isfinite(adv).all()
    assert torch.equal(adv[mask == 0], torch.zeros_like(adv[mask == 0]))
