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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from loongsage.core.engine.fused.attention import decode_attention
from loongsage.core.engine.fused.ops import add_rms_norm, qk_rope_store, silu_mul

_NORMS = {"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"}


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


class FusedDecoder:
    """Decode forward of a runner's model on fused kernels (see the module docstring)."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.bind()

    def bind(self) -> None:
        """(Re-)merge the projections; call after the parameters were replaced (a device move)."""
        r = self.runner
        self.layers = []
        for layer in r.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv, qkv_bias = _merge([attn.q_proj, attn.k_proj, attn.v_proj])
            gate_up, _ = _merge([mlp.gate_proj, mlp.up_proj])
            q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
            self.layers.append(
                (
                    layer.input_layernorm,
                    qkv,
                    qkv_bias,
                    q_norm,
                    k_norm,
                    attn.o_proj,
                    layer.post_attention_layernorm,
                    gate_up,
                    mlp.down_proj,
                )
            )

    def decode(
        self, input_ids: Tensor, positions: Tensor, keys: list[Tensor], values: list[Tensor], cols: Tensor, columns: int
    ) -> Tensor:
        """Float32 logits ``[B, V]`` of one new token per row; row ``b``'s key/value go to column
        ``cols[b]`` and attention covers its columns ``[0, cols[b]]`` (``columns`` bounds them all)."""
        r = self.runner
        hidden = r.inner.embed_tokens(input_ids)  # [B, 1, H]
        cos, sin = r.inner.rotary_emb(hidden, positions)
        cos, sin = cos[:, 0], sin[:, 0]
        delta, residual = hidden[:, 0], None
        lengths = cols + 1
        for i, (ln1, qkv_w, qkv_b, q_norm, k_norm, o_proj, ln2, gate_up, down) in enumerate(self.layers):
            x, residual = add_rms_norm(delta, residual, ln1.weight, ln1.variance_epsilon)
            qkv = F.linear(x, qkv_w, qkv_b)
            q = qk_rope_store(
                qkv,
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
            )
            out = decode_attention(q, keys[i], values[i], lengths, r.scales[i], columns)
            x, residual = add_rms_norm(o_proj(out), residual, ln2.weight, ln2.variance_epsilon)
            delta = down(silu_mul(F.linear(x, gate_up)))
        norm = r.inner.norm
        last, _ = add_rms_norm(delta, residual, norm.weight, norm.variance_epsilon)
        return r.head(last)
