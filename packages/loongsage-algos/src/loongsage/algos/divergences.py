"""Distribution divergences for on-policy distillation (MOPD's GKD term), per token.

The student Q (the policy being trained) sampled the tokens; the teacher P scored them. Unlike the
sampled-token estimators of :mod:`loongsage.algos.kl` (k2 and k3 serve MOPD too, fed the teacher's
log-prob of the student's token), these compare whole next-token distributions at every position::

    topk_kl        sum_{v in S} Q^_v (log Q^_v - log P^_v)     S = the teacher's top-k tokens,
                                                               P^, Q^ = P, Q renormalised over S
    full_vocab_kl  sum_v Q_v (log Q_v - log P_v)               KL(Q || P), reverse (mode-seeking)
    jsd            beta KL(P || M) + (1 - beta) KL(Q || M)     M = beta P + (1 - beta) Q
    topk_jsd       jsd of P^ and Q^ over the teacher's top-k

Each function takes the student's and the teacher's log-probs over the same support, ``[..., K]``
(``K = k`` for the top-k forms, the vocabulary size for the full forms; row ``[b, t]`` is the
distribution of token ``t`` given the tokens before it), and returns the unreduced per-position
divergence ``[...]``. The teacher is a constant: no gradient reaches it, whatever it carries.
Masking and reduction are the caller's (the loss pipeline weights positions with the policy loss's
global denominators). Computed in at least float32.

The entries (:func:`loongsage.core.entries.entry` of these functions) register through the
KL-estimator hook with ``consumes = "topk"`` (and ``k``, how many teacher tokens per position to
fetch) or ``"full_vocab"``: the framework then ships the teacher's top-k ids and log-probs, or its
full log-softmax, and gathers the student's log-softmax on the same support, only for these
entries. Their call is ``entry(student [B, T, K], teacher [B, T, K]) -> [B, T]``; the full-vocabulary
ones also offer ``partial``, the same function over a shard of the vocabulary (``part=True``).
"""

from __future__ import annotations

import functools
import math
from typing import Annotated

import torch
from torch import Tensor

from loongsage.core.contracts import KLEstimator
from loongsage.core.entries import Range, entry


def _prepare(student: Tensor, teacher: Tensor, renormalise: bool) -> tuple[Tensor, Tensor]:
    if student.shape != teacher.shape:
        raise ValueError(
            f"student {tuple(student.shape)} and teacher {tuple(teacher.shape)} log-probs: "
            "shapes must match (the same support at every position)"
        )
    dtype = torch.promote_types(student.dtype, torch.float32)
    q, p = student.to(dtype), teacher.detach().to(dtype)
    if renormalise:
        q = q - torch.logsumexp(q, dim=-1, keepdim=True)
        p = p - torch.logsumexp(p, dim=-1, keepdim=True)
    return q, p


def _kl(log_a: Tensor, log_b: Tensor) -> Tensor:
    """``sum a (log a - log b)`` over the last dimension; terms with ``a = 0`` count 0."""
    a = log_a.exp()
    return torch.where(a > 0, a * (log_a - log_b), torch.zeros_like(a)).sum(-1)


def _log_mixture(q: Tensor, p: Tensor, beta: float) -> Tensor:
    """``log M``, ``M = beta P + (1 - beta) Q``, in log space."""
    return torch.logaddexp(p + math.log(beta), q + math.log1p(-beta))


_CHUNK_ELEMENTS = 1 << 26  # values per chunk of positions: 256 MB of float32 intermediates


class _Divergence(torch.autograd.Function):
    """KL(Q || P) (``beta`` None) or the generalised JSD per position, from log-probs ``q`` (the
    student's, differentiated) and ``p`` (the teacher's, constant), over the last dimension.

    Autograd through the plain formula keeps about eight ``[positions, vocabulary]``
    intermediates for the backward (12 GB each way for 8k tokens of a 150k vocabulary); here the
    gradient is in closed form and both passes work a chunk of positions at a time, keeping only
    the inputs. With ``Q = e^q``: d KL(Q || P) / d q_v = Q_v (q_v - p_v + 1), and
    d JSD / d q_v = (1 - beta) Q_v (q_v - log M_v) (the terms through M cancel).
    """

    @staticmethod
    def forward(ctx, q: Tensor, p: Tensor, beta: float | None) -> Tensor:
        ctx.save_for_backward(q, p)
        ctx.beta = beta
        out = q.new_empty(q.shape[:-1])
        flat_q, flat_p, flat_out = q.reshape(-1, q.shape[-1]), p.reshape(-1, p.shape[-1]), out.view(-1)
        for rows in _chunks(flat_q):
            qc, pc = flat_q[rows], flat_p[rows]
            if beta is None:
                flat_out[rows] = _kl(qc, pc)
            else:
                log_m = _log_mixture(qc, pc, beta)
                flat_out[rows] = beta * _kl(pc, log_m) + (1.0 - beta) * _kl(qc, log_m)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        q, p = ctx.saved_tensors
        beta = ctx.beta
        out = torch.empty_like(q)
        flat_q, flat_p, flat_out = q.reshape(-1, q.shape[-1]), p.reshape(-1, p.shape[-1]), out.view(-1, q.shape[-1])
        flat_grad = grad.reshape(-1, 1)
        for rows in _chunks(flat_q):
            qc, pc = flat_q[rows], flat_p[rows]
            a = qc.exp()
            if beta is None:
                term = a * (qc - pc + 1.0)
            else:
                term = (1.0 - beta) * a * (qc - _log_mixture(qc, pc, beta))
            flat_out[rows] = flat_grad[rows] * torch.where(a > 0, term, torch.zeros_like(term))
        return out, None, None


def _chunks(flat: Tensor) -> list[slice]:
    step = max(1, _CHUNK_ELEMENTS // max(1, flat.shape[-1]))
    return [slice(start, start + step) for start in range(0, flat.shape[0], step)]


def topk_kl(student_logprobs: Tensor, teacher_logprobs: Tensor) -> Tensor:
    """KL(Q^ || P^) over the teacher's top-k support, both renormalised over it.

    ``student_logprobs`` holds the student's log-probs of the teacher's top-k tokens (gathered from
    its full log-softmax), ``teacher_logprobs`` the teacher's; shapes ``[..., k]`` -> ``[...]``.
    With ``k`` the vocabulary size it is :func:`full_vocab_kl`.
    """
    q, p = _prepare(student_logprobs, teacher_logprobs, renormalise=True)
    return _Divergence.apply(q, p, None).clamp(min=0.0)  # >= 0 exactly; rounding could leave -1e-9


def full_vocab_kl(student_logprobs: Tensor, teacher_logprobs: Tensor, *, part: bool = False) -> Tensor:
    """KL(Q || P) = ``sum_v Q_v (log Q_v - log P_v)`` over the whole vocabulary.

    Inputs are log-softmax outputs ``[..., V]`` (not renormalised here); returns ``[...]``. With
    ``part`` the inputs are a part of the vocabulary (a tensor-parallel rank's shard) and the sum
    of its terms is returned unclamped: a single term may be negative, the parts' sum is not.
    """
    q, p = _prepare(student_logprobs, teacher_logprobs, renormalise=False)
    out = _Divergence.apply(q, p, None)
    return out if part else out.clamp(min=0.0)


def jsd(
    student_logprobs: Tensor,
    teacher_logprobs: Tensor,
    *,
    beta: Annotated[float, Range(gt=0, lt=1)] = 0.5,
    renormalise: bool = False,
    part: bool = False,
) -> Tensor:
    """Generalised Jensen-Shannon divergence ``beta KL(P || M) + (1 - beta) KL(Q || M)``.

    ``M = beta P + (1 - beta) Q``, formed in log space (``logsumexp`` of ``log beta + log P`` and
    ``log(1 - beta) + log Q``) so tiny probabilities keep their digits. Bounded by the binary
    entropy ``H(beta) <= log 2``; ``beta`` in (0, 1). With ``renormalise`` both are first
    renormalised over the given support (the top-k form). Shapes ``[..., K]`` -> ``[...]``. With
    ``part`` (not with ``renormalise``) the inputs are a part of the vocabulary and the sum of its
    terms is returned unclamped (``M`` is formed token by token, so the parts add up).
    """
    if not 0.0 < beta < 1.0:
        raise ValueError(f"beta={beta}: must be in (0, 1)")
    if part and renormalise:
        raise ValueError(
            "part=True sums a part of the vocabulary's terms; renormalising over that part would change them"
        )
    q, p = _prepare(student_logprobs, teacher_logprobs, renormalise=renormalise)
    out = _Divergence.apply(q, p, beta)
    return out if part else out.clamp(min=0.0)


# How many teacher tokens per position the framework fetches for a top-k entry (not an argument of
# the divergence, which reads whatever support it is given).
_TopK = Annotated[int, Range(ge=1, note="teacher tokens per position")]


@entry("topk_kl", topk_kl, consumes="topk")
class TopKKL(KLEstimator):
    """``topk_kl``: reverse KL over the teacher's top-``k`` tokens, both sides renormalised."""

    k: _TopK = 16


@entry(
    "full_vocab_kl",
    full_vocab_kl,
    fixed={"part": False},
    consumes="full_vocab",
    partial=functools.partial(full_vocab_kl, part=True),
)
class FullVocabKL(KLEstimator):
    """``full_vocab_kl``: reverse KL(student || teacher) over the whole vocabulary."""


@entry(
    "jsd",
    jsd,
    fixed={"renormalise": False, "part": False},
    consumes="full_vocab",
    partial=functools.partial(jsd, part=True),
)
class JSD(KLEstimator):
    """``jsd``: generalised Jensen-Shannon divergence over the whole vocabulary (GKD)."""


@entry("topk_jsd", jsd, fixed={"renormalise": True, "part": False}, consumes="topk")
class TopKJSD(KLEstimator):
    """``topk_jsd``: generalised JSD over the teacher's top-``k`` tokens, both sides renormalised."""

    k: _TopK = 16
