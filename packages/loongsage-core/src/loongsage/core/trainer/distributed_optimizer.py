"""A distributed optimizer: AdamW whose float32 master weights and state are split over the
data-parallel ranks (ZeRO stage 1, what Megatron calls its distributed optimizer).

A replicated trainer holds, per parameter, its weight and gradient plus 12 bytes of float32
master weight and AdamW moments on every rank; split over ``d`` ranks those 12 bytes become
``12 / d``. The trainable parameters are laid end to end in one flat float32 vector per *bucket*
(a set of parameters and the group of ranks that hold them alike: the data-parallel group, or for
an MoE model's experts the ranks holding the same experts), padded to a multiple of the group's
size; rank ``r`` of the group owns the ``r``-th equal slice.

* **Gradients** accumulate, micro-batch after micro-batch, in the bucket's full float32 gradient
  vector: a hook adds each parameter's gradient to its slice as soon as autograd has accumulated
  it, then frees it. After the last micro-batch one reduce-scatter leaves each rank the summed
  gradient of its own slice (the all-reduce of replicated training moves twice the bytes).
* **Clipping** sums the squares of each rank's own slice over the group (then over the groups a
  caller names per kind of parameter, e.g. tensor-parallel shards), and scales the slice.
* **The step** is AdamW on each rank's slice; an all-gather then brings every rank the whole
  updated vector, which is rounded into the model's parameters.
* **Checkpoints** hold the whole vectors (masters and both moments, gathered), so a run resumes
  under another data-parallel size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from loongsage.core.model_math.state import global_norm, group_rank, group_size

_MOMENTS = ("exp_avg", "exp_avg_sq")


class Bucket:
    """Parameters held alike by the ranks of ``group``, flat, each rank owning one slice."""

    def __init__(self, params: list[torch.nn.Parameter], group: Any = None) -> None:
        self.params, self.group = params, group
        self.size, self.rank = group_size(group), group_rank(group)
        self.offsets, total = [], 0
        self.index = {}  # id(parameter) -> its place in params
        for i, p in enumerate(params):
            self.offsets.append(total)
            self.index[id(p)] = i
            total += p.numel()
        self.numel = total
        self.shard = -(-total // self.size)
        device = params[0].device
        self.grad = torch.zeros(self.shard * self.size, dtype=torch.float32, device=device)
        self.lo, self.hi = self.rank * self.shard, (self.rank + 1) * self.shard
        with torch.no_grad():
            whole = self._flat([p.detach() for p in params])
        self.master = torch.nn.Parameter(whole[self.lo : self.hi].clone())
        for p, offset in zip(params, self.offsets):
            p.register_post_accumulate_grad_hook(self._hook(offset))

    def _flat(self, tensors: list[Tensor]) -> Tensor:
        flat = torch.cat([t.reshape(-1).float() for t in tensors])
        return torch.nn.functional.pad(flat, (0, self.shard * self.size - self.numel))

    def _hook(self, offset: int) -> Callable[[Tensor], None]:
        def accumulate(param: Tensor) -> None:
            self.grad[offset : offset + param.numel()].add_(param.grad.reshape(-1))
            param.grad = None

        return accumulate

    def grad_view(self, param: torch.nn.Parameter) -> Tensor:
        """``param``'s slot in the full gradient vector (before :meth:`reduce_scatter`)."""
        offset = self.offsets[self.index[id(param)]]
        return self.grad[offset : offset + param.numel()].view_as(param)

    def reduce_scatter(self) -> None:
        """Every rank's gradients summed; this rank keeps its slice, as its master's gradient."""
        if self.size == 1:
            self.master.grad = self.grad[self.lo : self.hi]
            return
        shard = torch.empty(self.shard, dtype=torch.float32, device=self.grad.device)
        dist.reduce_scatter_tensor(shard, self.grad, group=self.group)
        self.master.grad = shard

    def squares(self, kind_of: Callable[[torch.nn.Parameter], int], kinds: int) -> Tensor:
        """Per kind of parameter, the sum of squared gradients over this rank's slice."""
        out = torch.zeros(kinds, dtype=torch.float32, device=self.grad.device)
        grad = self.master.grad
        for p, offset in zip(self.params, self.offsets):
            lo, hi = max(offset, self.lo), min(offset + p.numel(), self.hi)
            if lo < hi:
                out[kind_of(p)] += grad[lo - self.lo : hi - self.lo].pow(2).sum()
        return out

    @torch.no_grad()
    def gather_into_params(self) -> None:
        """The updated slices of every rank, rounded into the model's parameters."""
        dtypes = {p.dtype for p in self.params}
        dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32  # the bytes the all-gather moves
        whole = self._gather(self.master.detach().to(dtype))
        for p, offset in zip(self.params, self.offsets):
            p.copy_(whole[offset : offset + p.numel()].view_as(p))

    def _gather(self, shard: Tensor) -> Tensor:
        if self.size == 1:
            return shard
        whole = torch.empty(self.shard * self.size, dtype=shard.dtype, device=shard.device)
        dist.all_gather_into_tensor(whole, shard.contiguous(), group=self.group)
        return whole

    def full(self, shard: Tensor) -> Tensor:
        """A vector of this bucket, gathered whole and unpadded, on the CPU."""
        return self._gather(shard).cpu()[: self.numel]

    def own(self, whole: Tensor) -> Tensor:
        """This rank's slice of a whole vector (as :meth:`full` gave it, under any group size)."""
        if whole.numel() != self.numel:
            raise ValueError(f"checkpoint: a flat vector of {whole.numel()} elements for {self.numel} parameters")
        padded = torch.nn.functional.pad(whole.float(), (0, self.shard * self.size - self.numel))
        return padded[self.lo : self.hi]


class DistributedOptimizer:
    """AdamW over :class:`Bucket` slices (see the module docstring). ``optimizer`` is the torch
    AdamW stepping the slices: schedulers and ``param_groups`` work on it as on any optimizer."""

    def __init__(
        self,
        buckets: list[tuple[list[torch.nn.Parameter], Any]],
        *,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
    ) -> None:
        self.buckets = [Bucket(params, group) for params, group in buckets if params]
        self.optimizer = torch.optim.AdamW(
            [b.master for b in self.buckets], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay
        )

    def zero_grad(self) -> None:
        for b in self.buckets:
            b.grad.zero_()
            b.master.grad = None

    def grad_view(self, param: torch.nn.Parameter) -> Tensor | None:
        """``param``'s accumulated gradient, before the reduction (None: not trained here)."""
        for b in self.buckets:
            if id(param) in b.index:
                return b.grad_view(param)
        return None

    def reduce_scatter(self) -> None:
        for b in self.buckets:
            b.reduce_scatter()

    def clip_grad_norm(
        self,
        max_norm: float,
        kind_of: Callable[[torch.nn.Parameter], int] = lambda p: 0,
        kind_groups: tuple[Any, ...] = (False,),
        across: Any = None,
    ) -> Tensor:
        """Scale the slices' gradients to a global L2 norm of at most ``max_norm``; returns the
        norm before. A parameter's square counts over its bucket's group, then over
        ``kind_groups[kind_of(param)]`` (False: over nothing more; None: not at all, a copy counted
        elsewhere), then the total over ``across`` (ranks holding other parameters: pipeline stages)."""
        kinds = len(kind_groups)
        device = self.buckets[0].grad.device if self.buckets else torch.device("cpu")
        squares = torch.zeros(kinds, dtype=torch.float32, device=device)
        for b in self.buckets:
            part = b.squares(kind_of, kinds)
            if b.size > 1:
                dist.all_reduce(part, group=b.group)
            squares += part
        norm = global_norm(squares, kind_groups, across)
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for b in self.buckets:
            b.master.grad.mul_(scale)
        return norm

    def to(self, move: Callable[[Tensor], Tensor]) -> None:
        """Move the slices of masters and the gradient vectors by ``move`` (AdamW's moments move
        with the optimizer's state)."""
        for b in self.buckets:
            b.master.grad = None  # a view of the vector being moved
            b.master.data = move(b.master.data)
            b.grad = move(b.grad)

    def step(self) -> None:
        self.optimizer.step()
        for b in self.buckets:
            b.gather_into_params()

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Whole masters and moments per bucket, on the CPU (a collective of every bucket's group)."""
        buckets = []
        for b in self.buckets:
            state = self.optimizer.state.get(b.master, {})
            entry = {"master": b.full(b.master.detach())}
            for name in _MOMENTS:
                entry[name] = b.full(state[name]) if name in state else None
            buckets.append(entry)
        first = self.optimizer.state.get(self.buckets[0].master, {}) if self.buckets else {}
        step = first.get("step")
        return {
            "distributed_optimizer": True,
            "buckets": buckets,
            "step": None if step is None else float(step),
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups],
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or not state.get("distributed_optimizer"):
            raise ValueError(
                "checkpoint: its optimizer state was written without the distributed optimizer; "
                "resume with distributed_optimizer: false"
            )
        if len(state["buckets"]) != len(self.buckets):
            raise ValueError(f"checkpoint: {len(state['buckets'])} optimizer buckets for {len(self.buckets)}")
        for b, saved in zip(self.buckets, state["buckets"]):
            b.master.copy_(b.own(saved["master"]))
            if saved["exp_avg"] is not None and state["step"] is not None:
                self.optimizer.state[b.master] = {
                    "step": torch.tensor(state["step"], dtype=torch.float32),
                    **{name: b.own(saved[name]).to(b.master.device) for name in _MOMENTS},
                }
            b.gather_into_params()
        for group, saved in zip(self.optimizer.param_groups, state["param_groups"]):
            group.update(saved)
