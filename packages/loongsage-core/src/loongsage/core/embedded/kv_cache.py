"""The native engine's static batch: its KV cache, the decoder forward over it, and its rows.

Three pieces, replaced together when the engine moves to a block-paged cache with continuous
batching: :class:`StaticKVCache` (the memory), :class:`DecoderRunner` (the model's forward over
it) and :class:`StaticBatch` (the sample rows that share it: prefill, decode steps, compaction).

The engine does not call the HF model's top-level ``forward``: per decode step that path rebuilds
the 4-D attention mask, grows a ``DynamicCache`` by concatenation (copying the whole cache every
step) and runs output-capturing wrappers, which on a small model costs more than the maths. Instead
:class:`DecoderRunner` drives the model's own submodules (embedding, norms, q/k/v/o projections,
MLP, rotary embedding) and owns only the attention core: keys and values go into a preallocated
:class:`StaticKVCache` and attention is ``scaled_dot_product_attention`` over the filled columns
with a boolean key mask. The weights stay the HF module parameters, so ``update_weights`` and the
trainer see the same tensors by their HF names.

Supported: Llama-family decoders (``model.model.layers[i].self_attn.{q,k,v,o}_proj``, optional
``q_norm``/``k_norm`` as in Qwen3, ``mlp``, ``input_layernorm``, ``post_attention_layernorm``) with
full attention on every layer — Qwen3, Qwen2, Llama, Mistral without sliding window. Anything else
is refused at load time with one line saying why.

Layout: one batch of left-padded rows. Column ``c`` of the cache holds the token at padded index
``c`` of every row; ``key_mask[b, c]`` says whether row ``b`` has a real token there. All rows of a
batch advance together (one column per decode step), which is what lets a decode step be a plain
slice; the price is that a batch admits no new rows once it started and pays attention over the
left padding of its longest prompt.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from loongsage.core.embedded.sampling import SamplingTensors, draw_uniforms, sample
from loongsage.core.types import FinishReason, GenerationResult


PREFILL_CHUNK_TOKENS = 16384  # padded prompt tokens per prefill forward


class StaticKVCache:
    """Preallocated keys/values ``[B, kv_heads, max_len, head_dim]`` per layer plus a key mask."""

    def __init__(self, keys: list[Tensor], values: list[Tensor], key_mask: Tensor, length: int = 0):
        self.keys, self.values, self.key_mask, self.length = keys, values, key_mask, length

    @classmethod
    def allocate(cls, num_layers: int, batch: int, kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> "StaticKVCache":
        shape = (batch, kv_heads, max_len, head_dim)
        keys = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        values = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        return cls(keys, values, torch.zeros(batch, max_len, dtype=torch.bool, device=device))

    @property
    def batch_size(self) -> int:
        return self.key_mask.shape[0]

    @property
    def max_len(self) -> int:
        return self.key_mask.shape[1]

    def rows(self, start: int, end: int) -> "StaticKVCache":
        """A view of rows ``[start, end)`` sharing this cache's memory (writes land here)."""
        return StaticKVCache([k[start:end] for k in self.keys], [v[start:end] for v in self.values],
                             self.key_mask[start:end], self.length)

    def select(self, rows: Tensor) -> "StaticKVCache":
        """A cache holding the given rows, in that order (rows may repeat: ``n`` samples of a prompt).

        Only the filled columns are copied; the rest of the new buffers is left uninitialised.
        """
        n, filled = rows.numel(), self.length

        def take(buf: Tensor) -> Tensor:
            out = buf.new_empty((n, *buf.shape[1:]))
            out[:, :, :filled] = buf[rows, :, :filled]
            return out

        return StaticKVCache([take(k) for k in self.keys], [take(v) for v in self.values],
                             self.key_mask[rows], filled)


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class DecoderRunner:
    """Forward of a Llama-family ``*ForCausalLM`` over a :class:`StaticKVCache`."""

    def __init__(self, model: nn.Module, *, fp32_lm_head: bool = True):
        check_supported(model)
        cfg = model.config
        self.model, self.inner = model, model.model
        self.layers = list(self.inner.layers)
        self.num_heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.scales = [getattr(layer.self_attn, "scaling", self.head_dim ** -0.5) for layer in self.layers]
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.fp32_lm_head = fp32_lm_head
        self.device = self.inner.embed_tokens.weight.device
        self.refresh_head()

    def refresh_head(self) -> None:
        """Re-derive the LM-head weight used for logits (call after the weights changed)."""
        weight = self.model.get_output_embeddings().weight
        # ``.float()`` is the tensor itself for a float32 model, so this costs a copy only when the
        # model runs in bf16/fp16 and the head must still be computed in float32.
        self._head = weight.float() if self.fp32_lm_head else weight

    def allocate(self, batch: int, max_len: int) -> StaticKVCache:
        weight = self.inner.embed_tokens.weight
        return StaticKVCache.allocate(len(self.layers), batch, self.kv_heads, max_len, self.head_dim,
                                      weight.dtype, weight.device)

    def forward(self, input_ids: Tensor, positions: Tensor, cache: StaticKVCache) -> Tensor:
        """Run ``input_ids`` ``[B, T]`` at ``positions`` ``[B, T]``; return the last position's logits.

        The new keys/values are written at cache columns ``[length, length + T)``, whose
        ``key_mask`` the caller has set; ``length`` advances by ``T``. With ``T > 1`` (prefill) the
        attention is causal; every query also sees itself, so a padding position never attends to
        nothing (which would make NaNs that poison the batch). Logits are float32 when
        ``fp32_lm_head`` (hidden states cast up before the projection, as the trainer does).
        """
        bsz, seq = input_ids.shape
        start, end = cache.length, cache.length + seq
        keys_valid = cache.key_mask[:, :end]
        if seq == 1:
            mask = keys_valid[:, None, None, :]
        else:
            q_idx = torch.arange(start, end, device=input_ids.device)
            k_idx = torch.arange(end, device=input_ids.device)
            causal = k_idx[None, :] <= q_idx[:, None]
            mask = (keys_valid[:, None, None, :] & causal) | (k_idx[None, :] == q_idx[:, None])

        def write(i: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
            cache.keys[i][:, :, start:end] = k
            cache.values[i][:, :, start:end] = v
            return cache.keys[i][:, :, :end], cache.values[i][:, :, :end]

        logits = self._run(input_ids, positions, mask, write)
        cache.length = end
        return logits

    def forward_slots(self, input_ids: Tensor, positions: Tensor, keys: list[Tensor], values: list[Tensor],
                      end: int, mask: Tensor, cols: Tensor | None = None) -> Tensor:
        """Forward over slot rows whose keys/values live in ``keys[i]``/``values[i]`` ``[B, kv, L, d]``.

        Decode (``cols`` given, ``input_ids`` ``[B, 1]``): row ``b`` writes its new key/value at column
        ``cols[b]``. Prefill (``cols`` None, ``input_ids`` ``[B, T]``): the new keys/values go to columns
        ``[end - T, end)`` of every row. Attention covers columns ``[0, end)`` under ``mask``
        (broadcastable to ``[B, 1, T, end]``); returns the last position's float32 logits.
        """
        seq = input_ids.shape[1]
        if cols is not None:
            rows = torch.arange(input_ids.shape[0], device=input_ids.device)

            def write(i: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
                keys[i][rows, :, cols] = k[:, :, 0]
                values[i][rows, :, cols] = v[:, :, 0]
                return keys[i][:, :, :end], values[i][:, :, :end]
        else:
            def write(i: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
                keys[i][:, :, end - seq:end] = k
                values[i][:, :, end - seq:end] = v
                return keys[i][:, :, :end], values[i][:, :, :end]
        return self._run(input_ids, positions, mask, write)

    def _run(self, input_ids: Tensor, positions: Tensor, mask: Tensor, write) -> Tensor:
        """The decoder layers; ``write(i, k, v)`` stores layer ``i``'s new keys/values and returns the
        keys/values to attend over."""
        bsz, seq = input_ids.shape
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
                # Decode: the query heads that share a kv head become that head's query "rows", so
                # attention reads each cached key once instead of expanding keys per query head.
                q = q.reshape(bsz, self.kv_heads, self.num_heads // self.kv_heads, self.head_dim)
                out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scales[i])
                out = out.reshape(bsz, 1, self.num_heads * self.head_dim)
            else:
                out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scales[i],
                                                     enable_gqa=self.kv_heads != self.num_heads)
                out = out.transpose(1, 2).reshape(bsz, seq, self.num_heads * self.head_dim)
            hidden = hidden + attn.o_proj(out)
            mlp_out = layer.mlp(layer.post_attention_layernorm(hidden))
            # Mixture-of-experts blocks of some versions return (hidden, router_logits).
            hidden = hidden + (mlp_out[0] if isinstance(mlp_out, tuple) else mlp_out)
        last = self.inner.norm(hidden[:, -1])
        if self.fp32_lm_head:
            return last.float() @ self._head.T
        return self.model.get_output_embeddings()(last).float()


def check_supported(model: nn.Module) -> None:
    """Raise ValueError (one line) unless ``model`` is a decoder this runner can drive."""
    cfg = model.config
    name = getattr(cfg, "model_type", type(model).__name__)
    inner = getattr(model, "model", None)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if inner is None or any(not hasattr(inner, a) for a in needed):
        raise ValueError(f"native engine: model_type={name!r} is not a Llama-family decoder "
                         f"(needs model.model.{{{','.join(needed)}}})")
    layer_attrs = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")
    attn_attrs = ("q_proj", "k_proj", "v_proj", "o_proj")
    for layer in inner.layers:
        if any(not hasattr(layer, a) for a in layer_attrs) or any(not hasattr(layer.self_attn, a) for a in attn_attrs):
            raise ValueError(f"native engine: model_type={name!r}: decoder layer lacks "
                             f"{'/'.join(layer_attrs)} or self_attn.{'/'.join(attn_attrs)}")
    layer_types = getattr(cfg, "layer_types", None) or []
    implicit_window = not layer_types and getattr(cfg, "sliding_window", None) is not None and getattr(
        cfg, "use_sliding_window", True)
    if any(t != "full_attention" for t in layer_types) or implicit_window:
        raise ValueError(f"native engine: model_type={name!r} uses sliding-window attention, not supported yet")
    if model.get_output_embeddings() is None:
        raise ValueError(f"native engine: model_type={name!r} has no LM head")


class StaticBatch:
    """Sample rows generated together over one :class:`StaticKVCache`: one prefill, then one decode
    column per step.

    Row state lives in tensors (last token, position, limits, stop ids, sampling settings, random
    numbers, the tokens and log-probs so far) so that a step is a fixed number of tensor ops; a row
    that finishes is compacted away at once so it costs nothing afterwards.

    ``groups`` are the engine's request records: each has ``request`` (a ``GenerationRequest``),
    ``n``, ``stops`` (stop ids incl. eos) and ``put(sample, result) -> bool`` (True once complete).
    ``stats`` is the engine's counter dict (steps, tokens, prefill rows and tokens).
    """

    def __init__(self, runner: DecoderRunner, groups: list, *, max_model_len: int,
                 generator: torch.Generator, stats: dict[str, int]):
        self.runner, self.stats, self.groups = runner, stats, groups
        self.device = dev = runner.device
        counts = [g.n for g in groups]
        limits = [min(g.request.sampling.max_new_tokens, max_model_len - len(g.request.input_ids))
                  for g in groups]
        self.steps_max = max(limits)
        self.row_group = [g for g in groups for _ in range(g.n)]
        self.row_sample = [j for g in groups for j in range(g.n)]
        rows = len(self.row_group)
        self.limit = torch.tensor(limits, device=dev).repeat_interleave(torch.tensor(counts, device=dev))
        width = max(len(g.stops) for g in groups)
        self.stop_ids: Tensor | None = None
        if width:
            stops = [g.stops + [-1] * (width - len(g.stops)) for g in groups for _ in range(g.n)]
            self.stop_ids = torch.tensor(stops, dtype=torch.long, device=dev)
        params = [g.request.sampling for g in self.row_group]
        self.st = SamplingTensors.build(params, self.runner.vocab_size, dev)
        self.uniforms: Tensor | None = None
        if not self.st.all_greedy:
            self.uniforms = draw_uniforms(counts, [g.request.sampling.seed for g in groups], limits,
                                          self.steps_max, generator, dev)
        self.tokens = torch.empty(rows, self.steps_max, dtype=torch.long, device=dev)
        self.logprobs = torch.empty(rows, self.steps_max, dtype=torch.float32, device=dev)
        self.versions: list[int] = []
        self.t = 0  # tokens generated so far by every live row
        self.cache: StaticKVCache | None = None
        self.last: Tensor | None = None
        self.positions: Tensor | None = None

    @property
    def done(self) -> bool:
        return not self.row_group

    def live_groups(self) -> list:
        return list(dict.fromkeys(self.row_group))

    def _prefill(self) -> Tensor:
        prompts = [g.request.input_ids for g in self.groups]
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.bool)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = True
        dev = self.device
        ids, mask = ids.to(dev), mask.to(dev)
        positions = (mask.long().cumsum(-1) - 1).clamp_min(0)
        cache = self.runner.allocate(len(prompts), width + self.steps_max)
        cache.key_mask[:, :width] = mask
        cache.key_mask[:, width:] = True  # generated tokens are real for every row
        # Prefill in chunks of rows: the attention scores of one chunk are [rows, heads, width, width],
        # which for a whole batch of long prompts would be gigabytes.
        step = max(1, PREFILL_CHUNK_TOKENS // width)
        logits = torch.cat([self.runner.forward(ids[r:r + step], positions[r:r + step], cache.rows(r, r + step))
                            for r in range(0, len(prompts), step)])
        cache.length = width
        lengths = torch.tensor([len(p) for p in prompts], device=dev)
        if any(g.n > 1 for g in self.groups):
            # n samples share one prefill: copy the prompt's cache rows instead of recomputing them.
            rows = torch.arange(len(prompts), device=dev).repeat_interleave(
                torch.tensor([g.n for g in self.groups], device=dev))
            cache, logits, lengths = cache.select(rows), logits[rows], lengths[rows]
        stats = self.stats
        stats["prefill_rows"] += len(prompts)
        stats["prefill_tokens"] += sum(len(p) for p in prompts)
        self.cache, self.positions = cache, lengths
        return logits

    def step(self, version: int) -> list:
        """Advance every live row by one token; return the requests completed by this step."""
        if self.t == 0:
            logits = self._prefill()
        else:
            logits = self.runner.forward(self.last.unsqueeze(1), self.positions.unsqueeze(1), self.cache)
            self.positions += 1
        u = None if self.uniforms is None else self.uniforms[:, self.t]
        tokens, logprobs = sample(logits, self.st, u)
        self.tokens[:, self.t] = tokens
        self.logprobs[:, self.t] = logprobs
        self.versions.append(version)
        self.t += 1
        self.last = tokens
        self.stats["steps"] += 1
        self.stats["generated_tokens"] += len(self.row_group)
        finished = self.limit <= self.t
        stopped = None
        if self.stop_ids is not None:
            stopped = (tokens.unsqueeze(1) == self.stop_ids).any(dim=1)
            finished |= stopped
        if not bool(finished.any()):
            return []
        rows = finished.nonzero().flatten()
        reasons = stopped[rows].tolist() if stopped is not None else [False] * rows.numel()
        reasons = [FinishReason.STOP if s else FinishReason.LENGTH for s in reasons]
        completed = self._emit(rows, reasons)
        self._keep((~finished).nonzero().flatten())
        return completed

    def _emit(self, rows: Tensor, reasons: list[FinishReason]) -> list:
        t = self.t
        tokens = self.tokens[rows, :t].tolist()
        logprobs = self.logprobs[rows, :t].tolist()
        completed = []
        for k, r in enumerate(rows.tolist()):
            group = self.row_group[r]
            result = GenerationResult(group.request.request_id, tokens[k], logprobs[k], self.versions[:t], reasons[k])
            if group.put(self.row_sample[r], result):
                completed.append(group)
        return completed

    def _keep(self, rows: Tensor) -> None:
        """Compact the batch to ``rows`` (finished or aborted rows leave the computation)."""
        kept = rows.tolist()
        self.row_group = [self.row_group[r] for r in kept]
        self.row_sample = [self.row_sample[r] for r in kept]
        if not kept:
            self.cache = None
            return
        self.limit, self.tokens, self.logprobs = self.limit[rows], self.tokens[rows], self.logprobs[rows]
        if self.stop_ids is not None:
            self.stop_ids = self.stop_ids[rows]
        if self.uniforms is not None:
            self.uniforms = self.uniforms[rows]
        self.st = self.st.select(rows, self.runner.vocab_size)
        if self.t > 0:
            self.cache, self.last, self.positions = self.cache.select(rows), self.last[rows], self.positions[rows]
        else:  # not prefilled yet: drop whole requests before the prefill sees them
            alive = set(self.row_group)
            self.groups = [g for g in self.groups if g in alive]

    def abort(self, groups: set) -> list:
        """End the rows of ``groups`` with ``ABORT`` (tokens so far); return those groups completed."""
        hit = [i for i, g in enumerate(self.row_group) if g in groups]
        if not hit:
            return []
        dev = self.tokens.device
        keep = [i for i, g in enumerate(self.row_group) if g not in groups]
        with torch.inference_mode():
            completed = self._emit(torch.tensor(hit, device=dev), [FinishReason.ABORT] * len(hit))
            self._keep(torch.tensor(keep, dtype=torch.long, device=dev))
        return completed
