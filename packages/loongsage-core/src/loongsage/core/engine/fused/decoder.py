"""The decode step of a dense Llama-family decoder on fused kernels (:class:`FusedDecoder`).

Per layer it runs nine kernels where the torch path runs about thirty: the residual add with
RMSNorm, one merged q/k/v projection, q/k norm + rotary embedding + KV-cache store, decode attention
over each row's own columns, the output projection, add + RMSNorm, one merged gate/up projection,
``silu(gate) * up`` and the down projection.

Merged projections without a second copy of the weights: the q/k/v (and gate/up) weights are
moved into one buffer per layer and the HF parameters become views of it, so ``update_weights``
(an in-place copy by HF name), ``named_weights`` and the trainer-side names are unchanged.
:meth:`FusedDecoder.bind` re-merges after ``Module.to`` replaced the parameters (a memory release
and resume).

The same layers run any number of tokens of one or more sequences (:meth:`FusedDecoder.hidden`:
token ``n`` writes its key at its own column of its sequence's cache row and attends over the
columns before it). With ``invariant`` the path is batch-invariant: every GEMM is the fixed-tile
kernel of :mod:`~loongsage.core.engine.fused.matmul` (the engine's merged projections give the
same bits as the trainer's projections apart) and attention keeps a token's columns in one
program, so a token's numbers do not depend on how many tokens run beside it. The engine's decode
and prefill and the trainer's forward (:mod:`loongsage.core.trainer.invariant`) then compute
bit-identical log-probs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from loongsage.core.engine.fused.attention import SharedPrefixes, decode_attention
from loongsage.core.engine.fused.fp8 import fp8_matmul, quantize_rows, quantize_weight
from loongsage.core.engine.fused.matmul import invariant_linear, invariant_linears
from loongsage.core.engine.fused.ops import add_rms_norm, add_rms_norm_fp8, qk_rope_store, silu_mul, silu_mul_fp8

_NORMS = {"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"}
Rows = Tensor | tuple[Tensor, Tensor]  # a GEMM's input: bf16 rows, or float8 rows and their scales


def unsupported(model: nn.Module) -> str | None:
    """Why the fused decode cannot drive ``model`` (None when it can)."""
    cfg, inner = model.config, model.model
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act={cfg.hidden_act!r} (the fused MLP is SwiGLU)"
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if head_dim & (head_dim - 1) or head_dim < 16:
        return f"head_dim={head_dim} (a power of two of at least 16)"
    for i, layer in enumerate(inner.layers):
        mlp, attn = layer.mlp, layer.self_attn
        if not all(hasattr(mlp, p) for p in ("gate_proj", "up_proj", "down_proj")):
            return f"layer {i}'s MLP is not a dense gate/up/down SwiGLU (a mixture of experts?)"
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        norms += [n for n in (getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)) if n is not None]
        if any(type(n).__name__ not in _NORMS for n in norms):
            return f"layer {i} has a norm other than {sorted(_NORMS)}"
        if any(p.bias is not None for p in (mlp.gate_proj, mlp.up_proj)):
            return f"layer {i}'s gate/up projections have a bias"
    if type(inner.norm).__name__ not in _NORMS:
        return f"final norm {type(inner.norm).__name__}"
    return None


def _merge(modules: list[nn.Linear]) -> tuple[Tensor, Tensor | None]:
    """One weight buffer (and bias) for ``modules``; their parameters become views of it."""
    merged = torch.cat([m.weight.data for m in modules])
    start = 0
    for m in modules:
        rows = m.weight.shape[0]
        m.weight.data = merged[start : start + rows]
        start += rows
    if all(m.bias is None for m in modules):
        return merged, None
    bias = torch.cat([merged.new_zeros(m.weight.shape[0]) if m.bias is None else m.bias.data for m in modules])
    start = 0
    for m in modules:
        rows = m.weight.shape[0]
        if m.bias is not None:
            m.bias.data = bias[start : start + rows]
        start += rows
    return merged, bias


class _Layer(NamedTuple):
    ln1: nn.Module
    qkv: Tensor | None  # the merged q/k/v weight (None without merging)
    qkv_bias: Tensor | None
    q_norm: nn.Module | None
    k_norm: nn.Module | None
    o_proj: nn.Linear
    ln2: nn.Module
    gate_up: Tensor | None  # the merged gate/up weight
    down: nn.Linear
    attn: nn.Module  # the HF modules: the trainer's batch-invariant path takes each projection by itself
    mlp: nn.Module


class FusedDecoder:
    """Decode forward of a runner's model on fused kernels (see the module docstring).

    ``fp8`` runs the decode GEMMs on float8 copies of the projections (:mod:`.fp8`), quantized
    again after every weight update (:meth:`requantize`)."""

    def __init__(self, runner, *, merge: bool = True, invariant: bool = False, fp8: bool = False) -> None:
        self.runner, self.merge, self.invariant, self.fp8 = runner, merge, invariant, fp8
        self.quantized: list[dict[str, tuple[Tensor, Tensor]]] = []
        self.bind()

    def bind(self) -> None:
        """(Re-)merge the projections; call after the parameters were replaced (a device move).
        Without ``merge`` (the trainer's model, whose parameters must stay its own tensors) only
        the batch-invariant path runs, each projection by itself, with the same bits as merged."""
        self.layers: list[_Layer] = []
        for layer in self.runner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv, qkv_bias = _merge([attn.q_proj, attn.k_proj, attn.v_proj]) if self.merge else (None, None)
            gate_up, _ = _merge([mlp.gate_proj, mlp.up_proj]) if self.merge else (None, None)
            self.layers.append(
                _Layer(
                    layer.input_layernorm,
                    qkv,
                    qkv_bias,
                    getattr(attn, "q_norm", None),
                    getattr(attn, "k_norm", None),
                    attn.o_proj,
                    layer.post_attention_layernorm,
                    gate_up,
                    mlp.down_proj,
                    attn,
                    mlp,
                )
            )
        self.requantize()

    def unbind(self) -> None:
        """Drop every reference to the device's weights (the merged buffers, the FP8 copies), so a
        memory release frees them; :meth:`bind` makes them again."""
        self.layers, self.quantized = [], []

    def requantize(self) -> None:
        """The FP8 copies of the current weights (after an update wrote the bf16 ones)."""
        if not self.fp8:
            return
        self.quantized = [
            {
                "qkv": quantize_weight(layer.qkv),
                "o": quantize_weight(layer.o_proj.weight),
                "gate_up": quantize_weight(layer.gate_up),
                "down": quantize_weight(layer.down.weight),
            }
            for layer in self.layers
        ]

    def decode(
        self,
        input_ids: Tensor,
        positions: Tensor,
        keys: list[Tensor],
        values: list[Tensor],
        cols: Tensor,
        columns: int,
        shared: SharedPrefixes | None = None,
    ) -> Tensor:
        """Float32 logits ``[B, V]`` of one new token per row; row ``b``'s key/value go to column
        ``cols[b]`` and attention covers its columns ``[0, cols[b]]`` (``columns`` bounds them all).
        ``shared``: tiles of rows whose common prefix attention reads once."""
        last = self.hidden(input_ids, positions, keys, values, cols, columns, invariant=self.invariant, shared=shared)
        return self.head(last)

    def head(self, last: Tensor) -> Tensor:
        """Float32 logits of final-normed hidden states ``[N, H]``."""
        r = self.runner
        if not self.invariant:
            return r.head(last)
        weight = r.model.get_output_embeddings().weight
        return invariant_linear(last, weight, out_dtype=torch.float32 if r.fp32_lm_head else None).float()

    def hidden(
        self,
        input_ids: Tensor,
        positions: Tensor,
        keys: list[Tensor],
        values: list[Tensor],
        cols: Tensor,
        columns: int,
        *,
        cache_rows: Tensor | None = None,
        invariant: bool = False,
        shared: SharedPrefixes | None = None,
    ) -> Tensor:
        """Final-normed hidden states ``[N, H]`` of ``N`` tokens (``input_ids``/``positions`` ``[N, 1]``).

        Token ``n``'s key and value go to column ``cols[n]`` of cache row ``n`` (of
        ``cache_rows[n]`` where given: several tokens of one sequence), and it attends over that
        row's columns ``[0, cols[n]]``. Decode passes one token per slot; a prefill or the trainer
        passes the tokens of a sequence, each at its position. ``invariant`` computes every token
        the same way whatever ``N`` is: the batch-invariant GEMM (on the merged weights where this
        decoder merged them, else one per HF projection, as the trainer's modules are), attention
        with each token's columns in one program, in order (``shared`` tiles carry a row's state
        on from its prefix rather than merge, the same bits).
        """
        r = self.runner
        # FP8 GEMMs take their inputs quantized by the kernels that make them (see fused/fp8.py)
        fp8 = self.fp8 and not invariant
        norm, act = (add_rms_norm_fp8, silu_mul_fp8) if fp8 else (add_rms_norm, silu_mul)
        hidden = r.inner.embed_tokens(input_ids)  # [N, 1, H]
        cos, sin = r.inner.rotary_emb(hidden, positions)
        cos, sin = cos[:, 0], sin[:, 0]
        delta, residual = hidden[:, 0], None
        lengths = cols + 1
        for i, layer in enumerate(self.layers):
            x, residual = norm(delta, residual, layer.ln1.weight, layer.ln1.variance_epsilon)
            q_norm, k_norm = layer.q_norm, layer.k_norm
            q = qk_rope_store(
                self._qkv(i, x, invariant),
                r.num_heads,
                r.kv_heads,
                None if q_norm is None else q_norm.weight,
                None if k_norm is None else k_norm.weight,
                1e-6 if q_norm is None else q_norm.variance_epsilon,
                cos,
                sin,
                keys[i],
                values[i],
                cols,
                cache_rows,
            )
            splits = 1 if invariant else None
            out = decode_attention(
                q,
                keys[i],
                values[i],
                lengths,
                r.scales[i],
                columns,
                cache_rows=cache_rows,
                splits=splits,
                shared=shared,
            )
            o = self._linear(i, "o", out, layer.o_proj, invariant)
            x, residual = norm(o, residual, layer.ln2.weight, layer.ln2.variance_epsilon)
            delta = self._linear(i, "down", act(self._gate_up(i, x, invariant)), layer.down, invariant)
        norm = r.inner.norm
        last, _ = add_rms_norm(delta, residual, norm.weight, norm.variance_epsilon)
        return last

    def train_hidden(self, input_ids: Tensor, *, checkpoint: bool = False) -> Tensor:
        """Final-normed hidden states ``[rows * width, H]`` of right-padded sequences
        ``[rows, width]`` on the batch-invariant path, differentiable: the numbers :meth:`hidden`
        with ``invariant`` gives these tokens at their positions (bit for bit: the same kernels and
        GEMMs in the same order), each kernel wrapped so that its backward is the gradient of the
        HF ops it equals (:mod:`.differentiable`). ``checkpoint`` recomputes each layer in the backward
        (the trainer's activation checkpointing) instead of keeping its activations."""
        from torch.utils.checkpoint import checkpoint as recompute

        from loongsage.core.engine.fused.differentiable import AddRmsNorm, Attention, QkRope, SiluMul

        r = self.runner
        rows, width = input_ids.shape
        n = rows * width
        positions = torch.arange(width, device=input_ids.device).repeat(rows).view(n, 1)
        sequences = torch.arange(rows, device=input_ids.device).repeat_interleave(width)
        hidden = r.inner.embed_tokens(input_ids.reshape(n, 1))
        cos, sin = r.inner.rotary_emb(hidden, positions)
        cos, sin = cos[:, 0], sin[:, 0]

        def layer(i: int, delta: Tensor, residual: Tensor | None) -> tuple[Tensor, Tensor]:
            parts = self.layers[i]
            x, residual = AddRmsNorm.apply(delta, residual, parts.ln1.weight, parts.ln1.variance_epsilon)
            q_norm, k_norm = parts.q_norm, parts.k_norm
            q, keys, values = QkRope.apply(
                self._qkv(i, x, True),
                None if q_norm is None else q_norm.weight,
                None if k_norm is None else k_norm.weight,
                1e-6 if q_norm is None else q_norm.variance_epsilon,
                cos,
                sin,
                r.num_heads,
                r.kv_heads,
                rows,
                positions[:, 0],
                sequences,
            )
            o = self._linear(i, "o", Attention.apply(q, keys, values, r.scales[i]), parts.o_proj, True)
            x, residual = AddRmsNorm.apply(o, residual, parts.ln2.weight, parts.ln2.variance_epsilon)
            return self._linear(i, "down", SiluMul.apply(self._gate_up(i, x, True)), parts.down, True), residual

        delta, residual = hidden[:, 0], None
        for i in range(len(self.layers)):
            if checkpoint and torch.is_grad_enabled():
                delta, residual = recompute(layer, i, delta, residual, use_reentrant=False)
            else:
                delta, residual = layer(i, delta, residual)
        norm = r.inner.norm
        last, _ = AddRmsNorm.apply(delta, residual, norm.weight, norm.variance_epsilon)
        return last

    def _qkv(self, i: int, x: Rows, invariant: bool) -> Tensor:
        layer = self.layers[i]
        if invariant:
            attn = layer.attn
            projections = (attn.q_proj, attn.k_proj, attn.v_proj)
            # the merged weight's columns are each projection's bits (the GEMM tiles N); a bias
            # merged with zeros for a projection without one would add 0.0, turning a -0.0 into
            # +0.0, so that case keeps the projections apart, as the trainer runs them
            if layer.qkv is not None and len({m.bias is None for m in projections}) == 1:
                return invariant_linear(x, layer.qkv, layer.qkv_bias)
            return invariant_linears(x, [m.weight for m in projections], [m.bias for m in projections])
        if self.fp8:
            return fp8_matmul(*x, *self.quantized[i]["qkv"], layer.qkv_bias)
        return F.linear(x, layer.qkv, layer.qkv_bias)

    def _gate_up(self, i: int, x: Rows, invariant: bool) -> Tensor:
        layer = self.layers[i]
        if invariant:
            if layer.gate_up is not None:  # the same bits as the two projections apart (see _qkv)
                return invariant_linear(x, layer.gate_up)
            mlp = layer.mlp
            return invariant_linears(x, [mlp.gate_proj.weight, mlp.up_proj.weight], [None, None])
        if self.fp8:
            return fp8_matmul(*x, *self.quantized[i]["gate_up"])
        return F.linear(x, layer.gate_up)

    def _linear(self, i: int, name: str, x: Rows, module: nn.Linear, invariant: bool) -> Tensor:
        if invariant:
            return invariant_linear(x, module.weight, module.bias)
        if self.fp8:  # the down projection's input comes quantized; the attention output does not
            x8, scale = x if isinstance(x, tuple) else quantize_rows(x)
            return fp8_matmul(x8, scale, *self.quantized[i][name], module.bias)
        return module(x)
