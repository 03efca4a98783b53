"""Vectorised token sampling for the native engine: one call per decode step for the whole batch.

Every row carries its own settings (temperature, top-k, top-p, min-p) as a column of a small
tensor, so a batch may mix greedy and sampled requests with different filters and the step still
costs a fixed number of tensor ops, not one Python call per row.

Randomness is inverse-CDF sampling driven by one uniform number per row and step, drawn up front
for the whole batch (:func:`draw_uniforms`). A request with a seed draws its uniforms from its own
``torch.Generator``, so its samples do not depend on what else shares the batch; a tiny numerical
change in the logits (different padding in another batch) moves a sample only when the uniform
lands within that change of a CDF boundary.

Filter order (applied to the temperature-scaled distribution): top-k, then top-p over the
renormalised top-k mass, then min-p (keep tokens whose probability is at least ``min_p`` times the
largest; a ratio test, so renormalisation does not change it). The most likely token always
survives.

The returned log-prob of a sampled token is ``log_softmax(logits)`` of the *raw* policy logits in
float32, at temperature 1 and without any filter: exactly what the trainer computes for the same
token, so rollout and trainer log-probs differ only by numerics and weight staleness. The sampling
distribution itself (temperature, top-k/p, min-p) is deliberately not folded in; an importance
correction that needs the behaviour distribution must account for those settings separately.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from loongsage.core.types import SamplingParams


@dataclass
class SamplingTensors:
    """Per-row sampling settings of a batch, as tensors on the engine's device."""

    inv_temperature: Tensor  # [B] float32; 1 for greedy rows (unused there)
    greedy: Tensor  # [B] bool
    top_k: Tensor  # [B] long; vocab size when off
    top_p: Tensor  # [B] float32
    min_p: Tensor  # [B] float32
    filtered: Tensor  # [B] bool: a sampled row with top-k, top-p or min-p
    all_greedy: bool
    any_greedy: bool
    needs_filter: bool  # some sampled row uses top-k, top-p or min-p
    needs_temperature: bool  # some sampled row has temperature != 1
    candidates: int  # largest top-k of the sampled rows; the vocab size when one of them has none

    @classmethod
    def build(cls, params: list[SamplingParams], vocab_size: int, device: torch.device | str) -> SamplingTensors:
        temp = torch.tensor([p.temperature for p in params], dtype=torch.float32)
        greedy = temp == 0
        top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params], dtype=torch.long)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
        min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32)
        return cls._from(
            (1.0 / torch.where(greedy, torch.ones_like(temp), temp)).to(device),
            greedy.to(device),
            top_k.to(device),
            top_p.to(device),
            min_p.to(device),
            vocab_size,
        )

    @classmethod
    def _from(
        cls, inv_t: Tensor, greedy: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor, vocab: int
    ) -> SamplingTensors:
        # The batch-level flags pick cheaper code paths; computed once per batch (and on compaction),
        # never per step.
        sampled = ~greedy
        filt = sampled & ((top_k < vocab) | (top_p < 1) | (min_p > 0))
        candidates = int(top_k[sampled].max()) if bool(sampled.any()) else vocab
        return cls(
            inv_temperature=inv_t,
            greedy=greedy,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            filtered=filt,
            all_greedy=bool(greedy.all()),
            any_greedy=bool(greedy.any()),
            needs_filter=bool(filt.any()),
            needs_temperature=bool((sampled & (inv_t != 1)).any()),
            candidates=candidates,
        )

    def select(self, rows: Tensor, vocab_size: int) -> SamplingTensors:
        """Keep (or repeat) the given rows, in that order."""
        return self._from(
            self.inv_temperature[rows],
            self.greedy[rows],
            self.top_k[rows],
            self.top_p[rows],
            self.min_p[rows],
            vocab_size,
        )


def draw_uniforms(
    counts: list[int],
    seeds: list[int | None],
    limits: list[int],
    steps: int,
    generator: torch.Generator,
    device: torch.device | str,
) -> Tensor:
    """Uniform numbers ``[sum(counts), steps]`` in [0, 1): one row per sample, one column per step.

    Group ``i`` contributes ``counts[i]`` rows, of which the first ``limits[i]`` columns are used.
    A seeded group derives one sub-seed per sample from its seed and draws each sample's stream
    from its own ``torch.Generator``: sample ``j`` of a seed is the same whatever else shares the
    batch, whatever ``n`` (as long as ``n > j``) and whatever the length limit (a longer limit
    extends the same stream). Unseeded groups draw from the engine's ``generator``.
    """
    out = torch.zeros(sum(counts), steps)
    row = 0
    for count, seed, limit in zip(counts, seeds, limits):
        if seed is None:
            out[row : row + count, :limit] = torch.rand(count, limit, generator=generator)
        else:
            parent = torch.Generator().manual_seed(int(seed))
            for sub in torch.randint(0, 2**62, (count,), generator=parent).tolist():
                out[row, :limit] = torch.rand(limit, generator=torch.Generator().manual_seed(sub))
                row += 1
            continue
        row += count
    return out.to(device)


def sample(logits: Tensor, st: SamplingTensors, uniforms: Tensor) -> tuple[Tensor, Tensor]:
    """Sample one token per row; returns ``(tokens [B] long, logprobs [B] float32)``.

    ``logits`` are the raw float32 policy logits ``[B, V]``; ``uniforms`` is ``[B]``.
    """
    logits = logits.float()
    logprobs = torch.log_softmax(logits, dim=-1)
    if st.all_greedy:
        tokens = logits.argmax(dim=-1)
    else:
        tokens = _sample_rows(logits, logprobs, st, uniforms)
        if st.any_greedy:
            tokens = torch.where(st.greedy, logits.argmax(dim=-1), tokens)
    return tokens, logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def _sample_rows(logits: Tensor, logprobs: Tensor, st: SamplingTensors, uniforms: Tensor) -> Tensor:
    vocab = logits.shape[-1]
    if st.needs_temperature:
        probs = torch.softmax(logits * st.inv_temperature.unsqueeze(-1), dim=-1)
    else:
        probs = logprobs.exp()  # temperature 1: the policy distribution itself
    plain = _inverse_cdf(probs, uniforms).clamp_max_(vocab - 1)
    if not st.needs_filter:
        return plain

    # Candidates in descending order. When every sampled row has a top-k, the largest k bounds the
    # candidates and ``topk`` replaces a full-vocabulary sort (an order of magnitude cheaper on CPU).
    if st.candidates < vocab:
        probs, order = probs.topk(st.candidates, dim=-1)
    else:
        probs, order = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(probs.shape[-1], device=logits.device)
    keep = ranks.unsqueeze(0) < st.top_k.unsqueeze(-1)
    kept = probs * keep
    kept_mass = kept.cumsum(dim=-1)
    # top-p over the renormalised top-k mass: keep a token while the mass strictly before it is
    # below top_p (so the first token is always kept).
    keep &= (kept_mass - kept) < st.top_p.unsqueeze(-1) * kept_mass[:, -1:]
    keep &= probs >= st.min_p.unsqueeze(-1) * probs[:, :1]
    picked = _inverse_cdf(probs * keep, uniforms).clamp_max_(probs.shape[-1] - 1)
    # A row without filters keeps the vocabulary-order draw it gets in a batch without filtered
    # rows: its sample must not depend on what shares the batch.
    return torch.where(st.filtered, order.gather(-1, picked.unsqueeze(-1)).squeeze(-1), plain)


def _inverse_cdf(weights: Tensor, uniforms: Tensor) -> Tensor:
    """Index of the first entry whose cumulative weight exceeds ``u * total``.

    ``right=True`` skips zero-weight entries (their cumulative value equals their predecessor's), so
    a filtered-out token is never returned.
    """
    cdf = weights.cumsum(dim=-1)
    target = (uniforms * cdf[:, -1]).unsqueeze(-1)
    return torch.searchsorted(cdf, target, right=True).squeeze(-1)
