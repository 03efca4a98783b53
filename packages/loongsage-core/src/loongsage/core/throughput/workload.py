"""What a validated recipe asks of the hardware: the model's shape, the step's batch, the engine,
the trainer, the scheduler and the recipe's own placement. Whatever the model cannot price is
refused here in one line (a :class:`ConfigError`, as the launcher reports config errors)."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loongsage.core.sim.engine import LengthModel
from loongsage.core.throughput import constants as C
from loongsage.core.throughput.hardware import DTYPE_BYTES, trainer_kind
from loongsage.core.throughput.lengths import Lengths
from loongsage.core.throughput.phases import Batch, Source
from loongsage.core.throughput.shape import WARM_START_FIELDS, ModelShape, shape_from_hf, shape_from_warm_start
from loongsage.core.types import ConfigError

DEFAULT_PROMPT_TOKENS = 64  # when neither the reader nor --prompt-tokens says


@dataclass(frozen=True)
class Workload:
    shape: ModelShape
    model: str  # how the shape was found, for the report
    dtype: str
    batch: Batch
    lengths_note: str
    prompt_note: str
    engine: str  # the engine backend's name
    kernels: str  # a DECODE_EFFICIENCY key
    capacity: int  # rows one engine decodes at once
    engine_context: int  # tokens of cache per row the engine allocates
    engine_memory_fraction: float | None  # SGLang's mem_fraction_static: the share of the card it takes
    trainer: str  # a TRAINER_MFU key
    trainer_params: dict[str, Any]
    passes: float  # forward-pass equivalents of a training step (3: one forward and its backward)
    micro_batch_tokens: int
    asynchronous: bool
    staleness: int
    scheduler: str
    transport: str | None  # the recipe's, or None: the placement's default
    release_engine_memory: bool
    offload_trainer: bool
    recipe_gpus: float  # GPUs the recipe's placement reserves (0: a CPU run)
    colocate: bool
    gpus_per_actor: float
    world_size: int
    num_engines: int

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def shares_prompts(self) -> bool:
        """The trainer computes each group's prompt once (the torch trainer's ``share_prompts``)."""
        return bool(self.trainer_params.get("share_prompts"))


def _builder_defaults(registry: Any, name: str | None) -> dict[str, Any]:
    """The registered model builder's dataclass defaults (what a recipe's params leave out)."""
    try:
        factory = registry.entry("model_builder", name).factory
    except Exception:  # no registry, or no such builder: the recipe's params alone
        return {}
    if not dataclasses.is_dataclass(factory):
        return {}
    return {f.name: f.default for f in dataclasses.fields(factory) if f.default is not dataclasses.MISSING}


def model_shape(cfg: Any, registry: Any = None) -> tuple[ModelShape, str]:
    """The policy's shape without building it: a ``random_init`` preset, a warm-start builder's
    architecture params (its defaults from ``registry``), or the ``config.json`` of ``model.path``."""
    builder = cfg.model.builder
    if cfg.model.path:
        config = Path(cfg.model.path) / "config.json"
        if not config.is_file():
            raise ConfigError(f"model.path={cfg.model.path!r}: no config.json there, so the model's shape is unknown")
        return shape_from_hf(json.loads(config.read_text())), f"{cfg.model.path} (config.json)"
    params = dict((builder or {}).get("params") or {})
    name = (builder or {}).get("name")
    if name == "random_init":
        from loongsage.core.tinytask.shapes import PRESETS

        preset = dict(PRESETS[params.get("preset", "qwen3-1.7b")])
        if params.get("num_layers"):
            preset["num_hidden_layers"] = params["num_layers"]
        return shape_from_hf(preset), f"random_init preset {params.get('preset', 'qwen3-1.7b')}"
    arch = {**_builder_defaults(registry, name), **params}
    if set(WARM_START_FIELDS) <= set(arch):
        return shape_from_warm_start(arch), f"{name} builder"
    raise ConfigError(
        f"model.builder.name={name!r}: its model's shape is unknown to the plan; it reads random_init presets, "
        f"warm-start builders' {'/'.join(WARM_START_FIELDS)}, or model.path's config.json"
    )


def _prompt_tokens(reader: dict[str, Any], given: int | None) -> tuple[int, bool]:
    if given is not None:
        return given, True
    length = (reader.get("params") or {}).get("length")
    return (int(length), True) if isinstance(length, int) else (DEFAULT_PROMPT_TOKENS, False)


def _scheduler(spec: dict[str, Any]) -> tuple[bool, int]:
    from loongsage.core.rollout.schedulers import SCHEDULERS

    params = spec.get("params") or {}
    factory = SCHEDULERS.get(spec["name"])
    if factory is None:  # a plugin's: asynchronous, bounded by its max_staleness
        return True, int(params.get("max_staleness", 1))
    scheduler: Any = factory(**params)
    return bool(scheduler.asynchronous), int(scheduler.max_staleness)


def _passes(cfg: Any, trainer_params: dict[str, Any]) -> float:
    """A training step in forward-pass equivalents: 3 (a forward and its backward), +1 for old
    log-probs computed up front (several mini-batches, or a correction), +1 for the reference's
    log-probs (a KL term), +1 for recomputing checkpointed layers, +3 for a critic of the same shape."""
    algo, trainer = cfg.algorithm, cfg.trainer
    passes = 3.0
    passes += 1 if (trainer.mini_batches_per_step > 1 or algo.corrections) else 0
    passes += 1 if algo.kl is not None and (algo.kl_coef > 0 or algo.kl_in_reward) else 0
    passes += 1 if trainer_params.get("gradient_checkpointing") else 0
    passes += 3 if trainer.critic is not None else 0
    return passes


def workload(
    cfg: Any, *, lengths: LengthModel | None = None, prompt_tokens: int | None = None, registry: Any = None
) -> Workload:
    """The recipe ``cfg`` (validated) as a :class:`Workload`; ``lengths``: the response lengths'
    distribution (None: every sample runs to its source's max_new_tokens); ``registry``: the plugin
    registry ``load_config`` returned (a model builder's defaults)."""
    shape, model = model_shape(cfg, registry)
    sources, guessed = [], False
    for source in cfg.data_sources:
        limit = int(cfg.sampling_for(source).max_new_tokens)
        tokens, known = _prompt_tokens(source.reader, prompt_tokens)
        guessed = guessed or not known
        sources.append(Source(source.prompts_per_step, source.samples_per_prompt, tokens, Lengths(limit, lengths)))
    builder = (cfg.model.builder or {}).get("name")
    limits = ", ".join(sorted({str(s.lengths.limit) for s in sources}))
    if lengths is not None:
        lengths_note = f"log-normal, median {lengths.median:g}, p99 {lengths.p99:g}, at most max_new_tokens={limits}"
    elif builder == "random_init" and not cfg.model.path:
        lengths_note = f"every sample runs to max_new_tokens={limits}: exact (random_init's model has no end token)"
    else:
        lengths_note = (
            f"every sample runs to max_new_tokens={limits}: an upper bound; --lengths MEDIAN,P99 for a distribution"
        )
    prompt_note = ", ".join(str(s.prompt_tokens) for s in sources) + " tokens a prompt"
    if guessed:
        prompt_note += " (assumed where the reader does not say: --prompt-tokens N)"
    return Workload(
        shape=shape,
        model=model,
        dtype=cfg.model.dtype,
        batch=Batch(tuple(sources)),
        lengths_note=lengths_note,
        prompt_note=prompt_note,
        **_engine(cfg, sources),
        **_trainer(cfg),
        **_placement(cfg),
    )


def _engine(cfg: Any, sources: list[Source]) -> dict[str, Any]:
    spec = cfg.rollout.engine
    name, params = spec["name"], spec.get("params") or {}
    if name == "native":
        fused = params.get("kernels", "auto") != "torch" and cfg.model.dtype != "float32"
        kernels, capacity = ("fused" if fused else "torch"), int(params.get("max_batch_size", C.NATIVE_MAX_ROWS))
    elif name == "sglang":
        kernels, capacity = "sglang", int(params.get("max_batch_size") or C.SGLANG_MAX_ROWS)
    else:
        raise ConfigError(
            f"rollout.engine.name={name!r}: no measured decode efficiency; the model knows native and sglang"
        )
    longest = max(s.prompt_tokens + s.lengths.limit for s in sources)
    context = int(params.get("max_model_len") or longest)
    fraction = params.get("mem_fraction_static") if name == "sglang" else None
    return {
        "engine": name,
        "kernels": kernels,
        "capacity": capacity,
        "engine_context": max(context, longest),
        "engine_memory_fraction": float(fraction) if fraction else None,
    }


def _trainer(cfg: Any) -> dict[str, Any]:
    spec = cfg.trainer.backend
    params = dict(spec.get("params") or {})
    try:
        kind = trainer_kind(spec["name"], params)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return {
        "trainer": kind,
        "trainer_params": params,
        "passes": _passes(cfg, params),
        "micro_batch_tokens": cfg.trainer.micro_batch_tokens,
    }


def _placement(cfg: Any) -> dict[str, Any]:
    p = cfg.placement
    asynchronous, staleness = _scheduler(cfg.rollout.scheduler)
    world, engines = cfg.trainer.world_size, cfg.rollout.num_engines
    bundles = max(world, engines) if p.colocate else world + engines
    return {
        "asynchronous": asynchronous,
        "staleness": staleness,
        "scheduler": cfg.rollout.scheduler["name"],
        "transport": (cfg.rollout.transport or {}).get("name"),
        "release_engine_memory": bool(p.release_engine_memory),
        "offload_trainer": bool(p.offload_trainer),
        "recipe_gpus": math.ceil(bundles * p.gpus_per_actor - 1e-9) if p.gpus_per_actor else 0,
        "colocate": p.colocate,
        "gpus_per_actor": p.gpus_per_actor,
        "world_size": world,
        "num_engines": engines,
    }
