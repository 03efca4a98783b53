"""Advantage estimators: ``[B]`` rewards (and groups) in, ``[B, T]`` per-token advantages out.

Each estimator is a pure function whose keyword parameters, with their ranges, are the recipe's
``params``; :func:`loongsage.core.entries.entry` makes the registered entry from it, called with an
``AdvantageInput`` (whose fields feed the function's inputs of the same names).

Conventions shared by all of them:

- Per-token tensors span prompt + response, right-padded; ``response_mask`` selects the response
  tokens that count. Advantages are exactly 0 outside it, whatever the inputs hold there.
- Token-level recursions (returns, GAE) run over each row's masked-in tokens *in order*, skipping
  masked-out positions: tool/user tokens inside a multi-turn response neither advance the discount
  nor carry a value. The sequence reward lands on the row's last masked-in token.
- A row whose reward (or, where used, a token reward or value on its response) is not finite is
  left out of every statistic and gets advantage 0, so one failed scorer cannot poison the batch.
- Statistics are computed in float64; the result comes back in the reward dtype (float32 for
  integer rewards).
"""

from __future__ import annotations

from typing import Annotated, Literal

import torch
from torch import Tensor

from loongsage.core.contracts import AdvantageEstimator
from loongsage.core.entries import Range, entry

_CHUNK = 64  # block size of the blocked discounted cumsum


def _out_dtype(rewards: Tensor) -> torch.dtype:
    return rewards.dtype if rewards.is_floating_point() else torch.float32


def _finite_rewards(rewards: Tensor) -> tuple[Tensor, Tensor]:
    """Float64 rewards with non-finite entries zeroed, and the finite mask ``[B]``."""
    r = rewards.detach().to(torch.float64)
    valid = torch.isfinite(r)
    return torch.where(valid, r, torch.zeros_like(r)), valid


def _group_sum(x: Tensor, group_ids: Tensor) -> Tensor:
    """``[B]``: the sum of ``x`` over each row's group."""
    _, inverse = torch.unique(group_ids, return_inverse=True)
    num_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    return x.new_zeros(num_groups).index_add(0, inverse, x)[inverse]


def _group_sums(r: Tensor, valid: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor]:
    """Per-row ``(count, total)`` over the valid rows of its group."""
    w = valid.to(r.dtype)
    return _group_sum(w, group_ids), _group_sum(r * w, group_ids)


def _masked_whiten(x: Tensor, mask: Tensor, eps: float) -> Tensor:
    """``(x - mean) / (std + eps)`` over the tokens where ``mask``; 0 elsewhere.

    Population std (divide by the token count): token counts are large, and a batch of one valid
    token then gives 0 rather than 0/0.
    """
    w = mask.to(x.dtype)
    n = w.sum()
    if n == 0:
        return torch.zeros_like(x)
    mean = (x * w).sum() / n
    centered = (x - mean) * w
    std = ((centered**2).sum() / n).sqrt()
    return centered / (std + eps)


def discounted_cumsum(x: Tensor, discount: float) -> Tensor:
    """Reverse discounted cumulative sum along the last dim: ``y_t = sum_{k >= t} c^(k-t) x_k``.

    Blocked: each block of 64 is one small matmul, and the values carried between blocks are the
    same recursion one level up (discount ``c^64``), so there is no Python loop over ``T``.
    Exact for ``c = 0`` (``0^0 = 1``) and ``c = 1``; use float64 inputs for long sequences.
    """
    T = x.shape[-1]
    steps = torch.arange(min(T, _CHUNK), dtype=x.dtype, device=x.device)
    lag = steps[:, None] - steps[None, :]  # lag[k, t] = k - t
    base = torch.tensor(discount, dtype=x.dtype, device=x.device)
    powers = torch.where(lag >= 0, base.pow(lag.clamp(min=0)), torch.zeros_like(lag))
    if T <= _CHUNK:
        return x @ powers
    n = -(-T // _CHUNK)
    padded = torch.nn.functional.pad(x, (0, n * _CHUNK - T))
    local = padded.unflatten(-1, (n, _CHUNK)) @ powers  # [..., n, K]: sums within each block
    heads = discounted_cumsum(local[..., 0], discount**_CHUNK)  # [..., n]: full value at block starts
    after = torch.nn.functional.pad(heads[..., 1:], (0, 1))  # value at the next block's start
    to_next = base.pow(_CHUNK - steps)  # c^(K - j): distance from position j to the next block
    return (local + after[..., None] * to_next).flatten(-2)[..., :T]


class _Compact:
    """Each row's masked-in tokens moved to the front, in order; the inverse puts them back."""

    def __init__(self, response_mask: Tensor) -> None:
        self.valid = response_mask != 0
        # A stable sort of "is masked out" lists the masked-in positions first, in position order.
        self.order = torch.sort((~self.valid).to(torch.int8), dim=1, stable=True).indices
        self.count = self.valid.sum(dim=1)
        T = response_mask.shape[1]
        self.live = torch.arange(T, device=response_mask.device)[None, :] < self.count[:, None]

    def gather(self, x: Tensor) -> Tensor:
        """``[B, T]`` -> compact ``[B, T]``; positions past each row's count are 0."""
        out = x.gather(1, self.order)
        return torch.where(self.live, out, torch.zeros_like(out))

    def scatter(self, compact: Tensor) -> Tensor:
        """Compact ``[B, T]`` -> original layout, 0 outside ``response_mask``."""
        out = torch.zeros_like(compact).scatter(1, self.order, compact)
        return torch.where(self.valid, out, torch.zeros_like(out))

    def add_at_last(self, compact: Tensor, per_row: Tensor) -> Tensor:
        """Add ``per_row [B]`` at each row's last masked-in token (rows with none: nothing)."""
        last = (self.count - 1).clamp(min=0)[:, None]
        value = torch.where(self.count > 0, per_row, torch.zeros_like(per_row))[:, None]
        return compact.scatter_add(1, last, value.to(compact.dtype))


def _row_finite(x: Tensor | None, mask: Tensor) -> Tensor:
    """``[B]``: True where ``x`` is finite on every masked-in token (True if ``x`` is None)."""
    if x is None:
        return torch.ones(mask.shape[0], dtype=torch.bool, device=mask.device)
    return (torch.isfinite(x) | ~mask).all(dim=1)


def _masked_f64(x: Tensor | None, mask: Tensor) -> Tensor:
    """``x`` as float64 with every masked-out or non-finite entry set to 0."""
    if x is None:
        return torch.zeros(mask.shape, dtype=torch.float64, device=mask.device)
    x = x.detach().to(torch.float64)
    return torch.where(mask & torch.isfinite(x), x, torch.zeros_like(x))


# --------------------------------------------------------------------------------------- GRPO


def grpo_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    response_mask: Tensor,
    *,
    std_normalize: bool = True,
    scope: Literal["group", "batch"] = "group",
    eps: Annotated[float, Range(gt=0)] = 1e-6,  # added to the std: an all-equal group gives 0, not 0/0
) -> Tensor:
    """Group-relative advantages, one value per sequence broadcast over its response tokens.

    For row ``i`` in group ``g`` with ``n_g`` rows::

        A_i = (R_i - mean_g(R)) / (std_g(R) + eps)   if std_normalize   (GRPO)
        A_i =  R_i - mean_g(R)                        otherwise          (Dr.GRPO)

    With ``scope="batch"`` the statistics are taken over all rows of the batch instead of the
    row's group (the GRPO batch variant); ``group_ids`` are then ignored.

    ``std_g`` is the unbiased (n - 1) standard deviation, as in TRL and verl. A group of one row
    has no baseline, so its advantage is 0. Rows with a non-finite reward (a failed scorer) are
    left out of their group's statistics and get advantage 0 instead of skewing the baseline.

    Shapes: ``rewards [B]``, ``group_ids [B]`` (any integers), ``response_mask [B, T]``.
    Returns ``[B, T]`` in the reward dtype: ``A_i * response_mask``.
    """
    if scope == "batch":
        group_ids = torch.zeros_like(group_ids)
    elif scope != "group":
        raise ValueError(f"scope={scope!r}: must be 'group' or 'batch'")
    r, valid = _finite_rewards(rewards)
    count, total = _group_sums(r, valid, group_ids)
    centered = (r - total / count.clamp(min=1.0)) * valid.to(r.dtype)

    adv = centered
    if std_normalize:
        std = (_group_sum(centered**2, group_ids) / (count - 1.0).clamp(min=1.0)).sqrt()
        adv = centered / (std + eps)
    adv = torch.where(count > 1, adv, torch.zeros_like(adv))

    out_dtype = _out_dtype(rewards)
    return adv.to(out_dtype)[:, None] * response_mask.to(out_dtype)


@entry("grpo", grpo_advantages)
class GRPO(AdvantageEstimator):
    """``grpo``: group z-score (``std_normalize=True``) or Dr.GRPO mean-centring (``False``).

    ``scope="batch"`` takes mean and std over the whole batch instead of each group.
    """

    @property
    def min_group_size(self) -> int:  # a group of one is its own mean: advantage 0
        return 2 if self.scope == "group" else 1


# --------------------------------------------------------------------------------------- RLOO


def rloo_advantages(rewards: Tensor, group_ids: Tensor, response_mask: Tensor) -> Tensor:
    """REINFORCE leave-one-out: each row's baseline is the mean of the *other* rows of its group.

    For row ``i`` in group ``g`` with ``n_g`` valid rows::

        A_i = R_i - (sum_g(R) - R_i) / (n_g - 1)  =  n_g / (n_g - 1) * (R_i - mean_g(R))

    so the advantages of a group sum to 0. A group of one row has no other rows: advantage 0.
    Rows with a non-finite reward are left out of ``n_g`` and the sums and get advantage 0.

    Shapes: ``rewards [B]``, ``group_ids [B]``, ``response_mask [B, T]``.
    Returns ``[B, T]`` in the reward dtype: ``A_i * response_mask``.
    """
    r, valid = _finite_rewards(rewards)
    count, total = _group_sums(r, valid, group_ids)
    others = (total - r) / (count - 1.0).clamp(min=1.0)
    adv = torch.where(valid & (count > 1), r - others, torch.zeros_like(r))
    out_dtype = _out_dtype(rewards)
    return adv.to(out_dtype)[:, None] * response_mask.to(out_dtype)


@entry("rloo", rloo_advantages, min_group_size=2)  # a group of one has no other rows: advantage 0
class RLOO(AdvantageEstimator):
    """``rloo``: leave-one-out baseline within each group; no parameters."""


# ------------------------------------------------------------------------------- REINFORCE++


def reinforce_pp_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    response_mask: Tensor,
    *,
    token_rewards: Tensor | None = None,
    gamma: Annotated[float, Range(ge=0, le=1)] = 1.0,
    baseline: bool = False,
    eps: Annotated[float, Range(gt=0)] = 1e-6,
) -> Tensor:
    """REINFORCE++: batch-normalised discounted returns (``baseline``: REINFORCE++-baseline).

    Per row, ``R'_i = R_i - mean_g(R)`` with ``baseline`` (group mean over valid rows), else
    ``R'_i = R_i``. Over the row's response tokens ``t_1 < ... < t_n`` (masked-in positions only)
    the per-token reward is ``r_k = token_rewards[t_k] + R'_i * [k = n]`` and the return is::

        G_k = sum_{j >= k} gamma^(j - k) r_j

    The advantage is ``G`` whitened over every valid token of the batch::

        A = (G - mean(G)) / (std(G) + eps)      (population std over valid tokens)

    With ``gamma = 1`` and no token rewards every token of row ``i`` carries ``R'_i``.
    Valid tokens: masked-in tokens of rows whose reward and token rewards are finite; all others
    get 0 and do not enter the statistics.

    Shapes: ``rewards [B]``, ``group_ids [B]``, ``response_mask [B, T]``, ``token_rewards [B, T]``.
    Returns ``[B, T]`` in the reward dtype, zero outside ``response_mask``.
    """
    mask = response_mask != 0
    r, valid = _finite_rewards(rewards)
    valid = valid & _row_finite(token_rewards, mask)
    r = torch.where(valid, r, torch.zeros_like(r))
    if baseline:
        count, total = _group_sums(r, valid, group_ids)
        r = torch.where(valid, r - total / count.clamp(min=1.0), torch.zeros_like(r))

    compact = _Compact(response_mask)
    per_token = compact.add_at_last(compact.gather(_masked_f64(token_rewards, mask)), r)
    returns = compact.scatter(discounted_cumsum(per_token, gamma))
    adv = _masked_whiten(returns, mask & valid[:, None], eps)
    return adv.to(_out_dtype(rewards))


@entry("reinforce_pp", reinforce_pp_advantages, uses_token_rewards=True)
class ReinforcePP(AdvantageEstimator):
    """``reinforce_pp``: REINFORCE++ (``baseline=True``: subtract the group mean reward first)."""


# ---------------------------------------------------------------------------------------- GAE


def _gae(
    rewards: Tensor,
    values: Tensor,
    response_mask: Tensor,
    token_rewards: Tensor | None,
    gamma: float,
    lam: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Float64 ``(advantages, returns, valid_rows, mask)`` in the original layout."""
    mask = response_mask != 0
    r, valid = _finite_rewards(rewards)
    valid = valid & _row_finite(token_rewards, mask) & _row_finite(values, mask)
    v = _masked_f64(values, mask)

    compact = _Compact(response_mask)
    per_token = compact.add_at_last(compact.gather(_masked_f64(token_rewards, mask)), r)
    v_c = compact.gather(v)
    v_next = torch.nn.functional.pad(v_c[:, 1:], (0, 1))  # 0 after each row's last token (terminal)
    delta = per_token + gamma * v_next - v_c
    adv = compact.scatter(discounted_cumsum(delta, gamma * lam))
    adv = torch.where(valid[:, None], adv, torch.zeros_like(adv))
    return adv, adv + v, valid, mask


def gae_advantages(
    rewards: Tensor,
    values: Tensor,
    response_mask: Tensor,
    *,
    token_rewards: Tensor | None = None,
    gamma: Annotated[float, Range(ge=0, le=1)] = 1.0,
    lam: Annotated[float, Range(ge=0, le=1)] = 1.0,
    normalize: bool = False,
    eps: Annotated[float, Range(gt=0)] = 1e-6,
) -> Tensor:
    """Generalised advantage estimation over each row's response tokens.

    Over the row's masked-in tokens ``t_1 < ... < t_n`` with values ``V_k = values[t_k]``
    (``V_{n+1} = 0``: the response ends the episode) and per-token rewards
    ``r_k = token_rewards[t_k] + R_i * [k = n]``::

        delta_k = r_k + gamma * V_{k+1} - V_k
        A_k     = sum_{j >= k} (gamma * lam)^(j - k) delta_j

    With ``lam = gamma = 1`` this is the reward-to-go minus the value. ``normalize`` whitens the
    advantages over the batch's valid tokens (the returns are not affected). ``values`` at
    ``t`` is the critic's estimate before token ``t`` is generated; it is treated as a constant.
    Rows with a non-finite reward, token reward or value on their response get advantage 0.

    Shapes: ``rewards [B]``, ``values [B, T]``, ``response_mask [B, T]``, ``token_rewards [B, T]``.
    Returns ``[B, T]`` in the reward dtype, zero outside ``response_mask``.
    """
    adv, _, valid, mask = _gae(rewards, values, response_mask, token_rewards, gamma, lam)
    if normalize:
        adv = _masked_whiten(adv, mask & valid[:, None], eps)
    return adv.to(_out_dtype(rewards))


def gae_returns(
    rewards: Tensor,
    values: Tensor,
    response_mask: Tensor,
    *,
    token_rewards: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> Tensor:
    """Critic targets ``returns = A + V`` (unnormalised GAE advantages), the value loss's target.

    Same inputs and conventions as :func:`gae_advantages`; zero outside ``response_mask``. A row
    left out for a non-finite input gets ``returns = V`` (0 where ``V`` itself is not finite), so
    it pulls the critic nowhere.
    """
    _, returns, _, _ = _gae(rewards, values, response_mask, token_rewards, gamma, lam)
    return returns.to(_out_dtype(rewards))


@entry("gae", gae_advantages, needs_values=True, uses_token_rewards=True, returns=gae_returns)
class GAE(AdvantageEstimator):
    """``gae``: PPO with a critic; ``normalize`` whitens the advantages over the batch."""
