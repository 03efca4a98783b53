"""FP8 training GEMMs for the torch trainer's decoder layers (``fp8``), on ``torch._scaled_mm``.

Each projection of a decoder layer (q/k/v/o, gate/up/down) runs its three GEMMs in float8 with
current scaling, as Transformer Engine's current-scaling recipes and torchao's float8 training do,
while the weights, the optimizer state, the embedding and the FP32 LM head stay as they are:

* forward ``y = x @ W.T``: ``x`` and ``W`` in e4m3, scaled per token and per output channel
  (``rowwise``) or per tensor (``tensorwise``), summed in float32 by the FP8 tensor cores and
  written in bf16;
* backward ``dx = dy @ W`` and ``dW = dy.T @ x``: the gradient ``dy`` in e5m2 (``hybrid``: a wider
  range, 2 mantissa bits) or e4m3 (``e4m3``), each operand scaled along the dimension it keeps
  (``_scaled_mm`` scales the rows of its first operand and the columns of its second).

A scale is the largest magnitude over the format's largest value, taken from the tensor at hand
each time (no history of amaxes, so nothing to warm up or carry in a checkpoint). Token counts are
padded to a multiple of 16 (the tensor cores' tile) with zero tokens, which add nothing.

FP8 changes the trainer's numbers (e4m3 keeps 3 mantissa bits): its log-probs move away from a
bf16 engine's, which the run's importance correction and ``train/is_approx_k3_kl`` account for;
it cannot hold a consistency mode (``batch_invariant``, the engine's ``deterministic``), which is
refused before a run starts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

FORMATS = ("hybrid", "e4m3")  # Transformer Engine's names: e5m2 gradients, or e4m3 everywhere
RECIPES = ("rowwise", "tensorwise")
_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
_TINY = 1e-12  # the scale of an all-zero row: any positive one gives zeros back


def check_fp8(fp8: str | None, recipe: str) -> None:
    """One line naming an unknown FP8 format or recipe and the known ones."""
    if fp8 is not None and fp8 not in FORMATS:
        raise ValueError(f"torch trainer: fp8={fp8!r}; allowed: {', '.join(FORMATS)}, or null (the model's dtype)")
    if recipe not in RECIPES:
        raise ValueError(f"torch trainer: fp8_recipe={recipe!r}; allowed: {', '.join(RECIPES)}")


def unsupported_fp8(device: torch.device | str, dtype: torch.dtype) -> str | None:
    """Why FP8 GEMMs cannot run here (None when they can): the trainer's and the engine's check."""
    device = torch.device(device)
    if dtype != torch.bfloat16:
        return f"dtype {str(dtype).removeprefix('torch.')} (FP8 GEMMs write bf16: the model must be bfloat16)"
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        return f"compute capability {major}.{minor} (FP8 tensor cores need 8.9 or later: Ada, Hopper)"
    return None


def quantize(x: Tensor, fmt: str, rowwise: bool) -> tuple[Tensor, Tensor]:
    """``(x8, scale)`` with ``x ~= x8 * scale``: ``scale`` ``[rows, 1]`` (rowwise) or ``[]``."""
    dtype = _DTYPES[fmt]
    top = torch.finfo(dtype).max
    f = x.float()
    amax = f.abs().amax(dim=-1, keepdim=True) if rowwise else f.abs().amax()
    scale = (amax / top).clamp_(min=_TINY)
    # clamped: a value rounding past the largest finite one would not come back from the cast
    return (f / scale).clamp_(-top, top).to(dtype), scale


def _mm(a: Tensor, a_fmt: str, b: Tensor, b_fmt: str, rowwise: bool) -> Tensor:
    """``a [M, K] @ b [N, K].T`` in FP8, bf16 out: ``a`` scaled along its rows, ``b`` along its rows
    (the product's columns). Every side a multiple of 16."""
    # row-major operands: the quantized copies keep their strides, and the FP8 GEMM takes its first
    # operand row-major, its second (b8.t()) column-major
    a8, sa = quantize(a.contiguous(), a_fmt, rowwise)
    b8, sb = quantize(b.contiguous(), b_fmt, rowwise)
    return torch._scaled_mm(a8, b8.t(), scale_a=sa, scale_b=sb.t(), out_dtype=torch.bfloat16)


class _Fp8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, grad_fmt: str, rowwise: bool) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.grad_fmt, ctx.rowwise = grad_fmt, rowwise
        return _mm(x, "e4m3", weight, "e4m3", rowwise)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None, None]:
        x, weight = ctx.saved_tensors
        fmt, rowwise = ctx.grad_fmt, ctx.rowwise
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:  # dy [M, N] @ W [N, K]: W's columns scaled, as W.T's rows
            grad_x = _mm(grad, fmt, weight.t().contiguous(), "e4m3", rowwise).to(x.dtype)
        if ctx.needs_input_grad[1]:  # dy.T [N, M] @ x [M, K]: x's columns scaled, as x.T's rows
            grad_w = _mm(grad.t().contiguous(), fmt, x.t().contiguous(), "e4m3", rowwise).to(weight.dtype)
        return grad_x, grad_w, None, None


def fp8_linear(x: Tensor, weight: Tensor, bias: Tensor | None, fmt: str, recipe: str) -> Tensor:
    """``F.linear(x, weight, bias)`` with its GEMMs in FP8 (see the module docstring)."""
    grad_fmt = "e5m2" if fmt == "hybrid" else "e4m3"
    flat = x.reshape(-1, x.shape[-1])
    rows = flat.shape[0]
    extra = -rows % 16  # zero tokens up to the tensor cores' tile: the weight gradient sums over tokens
    out = _Fp8Matmul.apply(F.pad(flat, (0, 0, 0, extra)) if extra else flat, weight, grad_fmt, recipe == "rowwise")
    out = out[:rows].view(*x.shape[:-1], weight.shape[0])
    return out if bias is None else out + bias


class Fp8Linear(nn.Linear):
    """An ``nn.Linear`` whose GEMMs run in FP8; it holds the replaced layer's own parameters, so
    names, state dicts and the optimizer see the same tensors."""

    def __init__(self, linear: nn.Linear, fmt: str, recipe: str) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.fmt, self.recipe = fmt, recipe

    def forward(self, x: Tensor) -> Tensor:
        return fp8_linear(x, self.weight, self.bias, self.fmt, self.recipe)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8={self.fmt}, recipe={self.recipe}"


def use_fp8(layers: list[nn.Module], fmt: str, recipe: str) -> int:
    """Every ``nn.Linear`` inside ``layers`` (the decoder layers) becomes an :class:`Fp8Linear` in
    place; returns how many. GEMMs whose sides are not multiples of 16 stay as they are."""
    count = 0
    for layer in layers:
        for parent in list(layer.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear and child.in_features % 16 == 0 and child.out_features % 16 == 0:
                    setattr(parent, name, Fp8Linear(child, fmt, recipe))
                    count += 1
    return count
