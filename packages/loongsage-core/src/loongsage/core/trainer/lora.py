"""LoRA for the embedded torch trainer: adapters injected with peft, merged weights for the engine.

The adapters are injected into the HF model in place (``peft.inject_adapter_in_model``), so the
model keeps its class and its forward (``policy_logits`` and the engine share it unchanged); only
the targeted ``nn.Linear`` modules become peft LoRA layers holding the frozen base weight and the
trainable ``lora_A`` / ``lora_B`` pair. What leaves the trainer always speaks the base checkpoint's
names: the engine receives ``W + B @ A * alpha / rank`` under ``...q_proj.weight``, and an exported
HF folder holds the merged model with no trace of peft.

peft is an optional dependency (``loongsage-core[lora]``): nothing here imports it until a LoRA
config asks for it.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

ADAPTER = "default"  # peft's adapter name; one adapter per model


def require_peft() -> None:
    if importlib.util.find_spec("peft") is None:
        raise ValueError(
            "lora needs the peft package, which is not installed; install it with: pip install 'loongsage-core[lora]'"
        )


@dataclass
class LoraConfig:
    """``trainer.backend.params.lora``: low-rank adapters on the decoder's linear layers.

    ``target_modules`` are short module names (``q_proj``, ``down_proj`` ...); ``None`` targets
    every linear layer of the decoder layers. The update is scaled by ``alpha / rank``.
    """

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] | None = None

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"rank={self.rank}: must be >= 1")
        if self.alpha <= 0:
            raise ValueError(f"alpha={self.alpha}: must be > 0")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout}: must be in [0, 1)")
        if self.target_modules is not None and not self.target_modules:
            raise ValueError(
                "target_modules=[]: name at least one module, or leave it null for every linear layer of the decoder"
            )
        require_peft()  # at config validation, before any actor starts


def decoder_linear_names(layers: list[nn.Module]) -> list[str]:
    """Short names of the ``nn.Linear`` modules inside the decoder layers (what LoRA may target)."""
    return sorted(
        {name.rsplit(".", 1)[-1] for layer in layers for name, m in layer.named_modules() if isinstance(m, nn.Linear)}
    )


def check_targets(cfg: LoraConfig, layers: list[nn.Module]) -> list[str]:
    """The target module names (all decoder linear layers when unset); one line if one is unknown."""
    allowed = decoder_linear_names(layers)
    targets = list(cfg.target_modules) if cfg.target_modules is not None else allowed
    unknown = [t for t in targets if t not in allowed]
    if unknown:
        raise ValueError(
            f"lora.target_modules: {unknown[0]!r} is not a linear layer of the decoder; allowed: {', '.join(allowed)}"
        )
    return targets


def add_adapters(model: nn.Module, cfg: LoraConfig, layers: list[nn.Module]) -> list[str]:
    """Inject LoRA adapters into ``model`` in place and freeze everything else; return the targets.

    ``layers`` are the decoder layers: only modules inside them are targeted (never the embedding
    or the LM head, which a tied model shares).
    """
    require_peft()
    import peft

    targets = check_targets(cfg, layers)
    prefix = _layers_prefix(model, layers)
    # A regex confined to the decoder layers: a short name alone would also match outside them.
    pattern = rf"{prefix}\.\d+\.(.*\.)?({'|'.join(targets)})"  # peft full-matches a string
    peft.inject_adapter_in_model(
        peft.LoraConfig(
            r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=pattern, bias="none"
        ),
        model,
        adapter_name=ADAPTER,
    )
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_" in name)
    return targets


def _layers_prefix(model: nn.Module, layers: list[nn.Module]) -> str:
    """Dotted path of the container holding ``layers`` (``model.layers`` for an HF causal LM)."""
    first = layers[0]
    for name, module in model.named_modules():
        if module is first:
            return name.rsplit(".", 1)[0].replace(".", r"\.")
    raise ValueError("lora: the decoder layers are not modules of the model")


def lora_layers(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(HF module path, peft LoRA layer)`` for every adapted module."""
    from peft.tuners.lora import LoraLayer

    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            yield name, module


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Run the base model: every LoRA layer bypasses its adapters inside the block.

    The base weights are frozen, so this IS the starting policy: a LoRA run's KL reference needs no
    second copy of the model.
    """
    layers = [module for _, module in lora_layers(model)]
    for module in layers:
        module.enable_adapters(False)
    try:
        yield
    finally:
        for module in layers:
            module.enable_adapters(True)  # peft also restores requires_grad on the adapters


@torch.no_grad()
def merged_weights(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """``(base name, W + delta)`` for every adapted weight: all that LoRA changes in the model.

    peft's own ``get_delta_weight`` computes ``B @ A * scaling`` (transposed for fan-in-fan-out
    layers), so the result equals peft's ``merge_and_unload`` without touching the model.
    """
    for name, module in lora_layers(model):
        base = module.get_base_layer().weight
        yield f"{name}.weight", (base + module.get_delta_weight(ADAPTER).to(base.dtype)).detach()


def merged_state(model: nn.Module) -> dict[str, Tensor]:
    """The whole model as the base checkpoint names it, with every adapted weight merged."""
    state = {}
    for name, tensor in model.state_dict().items():
        if ".lora_" in name:
            continue
        state[name.replace(".base_layer.", ".")] = tensor
    state.update(merged_weights(model))
    return state


def adapter_state(model: nn.Module) -> dict[str, Tensor]:
    """The trainable adapter tensors (all a checkpoint needs beside the base model)."""
    return {name: p.detach().clone() for name, p in model.named_parameters() if ".lora_" in name}


def load_adapter_state(model: nn.Module, state: dict[str, Tensor]) -> None:
    """Copy a saved :func:`adapter_state` back; the adapter names must match exactly."""
    params = {name: p for name, p in model.named_parameters() if ".lora_" in name}
    if params.keys() != state.keys():
        missing = sorted(params.keys() - state.keys())
        extra = sorted(state.keys() - params.keys())
        raise ValueError(
            f"lora: the checkpoint's adapters do not match this model's (missing {missing[:2]}, "
            f"unexpected {extra[:2]}); resume with the same lora rank and target_modules"
        )
    with torch.no_grad():
        for name, p in params.items():
            if p.shape != state[name].shape:
                raise ValueError(
                    f"lora: checkpoint adapter {name!r} has shape {tuple(state[name].shape)}, "
                    f"this model's is {tuple(p.shape)}; resume with the same lora rank"
                )
            p.copy_(state[name])
