"""IS (token/sequence/geometric x clip/mask, veto), decoupled PPO's behaviour weight, M2PO and OPSM against
hand values and float64 loops."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loongsage.algos.corrections import (
    M2PO,
    OPSM,
    Decoupled,
    ImportanceSampling,
    decoupled_correction,
    is_correction,
    m2po_correction,
    opsm_correction,
)
from loongsage.algos.policy_losses import PPOClip
from loongsage.core.loss import LossPlan
from loongsage.core.types import CorrectionInput, TrainBatch


def inp(old, rollout, adv, mask, logprobs=None) -> CorrectionInput:
    return CorrectionInput(
        old_logprobs=torch.as_tensor(old, dtype=torch.float64),
        rollout_logprobs=torch.as_tensor(rollout, dtype=torch.float64),
        advantages=torch.as_tensor(adv, dtype=torch.float64),
        response_mask=torch.as_tensor(mask, dtype=torch.float64),
        logprobs=None if logprobs is None else torch.as_tensor(logprobs, dtype=torch.float64),
    )


def random_input(seed: int, rows: int = 6, cols: int = 8, scale: float = 0.6) -> CorrectionInput:
    g = torch.Generator().manual_seed(seed)
    rollout = -2 * torch.rand(rows, cols, generator=g, dtype=torch.float64)
    old = rollout + scale * torch.randn(rows, cols, generator=g, dtype=torch.float64)
    adv = torch.randn(rows, 1, generator=g, dtype=torch.float64).expand(rows, cols).clone()
    mask = (torch.rand(rows, cols, generator=g) < 0.75).double()
    mask[0] = 0.0  # an empty row
    return CorrectionInput(old, rollout, adv * mask, mask)


# ----------------------------------------------------------------------------- float64 references


def reference_is(c: CorrectionInput, level: str, mode: str, low: float, high: float, veto: float | None):
    """(token_weights, mask) as nested lists, from plain loops over each row.

    A weight is None where it cannot matter: on a token the mask removes (mask mode)."""
    weights, masks = [], []
    for old, ro, m in zip(c.old_logprobs.tolist(), c.rollout_logprobs.tolist(), c.response_mask.tolist(), strict=True):
        deltas = [max(-20.0, min(20.0, o - r)) for o, r in zip(old, ro, strict=True)]
        valid = [d for d, x in zip(deltas, m, strict=True) if x]
        seq = {"sequence": sum(valid), "geometric": sum(valid) / max(len(valid), 1)}
        row_w, row_m = [], []
        vetoed = veto is not None and any(math.exp(d) < veto for d in valid)
        for d, x in zip(deltas, m, strict=True):
            w = math.exp(d if level == "token" else seq[level])
            inside = low <= w <= high
            if not x:
                row_w.append(1.0)
                row_m.append(0.0)
            elif mode == "clip":
                row_w.append(min(max(w, low), high))
                row_m.append(0.0 if vetoed else 1.0)
            else:  # MIS / IcePop: kept tokens carry their raw IS weight, the others leave the mask
                kept = inside and not vetoed
                row_w.append(w if kept else None)
                row_m.append(1.0 if kept else 0.0)
        weights.append(row_w)
        masks.append(row_m)
    return weights, masks


def reference_m2po(values: list[float], tau: float) -> set[int]:
    """Indices (into ``values``) removed: drop the largest one at a time until the mean of the rest is <= tau."""
    order = sorted(range(len(values)), key=lambda k: (values[k], k))
    for removed in range(len(values) + 1):
        kept = order[: len(values) - removed]
        if not kept or sum(values[k] for k in kept) / len(kept) <= tau:
            return set(order[len(values) - removed :])
    raise AssertionError("unreachable")


def reference_opsm_seq_kl(target: list[float], source: list[float], m: list[float]) -> float:
    """k1 KL(source || target) of one row: the mean of log source - log target over its valid tokens."""
    gaps = [max(-20.0, min(20.0, r - t)) for t, r, x in zip(target, source, m, strict=True) if x]
    return sum(gaps) / max(len(gaps), 1)


# ------------------------------------------------------------------------------------------- IS


def test_is_hand_values() -> None:
    # delta = [0, 0.5, -1, x] on one row (last token padding): w = [1, 1.649, 0.368].
    c = inp([[0.0, 0.5, -1.0, 9.0]], [[0.0, 0.0, 0.0, 0.0]], [[1.0] * 4], [[1.0, 1.0, 1.0, 0.0]])
    tis = ImportanceSampling()(c)  # token, clip [0.5, 2]
    assert tis.token_weights[0].tolist() == pytest.approx([1.0, math.exp(0.5), 0.5, 1.0])
    assert tis.response_mask.tolist() == c.response_mask.tolist()
    assert tis.metrics["is_clipfrac"][0].tolist() == [0.0, 0.0, 1.0, 0.0]
    assert tis.metrics["is_weight_mean"][0].tolist() == pytest.approx([1.0, math.exp(0.5), math.exp(-1.0), 0.0])

    mis = ImportanceSampling(mode="mask")(c)  # MIS / IcePop: kept tokens keep their raw weight w
    assert mis.token_weights[0, :2].tolist() == pytest.approx([1.0, math.exp(0.5)])
    assert mis.response_mask[0].tolist() == [1.0, 1.0, 0.0, 0.0]
    assert mis.metrics["is_maskfrac"][0].tolist() == [0.0, 0.0, 1.0, 0.0]

    # Sequence: exp(0 + 0.5 - 1) = 0.607 (inside); geometric exp(-0.5 / 3) = 0.846 (inside).
    seq = ImportanceSampling(level="sequence", low=0.7)(c)
    assert seq.token_weights[0].tolist() == pytest.approx([0.7, 0.7, 0.7, 1.0])
    seq_mask = ImportanceSampling(level="sequence", mode="mask", low=0.7)(c)
    assert seq_mask.response_mask.tolist() == [[0.0] * 4]
    geo = ImportanceSampling(level="geometric", mode="mask", low=0.7)(c)
    assert geo.response_mask.tolist() == c.response_mask.tolist()
    assert geo.token_weights[0, :3].tolist() == pytest.approx([math.exp(-0.5 / 3)] * 3)  # kept: raw w
    assert geo.metrics["is_weight_mean"][0].tolist() == pytest.approx([math.exp(-0.5 / 3)] * 3 + [0.0])

    # Veto 0.4: the token with w = 0.368 drops the whole row, in clip mode too.
    vetoed = ImportanceSampling(veto=0.4)(c)
    assert vetoed.response_mask.tolist() == [[0.0] * 4]
    assert vetoed.metrics["is_vetofrac"][0].tolist() == [1.0, 1.0, 1.0, 0.0]
    assert ImportanceSampling(veto=0.3)(c).response_mask.tolist() == c.response_mask.tolist()


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("mode", ["clip", "mask"])
@pytest.mark.parametrize("veto", [None, 0.4])
def test_is_matches_loop_formula(level: str, mode: str, veto: float | None) -> None:
    c = random_input(11, scale=2.5 if level == "geometric" else 0.6)  # spread the weights around [0.5, 2]
    low, high = 0.5, 2.0
    out = ImportanceSampling(level=level, mode=mode, low=low, high=high, veto=veto)(c)
    weights, masks = reference_is(c, level, mode, low, high, veto)
    for got_row, want_row in zip(out.token_weights.tolist(), weights, strict=True):
        for got, want in zip(got_row, want_row, strict=True):
            if want is not None:
                assert got == pytest.approx(want, rel=1e-12)
    assert out.response_mask.tolist() == masks
    kept = out.response_mask != 0
    if mode == "mask" and kept.any():  # kept tokens really carry weights other than 1
        assert (out.token_weights[kept] != 1).all()
    changed = (out.token_weights != 1).any() if mode == "clip" else (out.response_mask != c.response_mask).any()
    assert changed  # the data exercises the bounds
    if veto is not None:
        assert out.metrics["is_vetofrac"].sum() > 0


def test_is_sequence_weight_of_a_long_sequence_stays_finite() -> None:
    delta = torch.full((1, 4096), 0.5, dtype=torch.float64)
    out = is_correction(delta, torch.zeros_like(delta), torch.ones_like(delta), level="sequence", mode="clip")
    torch.testing.assert_close(out.token_weights, torch.full_like(delta, 2.0))
    assert torch.isfinite(out.metrics["is_weight_mean"]).all()
    low0 = is_correction(-delta, torch.zeros_like(delta), torch.ones_like(delta), level="sequence", low=0.0)
    assert (low0.token_weights < 1e-300).all() and low0.metrics["is_clipfrac"].sum() == 0  # low = 0: no bound


# ----------------------------------------------------------------------------------------- M2PO


def test_m2po_hand_values() -> None:
    # delta^2 = [0, 0.25, 1] (+ padding). tau 0.1: keeping {0, 0.25} has mean 0.125 > 0.1 -> keep only {0}.
    c = inp([[0.0, 0.5, -1.0, 30.0]], [[0.0] * 4], [[1.0, 1.0, 1.0, 1.0]], [[1.0, 1.0, 1.0, 0.0]])
    out = M2PO(tau=0.1)(c)
    assert out.response_mask[0].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert out.token_weights.tolist() == [[1.0] * 4]
    assert out.metrics["m2po_masked_frac"][0].tolist() == [0.0, 1.0, 1.0, 0.0]
    assert out.metrics["m2po_mean_delta2"][0].tolist() == [0.0, 0.25, 1.0, 0.0]
    assert M2PO(tau=0.2)(c).response_mask[0].tolist() == [1.0, 1.0, 0.0, 0.0]  # mean 0.125 <= 0.2
    assert M2PO(tau=0.5)(c).response_mask[0].tolist() == [1.0, 1.0, 1.0, 0.0]  # mean 0.417 <= 0.5

    # harmful_only with A = +1: only delta > 0 (r > 1) may go; delta = -1 (r < 1) stays and is not counted.
    harmful = M2PO(tau=0.1, harmful_only=True)(c)
    assert harmful.response_mask[0].tolist() == [1.0, 0.0, 1.0, 0.0]
    flipped = M2PO(tau=0.1, harmful_only=True)(inp(c.old_logprobs, c.rollout_logprobs, -c.advantages, c.response_mask))
    assert flipped.response_mask[0].tolist() == [1.0, 1.0, 0.0, 0.0]


def test_m2po_masks_everything_when_even_the_smallest_exceeds_tau() -> None:
    c = inp([[0.5, -0.6]], [[0.0, 0.0]], [[1.0, 1.0]], [[1.0, 1.0]])
    assert M2PO(tau=0.04)(c).response_mask.tolist() == [[0.0, 0.0]]


@pytest.mark.parametrize("harmful_only", [False, True])
def test_m2po_matches_loop_formula_over_the_whole_mini_batch(harmful_only: bool) -> None:
    c = random_input(3, rows=8, cols=12, scale=0.3)
    out = m2po_correction(
        c.old_logprobs, c.rollout_logprobs, c.advantages, c.response_mask, tau=0.04, harmful_only=harmful_only
    )
    positions, values = [], []
    for i, (old, ro, adv, m) in enumerate(
        zip(
            c.old_logprobs.tolist(),
            c.rollout_logprobs.tolist(),
            c.advantages.tolist(),
            c.response_mask.tolist(),
            strict=True,
        )
    ):
        for t in range(len(m)):
            d = max(-20.0, min(20.0, old[t] - ro[t]))
            harmful = (adv[t] > 0 and d > 0) or (adv[t] < 0 and d < 0)
            if m[t] and (harmful or not harmful_only):
                positions.append((i, t))
                values.append(d * d)
    removed = {positions[k] for k in reference_m2po(values, 0.04)}
    assert 0 < len(removed) < len(values)
    expected = [
        [0.0 if (i, t) in removed or not m else 1.0 for t, m in enumerate(row)]
        for i, row in enumerate(c.response_mask.tolist())
    ]
    assert out.response_mask.tolist() == expected


# ----------------------------------------------------------------------------------------- OPSM


def test_opsm_hand_values() -> None:
    # reference rollout, no current log-probs: KL_i = mean(rollout - old). Row 0: -(0.5 - 1)/2 = 0.25,
    # A < 0 -> zeroed. Row 1: same KL, A > 0 -> kept. Row 2: KL = -0.25 (old more likely), A < 0 -> kept.
    old = [[0.5, -1.0, 7.0], [0.5, -1.0, 0.0], [-0.5, 1.0, 0.0]]
    ro = [[0.0] * 3] * 3
    adv = [[-1.0, -1.0, -1.0], [1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]]
    mask = [[1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [1.0, 1.0, 0.0]]
    out = OPSM(delta=0.1, reference="rollout")(inp(old, ro, adv, mask))
    assert out.token_weights.tolist() == [[0.0, 0.0, 1.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]
    assert out.response_mask.tolist() == mask  # denominator unchanged
    assert out.metrics["opsm_clipfrac"].tolist() == [[1.0, 1.0, 0.0], [0.0] * 3, [0.0] * 3]
    assert out.metrics["opsm_seq_kl"][:, 0].tolist() == pytest.approx([0.25, 0.25, -0.25])
    assert OPSM(delta=0.3, reference="rollout")(inp(old, ro, adv, mask)).token_weights.tolist() == [[1.0] * 3] * 3

    # reference rollout, current log-probs: KL_i = mean(rollout - current).
    current = [[-1.0, -1.0, 0.0], [0.0] * 3, [0.0] * 3]  # row 0: KL = 1; row 2: KL = 0
    with_current = OPSM(delta=0.1, reference="rollout")(inp(old, ro, adv, mask, logprobs=current))
    assert with_current.token_weights.tolist() == [[0.0, 0.0, 1.0], [1.0] * 3, [1.0] * 3]
    assert with_current.metrics["opsm_seq_kl"][:, 0].tolist() == pytest.approx([1.0, 0.0, 0.0])

    # reference old (the default): KL_i = mean(old - current); the engine's log-probs play no part.
    # Row 0: (0.5 + 1 - 1 + 1) / 2 = 0.75 -> zeroed; row 2: (-0.5 + 1) / 2 = 0.25 -> zeroed.
    by_old = OPSM(delta=0.1)(inp(old, ro, adv, mask, logprobs=current))
    assert by_old.metrics["opsm_seq_kl"][:, 0].tolist() == pytest.approx([0.75, -0.25, 0.25])
    assert by_old.token_weights.tolist() == [[0.0, 0.0, 1.0], [1.0] * 3, [0.0, 0.0, 1.0]]
    assert OPSM(delta=0.3)(inp(old, ro, adv, mask, logprobs=current)).token_weights[2].tolist() == [1.0] * 3
    # engine mismatch alone (current = old): the old reference sees no drift, the rollout one does
    assert OPSM(delta=0.1)(inp(old, ro, adv, mask, logprobs=old)).token_weights.tolist() == [[1.0] * 3] * 3
    assert OPSM(delta=0.1)(inp(old, ro, adv, mask)).token_weights.tolist() == [[1.0] * 3] * 3  # target = old
    assert OPSM(delta=0.1, reference="rollout")(inp(old, ro, adv, mask, logprobs=old)).token_weights[0].tolist() == [
        0.0,
        0.0,
        1.0,
    ]


@pytest.mark.parametrize("reference", ["old", "rollout"])
def test_opsm_matches_loop_formula_with_token_level_advantages(reference: str) -> None:
    c = random_input(8, scale=0.05)
    g = torch.Generator().manual_seed(1)
    adv = torch.randn(c.advantages.shape, generator=g, dtype=torch.float64)  # GAE-like: varies per token
    current = c.old_logprobs + 0.05 * torch.randn(c.advantages.shape, generator=g, dtype=torch.float64)
    source = (c.old_logprobs if reference == "old" else c.rollout_logprobs).tolist()
    for target in (None, current) if reference == "rollout" else (current,):
        out = opsm_correction(
            c.old_logprobs, c.rollout_logprobs, adv, c.response_mask, logprobs=target, delta=1e-3, reference=reference
        )
        ref_target = (c.old_logprobs if target is None else target).tolist()
        n_zero = 0
        for i, m in enumerate(c.response_mask.tolist()):
            kl = reference_opsm_seq_kl(ref_target[i], source[i], m)
            for t, x in enumerate(m):
                zeroed = bool(x) and adv[i, t].item() < 0 and kl > 1e-3
                assert out.token_weights[i, t].item() == (0.0 if zeroed else 1.0)
                n_zero += zeroed
        assert n_zero > 0


# ------------------------------------------------------------------------ decoupled PPO


def test_decoupled_hand_values() -> None:
    """w = pi_proximal / pi_behaviour per token, no lower bound; above the cap masked or clipped."""
    proximal = [[0.0, 0.0, math.log(8.0), 0.0]]
    behaviour = [[0.0, math.log(4.0), 0.0, 0.0]]  # w = 1, 1/4, 8, (padding)
    mask = [[1.0, 1.0, 1.0, 0.0]]
    masked = Decoupled()(inp(proximal, behaviour, [[1.0] * 4], mask))
    torch.testing.assert_close(masked.response_mask, torch.tensor([[1.0, 1.0, 0.0, 0.0]], dtype=torch.float64))
    torch.testing.assert_close(masked.token_weights, torch.tensor([[1.0, 0.25, 5.0, 1.0]], dtype=torch.float64))
    torch.testing.assert_close(
        masked.metrics["decoupled_maskfrac"], torch.tensor([[0.0, 0.0, 1.0, 0.0]], dtype=torch.float64)
    )
    torch.testing.assert_close(
        masked.metrics["decoupled_weight_mean"], torch.tensor([[1.0, 0.25, 8.0, 0.0]], dtype=torch.float64)
    )
    clipped = Decoupled(mode="clip")(inp(proximal, behaviour, [[1.0] * 4], mask))
    assert torch.equal(clipped.response_mask, masked.response_mask.new_tensor(mask))  # denominator kept
    torch.testing.assert_close(clipped.token_weights, torch.tensor([[1.0, 0.25, 5.0, 1.0]], dtype=torch.float64))
    assert set(clipped.metrics) == {"decoupled_weight_mean", "decoupled_clipfrac"}
    free = decoupled_correction(*(torch.tensor(x, dtype=torch.float64) for x in (proximal, behaviour, mask)), cap=None)
    torch.testing.assert_close(free.token_weights, torch.tensor([[1.0, 0.25, 8.0, 1.0]], dtype=torch.float64))
    assert torch.equal(free.response_mask, torch.tensor(mask, dtype=torch.float64))


@settings(deadline=None, max_examples=40)
@given(seed=st.integers(0, 2**16), cap=st.sampled_from([1.5, 2.0, 5.0]), mode=st.sampled_from(["clip", "mask"]))
def test_decoupled_matches_a_float64_loop(seed, cap, mode) -> None:
    g = torch.Generator().manual_seed(seed)
    behaviour = -3 * torch.rand(3, 6, generator=g, dtype=torch.float64)
    proximal = behaviour + torch.randn(3, 6, generator=g, dtype=torch.float64)
    mask = (torch.rand(3, 6, generator=g) < 0.7).double()
    out = Decoupled(cap=cap, mode=mode)(inp(proximal, behaviour, torch.zeros(3, 6), mask))
    for i in range(3):
        for t in range(6):
            w = math.exp(proximal[i, t].item() - behaviour[i, t].item())
            on = mask[i, t].item() == 1.0
            dropped = on and mode == "mask" and w > cap
            assert out.response_mask[i, t].item() == (0.0 if dropped or not on else 1.0)
            expected = min(w, cap) if on else 1.0
            assert out.token_weights[i, t].item() == pytest.approx(expected, rel=1e-12)


# ----------------------------------------------------------- properties over all the corrections

CORRECTIONS = [
    *[
        ImportanceSampling(level=lv, mode=md, veto=vt)
        for lv in ("token", "sequence", "geometric")
        for md in ("clip", "mask")
        for vt in (None, 0.5)
    ],
    ImportanceSampling(low=0.0, high=1.0),
    Decoupled(),
    Decoupled(mode="clip", cap=1.5),
    Decoupled(cap=None),
    M2PO(),
    M2PO(tau=0.01, harmful_only=True),
    OPSM(),
    OPSM(delta=0.0),
    OPSM(delta=1e-4, reference="rollout"),
    OPSM(delta=0.0, reference="rollout"),
]

rows_st = st.integers(1, 4)
cols_st = st.integers(1, 8)


@settings(deadline=None, max_examples=40)
@given(seed=st.integers(0, 2**16), rows=rows_st, cols=cols_st)
def test_no_mismatch_means_no_correction(seed, rows, cols) -> None:
    g = torch.Generator().manual_seed(seed)
    lp = -3 * torch.rand(rows, cols, generator=g)
    adv = torch.randn(rows, cols, generator=g)
    mask = (torch.rand(rows, cols, generator=g) < 0.7).float()
    c = CorrectionInput(lp, lp.clone(), adv, mask)
    for correction in CORRECTIONS:
        out = correction(c)
        assert torch.equal(out.token_weights, torch.ones_like(lp)), correction
        assert torch.equal(out.response_mask, mask), correction


@settings(deadline=None, max_examples=40)
@given(
    seed=st.integers(0, 2**16),
    rows=rows_st,
    cols=cols_st,
    scale=st.sampled_from([0.01, 0.3, 3.0, 100.0]),
    garbage=st.sampled_from([1e4, -1e4, float("inf"), float("-inf"), float("nan")]),
)
def test_masks_only_turn_tokens_off_and_padding_is_ignored(seed, rows, cols, scale, garbage) -> None:
    g = torch.Generator().manual_seed(seed)
    ro = -3 * torch.rand(rows, cols, generator=g)
    old = ro + scale * torch.randn(rows, cols, generator=g)
    cur = old + scale * torch.randn(rows, cols, generator=g)
    adv = torch.randn(rows, cols, generator=g)
    mask = (torch.rand(rows, cols, generator=g) < 0.6).float()
    pad = mask == 0
    clean = CorrectionInput(old, ro, adv, mask, logprobs=cur)
    dirty = CorrectionInput(
        *(x.masked_fill(pad, garbage) for x in (old, ro, adv)), mask, logprobs=cur.masked_fill(pad, garbage)
    )
    for correction in CORRECTIONS:
        out, ref = correction(dirty), correction(clean)
        assert torch.equal(out.response_mask, ref.response_mask), correction
        assert torch.equal(out.token_weights, ref.token_weights), correction
        assert ((out.response_mask == 0) | (out.response_mask == mask)).all(), correction
        assert (out.response_mask[pad] == 0).all(), correction
        assert (out.token_weights[pad] == 1).all() and torch.isfinite(out.token_weights).all(), correction
        assert (out.token_weights >= 0).all(), correction
        for name, value in out.metrics.items():
            assert torch.isfinite(value).all() and (value[pad] == 0).all(), (correction, name)
            torch.testing.assert_close(value, ref.metrics[name])


@settings(deadline=None, max_examples=40)
@given(seed=st.integers(0, 2**16), rows=rows_st, cols=cols_st, delta=st.sampled_from([0.0, 1e-4, 0.05]))
def test_opsm_only_touches_negative_advantages_and_never_the_mask(seed, rows, cols, delta) -> None:
    g = torch.Generator().manual_seed(seed)
    ro = -3 * torch.rand(rows, cols, generator=g)
    old = ro + 0.3 * torch.randn(rows, cols, generator=g)
    adv = torch.randn(rows, 1, generator=g).expand(rows, cols)
    mask = (torch.rand(rows, cols, generator=g) < 0.7).float()
    out = OPSM(delta=delta, reference="rollout")(CorrectionInput(old, ro, adv, mask))
    assert torch.equal(out.response_mask, mask)
    assert (out.token_weights[adv >= 0] == 1).all()
    # Whole sequences: a row is zeroed on all its valid tokens or on none.
    for i in range(rows):
        valid = out.token_weights[i][mask[i] != 0]
        assert valid.numel() == 0 or bool((valid == valid[0]).all())


@settings(deadline=None, max_examples=40)
@given(
    seed=st.integers(0, 2**16),
    rows=rows_st,
    cols=cols_st,
    veto=st.sampled_from([0.05, 0.5, 0.9]),
    mode=st.sampled_from(["clip", "mask"]),
    level=st.sampled_from(["token", "sequence", "geometric"]),
)
def test_veto_drops_exactly_the_sequences_with_a_small_token_weight(seed, rows, cols, veto, mode, level) -> None:
    g = torch.Generator().manual_seed(seed)
    ro = -3 * torch.rand(rows, cols, generator=g)
    old = ro + 1.5 * torch.randn(rows, cols, generator=g)
    mask = (torch.rand(rows, cols, generator=g) < 0.7).float()
    c = CorrectionInput(old, ro, torch.zeros_like(ro), mask)
    with_veto = ImportanceSampling(level=level, mode=mode, veto=veto)(c)
    without = ImportanceSampling(level=level, mode=mode)(c)
    for i in range(rows):
        hit = bool(((torch.exp(old[i] - ro[i]) < veto) & (mask[i] != 0)).any())
        if hit:
            assert (with_veto.response_mask[i] == 0).all()
        else:
            assert torch.equal(with_veto.response_mask[i], without.response_mask[i])


@settings(deadline=None, max_examples=40)
@given(
    seed=st.integers(0, 2**16),
    rows=rows_st,
    cols=cols_st,
    tau=st.sampled_from([0.001, 0.04, 0.5]),
    harmful_only=st.booleans(),
)
def test_m2po_keeps_the_budget_with_the_fewest_removals(seed, rows, cols, tau, harmful_only) -> None:
    g = torch.Generator().manual_seed(seed)
    ro = -3 * torch.rand(rows, cols, generator=g, dtype=torch.float64)
    old = ro + 0.4 * torch.randn(rows, cols, generator=g, dtype=torch.float64)
    adv = torch.randn(rows, cols, generator=g, dtype=torch.float64)
    mask = (torch.rand(rows, cols, generator=g) < 0.8).double()
    out = M2PO(tau=tau, harmful_only=harmful_only)(CorrectionInput(old, ro, adv, mask))
    d = old - ro
    candidates = mask != 0
    if harmful_only:
        candidates &= ((adv > 0) & (d > 0)) | ((adv < 0) & (d < 0))
    removed = (mask != 0) & (out.response_mask == 0)
    assert not (removed & ~candidates).any()
    kept = d.square()[candidates & ~removed]
    assert kept.numel() == 0 or kept.mean() <= tau
    if removed.any():  # putting back the smallest removed token breaks the budget
        back = torch.cat([kept, d.square()[removed].min().reshape(1)])
        assert back.mean() > tau
        assert d.square()[removed].min() >= (kept.max() if kept.numel() else 0)


# ---------------------------------------------------- denominators through the framework's pipeline


def test_denominators_through_loss_pipeline() -> None:
    """Masking corrections leave the denominator; OPSM's token weights and TIS's clip do not."""
    old = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, 2.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    adv = torch.tensor([[1.0] * 4, [-1.0] * 4])
    batch = TrainBatch(
        input_ids=torch.zeros(2, 4, dtype=torch.long),
        attention_mask=torch.ones(2, 4, dtype=torch.long),
        response_mask=mask,
        rollout_logprobs=torch.zeros(2, 4),
        advantages=adv,
        rewards=torch.zeros(2),
        group_ids=torch.arange(2),
        old_logprobs=old,
    )

    def prepare(correction, aggregation="token-mean"):
        return LossPlan(policy_loss=None, aggregation=aggregation, corrections=[correction]).prepare(batch)

    mis, sums = prepare(ImportanceSampling(mode="mask"))  # w = e^2 on token (1, 1): masked
    torch.testing.assert_close(mis.loss_weights, torch.tensor([[1 / 6] * 3 + [0.0], [1 / 6, 0.0, 1 / 6, 1 / 6]]))
    assert sums.ratios["train/is_maskfrac"] == (1.0, 7.0)
    # kept tokens carry their raw weight: w = e^0.5 on token (0, 0) multiplies its 1/6 share
    batch.old_logprobs = old + torch.tensor([[0.5, 0.0, 0.0, 0.0], [0.0] * 4])
    mis, _ = prepare(ImportanceSampling(mode="mask"))
    torch.testing.assert_close(
        mis.loss_weights, torch.tensor([[math.exp(0.5) / 6] + [1 / 6] * 2 + [0.0], [1 / 6, 0.0, 1 / 6, 1 / 6]])
    )
    batch.old_logprobs = old

    tis, _ = prepare(ImportanceSampling())  # clipped to 2, denominator still 7 tokens
    torch.testing.assert_close(tis.loss_weights, torch.tensor([[1 / 7] * 3 + [0.0], [1 / 7, 2 / 7, 1 / 7, 1 / 7]]))

    # OPSM needs the current policy: it is applied per micro-batch inside the loss, weights only
    pipeline = LossPlan(
        policy_loss=PPOClip(), aggregation="seq-mean-token-mean", corrections=[OPSM(delta=0.1, reference="rollout")]
    )
    batch.old_logprobs = -old  # row 1: KL(rollout || current) = 0.5 > 0.1 and A < 0
    prepared, sums = pipeline.prepare(batch)
    torch.testing.assert_close(prepared.loss_weights, torch.tensor([[1 / 6] * 3 + [0.0], [1 / 8] * 4]))  # untouched
    current = prepared.old_logprobs.clone().requires_grad_(True)
    loss, metrics = pipeline.closure()(current, prepared)
    loss.backward()
    assert metrics.ratios["train/opsm_clipfrac"] == (4.0, 7.0)
    assert torch.equal(current.grad[1], torch.zeros(4))  # the whole sequence leaves the numerator
    assert (current.grad[0, :3] != 0).all()  # B stays 2: row 0 keeps its 1/(3*2) share
    torch.testing.assert_close(current.grad[0, :3], -torch.full((3,), 1 / 6))


@pytest.mark.parametrize(
    ("factory", "params", "key"),
    [
        (ImportanceSampling, {"level": "row"}, "is.level"),
        (ImportanceSampling, {"mode": "drop"}, "is.mode"),
        (ImportanceSampling, {"low": 1.5}, "is.low"),
        (ImportanceSampling, {"low": -0.1}, "is.low"),
        (ImportanceSampling, {"high": 0.9}, "is.high"),
        (ImportanceSampling, {"veto": 0.0}, "is.veto"),
        (ImportanceSampling, {"veto": 1.5}, "is.veto"),
        (M2PO, {"tau": 0.0}, "m2po.tau"),
        (Decoupled, {"cap": 1.0}, "decoupled.cap"),
        (Decoupled, {"cap": 0.5}, "decoupled.cap"),
        (Decoupled, {"mode": "drop"}, "decoupled.mode"),
        (OPSM, {"delta": -1e-4}, "opsm.delta"),
        (OPSM, {"reference": "engine"}, "opsm.reference"),
    ],
)
def test_params_are_validated(factory, params: dict, key: str) -> None:
    with pytest.raises(ValueError, match=rf"^{key}="):
        factory(**params)


def test_defaults() -> None:
    assert ImportanceSampling() == ImportanceSampling(level="token", mode="clip", low=0.5, high=2.0, veto=None)
    assert M2PO().tau == 0.04 and M2PO().harmful_only is False
    assert Decoupled() == Decoupled(cap=5.0, mode="mask")  # AReaL's asynchronous recipes' cap
    assert OPSM() == OPSM(delta=0.1, reference="old")  # upstream LoongSage's: drift from pi_old, delta 0.1
