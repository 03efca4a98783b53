"""How ``compile_layers`` compiles a decoder layer's code: with Inductor rounding where eager torch rounds.

Inductor fuses a layer's bf16/fp16 pointwise work (RMSNorm, rotary embedding, SwiGLU) into kernels
that compute in float32 and, by default, leave out the roundings to the model dtype that lie between
the eager ops. Those roundings are the ones the native engine's fused kernels reproduce
(:mod:`loongsage.core.engine.fused.ops`), so a compiled trainer without them scores the engine's
tokens further from the engine than the eager trainer does: on a tiny bf16 Qwen3 on CPU its
log-probs differed from the eager forward's by 7e-4 on average. Inductor's
``emulate_precision_casts`` keeps every rounding, and the compiled forward then gives the eager
forward's log-probs bit for bit (``tests/core/trainer/test_trainer.py``).
"""

from __future__ import annotations

from torch import nn

EAGER_ROUNDING = {"emulate_precision_casts": True}  # Inductor options of every compiled part


def compile_like_eager(module: nn.Module, *, dynamic: bool | None = None) -> None:
    """Compile ``module`` in place (``nn.Module.compile``), rounding as its eager code does."""
    module.compile(dynamic=dynamic, options=EAGER_ROUNDING)
