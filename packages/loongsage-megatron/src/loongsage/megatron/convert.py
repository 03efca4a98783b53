"""HF <-> Megatron-Core weights for the Llama family (Qwen3, Qwen2, Llama), one tensor-parallel
rank at a time, as pure functions over tensors.

Megatron-Core's GPT layer (the local, Transformer-Engine-free spec) names and lays out the same
weights differently from HF:

* ``linear_qkv`` holds q, k and v **interleaved by query group**: for each of the ``g`` key/value
  groups, its ``heads / g`` query heads, then its key head, then its value head (``head_dim`` rows
  each). A contiguous slice of it is whole groups, which is how tensor parallelism splits it.
* ``linear_fc1`` is gate and up stacked; each rank holds its slice of gate over its slice of up.
* A mixture-of-experts layer (Qwen3-MoE) holds ``router.weight`` (HF's ``mlp.gate``) and one
  ``linear_fc1``/``linear_fc2`` pair per expert (``experts.local_experts.E``). HF keeps the experts
  fused in memory (``mlp.experts.gate_up_proj`` ``[E, 2 x ffn, hidden]``, gate rows over up rows,
  and ``mlp.experts.down_proj``), which is what the torch trainer and the engines name; checkpoint
  files name them per expert (``mlp.experts.E.gate_proj.weight``). Both are read; the fused names
  are written.
* Column-parallel layers (``linear_qkv``, ``linear_fc1``, the embedding and output layer over the
  vocabulary) split rows; row-parallel ones (``linear_proj``, ``linear_fc2``) split columns;
  norms are whole on every rank.

Under expert parallelism a rank holds a contiguous block of the experts, numbered from 0 in it.

Transformer Engine's layer fuses a norm into the linear layer after it: the input norm is
``linear_qkv.layer_norm_weight``, and (in a dense layer) the pre-MLP norm is
``linear_fc1.layer_norm_weight``; the tensors are the same (:func:`fused_norm_names`).

``hf_to_mcore`` gives a rank its shard; ``mcore_to_hf`` gathers all ranks' shards back into
HF-named tensors, in HF's layout, which is what an engine loads. Both are exact (no arithmetic).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Shape:
    """What the conversion needs of an HF config."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    experts: int = 0  # routed experts per layer (0: a dense model)

    @classmethod
    def of(cls, config: Mapping) -> Shape:
        """From an HF ``config.json`` (a dict)."""
        heads = int(config["num_attention_heads"])
        return cls(
            layers=int(config["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or int(config["hidden_size"]) // heads),
            vocab=int(config["vocab_size"]),
            tied=bool(config.get("tie_word_embeddings", False)),
            experts=num_experts(config),
        )

    def padded_vocab(self, tp: int) -> int:
        """The embedding's rows in Megatron: the vocabulary padded to a multiple of ``tp``."""
        return -(-self.vocab // tp) * tp

    def check_tp(self, tp: int) -> None:
        """One line naming what ``tp`` does not divide."""
        for what, n in (("num_key_value_heads", self.kv_heads), ("num_attention_heads", self.heads)):
            if n % tp:
                raise ValueError(f"tensor_parallel={tp} does not divide {what}={n}; allowed: a divisor of {n}")

    def check_ep(self, ep: int) -> None:
        """One line naming why ``ep`` cannot split the experts: a dense model, or a count it does not divide."""
        if ep > 1 and not self.experts:
            raise ValueError(f"expert_parallel={ep} needs a mixture-of-experts model; allowed: 1 for a dense model")
        if self.experts % ep:
            raise ValueError(
                f"expert_parallel={ep} does not divide num_experts={self.experts}; allowed: a divisor of {self.experts}"
            )


def num_experts(config: Mapping) -> int:
    """Routed experts per layer of an HF config, 0 for a dense model (transformers 5 writes Qwen3-MoE's
    ``num_experts`` as ``num_local_experts``)."""
    return int(config.get("num_experts") or config.get("num_local_experts") or 0)


# HF per-layer name -> (Megatron per-layer name, how it splits over tensor-parallel ranks)
_LAYER = {
    "input_layernorm.weight": ("input_layernorm.weight", None),
    "self_attn.q_norm.weight": ("self_attention.q_layernorm.weight", None),
    "self_attn.k_norm.weight": ("self_attention.k_layernorm.weight", None),
    "self_attn.o_proj.weight": ("self_attention.linear_proj.weight", 1),
    "post_attention_layernorm.weight": ("pre_mlp_layernorm.weight", None),
    "mlp.down_proj.weight": ("mlp.linear_fc2.weight", 1),
}
_QKV = ("q_proj", "k_proj", "v_proj")
_FC1 = ("gate_proj", "up_proj")
_GLOBAL = {
    "model.embed_tokens.weight": ("embedding.word_embeddings.weight", 0),
    "model.norm.weight": ("decoder.final_layernorm.weight", None),
    "lm_head.weight": ("output_layer.weight", 0),
}
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


def _split(tensor: Tensor, dim: int | None, rank: int, tp: int) -> Tensor:
    return tensor if dim is None or tp == 1 else tensor.chunk(tp, dim)[rank]


def _gather(parts: list[Tensor], dim: int | None) -> Tensor:
    """One tensor from the ranks' parts (one rank's part as it is: a view, no copy)."""
    return parts[0] if dim is None or len(parts) == 1 else torch.cat(parts, dim)


def qkv_interleave(q: Tensor, k: Tensor, v: Tensor, shape: Shape) -> Tensor:
    """HF's q, k, v (weights or biases) as Megatron's ``linear_qkv`` rows."""
    g, per, d = shape.kv_heads, shape.heads // shape.kv_heads, shape.head_dim
    rest = q.shape[1:]
    grouped = torch.cat([q.reshape(g, per * d, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest)], dim=1)
    return grouped.reshape(g * (per + 2) * d, *rest)


def qkv_split(qkv: Tensor, shape: Shape) -> tuple[Tensor, Tensor, Tensor]:
    """Megatron's ``linear_qkv`` rows (whole, or one rank's groups) as HF's q, k, v."""
    per, d = shape.heads // shape.kv_heads, shape.head_dim
    rest = qkv.shape[1:]
    g = qkv.shape[0] // ((per + 2) * d)
    grouped = qkv.reshape(g, (per + 2) * d, *rest)
    q, k, v = grouped.split([per * d, d, d], dim=1)
    return q.reshape(g * per * d, *rest), k.reshape(g * d, *rest), v.reshape(g * d, *rest)


def hf_to_mcore(
    hf: Mapping[str, Tensor],
    shape: Shape,
    rank: int = 0,
    tp: int = 1,
    *,
    ep_rank: int = 0,
    ep: int = 1,
    expert_rank: int | None = None,
    expert_tp: int | None = None,
    layers: range | None = None,
    first: bool = True,
    last: bool = True,
) -> dict[str, Tensor]:
    """Rank ``rank`` of ``tp``'s Megatron state from an HF state dict (``lm_head`` ignored when tied);
    under expert parallelism only expert-parallel rank ``ep_rank`` of ``ep``'s experts, numbered
    from 0 as its ``local_experts``, each split over ``expert_tp`` ranks (rank ``expert_rank``;
    the tensor parallelism when None). A pipeline stage holds ``layers`` (numbered from 0 in it),
    the embedding when ``first``, the final norm and output layer when ``last`` (a tied model's
    last stage without the first: a copy of the embedding as its output layer)."""
    shape.check_tp(tp)
    shape.check_ep(ep)
    local = range(ep_rank * (shape.experts // ep), (ep_rank + 1) * (shape.experts // ep)) if shape.experts else range(0)
    erank, etp = (rank, tp) if expert_tp is None else (expert_rank or 0, expert_tp)
    layers = range(shape.layers) if layers is None else layers
    held = {"model.embed_tokens.weight": first, "model.norm.weight": last, "lm_head.weight": last}
    out: dict[str, Tensor] = {}
    for name, (target, dim) in _GLOBAL.items():
        source = "model.embed_tokens.weight" if name == "lm_head.weight" and shape.tied else name
        if source in hf and held[name] and not (shape.tied and name == "lm_head.weight" and first):
            tensor = hf[source]
            if name in _VOCAB and tensor.shape[0] < shape.padded_vocab(tp):  # rows no token uses
                tensor = torch.cat(
                    [tensor, tensor.new_zeros(shape.padded_vocab(tp) - tensor.shape[0], *tensor.shape[1:])]
                )
            out[target] = _split(tensor, dim, rank, tp)
    if not shape.tied and last and "lm_head.weight" not in hf and "model.embed_tokens.weight" in hf:
        raise ValueError(
            "hf_to_mcore: the config does not tie the embeddings, and the checkpoint has no lm_head.weight"
        )
    for layer in layers:
        src, dst = f"model.layers.{layer}.", f"decoder.layers.{layer - layers.start}."
        for name, (target, dim) in _LAYER.items():
            if src + name in hf:
                out[dst + target] = _split(hf[src + name], dim, rank, tp)
        for kind in ("weight", "bias"):
            parts = [hf.get(f"{src}self_attn.{p}.{kind}") for p in _QKV]
            if all(p is not None for p in parts):
                out[f"{dst}self_attention.linear_qkv.{kind}"] = _split(qkv_interleave(*parts, shape), 0, rank, tp)
        gate, up = (hf.get(f"{src}mlp.{p}.weight") for p in _FC1)
        if gate is not None and up is not None:
            out[f"{dst}mlp.linear_fc1.weight"] = torch.cat([_split(gate, 0, rank, tp), _split(up, 0, rank, tp)])
        if f"{src}mlp.gate.weight" in hf:
            out[f"{dst}mlp.router.weight"] = hf[f"{src}mlp.gate.weight"]
        for e, gate, up, down in _hf_experts(hf, src, local):
            expert = f"{dst}mlp.experts.local_experts.{e - local.start}."
            out[expert + "linear_fc1.weight"] = torch.cat([_split(gate, 0, erank, etp), _split(up, 0, erank, etp)])
            out[expert + "linear_fc2.weight"] = _split(down, 1, erank, etp)
    return out


def _hf_experts(hf: Mapping[str, Tensor], src: str, experts: range) -> Iterator[tuple[int, Tensor, Tensor, Tensor]]:
    """``(expert, gate, up, down)`` of one HF layer's ``experts``, fused or per expert (nothing for a dense one)."""
    fused, down = hf.get(f"{src}mlp.experts.gate_up_proj"), hf.get(f"{src}mlp.experts.down_proj")
    for e in experts:
        if fused is not None and down is not None:
            gate, up = fused[e].chunk(2)
            yield e, gate, up, down[e]
        else:
            parts = [hf.get(f"{src}mlp.experts.{e}.{p}.weight") for p in ("gate_proj", "up_proj", "down_proj")]
            if all(p is not None for p in parts):
                yield e, *parts


_LOCAL_EXPERT = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)(\..*)$")


def merge_expert_shards(states: list[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """One state from the expert-parallel ranks' states (rank order): every rank's experts,
    renumbered from its block's start; every other tensor (replicated) from the first."""
    merged: dict[str, Tensor] = {}
    for ep_rank, state in enumerate(states):
        local = {int(m.group(2)) for m in map(_LOCAL_EXPERT.match, state) if m}
        for name, tensor in state.items():
            m = _LOCAL_EXPERT.match(name)
            if m:
                merged[f"{m.group(1)}{ep_rank * len(local) + int(m.group(2))}{m.group(3)}"] = tensor
            elif ep_rank == 0:
                merged[name] = tensor
    return merged


def numbered_from(state: Mapping[str, Tensor], start: int) -> dict[str, Tensor]:
    """A pipeline stage's state with its layers numbered globally (the stage's first is ``start``)."""
    if not start:
        return dict(state)
    pattern = re.compile(r"^decoder\.layers\.(\d+)\.")
    return {pattern.sub(lambda m: f"decoder.layers.{int(m.group(1)) + start}.", name): t for name, t in state.items()}


def mcore_to_hf(
    shards: list[Mapping[str, Tensor]], shape: Shape, *, experts_split: bool = True
) -> Iterator[tuple[str, Tensor]]:
    """HF-named tensors gathered from every tensor-parallel rank's Megatron state (rank order),
    layer by layer; the experts from the first rank's alone when they are not split over the
    ranks (``experts_split`` False: expert tensor parallelism 1)."""
    first = shards[0]
    expert_shards = shards if experts_split else shards[:1]
    for name, (target, dim) in _GLOBAL.items():
        if target in first and name != "model.norm.weight":
            yield name, _gather([s[target] for s in shards], dim)[: shape.vocab]
    for layer in range(shape.layers):
        src, dst = f"model.layers.{layer}.", f"decoder.layers.{layer}."
        for kind in ("weight", "bias"):
            key = f"{dst}self_attention.linear_qkv.{kind}"
            if key in first:
                q, k, v = (_gather(list(p), 0) for p in zip(*(qkv_split(s[key], shape) for s in shards)))
                yield from ((f"{src}self_attn.{p}.{kind}", t) for p, t in zip(_QKV, (q, k, v)))
        for name, (target, dim) in _LAYER.items():
            if dst + target in first:
                yield src + name, _gather([s[dst + target] for s in shards], dim)
        key = f"{dst}mlp.linear_fc1.weight"
        if key in first:
            halves = [s[key].chunk(2) for s in shards]
            yield f"{src}mlp.gate_proj.weight", _gather([h[0] for h in halves], 0)
            yield f"{src}mlp.up_proj.weight", _gather([h[1] for h in halves], 0)
        if f"{dst}mlp.router.weight" in first:
            yield f"{src}mlp.gate.weight", first[f"{dst}mlp.router.weight"]
            fc1, fc2 = (
                [
                    [s[f"{dst}mlp.experts.local_experts.{e}.linear_{n}.weight"] for s in expert_shards]
                    for e in range(shape.experts)
                ]
                for n in ("fc1", "fc2")
            )
            gate_up = [
                torch.cat([_gather([p.chunk(2)[0] for p in parts], 0), _gather([p.chunk(2)[1] for p in parts], 0)])
                for parts in fc1
            ]
            yield f"{src}mlp.experts.gate_up_proj", torch.stack(gate_up)
            yield f"{src}mlp.experts.down_proj", torch.stack([_gather(parts, 1) for parts in fc2])
    if "decoder.final_layernorm.weight" in first:
        yield "model.norm.weight", first["decoder.final_layernorm.weight"]


# a local layer's norm -> Transformer Engine's name for it, fused into the linear layer after it
_FUSED_NORMS = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}
_LAYER_NORM = re.compile(r"^(.*decoder\.layers\.\d+\.)(" + "|".join(map(re.escape, _FUSED_NORMS)) + ")$")
_LAYER_FUSED = re.compile(r"^(.*decoder\.layers\.\d+\.)(" + "|".join(map(re.escape, _FUSED_NORMS.values())) + ")$")


def fused_norm_names(state: Mapping[str, Tensor], names: Iterable[str]) -> dict[str, Tensor]:
    """``state`` (local-spec names) under the names of a model holding ``names``: a norm takes
    Transformer Engine's fused name where the model has it (a mixture-of-experts layer keeps a
    separate pre-MLP norm)."""
    names = set(names)
    out = {}
    for name, tensor in state.items():
        m = _LAYER_NORM.match(name)
        fused = m and m.group(1) + _FUSED_NORMS[m.group(2)]
        out[fused if fused and fused in names and name not in names else name] = tensor
    return out


def unfused_norm_names(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``state`` with Transformer Engine's fused norm names back under the local spec's."""
    local = {v: k for k, v in _FUSED_NORMS.items()}
    out = {}
    for name, tensor in state.items():
        m = _LAYER_FUSED.match(name)
        out[m.group(1) + local[m.group(2)] if m else name] = tensor
    return out
