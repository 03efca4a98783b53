"""The trainer's batch-invariant forward: the sampled tokens' log-probs exactly as the native
engine's ``batch_invariant`` mode computes them, with the gradients of the plain HF forward.

Engine and trainer log-probs differ on the fast path because their kernels round differently at
different batch shapes: a decode step multiplies a few rows at a time, the trainer's forward
thousands, and the GEMMs (split-K, tile choice), attention and reductions sum in other orders. In
this mode both sides run the same kernels on a path where each token's numbers do not depend on
how many tokens run beside it (:meth:`~loongsage.core.engine.fused.decoder.FusedDecoder.hidden`
with ``invariant``): fixed-tile GEMMs, attention over a token's columns in one program in order,
the fused norms, rotary and SwiGLU kernels, the FP32 head as a fixed-tile GEMM and the log-prob
over vocabulary chunks of a fixed length. The trainer feeds a sequence's tokens at their positions
into a cache of its own, so every token is computed as the engine computed it when it was
prefilled or decoded: the log-probs agree bit for bit.

The backward is the plain HF forward's, recomputed (as activation checkpointing recomputes): the
invariant kernels have no backward of their own, and a gradient need not match the engine's
numbers. So a step costs the invariant forward (slower kernels than cuBLAS' and cuDNN's), then the
HF forward and backward. What the mode costs is measured in ``bench/consistency_gpu.py``.
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
        never read by a real token: attention is causal)."""
        rows, width = input_ids.shape
        n, dev = rows * width, input_ids.device
        positions = torch.arange(width, device=dev).repeat(rows).view(n, 1)
        sequence = torch.arange(rows, device=dev).repeat_interleave(width)
        r = self.runner
        dtype = r.inner.embed_tokens.weight.dtype
        # one cache for all layers: a layer's keys are read before the next layer writes its own
        keys = torch.empty(rows, r.kv_heads, width, r.head_dim, dtype=dtype, device=dev)
        values = torch.empty_like(keys)
        layers = len(r.layers)
        last = self.decoder.hidden(
            input_ids.reshape(n, 1),
            positions,
            [keys] * layers,
            [values] * layers,
            positions[:, 0],
            width,
            cache_rows=sequence,
            invariant=True,
        )
        return last.view(rows, width, -1)

    def logprobs(
        self, input_ids: Tensor, attention_mask: Tensor, first: int, *, with_entropy: bool
    ) -> tuple[Tensor, Tensor | None]:
        """Log-probs (and entropies) ``[B, T]`` of tokens ``first..T-1``, zeros before ``first``,
        as :func:`~loongsage.core.model_math.logprobs.logprobs_and_entropy` returns them."""
        from loongsage.core.engine.fused.matmul import invariant_linear
        from loongsage.core.engine.fused.sampling import InvariantTokenLogprobs

        params = [p for p in self.model.model.parameters() if p.requires_grad]
        hidden = _InvariantBody.apply(self, input_ids, attention_mask, *params)
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


class _InvariantBody(torch.autograd.Function):
    """Forward: the invariant path's hidden states. Backward: the HF model body's, recomputed."""

    @staticmethod
    def forward(ctx, fwd: InvariantForward, input_ids: Tensor, attention_mask: Tensor, *params: Tensor) -> Tensor:
        ctx.fwd, ctx.params = fwd, params
        ctx.save_for_backward(input_ids, attention_mask)
        with torch.no_grad():
            return fwd.hidden(input_ids)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        input_ids, attention_mask = ctx.saved_tensors
        with torch.enable_grad():
            out = ctx.fwd.model.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
            out = out.last_hidden_state
        grads = torch.autograd.grad(out, ctx.params, grad, allow_unused=True)
        return (None, None, None, *grads)
