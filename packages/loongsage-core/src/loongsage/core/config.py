"""The config tree, how recipes are found and composed (Hydra), and validation before any actor.

A recipe is a small YAML over these defaults. ``load_config`` composes it with command-line
overrides, then ``validate`` checks every key, every plugin's ``params`` against the plugin's own
signature, and cross-field rules, raising :class:`ConfigError` with one line naming the key path
and what is allowed.
"""

from __future__ import annotations

import importlib.resources
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from loongsage.core.aggregation import AGGREGATION_MODES
from loongsage.core.distill import check_teacher
from loongsage.core.schema import build_dataclass
from loongsage.core.types import ConfigError, SamplingParams

Spec = dict[str, Any]  # {name: ..., params: {...}}

# Short forms accepted on the command line: `colocate=false`, `resume=true`.
OVERRIDE_ALIASES = {"colocate": "placement.colocate", "resume": "checkpoint.resume"}


@dataclass
class RunConfig:
    name: str = "run"
    seed: int = 0
    total_steps: int = 10
    output_dir: str = "runs"  # outputs go to <output_dir>/<name>/
    log_dir: str = "log"

    def __post_init__(self) -> None:
        if self.total_steps < 1:
            raise ValueError(f"total_steps={self.total_steps}: must be >= 1")


@dataclass
class ModelConfig:
    path: str | None = None  # local HF folder
    builder: Spec | None = None  # a model_builder backend that makes the folder offline (cached)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    fp32_lm_head: bool = True


@dataclass
class DataSourceConfig:
    name: str
    reader: Spec
    prompts_per_step: int = 8  # B_i
    samples_per_prompt: int = 8  # N_i
    agent: Spec = field(default_factory=lambda: {"name": "single_turn"})
    reward: Spec = field(default_factory=lambda: {"name": "exact_match"})
    eval_reader: Spec | None = None
    eval_agent: Spec | None = None  # agent for evaluation (default: ``agent``), e.g. a generating one for SFT
    teacher: Spec | None = None  # MOPD: {name: <teacher backend>, params: {path | builder, ...}}
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams fields except n
    on_bad_row: Literal["skip", "error"] = "skip"

    def __post_init__(self) -> None:
        if self.prompts_per_step < 1:
            raise ValueError(f"prompts_per_step={self.prompts_per_step}: must be >= 1")
        if self.samples_per_prompt < 1:
            raise ValueError(f"samples_per_prompt={self.samples_per_prompt}: must be >= 1")


@dataclass
class RolloutConfig:
    engine: Spec = field(default_factory=lambda: {"name": "native"})
    num_engines: int = 1
    scheduler: Spec = field(default_factory=lambda: {"name": "sync"})
    transport: Spec = field(default_factory=lambda: {"name": "cpu"})  # weight push trainer -> engines
    max_refill_rounds: int = 0  # extra generation rounds to replace groups that filters dropped
    refill_oversample: float = 1.0  # prompts asked per missing group in a refill round

    def __post_init__(self) -> None:
        if self.num_engines < 1:
            raise ValueError(f"num_engines={self.num_engines}: must be >= 1")
        if self.max_refill_rounds < 0:
            raise ValueError(f"max_refill_rounds={self.max_refill_rounds}: must be >= 0")
        if self.refill_oversample < 1:
            raise ValueError(f"refill_oversample={self.refill_oversample}: must be >= 1")


@dataclass
class DistillConfig:
    """MOPD: on-policy distillation, each data source from its own ``teacher``.

    PG branch: ``A_t <- A_t - pg_coef * sg(log pi_s - log pi_t)`` on every response token. GKD
    branch: ``L = (1 - gkd_coef) L_RL + gkd_coef L_GKD`` with ``divergence`` per token (a KL-estimator
    entry: k2/k3 on the sampled token, topk_kl / topk_jsd on the teacher's top-k, full_vocab_kl / jsd
    on the whole vocabulary).
    """

    pg_coef: float = 1.0
    gkd_coef: float = 0.0
    divergence: Spec | None = None

    def __post_init__(self) -> None:
        if not self.pg_coef >= 0:
            raise ValueError(f"pg_coef={self.pg_coef}: must be >= 0")
        if not 0 <= self.gkd_coef <= 1:
            raise ValueError(f"gkd_coef={self.gkd_coef}: must be in [0, 1]")
        if self.pg_coef == 0 and self.gkd_coef == 0:
            raise ValueError("pg_coef=0 and gkd_coef=0: distillation would do nothing; set either > 0 "
                             "or drop algorithm.distill")
        if self.gkd_coef > 0 and self.divergence is None:
            raise ValueError(f"divergence=null: gkd_coef={self.gkd_coef} needs one, e.g. {{name: jsd}}, "
                             "{name: topk_kl, params: {k: 16}}, {name: k3}")
        if self.gkd_coef == 0 and self.divergence is not None:
            raise ValueError("divergence: set but gkd_coef=0, so it would never be computed; set gkd_coef > 0 "
                             "or drop the divergence")


@dataclass
class AlgorithmConfig:
    advantage: Spec = field(default_factory=lambda: {"name": "grpo"})
    policy_loss: Spec = field(default_factory=lambda: {"name": "ppo_clip"})
    kl: Spec | None = None
    kl_coef: float = 0.0
    kl_in_reward: bool = False  # KL as a token reward before advantages (else a loss term)
    corrections: list[Spec] = field(default_factory=list)
    filters: list[Spec] = field(default_factory=list)
    aggregation: str = "token-mean"
    aggregation_constant: float | None = None  # C of seq-mean-token-sum-norm
    distill: DistillConfig | None = None  # MOPD; null = off (then no source may name a teacher)

    def __post_init__(self) -> None:
        if self.aggregation not in AGGREGATION_MODES:
            raise ValueError(f"aggregation={self.aggregation!r}; allowed: {', '.join(AGGREGATION_MODES)}")


@dataclass
class OptimizerConfig:
    lr: float = 1e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    warmup_steps: int = 0

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"lr={self.lr}: must be > 0")


@dataclass
class CriticConfig:
    """A value model trained beside the policy (PPO with GAE); one rank, in the trainer's bundle."""

    backend: Spec = field(default_factory=lambda: {"name": "torch_critic"})
    optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=1e-3))
    value_clip: float = 0.2

    def __post_init__(self) -> None:
        if self.value_clip <= 0:
            raise ValueError(f"value_clip={self.value_clip}: must be > 0")


@dataclass
class TrainerConfig:
    backend: Spec = field(default_factory=lambda: {"name": "torch"})
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    micro_batch_tokens: int = 8192  # token budget of one micro-batch (padded length x rows)
    mini_batches_per_step: int = 1
    world_size: int = 1  # data-parallel ranks (FSDP2; gloo on CPU)
    critic: CriticConfig | None = None

    def __post_init__(self) -> None:
        for key in ("micro_batch_tokens", "mini_batches_per_step", "world_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}={getattr(self, key)}: must be >= 1")


@dataclass
class PlacementConfig:
    colocate: bool = True
    cpus_per_actor: float = 1.0
    gpus_per_actor: float = 0.0
    num_cpus: int | None = None  # Ray's num_cpus when this run starts Ray itself
    torch_threads: int = 0  # intra-op threads per actor; 0 = every core (sync steps never overlap)


@dataclass
class TrackingConfig:
    # each a tracker name (jsonl, tensorboard, wandb) or a spec with params: {name: wandb, params: {...}}
    backends: list[str | Spec] = field(default_factory=lambda: ["jsonl", "tensorboard"])
    progress: bool = True


@dataclass
class EvaluationConfig:
    every_steps: int = 0  # 0 = only at start and end
    pass_k: int = 0  # at the first and last evaluation, also pass@k with k samples (0 = off)
    max_prompts: int = 256
    success_threshold: float = 1.0  # a response with reward >= this counts as correct


@dataclass
class CheckpointConfig:
    every_steps: int = 0  # 0 = only at the end
    resume: bool = False
    keep_last: int = 2
    export_hf: bool = True


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data_sources: list[DataSourceConfig] = field(default_factory=list)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    plugins: list[str] = field(default_factory=list)

    @property
    def run_dir(self) -> Path:
        return Path(self.run.output_dir) / self.run.name

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def sampling_for(self, source: DataSourceConfig) -> SamplingParams:
        return SamplingParams(**{**source.sampling, "n": source.samples_per_prompt})


# ----------------------------------------------------------------------------- finding recipes
def packaged_recipe_dir() -> Path:
    """Recipes shipped inside the core wheel; in an editable install, the repository's recipes/."""
    packaged = Path(str(importlib.resources.files("loongsage.core") / "recipes"))
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parents[5] / "recipes"  # src/loongsage/core -> repository root


def recipe_search_path(config_dir: str | None = None) -> list[Path]:
    dirs = [Path.cwd() / "recipes"]
    if config_dir:
        dirs.insert(0, Path(config_dir))
    dirs.append(packaged_recipe_dir())
    return dirs


def find_recipe(name: str, config_dir: str | None = None) -> Path:
    """Resolve ``tiny/grpo_arith_cpu`` (or a path to a YAML file) to a file."""
    direct = Path(name)
    if direct.suffix in (".yaml", ".yml") and direct.is_file():
        return direct.resolve()
    stem = name[:-5] if name.endswith(".yaml") else name
    searched = recipe_search_path(config_dir)
    for base in searched:
        candidate = base / f"{stem}.yaml"
        if candidate.is_file():
            return candidate.resolve()
    raise ConfigError(
        f"recipe {name!r} not found; looked in: {', '.join(str(d) for d in searched)}; "
        f"known: {', '.join(list_recipes(config_dir)) or '(none)'}"
    )


def list_recipes(config_dir: str | None = None) -> list[str]:
    names: set[str] = set()
    for base in recipe_search_path(config_dir):
        if base.is_dir():
            names.update(str(p.relative_to(base).with_suffix("")) for p in base.rglob("*.yaml"))
    return sorted(names)


# ----------------------------------------------------------------------------- compose + validate
def _expand_aliases(overrides: list[str]) -> list[str]:
    out = []
    for item in overrides:
        key, sep, value = item.partition("=")
        prefix = "".join(c for c in key if c in "+~")
        bare = key[len(prefix):]
        if sep and bare in OVERRIDE_ALIASES:
            item = f"{prefix}{OVERRIDE_ALIASES[bare]}={value}"
        out.append(f"++{item}" if sep and not prefix else item)  # set or add; validate() names unknown keys
    return out


def compose(recipe: Path, overrides: list[str]) -> dict[str, Any]:
    """Compose ``recipe`` with Hydra overrides into a plain dict (no validation yet)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        with initialize_config_dir(config_dir=str(recipe.parent), version_base=None):
            cfg = hydra_compose(config_name=recipe.stem, overrides=_expand_aliases(overrides))
        return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    except (HydraException, OmegaConfBaseException) as exc:
        first = str(exc).strip().splitlines()[0]
        raise ConfigError(f"{recipe.name}: {first}") from None


def validate(raw: dict[str, Any], registry: Any) -> Config:
    """Build the typed config and check every plugin spec; raise ConfigError (one line) if bad.

    Cheap entries (algorithms, agents, rewards, readers, schedulers) are built once here so their
    own range checks run before anything starts; engine and trainer backends, which load models,
    are checked against their signatures only.
    """
    cfg: Config = build_dataclass(Config, raw, "config")
    if not cfg.data_sources:
        raise ConfigError("data_sources: at least one data source is required")
    names = [s.name for s in cfg.data_sources]
    if len(set(names)) != len(names):
        raise ConfigError(f"data_sources: names must be unique, got {names}")
    if cfg.model.path is None and cfg.model.builder is None:
        raise ConfigError("model: set model.path (a local HF folder) or model.builder")
    if cfg.model.builder is not None:
        registry.create("model_builder", cfg.model.builder, "model.builder")
    elif not (Path(cfg.model.path) / "config.json").is_file():
        raise ConfigError(f"model.path={cfg.model.path!r}: not an HF model folder (no config.json there)")

    for i, src in enumerate(cfg.data_sources):
        path = f"data_sources[{i}]"
        registry.create("data_source", src.reader, f"{path}.reader")
        if src.eval_reader is not None:
            registry.create("data_source", src.eval_reader, f"{path}.eval_reader")
        registry.create("agent", src.agent, f"{path}.agent")
        if src.eval_agent is not None:
            registry.create("agent", src.eval_agent, f"{path}.eval_agent")
        registry.create("reward", src.reward, f"{path}.reward")
        if src.teacher is not None:
            check_teacher(registry, src.teacher, f"{path}.teacher")
            if cfg.algorithm.distill is None:
                # refused rather than ignored: a teacher costs a model's memory and a forward per step
                raise ConfigError(f"{path}.teacher is set but algorithm.distill is null, so the teacher would never "
                                  "be called; set algorithm.distill (e.g. {pg_coef: 1.0}) or drop the teacher")
        elif cfg.algorithm.distill is not None:
            raise ConfigError(f"{path}.teacher: algorithm.distill is set, so every data source needs a teacher and "
                              f"{src.name!r} has none; add one (e.g. {{name: embedded, params: {{path: <HF folder>}}}}) "
                              "or drop algorithm.distill")
        if "n" in src.sampling:
            raise ConfigError(f"{path}.sampling.n: set {path}.samples_per_prompt instead")
        sampling = build_dataclass(SamplingParams, {**src.sampling, "n": src.samples_per_prompt}, f"{path}.sampling")
        try:
            sampling.validate()
        except ValueError as exc:
            raise ConfigError(f"{path}.{exc}") from None
        dp_mb = cfg.trainer.world_size * cfg.trainer.mini_batches_per_step
        if src.prompts_per_step % dp_mb:
            raise ConfigError(
                f"{path}.prompts_per_step={src.prompts_per_step}: must be divisible by trainer.world_size x "
                f"trainer.mini_batches_per_step = {dp_mb} so every rank and mini-batch gets exact proportions"
            )

    supplied = ("model_path", "dtype", "fp32_lm_head")
    registry.check("engine", cfg.rollout.engine, "rollout.engine", skip=(*supplied, "seed"))
    registry.create("rollout_scheduler", cfg.rollout.scheduler, "rollout.scheduler")
    registry.create("transport", cfg.rollout.transport, "rollout.transport")
    registry.check("trainer", cfg.trainer.backend, "trainer.backend", skip=supplied)
    estimator = registry.create("advantage", cfg.algorithm.advantage, "algorithm.advantage")
    if getattr(estimator, "needs_values", False) and cfg.trainer.critic is None:
        raise ConfigError(f"algorithm.advantage.name={cfg.algorithm.advantage['name']!r} needs critic values, and "
                          "this config trains no critic; set trainer.critic (e.g. {backend: {name: torch_critic}}) "
                          "or choose an outcome estimator (e.g. grpo, rloo)")
    if cfg.trainer.critic is not None:
        registry.check("trainer", cfg.trainer.critic.backend, "trainer.critic.backend", skip=supplied)
        if not getattr(estimator, "needs_values", False):
            raise ConfigError(f"trainer.critic is set but algorithm.advantage {cfg.algorithm.advantage['name']!r} "
                              "does not use values; use gae or drop the critic")
    policy_loss = registry.create("policy_loss", cfg.algorithm.policy_loss, "algorithm.policy_loss")
    supported = getattr(policy_loss, "supported_aggregations", None)
    if supported is not None and cfg.algorithm.aggregation not in supported:
        raise ConfigError(f"algorithm.aggregation={cfg.algorithm.aggregation!r} is not supported by "
                          f"{cfg.algorithm.policy_loss['name']!r}; allowed: {', '.join(supported)}")
    if cfg.algorithm.kl is not None:
        kl = registry.create("kl", cfg.algorithm.kl, "algorithm.kl")
        if getattr(kl, "consumes", "logprobs") != "logprobs":
            raise ConfigError(f"algorithm.kl.name={cfg.algorithm.kl['name']!r} consumes {kl.consumes!r}; the reference "
                              "KL reads log-probs only (k1, k2, k3, low_var_kl); distribution divergences serve "
                              "algorithm.distill.divergence")
    elif cfg.algorithm.kl_coef:
        raise ConfigError("algorithm.kl_coef is set but algorithm.kl is null; name a KL estimator, e.g. {name: k3}")
    if cfg.algorithm.kl_in_reward and not getattr(estimator, "uses_token_rewards", False):
        raise ConfigError(f"algorithm.kl_in_reward=true: advantage {cfg.algorithm.advantage['name']!r} ignores token "
                          "rewards, so the KL would have no effect; use an estimator that consumes them (e.g. "
                          "reinforce_pp) or put the KL in the loss")
    distill = cfg.algorithm.distill
    if distill is not None and distill.divergence is not None:
        registry.create("kl", distill.divergence, "algorithm.distill.divergence")
    for j, spec in enumerate(cfg.algorithm.corrections):
        registry.create("correction", spec, f"algorithm.corrections[{j}]")
    for j, spec in enumerate(cfg.algorithm.filters):
        registry.create("data_filter", spec, f"algorithm.filters[{j}]")
    from loongsage.core.tracking import check_trackers

    check_trackers(registry, cfg.tracking.backends)
    return cfg


def load_config(recipe: str, overrides: list[str] | None = None, *, config_dir: str | None = None,
                registry: Any = None) -> tuple[Config, Any]:
    """Find, compose and validate a recipe; returns the config and the plugin registry."""
    from loongsage.core.plugins import load_registry

    path = find_recipe(recipe, config_dir)
    raw = compose(path, list(overrides or []))
    plugins = raw.get("plugins") or []
    if registry is None:
        registry = load_registry(plugins if isinstance(plugins, list) else [])
    return validate(raw, registry), registry
