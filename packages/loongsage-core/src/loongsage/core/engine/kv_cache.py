"""The native engine's decoder forward (:class:`DecoderRunner`).

:class:`DecoderRunner` runs the model over the preallocated slot cache of
:mod:`loongsage.core.engine.continuous` (:meth:`DecoderRunner.forward_slots`).

The engine does not call the HF model's top-level ``forward``: per decode step that path rebuilds
the 4-D attention mask, grows a ``DynamicCache`` by concatenation (copying the whole cache every
step) and runs output-capturing wrappers, which on a small model costs more than the maths. Instead
:class:`DecoderRunner` drives the model's own submodules (embedding, norms, q/k/v/o projections,
MLP, rotary embedding) and owns only the attention core: keys and values go into a preallocated
cache and attention is ``scaled_dot_product_attention`` over the filled columns with a boolean key
mask. The weights stay the HF module parameters, so ``update_weights`` and the
trainer see the same tensors by their HF names.

Supported: Llama-family decoders (``model.model.layers[i].self_attn.{q,k,v,o}_proj``, optional
``q_norm``/``k_norm`` as in Qwen3, ``mlp``, ``input_layernorm``, ``post_attention_layernorm``) with
full attention on every layer — Qwen3, Qwen2, Llama, Mistral without sliding window. Anything else
is refused at load time with one line saying why.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from loongsage.core.engine.fused import fused_decoder_or_reason
from loongsage.core.model_math.dtypes import HALF_DTYPES
from loongsage.core.model_math.head import fp32_head

if TYPE_CHECKING:  # Triton's: imported where the fused kernels run
    from loongsage.core.engine.fused.attention import SharedPrefixes


def grouped_decode_attention(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scale: float) -> Tensor:
    """One query token a row, ``q`` ``[B, heads, d]``, over ``keys``/``values`` ``[B, kv_heads,
    columns, d]`` under ``mask`` (broadcastable to ``[B, 1, 1, columns]``): ``[B, heads * d]``.

    The query heads that share a kv head become that head's query "rows", so attention reads each
    cached key once instead of expanding keys per query head."""
    rows, heads, dim = q.shape
    kv = keys.shape[1]
    out = F.scaled_dot_product_attention(
        q.reshape(rows, kv, heads // kv, dim), keys, values, attn_mask=mask, scale=scale
    )
    return out.reshape(rows, heads * dim)


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class DecoderRunner:
    """Forward of a Llama-family ``*ForCausalLM`` over a slot KV cache (keys/values passed in)."""

    def __init__(
        self,
        model: nn.Module,
        *,
        fp32_lm_head: bool = True,
        kernels: str = "auto",
        batch_invariant: bool = False,
        quantization: str | None = None,
    ):
        check_supported(model)
        cfg = model.config
        self.model, self.inner = model, model.model
        self.layers = list(self.inner.layers)
        self.num_heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.scales = [getattr(layer.self_attn, "scaling", self.head_dim**-0.5) for layer in self.layers]
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.fp32_lm_head = fp32_lm_head
        self.device = self.inner.embed_tokens.weight.device
        self.refresh_head()
        # mixture-of-experts layers (an HF MoE block: a ``gate`` router and ``experts``)
        self.moe_gates = [
            layer.mlp.gate for layer in self.layers if hasattr(layer.mlp, "gate") and hasattr(layer.mlp, "experts")
        ]
        self.topk = int(getattr(cfg, "num_experts_per_tok", 0) or 0)
        self.last_routes: Tensor | None = None  # [B, T, MoE layers, topk] of the last forward, when recording
        self._chosen: list[Tensor] | None = None
        # the decode step on fused kernels where they apply (CUDA, Triton, a dense decoder they cover)
        self.fused, self.fused_off_because = fused_decoder_or_reason(self, kernels)
        # prefill and decode through the fused layers' batch-invariant path (see fused/decoder.py)
        self.invariant = bool(batch_invariant)
        if self.invariant:
            if self.fused is None:
                why = self.fused_off_because
                raise ValueError(f"native engine: batch_invariant needs the fused kernels, which cannot run: {why}")
            self.fused.invariant = True
        if quantization == "fp8":  # the decode GEMMs on float8 copies of the projections (fused/fp8.py)
            from loongsage.core.model_math.fp8_linear import unsupported_fp8

            why = self.fused_off_because if self.fused is None else unsupported_fp8(self.device, model.dtype)
            if why is not None:
                raise ValueError(f"native engine: quantization=fp8 runs on the fused decode kernels, not here: {why}")
            self.fused.fp8 = True
            self.fused.requantize()

    @property
    def recording(self) -> bool:
        return self._chosen is not None

    def record_routes(self) -> None:
        """From now on every forward leaves the experts its MoE layers chose in ``last_routes`` (R3)."""
        if not self.moe_gates or self.topk < 1:
            raise ValueError("native engine: return_routed_experts: the model has no mixture-of-experts layers")

        def keep(_module: nn.Module, _args: tuple, out: Tensor | tuple) -> None:
            if self._chosen is not None:  # HF's router returns (logits, weights, indices); older ones the logits
                chosen = out[2] if isinstance(out, tuple) else out.float().softmax(-1).topk(self.topk, -1).indices
                self._chosen.append(chosen)

        for gate in self.moe_gates:
            gate.register_forward_hook(keep)
        self._chosen = []

    def moved(self) -> None:
        """The parameters were replaced (``Module.to``): re-derive everything built from them."""
        self.refresh_head()
        if self.fused is None:
            return
        if self.inner.embed_tokens.weight.is_cuda:  # merged only where it runs
            self.fused.bind()
        else:  # released to the host: nothing may keep the device's weights alive
            self.fused.unbind()

    def weights_changed(self) -> None:
        """An update wrote new values into the parameters (in place)."""
        self.refresh_head()
        if self.fused is not None:
            self.fused.requantize()

    def refresh_head(self) -> None:
        """Re-derive the LM-head weight used for logits (call after the weights changed)."""
        weight = self.model.get_output_embeddings().weight
        # On CUDA, :func:`fp32_head` reads the bf16/fp16 weight itself; elsewhere ``.float()`` costs
        # a copy only when the model runs in bf16/fp16 (it is the tensor itself for float32).
        on_gpu = weight.device.type == "cuda" and weight.dtype in HALF_DTYPES
        self._head = weight if on_gpu or not self.fp32_lm_head else weight.float()

    def forward_slots(
        self,
        input_ids: Tensor,
        positions: Tensor,
        keys: list[Tensor],
        values: list[Tensor],
        end: int,
        mask: Tensor,
        cols: Tensor | None = None,
        shared: SharedPrefixes | None = None,
    ) -> Tensor:
        """Forward over slot rows whose keys/values live in ``keys[i]``/``values[i]`` ``[B, kv, L, d]``.

        Decode (``cols`` given, ``input_ids`` ``[B, 1]``): row ``b`` writes its new key/value at column
        ``cols[b]``. Prefill (``cols`` None, ``input_ids`` ``[B, T]``): the new keys/values go to columns
        ``[end - T, end)`` of every row. Attention covers columns ``[0, end)`` under ``mask``
        (broadcastable to ``[B, 1, T, end]``); returns the last position's float32 logits.
        ``shared`` (fused decode only): tiles of rows whose common prefix attention reads once.
        """
        seq = input_ids.shape[1]
        if cols is not None and self.fused is not None:  # dense models only: never recording routes
            return self.fused.decode(input_ids, positions, keys, values, cols, end, shared)
        if cols is not None:
            rows = torch.arange(input_ids.shape[0], device=input_ids.device)

            def write(i: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
                keys[i][rows, :, cols] = k[:, :, 0]
                values[i][rows, :, cols] = v[:, :, 0]
                return keys[i][:, :, :end], values[i][:, :, :end]
        else:

            def write(i: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
                keys[i][:, :, end - seq : end] = k
                values[i][:, :, end - seq : end] = v
                return keys[i][:, :, :end], values[i][:, :, :end]

        return self._run(input_ids, positions, mask, write)

    def prefill_invariant(
        self, tokens: list[int], positions: list[int], slots: list[int], last: list[int], keys, values
    ) -> Tensor:
        """The batch-invariant prefill of several sequences' tokens in one pass (``tokens[n]`` at
        ``positions[n]`` of slot ``slots[n]``, its key and value written at that column of the
        slot's cache, attending over the slot's columns up to it); float32 logits ``[len(last), V]``
        of the tokens at the indices ``last``. Each token is computed as it would be alone."""
        dev = self.device
        at = torch.tensor(positions, dtype=torch.long, device=dev).view(-1, 1)
        ids = torch.tensor(tokens, dtype=torch.long, device=dev).view(-1, 1)
        rows = torch.tensor(slots, dtype=torch.long, device=dev)
        hidden = self.fused.hidden(ids, at, keys, values, at[:, 0], max(positions) + 1, cache_rows=rows, invariant=True)
        return self.fused.head(hidden[torch.tensor(last, device=dev)])

    def _run(self, input_ids: Tensor, positions: Tensor, mask: Tensor, write) -> Tensor:
        """The decoder layers; ``write(i, k, v)`` stores layer ``i``'s new keys/values and returns the
        keys/values to attend over."""
        bsz, seq = input_ids.shape
        if self._chosen is not None:
            self._chosen.clear()
        hidden = self.inner.embed_tokens(input_ids)
        cos, sin = self.inner.rotary_emb(hidden, positions)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)
            q = attn.q_proj(x).view(bsz, seq, self.num_heads, self.head_dim)
            k = attn.k_proj(x).view(bsz, seq, self.kv_heads, self.head_dim)
            v = attn.v_proj(x).view(bsz, seq, self.kv_heads, self.head_dim)
            if getattr(attn, "q_norm", None) is not None:
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            keys, values = write(i, k, v)
            if seq == 1:
                q = q.reshape(bsz, self.num_heads, self.head_dim)
                out = grouped_decode_attention(q, keys, values, mask, self.scales[i]).view(bsz, 1, -1)
            else:
                out = F.scaled_dot_product_attention(
                    q, keys, values, attn_mask=mask, scale=self.scales[i], enable_gqa=self.kv_heads != self.num_heads
                )
                out = out.transpose(1, 2).reshape(bsz, seq, self.num_heads * self.head_dim)
            hidden = hidden + attn.o_proj(out)
            mlp_out = layer.mlp(layer.post_attention_layernorm(hidden))
            # Mixture-of-experts blocks of some versions return (hidden, router_logits).
            hidden = hidden + (mlp_out[0] if isinstance(mlp_out, tuple) else mlp_out)
        if self._chosen is not None:
            self.last_routes = torch.stack(self._chosen, 1).view(bsz, seq, len(self._chosen), self.topk)
        return self.head(self.inner.norm(hidden[:, -1]))

    def head(self, last: Tensor) -> Tensor:
        """Float32 logits of the final-normed hidden states ``[B, H]``."""
        if self.fp32_lm_head:
            return fp32_head(last, self._head)
        return self.model.get_output_embeddings()(last).float()


def check_supported(model: nn.Module) -> None:
    """Raise ValueError (one line) unless ``model`` is a decoder this runner can drive."""
    cfg = model.config
    name = getattr(cfg, "model_type", type(model).__name__)
    inner = getattr(model, "model", None)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if inner is None or any(not hasattr(inner, a) for a in needed):
        raise ValueError(
            f"native engine: model_type={name!r} is not a Llama-family decoder "
            f"(needs model.model.{{{','.join(needed)}}})"
        )
    layer_attrs = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")
    attn_attrs = ("q_proj", "k_proj", "v_proj", "o_proj")
    for layer in inner.layers:
        if any(not hasattr(layer, a) for a in layer_attrs) or any(not hasattr(layer.self_attn, a) for a in attn_attrs):
            raise ValueError(
                f"native engine: model_type={name!r}: decoder layer lacks "
                f"{'/'.join(layer_attrs)} or self_attn.{'/'.join(attn_attrs)}"
            )
    layer_types = getattr(cfg, "layer_types", None) or []
    implicit_window = (
        not layer_types
        and getattr(cfg, "sliding_window", None) is not None
        and getattr(cfg, "use_sliding_window", True)
    )
    if any(t != "full_attention" for t in layer_types) or implicit_window:
        raise ValueError(f"native engine: model_type={name!r} uses sliding-window attention, not supported yet")
    if model.get_output_embeddings() is None:
        raise ValueError(f"native engine: model_type={name!r} has no LM head")
