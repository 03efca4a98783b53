"""A trainer's state between the device and host memory, for a colocated engine's turn on the card
(``placement.offload_trainer``): the weights, the float32 masters (or the distributed optimizer's
slices and gradient vector) and AdamW's moments move in place, so the optimizer, the gradient
hooks and the masters keep the very tensors they hold. To the host they go into pinned memory,
asynchronously, one synchronisation per move: the first offload pays the pinning, later ones
reuse the allocator's pinned blocks and run at the bus's speed."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def place_trainer_state(
    model: torch.nn.Module, optimizer: Any, masters: Any, dist_opt: Any, device: str, *, weights: bool
) -> None:
    """Move the optimizer's state and the masters to ``device``, the model's weights too when
    ``weights``; the gradients of the last step are dropped (a step starts from none)."""
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    if weights:  # in place: parameters keep their identity (the optimizer's, the hooks')
        for module in model.modules():
            for group in (module._parameters, module._buffers):
                for tensor in group.values():
                    if tensor is not None:
                        tensor.data = moved(tensor.data, device)
    for _, master in masters.copies() if masters is not None else ():
        master.data = moved(master.data, device)
    if dist_opt is not None:
        dist_opt.to(lambda t: moved(t, device))
    for state in optimizer.state.values() if optimizer is not None else ():
        for key, value in state.items():
            if isinstance(value, Tensor) and value.dim() > 0:  # AdamW keeps its step count on the CPU
                state[key] = moved(value, device)
    torch.cuda.synchronize()  # the copies ran asynchronously
    if device == "cpu":
        torch.cuda.empty_cache()


def moved(tensor: Tensor, device: str | torch.device) -> Tensor:
    """``tensor`` on ``device``, copied asynchronously (to the host: into pinned memory). The
    caller synchronizes."""
    if tensor.device == torch.device(device):
        return tensor
    if torch.device(device).type == "cpu":
        return torch.empty_like(tensor, device="cpu", pin_memory=True).copy_(tensor, non_blocking=True)
    return tensor.to(device, non_blocking=True)
