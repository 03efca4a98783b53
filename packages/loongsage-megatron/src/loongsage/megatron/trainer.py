"""``megatron``: the trainer backend on a Megatron-Core GPT model (the trainer contract).

The core's trainer skeleton (micro-batches by token budget, segments scored alone, the loss
closure, AdamW with warm-up and clipping or the distributed optimizer, float32 master weights,
held MOPD teachers, checkpoints and exports) over the Megatron model adapter
(:class:`~loongsage.megatron.adapter.MegatronModel`: the model built and split over the ranks, its
forward, its gradients' sums and norms, its HF-named state).

A replica may be split over ranks (:mod:`.layout`): ``tensor_parallel`` ranks each hold a slice of
every layer and see the same rows; under ``expert_parallel`` each rank holds a block of every MoE
layer's experts and trains on rows of its own (the experts' ranks are data-parallel ranks for
everything else); under ``pipeline_parallel`` each rank holds a stage of consecutive layers;
``context_parallel`` ranks each hold a share of every sequence's tokens. ``distributed_optimizer``
splits the float32 masters and AdamW state over the data-parallel ranks, the experts' over the
ranks holding them.

This module holds the backend's params and the checks that refuse them in one line: in the driver
before any actor starts (:meth:`MegatronTrainer.preflight`), and before the model is built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from loongsage.core.trainer.lora import LoraConfig
from loongsage.core.trainer.skeleton import TrainerSkeleton, check_dtype
from loongsage.core.types import Check
from loongsage.megatron.adapter import MegatronModel
from loongsage.megatron.layout import Layout
from loongsage.megatron.model import (
    architecture,
    check_fp8,
    check_layer_spec,
    check_packing,
    rope_base,
    transformer_engine_error,
)
from loongsage.megatron.weights import read_config

_LORA_REFUSED = "lora: MegatronTrainer does not support LoRA; leave lora unset"


@dataclass
class MegatronTrainer(TrainerSkeleton):
    """Megatron-Core GPT model, one replica per data-parallel rank (see the module docstring)."""

    kind = "trainer"

    dp_mode: Literal["replicate"] = "replicate"
    lora: LoraConfig | None = None  # refused: the torch trainer trains adapters
    layer_spec: str = "auto"  # "te" (Transformer Engine) where it imports on a GPU, else "sdpa"; or "local"
    routing_replay: bool = True  # R3 on an MoE model: replay the engine's routed experts when rows carry them
    tensor_parallel: int = 1  # ranks one replica is split over (trainer.world_size: a multiple of it)
    expert_parallel: int = 1  # ranks an MoE layer's experts are split over (each trains on rows of its own)
    pipeline_parallel: int = 1  # consecutive stages of layers one replica is split into
    expert_tensor_parallel: int | None = None  # ranks one expert is split over (None: tensor_parallel; or 1)
    context_parallel: int = 1  # ranks each holding a share of every sequence's tokens
    pack_sequences: bool = False  # a micro-batch's rows run as one sequence of their real tokens (.packing)
    # the decoder layers' GEMMs in FP8 through Transformer Engine: hybrid (e4m3 forward, e5m2
    # gradients) or e4m3; null: bf16. Needs layer_spec te; the FP32 head stays FP32
    fp8: str | None = None
    fp8_recipe: str = "delayed"  # Transformer Engine's scaling: delayed, tensorwise, blockwise or mxfp8

    supports_lora: ClassVar[bool] = False
    # a held teacher routes its own tokens: the student's recorded routes are not its
    held_teacher_params: ClassVar[dict[str, Any]] = {
        "lora": None,
        "gradient_checkpointing": False,
        "routing_replay": False,
    }

    def __post_init__(self) -> None:
        check_layer_spec(self.layer_spec)  # before Megatron's process groups start
        check_fp8(self.fp8, self.fp8_recipe)
        self.layout = Layout.of(
            {
                name: getattr(self, name)
                for name in (
                    "tensor_parallel",
                    "pipeline_parallel",
                    "expert_parallel",
                    "expert_tensor_parallel",
                    "context_parallel",
                )
            }
        )
        if self.dp_mode != "replicate":
            raise ValueError(f"megatron trainer: dp_mode={self.dp_mode!r}; allowed: replicate")
        check_dtype(self.dtype)
        if self.lora is not None:
            raise ValueError(_LORA_REFUSED)
        self._attach(
            MegatronModel(
                self.model_path,
                layout=self.layout,
                dtype=self.dtype,
                device=self.device,
                fp32_lm_head=self.fp32_lm_head,
                recompute=self.gradient_checkpointing,
                layer_spec=self.layer_spec,
                pack_sequences=self.pack_sequences,
                routing_replay=self.routing_replay,
                fp8=self.fp8,
                fp8_recipe=self.fp8_recipe,
            )
        )

    @staticmethod
    def doctor() -> list[Check]:
        """Megatron-Core importable, and Transformer Engine's layer (optional: without it the
        trainer builds the ``sdpa`` layer)."""
        import importlib.metadata

        try:
            import megatron.core  # noqa: F401

            core = Check("megatron-core", True, importlib.metadata.version("megatron-core"))
        except Exception as exc:  # missing, or a library it loads: one line either way
            found = f"does not import ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
            core = Check("megatron-core", False, found, "pip install loongsage-megatron (it pins megatron-core)")
        te = transformer_engine_error()
        return [
            core,
            Check(
                "Transformer Engine (layer_spec te)",
                te is None,
                "imports" if te is None else te,
                "" if te is None else "optional: docs/megatron.md, 'Transformer Engine', says how to build it",
                optional=True,
            ),
        ]

    @classmethod
    def preflight(cls, params: dict[str, Any], model_path: str, *, world_size: int = 1) -> None:
        """The architecture and the parameters, checked in the driver before any actor starts."""
        if params.get("lora") is not None:
            raise ValueError(_LORA_REFUSED)
        check_layer_spec(params.get("layer_spec", "auto"))
        check_fp8(params.get("fp8"), params.get("fp8_recipe", "delayed"))
        check_packing(
            bool(params.get("pack_sequences")), params.get("layer_spec", "auto"), params.get("context_parallel", 1)
        )
        config = read_config(model_path)
        architecture(config)
        rope_base(config)
        Layout.of(params).check(config, world_size)
