"""``megatron``: the trainer backend on a Megatron-Core GPT model (the trainer contract).

The model is built from the HF checkpoint (:mod:`.model`: the TE-free layer with torch's fused
attention) and its weights converted in (:mod:`.convert`). Everything around the model is the torch
trainer's: micro-batches by token budget, segments scored alone, the loss functions, AdamW with
warm-up and clipping, replicated data parallelism (gradients summed over gloo or NCCL), checkpoints
of HF-named tensors (so a checkpoint moves between the two backends), exports to the engines and to
an HF folder. What differs is the forward: Megatron's ``[batch, seq]`` interface with explicit
positions and a boolean mask, and the conversion at every boundary.

Tensor parallelism inside a trainer replica and Megatron's distributed optimizer are not wired yet
(docs/megatron.md); a replica is one process holding the whole model.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
import torch.distributed as dist
from torch import Tensor

from loongsage.core.embedded.trainer import _DTYPES, TorchTrainer
from loongsage.megatron.convert import Shape, mcore_to_hf
from loongsage.megatron.model import architecture, build_gpt, check_attention, load_hf_weights, rope_base


def read_config(model_path: str) -> dict[str, Any]:
    try:
        return json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"megatron trainer: cannot read {model_path}/config.json ({exc})") from None


@dataclass
class MegatronTrainer(TorchTrainer):
    """Megatron-Core GPT model, one replica per data-parallel rank (see the module docstring)."""

    kind = "trainer"

    dp_mode: Literal["replicate"] = "replicate"
    attention: str = "sdpa"  # torch's fused kernels; "local": Megatron's unfused attention
    supports_lora: ClassVar[bool] = False

    def __post_init__(self) -> None:
        check_attention(self.attention)  # before Megatron's process groups start
        if self.dp_mode != "replicate":
            raise ValueError(f"megatron trainer: dp_mode={self.dp_mode!r}; allowed: replicate")
        if self.gradient_checkpointing:
            raise ValueError("megatron trainer: gradient_checkpointing is not supported yet; allowed: false")
        super().__post_init__()

    @classmethod
    def preflight(cls, params: dict[str, Any], model_path: str, *, world_size: int = 1) -> None:
        """The architecture and the parameters, checked in the driver before any actor starts."""
        if params.get("lora") is not None:
            raise ValueError("lora: MegatronTrainer does not support LoRA; leave lora unset")
        check_attention(params.get("attention", "sdpa"))
        config = read_config(model_path)
        architecture(config)
        rope_base(config)

    def _load_model(self) -> torch.nn.Module:
        from safetensors.torch import load_file

        self.config = read_config(self.model_path)
        self.shape = Shape.of(self.config)
        start_model_parallel(self.device)
        model = build_gpt(self.config, dtype=_DTYPES[self.dtype], attention=self.attention)
        hf = {n: t for p in sorted(Path(self.model_path).glob("*.safetensors")) for n, t in load_file(str(p)).items()}
        load_hf_weights(model, hf, self.config)
        if self.fp32_lm_head and self.dtype != "float32":
            fp32_output_layer(model.output_layer)
        return model

    def _decoder_layers(self) -> list[torch.nn.Module]:
        return list(self.model.decoder.layers)

    def _logits(self, input_ids: Tensor, attention_mask: Tensor, first: int = 1) -> Tensor:
        """Logits at positions ``first-1..T-1``, float32, over the real vocabulary.

        Positions run 0..T-1 whatever the padding, as the HF model numbers them without
        ``position_ids``. Rows padded on the right only (as rollouts are) need no mask beyond the
        causal one: a real token never attends to a later pad, and the attention runs as plain
        causal (the flash kernel on a GPU). Otherwise a padded key is masked, and every position
        attends at least to itself (a padding row's output is never used, but a row attending to
        nothing would be NaN). The output layer runs only on the positions kept.
        """
        b, t = input_ids.shape
        device = input_ids.device
        positions = torch.arange(t, device=device).expand(b, t)
        masked = None
        if not bool((attention_mask[:, 1:] <= attention_mask[:, :-1]).all()):
            causal = torch.ones(t, t, dtype=torch.bool, device=device).triu(1)
            masked = (causal | ~attention_mask.bool()[:, None, :]) & ~torch.eye(t, dtype=torch.bool, device=device)
            masked = masked[:, None]
        with hidden_states_only(self.model):
            hidden = self.model(input_ids, positions, masked)  # [s, b, hidden], after the final norm
        # the head on batch-first rows: Megatron's own post-process returns [b, s, vocab] by a
        # contiguous copy of the whole logits (10 GB at 4 x 4096 with Qwen's vocabulary, copied
        # again in the backward), and runs on every position
        hidden = hidden[first - 1:].transpose(0, 1)
        tied = self.model.shared_embedding_or_output_weight() if self.model.share_embeddings_and_output_weights else None
        logits, _ = self.model.output_layer(hidden, weight=tied)
        return logits[..., :self.shape.vocab].float()

    # ------------------------------------------------------------------ weights and state
    def _full_model_state(self) -> dict[str, Tensor]:
        return dict(self._hf_tensors())

    def _hf_tensors(self) -> Iterator[tuple[str, Tensor]]:
        own = {k: v for k, v in self.model.state_dict(keep_vars=True).items() if isinstance(v, Tensor)}
        for name, tensor in mcore_to_hf([own], self.shape):
            yield name, tensor.detach()
            if name == "model.embed_tokens.weight" and self.shape.tied:
                yield "lm_head.weight", tensor.detach()  # as the HF model lists its tied head

    def export_weights(self) -> Iterator[tuple[str, Tensor]]:
        """HF-named tensors of the current policy (q/k/v and gate/up split out of Megatron's merged ones)."""
        yield from self._hf_tensors()

    def _load_model_state(self, state: dict[str, Tensor]) -> None:
        load_hf_weights(self.model, state, self.config)

    def _write_hf(self, path: Path, state: dict[str, Tensor]) -> None:
        from safetensors.torch import save_file

        path.mkdir(parents=True, exist_ok=True)
        for name in ("config.json", "generation_config.json"):
            if (Path(self.model_path) / name).is_file():
                shutil.copyfile(Path(self.model_path) / name, path / name)
        tensors = {n: t.contiguous() for n, t in state.items() if not (self.shape.tied and n == "lm_head.weight")}
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


@contextmanager
def hidden_states_only(model: torch.nn.Module) -> Iterator[None]:
    """``GPTModel.forward`` returning the decoder's output (its ``post_process`` off for the call)."""
    model.post_process = False
    try:
        yield
    finally:
        model.post_process = True


def fp32_output_layer(layer: torch.nn.Module) -> None:
    """The output layer's GEMM with float32 logits (the engine's FP32 head: the same kernel), for a
    replica holding the whole vocabulary. A tied model hands the embedding in as ``weight``."""
    from loongsage.core.embedded.kv_cache import fp32_head

    def forward(input_: Tensor, weight: Tensor | None = None, runtime_gather_output: bool | None = None,
                **_: Any) -> tuple[Tensor, None]:
        return fp32_head(input_, layer.weight if weight is None else weight), None

    layer.forward = forward


def start_model_parallel(device: str) -> None:
    """Megatron's process groups over the run's data-parallel world (one process: a group of
    one of its own); tensor and pipeline parallelism 1. CPU shims when CUDA is absent."""
    from megatron.core import parallel_state, tensor_parallel

    from loongsage.core.placement import free_port
    from loongsage.megatron.cpu import apply_cpu_shims

    if not str(device).startswith("cuda"):
        apply_cpu_shims()
    if not dist.is_initialized():
        backend = "nccl" if str(device).startswith("cuda") else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
        tensor_parallel.model_parallel_cuda_manual_seed(int(torch.initial_seed()) % (2**31))
