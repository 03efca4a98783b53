"""The trainer's forward and its per-token outputs: logits of an HF causal LM from the first
trained position on (the FP32 head where asked), and float32 log-probs, entropies and the
distribution over a teacher's support from one log-softmax. The native engine's deterministic mode
and the teachers share these functions, so every side computes the same numbers."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from loongsage.core.model_math.head import fp32_head


def token_logprobs(logits: Tensor, input_ids: Tensor) -> Tensor:
    """Log-prob of each token given the previous ones, aligned to token positions.

    ``logits`` [B, T, V] from positions 0..T-1 predict tokens 1..T; position 0 has no prediction
    and gets 0. Computed in float32 (the FP32-head contract shared with the engine).
    """
    return logprobs_and_entropy(logits, input_ids, 1, with_entropy=False)[0]


def logprobs_and_entropy(
    logits: Tensor, input_ids: Tensor, first: int, *, with_entropy: bool
) -> tuple[Tensor, Tensor | None]:
    """Per-token log-probs (and entropies) of tokens ``first..T-1`` from one float32 log-softmax.

    ``logits`` [B, T - first + 1, V] are the model's outputs at positions ``first-1..T-1``
    (``first >= 1``); the results are [B, T] with zeros before ``first``.
    """
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    lp = F.pad(logp.gather(-1, input_ids[:, first:].unsqueeze(-1)).squeeze(-1), (first, 0))
    ent = None
    if with_entropy:
        with torch.no_grad():
            ent = F.pad(-(logp.exp() * logp).sum(-1), (first, 0))
    return lp, ent


def logprobs_entropy_and_distribution(
    logits: Tensor, input_ids: Tensor, first: int, support_ids: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`logprobs_and_entropy` plus the log-probs over a support, from the same log-softmax.

    ``support_ids`` [B, T, k] names k tokens per position (a teacher's top-k): the result is the
    log-probs of those tokens, [B, T - first, k]; ``None`` keeps the full log-softmax,
    [B, T - first, V]. Only positions ``first..T-1`` (from the first trained token on) are
    returned, without padding, so the full vocabulary costs no copy beyond the log-softmax itself.
    """
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    lp = F.pad(logp.gather(-1, input_ids[:, first:].unsqueeze(-1)).squeeze(-1), (first, 0))
    with torch.no_grad():
        ent = F.pad(-(logp.exp() * logp).sum(-1), (first, 0))
    dist = logp if support_ids is None else logp.gather(-1, support_ids[:, first:].to(logp.device))
    return lp, ent, dist


def policy_logits(
    model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor, first: int = 1, *, fp32_lm_head: bool = True
) -> Tensor:
    """The trainer's forward: logits at positions ``first-1..T-1`` of an HF causal LM.

    The LM head (and later its log-softmax) runs only where a trained token is predicted (``first``
    = 1 keeps every position); with ``fp32_lm_head`` a bf16/fp16 model's head runs in float32. The
    native engine's deterministic mode calls this same function, so both sides compute identical
    log-probs for the same tokens.
    """
    keep = input_ids.shape[1] - first + 1 if first > 1 else 0  # 0 = all positions
    head = model.get_output_embeddings()
    if not fp32_lm_head or head.weight.dtype == torch.float32:
        return model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=keep, use_cache=False).logits
    hidden = model.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    return head_logits(model, hidden, first, fp32_lm_head=True)


def head_logits(model: torch.nn.Module, hidden: Tensor, first: int = 1, *, fp32_lm_head: bool = True) -> Tensor:
    """The LM head over final hidden states ``[B, T, H]`` at positions ``first-1..T-1`` (all when
    ``first`` <= 1): :func:`policy_logits`' head, for a body run another way."""
    if first > 1:
        hidden = hidden[:, first - 1 :]
    head = model.get_output_embeddings()
    if not fp32_lm_head or head.weight.dtype == torch.float32:
        return head(hidden)
    if type(head.weight) is torch.nn.Parameter:  # the engine's head (a sharded DTensor takes the upcast)
        return fp32_head(hidden, head.weight)
    return F.linear(hidden.float(), head.weight.float())


def response_start(mask: Tensor) -> int:
    """First position any row of ``mask`` [B, T] trains on (0 if none): the head runs from there."""
    cols = torch.nonzero(mask.sum(0), as_tuple=False)
    return int(cols[0]) if len(cols) else 0
