"""A Megatron-Core GPT model built from an HF config, on one of three layer specs:

* ``te``: Transformer Engine's layer (its fused norm-and-linear layers, cuDNN's fused attention),
  when ``transformer_engine.pytorch`` imports on a GPU;
* ``sdpa``: the Transformer-Engine-free local layer with torch's fused attention
  (``scaled_dot_product_attention``: flash or memory-efficient kernels on a GPU);
* ``local``: Megatron's local layer as it is, whose unfused attention materialises the full score
  matrix (measured on an H200: 17.1k tok/s at 4x1024 and out of memory at 4x4096 on the 1.7B shape).

``auto`` (the default) is ``te`` where Transformer Engine imports on a GPU, ``sdpa`` elsewhere.
Megatron-Core is imported here only; :mod:`loongsage.megatron.convert` needs torch alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from loongsage.megatron import context, packing
from loongsage.megatron.convert import num_experts
from loongsage.megatron.layout import Layout

# the HF architectures whose layers this spec reproduces (RMSNorm, SwiGLU, rotary, GQA)
# (and, for Qwen3-MoE, a mixture of experts in every layer's MLP)
ARCHITECTURES = {
    "Qwen3ForCausalLM": {"qk_layernorm": True, "qkv_bias": False, "moe": False},
    "Qwen3MoeForCausalLM": {"qk_layernorm": True, "qkv_bias": False, "moe": True},
    "Qwen2ForCausalLM": {"qk_layernorm": False, "qkv_bias": True, "moe": False},
    "LlamaForCausalLM": {"qk_layernorm": False, "qkv_bias": False, "moe": False},
}
# why an architecture users ask for is not built here
NOT_BUILT = {
    "DeepseekV4ForCausalLM": "its hyper-connections (mHC), compressed sparse attention (CSA/HCA) and "
    "hash-routed first layers are not in Megatron-Core 0.19",
    "DeepseekV3ForCausalLM": "Megatron-Core has its multi-latent attention and shared experts, but the HF "
    "conversion and the spec for them are not written here",
}


def architecture(config: Mapping) -> dict[str, bool]:
    """The spec options of an HF config's architecture, or one line naming what is supported."""
    names = list(config.get("architectures") or [])
    for name in names:
        if name in ARCHITECTURES:
            if ARCHITECTURES[name]["moe"]:
                check_moe(config)
            return ARCHITECTURES[name]
    why = next((f" ({NOT_BUILT[n]})" for n in names if n in NOT_BUILT), "")
    raise ValueError(
        f"megatron trainer: architecture {names or 'unknown'} is not supported{why}; "
        f"allowed: {', '.join(ARCHITECTURES)}"
    )


def check_moe(config: Mapping) -> None:
    """One line naming a mixture-of-experts layout the spec does not reproduce: every layer must
    route (no dense ``mlp_only_layers``, ``decoder_sparse_step`` 1), with no shared expert."""
    if config.get("mlp_only_layers") or int(config.get("decoder_sparse_step") or 1) != 1:
        raise ValueError(
            f"megatron trainer: mlp_only_layers={config.get('mlp_only_layers')} and decoder_sparse_step="
            f"{config.get('decoder_sparse_step')}: dense layers between MoE layers are not supported yet; "
            "allowed: every layer a mixture of experts"
        )
    if config.get("shared_expert_intermediate_size"):
        raise ValueError("megatron trainer: shared experts are not supported yet; allowed: routed experts only")


def moe_fields(config: Mapping) -> dict[str, Any]:
    """``TransformerConfig`` fields of a Qwen3-MoE config (none for a dense model).

    HF's router takes the softmax over every expert, then the top k, renormalised when
    ``norm_topk_prob``: the softmax over the top-k logits is exactly that, Megatron without
    ``moe_router_pre_softmax``; without renormalisation it is Megatron's pre-softmax. No auxiliary
    loss (an RL step trains on the policy loss alone); tokens are dispatched by all-gather over the
    expert-parallel ranks, which needs no CUDA streams. Routing replay is on: the trainer hands a
    micro-batch's recorded routes to the routers (R3, :func:`replayed_routes`).
    """
    if not architecture(config)["moe"]:
        return {}
    return {
        "num_moe_experts": num_experts(config),
        "moe_router_topk": int(config["num_experts_per_tok"]),
        "moe_ffn_hidden_size": int(config["moe_intermediate_size"]),
        "moe_router_pre_softmax": not bool(config.get("norm_topk_prob", True)),
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
        "moe_grouped_gemm": False,
        "moe_token_dispatcher_type": "allgather",
        "moe_enable_routing_replay": True,
    }


FP8_FORMATS = ("hybrid", "e4m3")  # Megatron's: e4m3 everywhere, or e4m3 forward and e5m2 gradients
FP8_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")  # Transformer Engine's scalings, as Megatron names them


def check_fp8(fp8: str | None, recipe: str) -> None:
    """One line naming an unknown FP8 format or recipe and the known ones."""
    if fp8 is not None and fp8 not in FP8_FORMATS:
        raise ValueError(f"megatron trainer: fp8={fp8!r}; allowed: {', '.join(FP8_FORMATS)}, or null (bf16 GEMMs)")
    if recipe not in FP8_RECIPES:
        raise ValueError(f"megatron trainer: fp8_recipe={recipe!r}; allowed: {', '.join(FP8_RECIPES)}")


def transformer_config(
    config: Mapping,
    *,
    dtype: torch.dtype,
    layout: Layout = Layout(),
    recompute: bool = False,
    fp8: str | None = None,
    fp8_recipe: str = "delayed",
) -> Any:
    """Megatron's ``TransformerConfig`` for an HF ``config.json`` (a dict), split as ``layout``
    says; ``recompute``: every layer's activations are recomputed in the backward
    (full, one layer at a time). With tensor parallelism sequence parallelism is on: between the
    layers' tensor-parallel regions each rank holds its share of the tokens (Megatron's MoE layer
    trains under tensor parallelism only so). ``fp8`` runs the decoder layers' GEMMs in FP8 through
    Transformer Engine (Megatron enters its FP8 context around each layer; the embedding and the
    FP32 head stay outside), scaled by ``fp8_recipe``."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    arch = architecture(config)
    heads = int(config["num_attention_heads"])
    rope_base(config)  # refuses what the spec does not reproduce
    return TransformerConfig(
        num_layers=int(config["num_hidden_layers"]),
        hidden_size=int(config["hidden_size"]),
        ffn_hidden_size=int(config["intermediate_size"]),
        num_attention_heads=heads,
        num_query_groups=int(config.get("num_key_value_heads") or heads),
        kv_channels=int(config.get("head_dim") or int(config["hidden_size"]) // heads),
        normalization="RMSNorm",
        layernorm_epsilon=float(config.get("rms_norm_eps", 1e-6)),
        qk_layernorm=arch["qk_layernorm"],
        add_qkv_bias=arch["qkv_bias"],
        add_bias_linear=False,
        gated_linear_unit=True,
        activation_func=F.silu,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # the fusions are Apex/TE kernels; torch runs the same arithmetic unfused
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        use_cpu_initialization=True,
        perform_initialization=False,  # the weights come from the checkpoint
        tensor_model_parallel_size=layout.tp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.expert_tp,
        pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp,
        sequence_parallel=layout.tp > 1,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        pipeline_dtype=dtype,
        **({"fp8": fp8, "fp8_recipe": fp8_recipe} if fp8 else {}),
        **moe_fields(config),
        **(
            {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
            if recompute
            else {}
        ),
    )


LAYER_SPECS = ("auto", "te", "sdpa", "local")


def check_layer_spec(spec: str) -> None:
    """One line naming an unknown layer spec and the known ones."""
    if spec not in LAYER_SPECS:
        raise ValueError(f"megatron trainer: layer_spec={spec!r}; allowed: {', '.join(LAYER_SPECS)}")


def transformer_engine_error() -> str | None:
    """Why Transformer Engine's torch modules do not import here (None when they do)."""
    import importlib.util

    if importlib.util.find_spec("transformer_engine") is None:
        return "transformer_engine is not installed"
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as exc:  # its extension or a library it loads missing: one line either way
        return f"transformer_engine.pytorch does not import ({type(exc).__name__}: {str(exc).splitlines()[0]})"
    return None


def resolve_layer_spec(spec: str, device: str, layout: Layout = Layout()) -> str:
    """The spec to build: ``auto`` picks ``te`` on a GPU where Transformer Engine imports (and no
    context parallelism, which this package builds on the ``sdpa`` attention), else ``sdpa``;
    ``te`` asked for where it cannot run is refused in one line."""
    check_layer_spec(spec)
    on_gpu = str(device).startswith("cuda")
    if spec == "auto":
        return "te" if on_gpu and layout.cp == 1 and transformer_engine_error() is None else "sdpa"
    if spec == "te":
        if not on_gpu:
            why = "it runs on GPUs only"
        elif layout.cp > 1:
            why = "context_parallel is built on the sdpa spec's attention"
        else:
            why = transformer_engine_error()
        if why:
            raise ValueError(f"megatron trainer: layer_spec=te on {device}: {why}; allowed: auto, sdpa, local")
    return spec


def check_packing(packed: bool, spec: str, cp: int) -> None:
    """One line naming what packed rows do not run with: Megatron's unfused attention (no packed
    path) and context parallelism (its chunks are of whole padded rows)."""
    if packed and (spec == "local" or cp > 1):
        raise ValueError(
            f"megatron trainer: pack_sequences with layer_spec={spec} and context_parallel={cp}; "
            "allowed: layer_spec auto, te or sdpa with context_parallel 1"
        )


def layer_spec(config: Mapping, spec: str = "sdpa") -> Any:
    """The GPT layer: Transformer Engine's (``te``), or the local (TE-free) one with torch's fused
    attention as its core attention (``sdpa``) or the local spec's own unfused one (``local``, for
    comparison)."""
    check_layer_spec(spec)
    arch = architecture(config)
    experts = num_experts(config) if arch["moe"] else None
    if spec == "te":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=experts, moe_grouped_gemm=False, qk_layernorm=arch["qk_layernorm"]
        )
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    if experts:
        _megatron_without_te()
    layer = get_gpt_layer_local_spec(
        num_experts=experts, moe_grouped_gemm=False, qk_layernorm=arch["qk_layernorm"], normalization="RMSNorm"
    )
    if spec == "sdpa":
        layer.submodules.self_attention.submodules.core_attention = sdpa_attention_class()
    norm = rms_norm_class()
    submodules, attn = layer.submodules, layer.submodules.self_attention.submodules
    submodules.input_layernorm = submodules.pre_mlp_layernorm = norm
    if arch["qk_layernorm"]:
        attn.q_layernorm = attn.k_layernorm = norm
    return layer


def _megatron_without_te() -> None:
    """Megatron-Core 0.16's router GEMM reads ``te_general_gemm``, which it defines only when
    Transformer Engine imports (0.19 defines it as None)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def build_gpt(
    config: Mapping,
    *,
    dtype: torch.dtype,
    layout: Layout = Layout(),
    padded_vocab: int | None = None,
    spec: str = "sdpa",
    recompute: bool = False,
    packed: bool = False,
    fp8: str | None = None,
    fp8_recipe: str = "delayed",
) -> Any:
    """A ``GPTModel`` (this rank's shard: under pipeline parallelism its stage's layers, the
    embedding on the first stage, the final norm and output layer on the last) shaped as
    ``config``, its layers of ``spec`` (resolved: not ``auto``), running its rows ``packed``
    (:mod:`.packing`) or padded; its weights are to be loaded."""
    check_packing(packed, spec, layout.cp)
    if fp8 and spec != "te":
        raise ValueError(
            f"megatron trainer: fp8={fp8!r} runs on Transformer Engine's layers; the layers here are {spec!r} "
            f"({transformer_engine_error() or 'layer_spec asks for them'})"
        )
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    layers = stage_layers(int(config["num_hidden_layers"]))
    if spec == "te":
        from megatron.core.extensions.transformer_engine import TENorm
    blocks = TransformerBlockSubmodules(
        layer_specs=[layer_spec(config, spec)] * len(layers), layer_norm=TENorm if spec == "te" else rms_norm_class()
    )
    model = GPTModel(
        config=transformer_config(
            config, dtype=dtype, layout=layout, recompute=recompute, fp8=fp8, fp8_recipe=fp8_recipe
        ),
        transformer_layer_spec=blocks,
        vocab_size=padded_vocab or int(config["vocab_size"]),
        max_sequence_length=int(config.get("max_position_embeddings") or 4096),
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=bool(config.get("tie_word_embeddings", False)),
        position_embedding_type="rope",
        rotary_base=rope_base(config),
    )
    model.transformer_engine, model.packed_sequences = spec == "te", packed
    mark_tensor_parallel(model)
    if model.post_process:  # the head's input is gathered whole first (gpt_logits): the layer must not gather it again
        model.output_layer.sequence_parallel = False
    return model.to(dtype)  # the norms too, as the HF model holds them (Megatron makes them float32)


def mark_tensor_parallel(model: Any) -> None:
    """Mark the sharded parameters as Megatron's initialisation would (``tensor_model_parallel``,
    the split dimension): with the weights coming from a checkpoint it does not run, and the
    gradient norm must tell a shard from a replicated norm."""
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        set_tensor_model_parallel_attributes,
    )

    layouts = (
        (ColumnParallelLinear, {"weight": 0, "bias": 0}),
        (VocabParallelEmbedding, {"weight": 0}),
        (RowParallelLinear, {"weight": 1}),
    )  # a row-parallel bias is whole on every rank
    for module in model.modules():
        split = next((dims for kind, dims in layouts if isinstance(module, kind)), {})
        for name, dim in split.items():
            param = getattr(module, name, None)
            if isinstance(param, torch.nn.Parameter) and not hasattr(param, "tensor_model_parallel"):
                set_tensor_model_parallel_attributes(param, is_parallel=True, dim=dim, stride=1)


def stage_layers(layers: int) -> range:
    """The decoder layers (global numbers from 0) this rank's pipeline stage holds: an equal share."""
    from megatron.core import parallel_state

    stages, stage = (
        parallel_state.get_pipeline_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_rank(),
    )
    return range(stage * layers // stages, (stage + 1) * layers // stages)


def rope_base(config: Mapping) -> float:
    """The rotary base (``rope_theta``: top level before transformers 5, in ``rope_parameters``
    since); scaled rotary variants are refused in one line."""
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind != "default":
        raise ValueError(f"megatron trainer: rope_type={kind!r} is not supported yet; allowed: default")
    return float(rope.get("rope_theta") or config.get("rope_theta") or 10000.0)


def load_hf_weights(model: Any, hf: Mapping[str, torch.Tensor], config: Mapping, layout: Layout = Layout()) -> None:
    """Fill ``model`` (this rank's shard of ``layout``, its ranks read from Megatron's process
    groups: its tensor-parallel slice, its block of experts and their slice, its pipeline
    stage's layers) from HF-named tensors; every weight must be given."""
    from loongsage.megatron.convert import Shape, fused_norm_names, hf_to_mcore
    from megatron.core import parallel_state as ps

    own = model.state_dict()
    state = hf_to_mcore(
        hf,
        Shape.of(config),
        ps.get_tensor_model_parallel_rank(),
        layout.tp,
        ep_rank=ps.get_expert_model_parallel_rank(),
        ep=layout.ep,
        expert_rank=ps.get_expert_tensor_parallel_rank(),
        expert_tp=layout.expert_tp,
        layers=stage_layers(int(config["num_hidden_layers"])),
        first=model.pre_process,
        last=model.post_process,
    )
    state = fused_norm_names(state, own)
    missing = sorted(k for k in own if k not in state and not k.endswith("_extra_state"))
    unknown = sorted(k for k in state if k not in own)
    if missing or unknown:
        raise ValueError(
            f"megatron trainer: the checkpoint does not fit the model: missing {missing[:3]}, unexpected {unknown[:3]}"
        )
    for key, tensor in state.items():
        if tuple(own[key].shape) != tuple(tensor.shape):
            raise ValueError(
                f"megatron trainer: {key} is {tuple(tensor.shape)} in the checkpoint, "
                f"{tuple(own[key].shape)} in the model"
            )
    # the per-module extra state (Transformer Engine's FP8 metadata; None without it) stays the model's own
    model.load_state_dict({**own, **{k: t.to(own[k].dtype) for k, t in state.items()}}, strict=True)


def rms_norm_class() -> type:
    """torch's RMSNorm as Megatron builds its norms, allowed under sequence parallelism (Megatron's
    torch-norm wrapper refuses it). Its weight is marked ``sequence_parallel``, as Megatron marks a
    norm whose input is a share of the tokens: its gradient is summed over the tensor-parallel
    ranks (:func:`loongsage.megatron.parallel.sum_replicated_grads`)."""
    global _NORM
    if _NORM is None:

        class RMSNorm(torch.nn.RMSNorm):
            def __init__(self, config: Any, hidden_size: int, eps: float = 1e-6, **_: Any):
                super().__init__(hidden_size, eps=eps)
                self.weight.sequence_parallel = config.sequence_parallel

        _NORM = RMSNorm
    return _NORM


_NORM: type | None = None


def sdpa_attention_class() -> type:
    """Megatron's core-attention module over ``torch.nn.functional.scaled_dot_product_attention``
    (a class made on first use: its base class is Megatron's)."""
    global _SDPA
    if _SDPA is None:
        _SDPA = _make_sdpa_attention()
    return _SDPA


_SDPA: type | None = None


def _make_sdpa_attention() -> type:
    from megatron.core import parallel_state
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.module import MegatronModule

    class SDPAAttention(MegatronModule):
        """Causal attention by torch's fused kernels; Megatron's ``[s, b, heads, dim]`` in and
        ``[s, b, heads * dim]`` out (packed rows: ``[tokens, heads, dim]`` in, ``[tokens, heads * dim]``
        out). A boolean ``attention_mask`` is True where masked."""

        def __init__(
            self,
            config,
            layer_number,
            attn_mask_type,
            attention_type,
            attention_dropout=None,
            softmax_scale=None,
            cp_comm_type=None,
            pg_collection=None,
            **_,
        ):
            super().__init__(config=config)
            tp = parallel_state.get_tensor_model_parallel_world_size()
            self.heads, self.groups = config.num_attention_heads // tp, config.num_query_groups // tp
            self.head_dim = config.kv_channels
            self.attn_mask_type, self.softmax_scale = attn_mask_type, softmax_scale

        def forward(
            self,
            query,
            key,
            value,
            attention_mask,
            attn_mask_type=None,
            attention_bias=None,
            packed_seq_params=None,
            **_,
        ):
            gqa = self.heads != self.groups
            if packed_seq_params is not None:  # [tokens, heads, dim]: the rows back to back
                return packing.attention(
                    query, key, value, packed_seq_params.cu_seqlens_q, scale=self.softmax_scale, gqa=gqa
                )
            # [b, heads, s, dim] views of batch-first storage, the layout the HF model hands to the
            # same kernels (a copy of q, k, v: 0.2% of a layer's bytes; bench/train_mfu measured this)
            q, k, v = (t.transpose(0, 1).contiguous().transpose(1, 2) for t in (query, key, value))
            if self.config.context_parallel_size > 1:  # this rank's chunks of every sequence
                if attention_mask is not None:
                    raise ValueError("context_parallel: rows must be padded on the right only (causal attention)")
                out = context.attention(q, k, v, scale=self.softmax_scale, gqa=gqa)
            else:
                if attention_mask is not None:
                    extra = {"attn_mask": ~attention_mask}  # SDPA's boolean mask is True where attended
                else:
                    extra = {"is_causal": (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal}
                out = F.scaled_dot_product_attention(q, k, v, scale=self.softmax_scale, enable_gqa=gqa, **extra)
            out = out.transpose(1, 2).reshape(q.shape[0], q.shape[2], self.heads * self.head_dim)
            return out.transpose(0, 1).contiguous()  # Megatron's linear layers view their input

    return SDPAAttention
