"""The embedded torch trainer backend (``torch``): the trainer skeleton (:mod:`.skeleton`: micro-batches,
the loss closure per micro-batch, AdamW, held teachers, checkpoints) over an HF causal LM
(:class:`~loongsage.core.trainer.torch_model.TorchModel`: FSDP2 or replicated data parallelism,
LoRA, the FP32 head).

This module holds the backend's params and the checks that refuse a combination of them in one
line, before the model is loaded (and, through :meth:`TorchTrainer.preflight`, in the driver before
any actor starts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch

from loongsage.core.model_math.dtypes import DTYPES
from loongsage.core.model_math.fp8_linear import check_fp8, unsupported_fp8
from loongsage.core.trainer.adapter import world_size
from loongsage.core.trainer.lora import LoraConfig, check_targets
from loongsage.core.trainer.skeleton import TrainerSkeleton, check_dtype
from loongsage.core.trainer.torch_model import TorchModel


@dataclass
class TorchTrainer(TrainerSkeleton):
    """HF transformers causal LM, fp32 on CPU, AdamW, grad clipping, FSDP2 or replicated DP
    (the :class:`~loongsage.core.contracts.Trainer` contract)."""

    kind = "trainer"

    dp_mode: Literal["fsdp2", "replicate"] = "fsdp2"
    lora: LoraConfig | None = None  # None: full fine-tuning
    # each decoder layer compiled by torch.compile (fused norms, rotary and activations; torch_model.py)
    compile_layers: bool = False
    # the FP32 head and its log-softmax this many tokens at a time (0: at once; chunked_head.py)
    head_chunk_tokens: int = 0
    # log-probs bit for bit the native engine's batch_invariant mode's (CUDA, bf16/fp16; invariant.py)
    batch_invariant: bool = False
    # a prompt computed once for the rows of a micro-batch that begin with it (shared_prompts.py)
    share_prompts: bool = False
    # the decoder layers' GEMMs in FP8 with current scaling (bf16 models; model_math/fp8_linear.py):
    # hybrid (e4m3 forward, e5m2 gradients) or e4m3; null: the model's dtype
    fp8: str | None = None
    fp8_recipe: str = "rowwise"  # the scales: per token and output channel (rowwise), or per tensor

    supports_lora: ClassVar[bool] = True  # the critic's value head is outside the decoder layers LoRA targets
    supports_batch_invariant: ClassVar[bool] = True  # a critic's values are no engine's log-probs
    supports_share_prompts: ClassVar[bool] = True  # the critic's value model has a forward of its own
    # a held teacher scores in the model dtype: its log-probs are the targets, not trained through
    held_teacher_params: ClassVar[dict[str, Any]] = {"lora": None, "gradient_checkpointing": False, "fp8": None}
    adapter_class: ClassVar[type[TorchModel]] = TorchModel  # the model it trains (the critic's: a value model)

    def __post_init__(self) -> None:
        check_dtype(self.dtype)
        world = world_size()
        self._check_head_chunks(world)
        self._check_fp8(world)
        self._check_batch_invariant(world)
        self._check_share_prompts(world)
        if self.lora is not None:
            self._check_lora_placement(world, self.dp_mode)
        if world > 1 and self.dp_mode == "fsdp2" and self.distributed_optimizer:
            raise ValueError(
                "distributed_optimizer: FSDP2 shards the optimizer state already; set dp_mode: replicate "
                "to split it over the ranks this way, or leave distributed_optimizer false"
            )
        self._attach(
            self.adapter_class(
                self.model_path,
                dtype=self.dtype,
                device=self.device,
                fp32_lm_head=self.fp32_lm_head,
                gradient_checkpointing=self.gradient_checkpointing,
                dp_mode=self.dp_mode,
                lora=self.lora,
                compile_layers=self.compile_layers,
                head_chunk_tokens=self.head_chunk_tokens,
                batch_invariant=self.batch_invariant,
                share_prompts=self.share_prompts,
                fp8=None if self.fp8 is None else (self.fp8, self.fp8_recipe),
            )
        )

    @classmethod
    def preflight(cls, params: dict[str, Any], model_path: str, *, world_size: int = 1) -> None:
        """Checks that need the model, run by the controller before any actor starts (one line each).

        The model is instantiated on the meta device: its layer names without its weights.
        """
        lora = params.get("lora")
        if lora is None:
            return
        cls._check_lora_placement(world_size, params.get("dp_mode", "fsdp2"))
        from transformers import AutoConfig, AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
        check_targets(lora, list(model.model.layers))

    def _check_head_chunks(self, world: int) -> None:
        chunk = self.head_chunk_tokens
        if isinstance(chunk, bool) or not (isinstance(chunk, int) and chunk >= 0):
            raise ValueError(
                f"head_chunk_tokens={self.head_chunk_tokens!r}: must be an integer >= 0 (0: the head at once)"
            )
        if not self.head_chunk_tokens:
            return
        if not self.fp32_lm_head and self.dtype != "float32":
            raise ValueError(
                "head_chunk_tokens: the chunked head is the FP32 head; set fp32_lm_head: true or head_chunk_tokens: 0"
            )
        if world > 1 and self.dp_mode == "fsdp2":
            raise ValueError(
                "head_chunk_tokens: not with FSDP2's sharded head; set dp_mode: replicate or head_chunk_tokens: 0"
            )

    def _check_fp8(self, world: int) -> None:
        check_fp8(self.fp8, self.fp8_recipe)
        if self.fp8 is None:
            return
        clash = {
            "batch_invariant": self.batch_invariant,  # the engine's bf16 numbers, which FP8 cannot give
            "lora": self.lora is not None,  # the adapters' GEMMs are not FP8 ones
            "dp_mode: fsdp2": world > 1 and self.dp_mode == "fsdp2",  # sharded parameters: not tried with FP8 yet
        }
        _refuse_clashes("fp8", clash)
        why = unsupported_fp8(self.device, DTYPES[self.dtype])
        if why is not None:
            raise ValueError(f"fp8: FP8 GEMMs cannot train here: {why}")

    def _check_batch_invariant(self, world: int) -> None:
        if not self.batch_invariant:
            return
        clash = {
            "compile_layers": self.compile_layers,  # Inductor would fuse and round the layers its own way
            "lora": self.lora is not None,  # the invariant path multiplies the base weights alone
            "head_chunk_tokens": bool(self.head_chunk_tokens),
            "dp_mode: fsdp2": world > 1 and self.dp_mode == "fsdp2",  # sharded weights
            "a value model": not self.supports_batch_invariant,
        }
        _refuse_clashes("batch_invariant", clash)
        if self.dtype not in ("bfloat16", "float16") or not str(self.device).startswith("cuda"):
            raise ValueError(
                f"batch_invariant: runs bf16/fp16 models on CUDA (the engine's fused kernels); "
                f"here dtype={self.dtype}, device={self.device}"
            )

    def _check_share_prompts(self, world: int) -> None:
        if not self.share_prompts:
            return
        clash = {
            # HF's checkpointed layers drop the KV cache through which rows read their prompt
            "gradient_checkpointing": self.gradient_checkpointing,
            "batch_invariant": self.batch_invariant,  # a forward of its own, token by token
            "dp_mode: fsdp2": world > 1 and self.dp_mode == "fsdp2",  # the body runs outside FSDP2's root
            "a value model": not self.supports_share_prompts,
        }
        _refuse_clashes("share_prompts", clash)

    @classmethod
    def _check_lora_placement(cls, world_size: int, dp_mode: str) -> None:
        if not cls.supports_lora:
            raise ValueError(f"lora: {cls.__name__} does not support LoRA; leave lora unset")
        if world_size > 1 and dp_mode == "fsdp2":
            raise ValueError(
                "lora: dp_mode='fsdp2' is not supported with LoRA; set dp_mode='replicate' "
                "(the adapters are small, so a full replica per rank costs little)"
            )


def _refuse_clashes(option: str, clash: dict[str, bool]) -> None:
    """One line naming every setting in ``clash`` that is on beside ``option``."""
    named = [name for name, on in clash.items() if on]
    if named:
        raise ValueError(f"{option}: not with {', '.join(named)}; turn one of them off")
