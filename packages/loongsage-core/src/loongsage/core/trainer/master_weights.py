"""Float32 master weights for a model trained in bfloat16 or float16.

An update of ``lr x g`` to a bfloat16 weight is lost whenever it is below half the weight's last
bit: with 8 significant bits that is a relative update under 2^-9, and RL fine-tuning runs at
learning rates of 1e-6. So the optimizer steps a float32 copy of every low-precision weight (its
state is float32 with it) and the model gets the rounded result after each step, as Megatron's
mixed-precision optimizer and FSDP's mixed precision do.

Gradients accumulate in float32 too: a hook moves each parameter's gradient into its master's as
soon as autograd has accumulated it, and frees it, so the micro-batches of a step are summed in
float32 and at most one low-precision gradient is alive at a time. Parameters already in float32
are their own masters.
"""

from __future__ import annotations

import torch
from torch import Tensor


class MasterWeights:
    """The float32 tensors an optimizer steps in place of ``params`` (same order)."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params
        self.masters = [p if p.dtype == torch.float32 else self._master(p) for p in params]
        self._holders = dict(zip(params, self.masters))
        for param, master in zip(params, self.masters):
            if master is not param:
                param.register_post_accumulate_grad_hook(self._hook(master))

    @staticmethod
    def _master(param: torch.nn.Parameter) -> torch.nn.Parameter:
        master = torch.nn.Parameter(param.detach().float().clone())
        # what a backend marked on the parameter (Megatron's tensor-parallel layout, ``allreduce``)
        # holds for its master: gradient sums and norms read it there
        for key, value in vars(param).items():
            if not key.startswith("_"):
                setattr(master, key, value)
        return master

    @staticmethod
    def _hook(master: torch.nn.Parameter):
        def accumulate(param: Tensor) -> None:
            if master.grad is None:
                master.grad = param.grad.float()
            else:
                master.grad.add_(param.grad)
            param.grad = None

        return accumulate

    def holder(self, param: torch.nn.Parameter) -> torch.nn.Parameter:
        """The tensor holding ``param``'s gradient and stepped by the optimizer (``param`` itself
        when it is not trained here)."""
        return self._holders.get(param, param)

    def copies(self) -> list[tuple[torch.nn.Parameter, torch.nn.Parameter]]:
        """``(parameter, master)`` of the low-precision parameters (a float32 one is its own master)."""
        return [(p, m) for p, m in zip(self.params, self.masters) if m is not p]

    @torch.no_grad()
    def to_model(self) -> None:
        """The stepped masters, rounded into the model's weights."""
        pairs = self.copies()
        if pairs:  # one multi-tensor copy: a few kernels for the whole model, not one per tensor
            torch._foreach_copy_([p for p, _ in pairs], [m for _, m in pairs])

    @torch.no_grad()
    def from_model(self) -> None:
        """Masters reset to the model's weights (after they were loaded from elsewhere)."""
        for param, master in self.copies():
            master.copy_(param)

    def state(self) -> list[Tensor]:
        """The low-precision weights' masters, for a checkpoint."""
        return [m.detach() for _, m in self.copies()]

    @torch.no_grad()
    def load(self, state: list[Tensor] | None) -> None:
        """Masters from :meth:`state`; None (a checkpoint without them): from the model's weights."""
        if state is None:
            self.from_model()
            return
        owned = [m for _, m in self.copies()]
        if len(state) != len(owned):
            raise ValueError(f"checkpoint: {len(state)} master weights for {len(owned)} low-precision parameters")
        for master, saved in zip(owned, state):
            master.copy_(saved)
