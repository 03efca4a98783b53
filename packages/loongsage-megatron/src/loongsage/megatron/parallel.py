"""Model parallelism inside a trainer replica: what changes when each rank holds a shard.

* **Log-probs and entropy over a vocabulary split across ranks**, in float32, without gathering
  the logits: each rank holds ``[b, t, vocab / tp]``; the maximum, the sum of exponentials and the
  sampled token's logit are reduced over the tensor-parallel group. The reductions are Megatron's
  ``reduce_from_tensor_model_parallel_region`` (all-reduce forward, identity backward): every rank
  computes the same loss, and each one's gradient flows into its own shard of the logits.
* **Sequence parallelism** between the tensor-parallel regions: each rank holds ``1 / tp`` of the
  tokens (the norms, the residual stream, the routers), which is how Megatron's MoE layer trains
  under tensor parallelism; the head's input is gathered whole first.
* **The q/k norms', norms' and routers' gradients** summed over the group: every rank holds them
  whole but applies them to its own heads, or (sequence parallelism) its own tokens, only.
* **The gradient norm** for clipping: squares of the sharded parameters' gradients summed over the
  group, those of the experts over the expert-parallel group, those of the replicated ones (norms)
  counted once.
* **The full state** for exports and checkpoints: every rank's shard gathered to the group's
  first rank (the experts first, over the expert-parallel group).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

_MASKED = -1e30  # a padded vocabulary row's shifted logit: exp() is 0, and 0 x it is 0 (no NaN)


def vocab_parallel_logprobs(
    logits: Tensor, input_ids: Tensor, first: int, *, vocab_start: int, vocab: int, with_entropy: bool
) -> tuple[Tensor, Tensor | None]:
    """:func:`loongsage.core.model_math.logprobs.logprobs_and_entropy` over this rank's vocabulary
    shard ``logits`` ``[B, T - first + 1, shard]`` (rows ``vocab_start..``; rows at or past
    ``vocab`` are padding); results ``[B, T]``, zeros before ``first``, the same on every rank."""
    lp, ent = vocab_parallel_token_logprobs(
        logits[:, :-1], input_ids[:, first:], vocab_start=vocab_start, vocab=vocab, with_entropy=with_entropy
    )
    return F.pad(lp, (first, 0)), None if ent is None else F.pad(ent, (first, 0))


def vocab_parallel_token_logprobs(
    logits: Tensor, targets: Tensor, *, vocab_start: int, vocab: int, with_entropy: bool
) -> tuple[Tensor, Tensor | None]:
    """The log-prob of ``targets`` ``[B, n]`` under each row of this rank's vocabulary shard
    ``logits`` ``[B, n, shard]``, and the entropy (no gradient), the same on every rank."""
    shifted, exp, sum_exp = _shifted(logits, vocab_start, vocab)
    lp = _picked(shifted, targets, vocab_start) - sum_exp.log()
    if not with_entropy:
        return lp, None
    with torch.no_grad():
        return lp, sum_exp.log() - vocab_sum((exp * shifted).sum(-1)) / sum_exp


def vocab_parallel_distribution(
    logits: Tensor, input_ids: Tensor, first: int, *, vocab_start: int, vocab: int
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`vocab_parallel_logprobs` (with entropies) and this rank's shard of the log-softmax
    ``[B, T - first, shard]`` (padding rows about -1e30: probability 0), for a divergence summed
    over the shards (MOPD's GKD branch) without gathering the vocabulary."""
    shifted, exp, sum_exp = _shifted(logits[:, :-1], vocab_start, vocab)
    lp = F.pad(_picked(shifted, input_ids[:, first:], vocab_start) - sum_exp.log(), (first, 0))
    # the shard's log-softmax feeds a per-shard sum: every shard's terms depend on this rank's
    # logits through the normaliser, so its gradient is summed over the ranks (the log-probs' is
    # already whole on each)
    log_z = _SummedBothWays.apply(exp.sum(-1)).log()
    with torch.no_grad():
        ent = F.pad(sum_exp.log() - vocab_sum((exp * shifted).sum(-1)) / sum_exp, (first, 0))
    return lp, ent, shifted - log_z.unsqueeze(-1)


class _SummedBothWays(torch.autograd.Function):
    """Summed over the tensor-parallel ranks in the forward, and its gradient in the backward."""

    @staticmethod
    def forward(ctx: Any, values: Tensor) -> Tensor:
        from megatron.core import parallel_state

        ctx.group = parallel_state.get_tensor_model_parallel_group()
        out = values.clone()
        dist.all_reduce(out, group=ctx.group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad


def _shifted(logits: Tensor, vocab_start: int, vocab: int) -> tuple[Tensor, Tensor, Tensor]:
    """The shard's logits (each row predicting one token) less the global maximum (padding rows
    masked), their exponentials, and the sum of exponentials over every shard."""
    from megatron.core import parallel_state

    pred = logits.float()
    shard = pred.shape[-1]
    peak = pred.detach().max(-1).values  # any shift keeps the softmax; the global maximum avoids overflow
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=parallel_state.get_tensor_model_parallel_group())
    shifted = pred - peak.unsqueeze(-1)
    padding = torch.arange(vocab_start, vocab_start + shard, device=pred.device) >= vocab
    if bool(padding.any()):
        shifted = shifted.masked_fill(padding, _MASKED)
    exp = shifted.exp()
    return shifted, exp, vocab_sum(exp.sum(-1))


def _picked(shifted: Tensor, targets: Tensor, vocab_start: int) -> Tensor:
    """The shifted logit of each target token, from the shard that holds it."""
    shard = shifted.shape[-1]
    target = targets - vocab_start
    here = (target >= 0) & (target < shard)
    return vocab_sum(shifted.gather(-1, target.clamp(0, shard - 1).unsqueeze(-1)).squeeze(-1) * here)


def vocab_sum(values: Tensor) -> Tensor:
    """Per-position values summed over the tensor-parallel ranks' vocabulary shards: all-reduce
    forward, identity backward (every rank computes the same loss; each one's gradient flows into
    its own shard)."""
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    return reduce_from_tensor_model_parallel_region(values)


def vocab_shard(full: Tensor, vocab_start: int, shard: int) -> Tensor:
    """This rank's columns ``vocab_start..vocab_start + shard`` of a whole-vocabulary log-softmax
    ``[..., vocab]`` (a teacher worker's); columns past the vocabulary (padding) at about -1e30."""
    part = full[..., vocab_start : vocab_start + shard]
    return F.pad(part, (0, shard - part.shape[-1]), value=_MASKED)


@dataclass(frozen=True)
class ParameterKinds:
    """How a gradient norm counts each parameter: an expert's square over the expert-parallel
    ranks (Megatron's ``allreduce=False``), a tensor-parallel shard's over the tensor-parallel
    ranks, a replicated one's once, the last pipeline stage's copy of a tied embedding not at all
    (the first stage counts it): ``groups[kind]`` (False: over nothing; None: not counted). The
    total then sums over the pipeline stages (``across``)."""

    groups: tuple[Any, ...]
    across: Any = None

    @staticmethod
    def kind_of(param: torch.nn.Parameter) -> int:
        if getattr(param, "shared", False):  # Megatron's mark on the last stage's copy of the embedding
            return 3
        if not getattr(param, "allreduce", True):
            return 0
        return 1 if getattr(param, "tensor_model_parallel", False) else 2


def parameter_kinds() -> ParameterKinds:
    from megatron.core import parallel_state

    return ParameterKinds(
        (
            parallel_state.get_expert_tensor_and_model_parallel_group(),
            parallel_state.get_tensor_model_parallel_group(),
            False,
            None,
        ),
        parallel_state.get_pipeline_model_parallel_group(),
    )


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over a split model: the global L2 norm counts each
    parameter's gradient as :class:`ParameterKinds` says."""
    from loongsage.core.model_math.state import global_norm

    kinds = parameter_kinds()
    grads = [(p.grad, kinds.kind_of(p)) for p in params if p.grad is not None]
    device = grads[0][0].device if grads else torch.device("cpu")
    squares = torch.zeros(len(kinds.groups), device=device)
    for grad, kind in grads:
        squares[kind] += grad.detach().float().pow(2).sum()
    total = global_norm(squares, kinds.groups, kinds.across)
    scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for grad, _ in grads:
        grad.mul_(scale.to(grad.dtype))
    return total


def gathered_state(own: dict[str, Tensor], group: dist.ProcessGroup | None = None) -> list[dict[str, Tensor]] | None:
    """Every rank's state (rank order) on the first rank of ``group`` (the tensor-parallel group
    when None), None elsewhere. A collective of the group: every rank of it calls."""
    from megatron.core import parallel_state

    group = group or parallel_state.get_tensor_model_parallel_group()
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    shards: list[dict[str, Tensor]] = [{} for _ in range(tp)]
    for name in sorted(own):
        parts = [torch.empty_like(own[name]) for _ in range(tp)]
        dist.all_gather(parts, own[name].detach().contiguous(), group=group)
        for r, part in enumerate(parts):
            shards[r][name] = part
    return shards if rank == 0 else None


def sum_replicated_grads(named: list[tuple[str, torch.nn.Parameter, Tensor | None]]) -> None:
    """Sum over the tensor-parallel group the gradients of the parameters every rank holds whole
    but applies to a part of the work (as Megatron's ``finalize_model_grads`` does): the q/k norms
    (each rank normalises its own heads) and, under sequence parallelism, those marked
    ``sequence_parallel`` (the norms and routers, each rank seeing its share of the tokens).
    ``named``: each parameter's name, the parameter, and its gradient so far."""
    from loongsage.core.model_math.state import sum_in_place
    from megatron.core import parallel_state

    grads = [
        g
        for n, p, g in named
        if g is not None and ("q_layernorm" in n or "k_layernorm" in n or getattr(p, "sequence_parallel", False))
    ]
    if grads:
        sum_in_place(grads, parallel_state.get_tensor_model_parallel_group())
