"""The native engine's decode step on fused Triton kernels (CUDA only; optional).

``kernels="auto"`` (the engine's default) uses them where Triton imports, the device is CUDA and
the model is a dense Llama-family decoder in bf16 or fp16; ``kernels="triton"`` insists and says why
not; ``kernels="torch"`` keeps the HF-submodule path everywhere. Prefill always runs the torch path.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

KERNELS = ("auto", "triton", "torch")


def fused_decoder_or_reason(runner, kernels: str):
    """A :class:`~loongsage.core.engine.fused.decoder.FusedDecoder` for ``runner``, or the one-line
    reason it runs the torch path (raised as ValueError when ``kernels="triton"`` asked for it)."""
    if kernels not in KERNELS:
        raise ValueError(f"native engine: kernels={kernels!r}: must be one of {list(KERNELS)}")
    if kernels == "torch":
        return None, "kernels=torch"
    reason = why_not_fused(runner.model, runner.device.type)
    if reason is None:
        from loongsage.core.engine.fused.decoder import FusedDecoder

        return FusedDecoder(runner), None
    if kernels == "triton":
        raise ValueError(f"native engine: kernels=triton: {reason}")
    return None, reason


def why_not_fused(model: nn.Module, device: str) -> str | None:
    """Why the fused kernels cannot run ``model`` on ``device`` (a device type), or None."""
    if device != "cuda":
        return f"device {device!r} (the fused kernels are CUDA kernels)"
    dtype = model.get_input_embeddings().weight.dtype
    if dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {str(dtype).removeprefix('torch.')} (the fused kernels run bf16/fp16 models)"
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed"
    from loongsage.core.engine.fused.decoder import unsupported

    return unsupported(model)
