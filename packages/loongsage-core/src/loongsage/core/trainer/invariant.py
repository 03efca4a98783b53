"""The trainer's batch-invariant forward: the sampled tokens' log-probs exactly as the native
engine's ``batch_invariant`` mode computes them, and their gradients.

Engine and trainer log-probs differ on the fast path because their kernels round differently at
different batch shapes: a decode step multiplies a few rows at a time, the trainer's forward
thousands, and the GEMMs (split-K, tile choice), attention and reductions sum in other orders. In
this mode both sides run the same kernels on a path where each token's numbers do not depend on
how many tokens run beside it (:meth:`~loongsage.core.engine.fused.decoder.FusedDecoder.hidden`
with ``invariant``): fixed-tile GEMMs, attention over a token's columns in one program in order,
the fused norms, rotary and SwiGLU kernels, the FP32 head as a fixed-tile GEMM and the log-prob
over vocabulary chunks of a fixed length. The trainer feeds a sequence's tokens at their positions
into a cache of its own (:meth:`~loongsage.core.engine.fused.decoder.FusedDecoder.train_hidden`),
so every token is computed as the engine computed it when it was prefilled or decoded: the
log-probs agree bit for bit.

The backward differentiates that same forward: each kernel's backward is the gradient of the HF
ops it equals at its saved inputs (:mod:`loongsage.core.engine.fused.differentiable`), the GEMMs'
runs torch matmuls. So a step costs one forward on the invariant kernels (slower than cuBLAS' and
cuDNN's) and an ordinary backward; the gradient is the HF model's, taken at the invariant forward's
activations. What the mode costs is measured in ``bench/consistency_gpu.py`` and
``bench/gpu_invariant_step.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class InvariantForward:
    """A bf16/fp16 Llama-family HF model's log-probs on the batch-invariant path (CUDA, Triton)."""

    def __init__(self, model: nn.Module, fp32_lm_head: bool) -> None:
        from loongsage.core.engine.fused.decoder import FusedDecoder, unsupported
        from loongsage.core.engine.kv_cache import DecoderRunner

        self.model = model
        self.runner = DecoderRunner(model, fp32_lm_head=fp32_lm_head, kernels="torch")
        # a decoder the kernels cover (the trainer checked the device and the dtype), in one line
        why = unsupported(model)
        if why is not None:
            raise ValueError(f"batch_invariant: the fused kernels cannot run this model: {why}")
        # the trainer's parameters stay its own tensors: no merged q/k/v buffer
        self.decoder = FusedDecoder(self.runner, merge=False, invariant=True)

    def hidden(self, input_ids: Tensor) -> Tensor:
        """Final-normed hidden states ``[B, T, H]`` of right-padded rows (pads are computed and
        never read by a real token: attention is causal), differentiable."""
        rows, width = input_ids.shape
        # transformers 5 names it is_activation_checkpointing (the older name warns), 4.x the other
        name = "is_activation_checkpointing" if hasattr(self.model, "is_activation_checkpointing") else None
        checkpoint = bool(getattr(self.model, name or "is_gradient_checkpointing", False))
        return self.decoder.train_hidden(input_ids, checkpoint=checkpoint).view(rows, width, -1)

    def logprobs(self, input_ids: Tensor, first: int, *, with_entropy: bool) -> tuple[Tensor, Tensor | None]:
        """Log-probs (and entropies) ``[B, T]`` of tokens ``first..T-1``, zeros before ``first``,
        as :func:`~loongsage.core.model_math.logprobs.logprobs_and_entropy` returns them."""
        from loongsage.core.engine.fused.matmul import invariant_linear
        from loongsage.core.engine.fused.sampling import InvariantTokenLogprobs

        hidden = self.hidden(input_ids)
        rows, width, size = hidden.shape
        at = hidden[:, first - 1 : width - 1].reshape(-1, size)  # the positions that predict tokens first..
        head = self.model.get_output_embeddings().weight
        out = torch.float32 if self.runner.fp32_lm_head else None
        logits = invariant_linear(at, head, out_dtype=out).float()
        tokens = input_ids[:, first:].reshape(-1)
        lp = F.pad(InvariantTokenLogprobs.apply(logits, tokens).view(rows, width - first), (first, 0))
        ent = None
        if with_entropy:
            with torch.no_grad():
                logp = torch.log_softmax(logits, dim=-1)
                ent = F.pad(-(logp.exp() * logp).sum(-1).view(rows, width - first), (first, 0))
        return lp, ent
