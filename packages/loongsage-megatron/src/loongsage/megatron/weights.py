"""A Megatron GPT model's weights in and out, always HF-named: the model built from an HF checkpoint
(the trainer's and the teacher's), and its state gathered from the ranks' shards for checkpoints,
exports to the engines and HF folders. A checkpoint thus moves between the torch and the Megatron
trainers, and between layouts.

Gathering a split replica's state: the experts over the expert-parallel ranks (each block
renumbered), the tensor-parallel shards on the stage's first rank, and the pipeline stages'
tensors on the first stage (collectives of their groups; every other rank yields nothing).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from loongsage.core.model_math.dtypes import DTYPES
from loongsage.megatron.convert import Shape, mcore_to_hf, merge_expert_shards, numbered_from, unfused_norm_names
from loongsage.megatron.layout import Layout
from loongsage.megatron.model import build_gpt, load_hf_weights, resolve_layer_spec, stage_layers
from loongsage.megatron.parallel import gathered_state
from loongsage.megatron.pipeline import Stage, to_first_stage


def read_config(model_path: str) -> dict[str, Any]:
    try:
        return json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"megatron trainer: cannot read {model_path}/config.json ({exc})") from None


def load_gpt(
    model_path: str,
    config: dict[str, Any],
    *,
    dtype: str,
    device: str,
    spec: str = "auto",
    fp32_lm_head: bool = True,
    recompute: bool = False,
    layout: Layout = Layout(),
    packed: bool = False,
    fp8: str | None = None,
    fp8_recipe: str = "delayed",
) -> torch.nn.Module:
    """This rank's shard of a Megatron GPT model of layer spec ``spec`` (:func:`resolve_layer_spec`)
    with the HF checkpoint's weights (Megatron's process groups started first, as ``layout``
    says), the output layer giving float32 logits where asked."""
    from safetensors.torch import load_file

    layout.start(device)
    shape = Shape.of(config)
    spec = resolve_layer_spec(spec, device, layout)
    model = build_gpt(
        config,
        dtype=DTYPES[dtype],
        spec=spec,
        recompute=recompute,
        layout=layout,
        packed=packed,
        padded_vocab=shape.padded_vocab(layout.tp),
        fp8=fp8,
        fp8_recipe=fp8_recipe,
    )
    hf = {n: t for p in sorted(Path(model_path).glob("*.safetensors")) for n, t in load_file(str(p)).items()}
    load_hf_weights(model, hf, config, layout)
    if fp32_lm_head and dtype != "float32" and model.post_process:
        fp32_output_layer(model.output_layer)
    return model


def fp32_output_layer(layer: torch.nn.Module) -> None:
    """The output layer's GEMM with float32 logits (the engine's FP32 head: the same kernel) over
    this rank's vocabulary rows. A tied model hands the embedding in as ``weight``. Under tensor
    parallelism the input enters as Megatron's column-parallel layer takes it (identity forward,
    its gradient summed over the ranks' vocabulary shards)."""
    from loongsage.core.model_math.head import fp32_head
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

    def forward(
        input_: Tensor, weight: Tensor | None = None, runtime_gather_output: bool | None = None, **_: Any
    ) -> tuple[Tensor, None]:
        if parallel_state.get_tensor_model_parallel_world_size() > 1:
            input_ = copy_to_tensor_model_parallel_region(input_)
        return fp32_head(input_, layer.weight if weight is None else weight), None

    layer.forward = forward


def hf_tensors(
    model: Any, shape: Shape, layout: Layout, device: str, *, stage: Stage | None = None
) -> Iterator[tuple[str, Tensor]]:
    """HF-named tensors of ``model``: one rank's own as views; with the replica split, gathered as the
    module docstring says (``stage``: this rank's, under pipeline parallelism)."""
    own = unfused_norm_names(
        {
            k: v
            for k, v in model.state_dict(keep_vars=True).items()
            if isinstance(v, Tensor) and not k.endswith("_extra_state")
        }
    )
    if shape.tied and not model.pre_process:
        own.pop("output_layer.weight", None)  # the last stage's copy of the embedding
    shards = _gathered(own, layout)
    if shards is None:
        return
    start = stage_layers(shape.layers).start

    def stage_tensors() -> Iterator[tuple[str, Tensor]]:
        for name, tensor in mcore_to_hf(
            [numbered_from(s, start) for s in shards], shape, experts_split=layout.expert_tp > 1
        ):
            yield name, tensor.detach()
            if name == "model.embed_tokens.weight" and shape.tied:
                yield "lm_head.weight", tensor.detach()  # as the HF model lists its tied head

    if stage is None:
        yield from stage_tensors()
    else:  # one replica's stages send theirs to its first
        yield from to_first_stage(stage, stage_tensors, device)


def _gathered(own: dict[str, Tensor], layout: Layout) -> list[dict[str, Tensor]] | None:
    """A stage's whole state as its tensor-parallel ranks' shards, on the first rank of the first
    data-parallel replica (None elsewhere): the experts gathered over the expert-parallel ranks
    (each block renumbered), then the shards over the tensor-parallel ranks. Experts that are
    whole on each rank (expert tensor parallelism 1) go with the first shard only."""
    from megatron.core import parallel_state as ps

    whole_experts = layout.expert_tp == 1 and layout.tp > 1
    experts = {k: v for k, v in own.items() if not getattr(v, "allreduce", True)}
    if whole_experts:
        own = {k: v for k, v in own.items() if k not in experts}
    if layout.ep > 1:
        blocks = gathered_state(experts, ps.get_expert_model_parallel_group())
        experts = merge_expert_shards(blocks) if blocks is not None else None
        if experts is None and not whole_experts:
            return None  # the experts' first rank holds its tensor-parallel group's whole state
        if not whole_experts:
            own = {**own, **experts}
    shards = [own] if layout.tp == 1 else gathered_state(own)
    if shards is None or ps.get_data_parallel_rank() != 0:
        return None
    if whole_experts:  # on the first tensor-parallel rank, which is the experts' first rank
        shards[0] = {**shards[0], **experts}
    return shards


def write_hf(path: Path, tensors: dict[str, Tensor], model_path: str, shape: Shape) -> None:
    """An HF folder: the checkpoint's configs and one safetensors file (a tied head once, as HF saves it)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json"):
        if (Path(model_path) / name).is_file():
            shutil.copyfile(Path(model_path) / name, path / name)
    tensors = {n: t.contiguous() for n, t in tensors.items() if not (shape.tied and n == "lm_head.weight")}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
