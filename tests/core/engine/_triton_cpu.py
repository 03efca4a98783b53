"""Run the engine's Triton kernels on the CPU, in Triton's interpreter, for the CPU suite.

The interpreter must be on (``TRITON_INTERPRET=1``) before Triton is first imported: Triton's own
``tl.sum`` and friends are ``@triton.jit`` functions too, and only those decorated in interpreter
mode run there. So these kernels are tested in a process of their own (``test_fused_kernels.py``
starts it). ``load_fused()`` imports the kernel modules there and corrects two faults of the
interpreter that a GPU build does not have (both seen in Triton 3.6 and 3.9):

* ``tl.dot`` on bfloat16 operands multiplies their raw 16-bit patterns (the interpreter stores
  bf16 as uint16): the operands are widened to float32 first, which is exact;
* a float32 -> bfloat16 (or float8 e4m3) cast truncates the mantissa, where a GPU rounds to
  nearest even; the cast goes through torch, which rounds to nearest even.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import numpy as np

MODULES = ("ops", "attention", "decoder", "sampling", "matmul", "fp8")


def _patch_interpreter() -> None:
    import torch
    import triton.language as tl
    import triton.runtime.interpreter as interp

    if getattr(interp, "_loongsage_patched", False):
        return
    original = interp._convert_float

    def convert(data, src, dst, rounding):
        if src == tl.float32 and dst == tl.bfloat16:
            wide = torch.from_numpy(np.ascontiguousarray(data).view(np.float32).copy())
            return wide.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        if src == tl.float32 and dst == tl.float8e4nv:
            wide = torch.from_numpy(np.ascontiguousarray(data).view(np.float32).copy())
            return wide.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        return original(data, src, dst, rounding)

    dot = interp.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, *args):
        if a.dtype.scalar == tl.bfloat16:
            widen = lambda h: interp.TensorHandle(  # noqa: E731
                original(h.data, tl.bfloat16, tl.float32, None).view(np.float32), tl.float32
            )
            a, b = widen(a), widen(b)
        return dot(self, a, b, d, *args)

    interp._convert_float = convert
    interp.InterpreterBuilder.create_dot = create_dot
    interp._loongsage_patched = True


def load_fused() -> dict[str, ModuleType]:
    """The ``loongsage.core.engine.fused`` kernel modules, interpreted on the CPU."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("set TRITON_INTERPRET=1 before Triton is imported (see test_fused_kernels.py)")
    _patch_interpreter()
    return {name: importlib.import_module(f"loongsage.core.engine.fused.{name}") for name in MODULES}
