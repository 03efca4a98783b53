"""The config tree, how recipes are found and composed (Hydra), and validation before any actor.

A recipe is a small YAML over these defaults. ``load_config`` composes it with command-line
overrides, then ``validate`` checks every key, every plugin's ``params`` against the plugin's own
signature, and cross-field rules, raising :class:`ConfigError` with one line naming the key path
and what is allowed.
"""

from __future__ import annotations

import importlib.resources
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from loongsage.core.aggregation import AGGREGATION_MODES
from loongsage.core.distill import check_teacher
from loongsage.core.schema import build_dataclass, ranged
from loongsage.core.types import ConfigError, SamplingParams

Spec = dict[str, Any]  # {name: ..., params: {...}}

# Short forms accepted on the command line: `colocate=false`, `resume=true`.
OVERRIDE_ALIASES = {"colocate": "placement.colocate", "resume": "checkpoint.resume"}


@dataclass
class RunConfig:
    name: str = "run"
    seed: int = ranged(0, ge=0)
    total_steps: int = ranged(10, ge=1)
    output_dir: str = "runs"  # outputs go to <output_dir>/<name>/
    log_dir: str = "log"

    def __post_init__(self) -> None:
        if self.name.strip() in ("", ".", ".."):
            raise ValueError(f"name={self.name!r}: must name a directory under run.output_dir (e.g. my_run)")


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
    prompts_per_step: int = ranged(8, ge=1)  # B_i
    samples_per_prompt: int = ranged(8, ge=1)  # N_i
    agent: Spec = field(default_factory=lambda: {"name": "single_turn"})
    reward: Spec = field(default_factory=lambda: {"name": "exact_match"})
    eval_reader: Spec | None = None
    eval_agent: Spec | None = None  # agent for evaluation (default: ``agent``), e.g. a generating one for SFT
    teacher: Spec | None = None  # MOPD: {name: <teacher backend>, params: {path | builder, ...}}
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams fields except n
    on_bad_row: Literal["skip", "error"] = "skip"


@dataclass
class RolloutConfig:
    engine: Spec = field(default_factory=lambda: {"name": "native"})
    num_engines: int = ranged(1, ge=1)
    scheduler: Spec = field(default_factory=lambda: {"name": "sync"})
    transport: Spec = field(default_factory=lambda: {"name": "cpu"})  # weight push trainer -> engines
    # extra generation rounds to replace groups that filters dropped
    max_refill_rounds: int = ranged(0, ge=0, note="0 = no refill")
    refill_oversample: float = ranged(1.0, ge=1)  # prompts asked per missing group in a refill round


@dataclass
class DistillConfig:
    """MOPD: on-policy distillation, each data source from its own ``teacher``.

    PG branch: ``A_t <- A_t - pg_coef * sg(log pi_s - log pi_t)`` on every response token. GKD
    branch: ``L = (1 - gkd_coef) L_RL + gkd_coef L_GKD`` with ``divergence`` per token (a KL-estimator
    entry: k2/k3 on the sampled token, topk_kl / topk_jsd on the teacher's top-k, full_vocab_kl / jsd
    on the whole vocabulary).
    """

    pg_coef: float = ranged(1.0, ge=0)
    gkd_coef: float = ranged(0.0, ge=0, le=1)
    divergence: Spec | None = None

    def __post_init__(self) -> None:
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
    kl_coef: float = ranged(0.0, ge=0)
    kl_in_reward: bool = False  # KL as a token reward before advantages (else a loss term)
    corrections: list[Spec] = field(default_factory=list)
    filters: list[Spec] = field(default_factory=list)
    aggregation: str = "token-mean"
    aggregation_constant: float | None = ranged(None, gt=0)  # C of seq-mean-token-sum-norm
    distill: DistillConfig | None = None  # MOPD; null = off (then no source may name a teacher)

    def __post_init__(self) -> None:
        if self.aggregation not in AGGREGATION_MODES:
            raise ValueError(f"aggregation={self.aggregation!r}; allowed: {', '.join(AGGREGATION_MODES)}")


@dataclass
class OptimizerConfig:
    lr: float = ranged(1e-4, gt=0)
    betas: list[float] = ranged(default_factory=lambda: [0.9, 0.999], ge=0, lt=1)
    eps: float = ranged(1e-8, gt=0)
    weight_decay: float = ranged(0.0, ge=0)
    grad_clip: float = ranged(1.0, gt=0, note="max gradient norm; inf = no clipping")
    warmup_steps: int = ranged(0, ge=0, note="0 = no warm-up")

    def __post_init__(self) -> None:
        if len(self.betas) != 2:
            raise ValueError(f"betas={self.betas}: must be two numbers [beta1, beta2], e.g. [0.9, 0.999]")


@dataclass
class CriticConfig:
    """A value model trained beside the policy (PPO with GAE); one rank, in the trainer's bundle."""

    backend: Spec = field(default_factory=lambda: {"name": "torch_critic"})
    optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=1e-3))
    value_clip: float = ranged(0.2, gt=0)


@dataclass
class TrainerConfig:
    backend: Spec = field(default_factory=lambda: {"name": "torch"})
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    micro_batch_tokens: int = ranged(8192, ge=1)  # token budget of one micro-batch (padded length x rows)
    mini_batches_per_step: int = ranged(1, ge=1)
    world_size: int = ranged(1, ge=1)  # data-parallel ranks (FSDP2; gloo on CPU)
    critic: CriticConfig | None = None


@dataclass
class PlacementConfig:
    colocate: bool = True
    cpus_per_actor: float = ranged(1.0, gt=0)  # CPUs of one bundle (see placement_bundles)
    gpus_per_actor: float = ranged(0.0, ge=0)
    num_cpus: int | None = ranged(None, ge=1)  # Ray's num_cpus when this run starts Ray itself (null = every core)
    # intra-op threads per actor; 0 = every core (sync steps never overlap)
    torch_threads: int = ranged(0, ge=0, note="0 = every core")


@dataclass
class TrackingConfig:
    # each a tracker name (jsonl, tensorboard, wandb) or a spec with params: {name: wandb, params: {...}}
    backends: list[str | Spec] = field(default_factory=lambda: ["jsonl", "tensorboard"])
    progress: bool = True


@dataclass
class EvaluationConfig:
    every_steps: int = ranged(0, ge=0, note="0 = only at start and end")
    # at the first and last evaluation, also pass@k with k samples (0 = off)
    pass_k: int = ranged(0, ge=0, note="0 = off")
    max_prompts: int = ranged(256, ge=1)
    success_threshold: float = 1.0  # a response with reward >= this counts as correct


@dataclass
class CheckpointConfig:
    every_steps: int = ranged(0, ge=0, note="0 = only at the end")
    resume: bool = False
    keep_last: int = ranged(2, ge=0, note="0 = keep all")
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


# ----------------------------------------------------------------------------- placement
def placement_bundles(cfg: Config) -> list[dict[str, float]]:
    """The Ray bundles a run reserves: colocated roles share bundle i, so ``max(world_size, num_engines)``
    bundles; disaggregated roles get one each, ``world_size + num_engines``; each of ``cpus_per_actor``
    CPUs (and ``gpus_per_actor`` GPUs)."""
    p = cfg.placement
    world, engines = cfg.trainer.world_size, cfg.rollout.num_engines
    count = max(world, engines) if p.colocate else world + engines
    bundle = {"CPU": p.cpus_per_actor, **({"GPU": p.gpus_per_actor} if p.gpus_per_actor else {})}
    return [dict(bundle) for _ in range(count)]


def placement_demand(cfg: Config) -> tuple[dict[str, float], dict[str, str]]:
    """The resources all bundles need together (``{"CPU": 2.0}``) and, per resource, how that number
    comes about, for messages: ``2 bundles (disaggregated: ...) x placement.cpus_per_actor=1``."""
    bundles = placement_bundles(cfg)
    need: dict[str, float] = {}
    for bundle in bundles:
        for key, amount in bundle.items():
            need[key] = need.get(key, 0.0) + amount
    world, engines = cfg.trainer.world_size, cfg.rollout.num_engines
    layout = (f"colocated: max(trainer.world_size={world}, rollout.num_engines={engines})" if cfg.placement.colocate
              else f"disaggregated: trainer.world_size={world} + rollout.num_engines={engines}")
    count = f"{len(bundles)} bundle{'' if len(bundles) == 1 else 's'} ({layout})"
    per = {"CPU": ("cpus_per_actor", cfg.placement.cpus_per_actor), "GPU": ("gpus_per_actor", cfg.placement.gpus_per_actor)}
    how = {key: f"{count} x placement.{per[key][0]}={per[key][1]:g}" for key in need}
    return need, how


def check_placement(cfg: Config) -> None:
    """Refuse a ``placement.num_cpus`` too small for the bundles (Ray would wait for them forever)."""
    need, how = placement_demand(cfg)
    num_cpus = cfg.placement.num_cpus
    if num_cpus is not None and num_cpus < need["CPU"] - 1e-9:
        raise ConfigError(f"placement.num_cpus={num_cpus}: the placement needs {need['CPU']:g} CPUs, {how['CPU']}; "
                          f"set placement.num_cpus >= {math.ceil(need['CPU'] - 1e-9)}, lower placement.cpus_per_actor, "
                          "or leave placement.num_cpus null")


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


def check_config_dir(config_dir: str | None) -> None:
    """An extra recipe directory must exist: a typo there would silently fall back to other recipes."""
    if config_dir is not None and not Path(config_dir).is_dir():
        what = "is a file, not a directory" if Path(config_dir).exists() else "no such directory"
        raise ConfigError(f"--config-dir {config_dir!r}: {what}; pass a folder of recipe YAML files")


def find_recipe(name: str, config_dir: str | None = None) -> Path:
    """Resolve ``tiny/grpo_arith_cpu`` (or a path to a YAML file) to a file."""
    check_config_dir(config_dir)
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
    check_config_dir(config_dir)
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
        bare = key.lstrip("+~")
        prefix = key[:len(key) - len(bare)]
        if not sep and not prefix.startswith("~"):
            raise ConfigError(f"override {item!r}: no '='; write key=value (e.g. run.total_steps=5), "
                              "or ~key to delete a key")
        if sep and bare in OVERRIDE_ALIASES:
            item = f"{prefix}{OVERRIDE_ALIASES[bare]}={value}"
        out.append(f"++{item}" if sep and not prefix else item)  # set or add; validate() names unknown keys
    return out


def _compose(recipe: Path, overrides: list[str]) -> dict[str, Any]:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(recipe.parent), version_base=None):
        cfg = hydra_compose(config_name=recipe.stem, overrides=overrides)
    return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]


def compose(recipe: Path, overrides: list[str]) -> dict[str, Any]:
    """Compose ``recipe`` with Hydra overrides into a plain dict (no validation yet).

    Anything that goes wrong (a YAML syntax error in the recipe, an override Hydra cannot parse or
    apply) becomes one ConfigError line naming the file and position, or the override at fault.
    """
    expanded = _expand_aliases(overrides)
    try:
        return _compose(recipe, expanded)
    except Exception as exc:  # Hydra, OmegaConf and YAML raise many types; each is explained below
        raise ConfigError(_explain_compose_error(recipe, overrides, expanded, exc)) from None


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _first_line(exc: BaseException) -> str:
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    lines = str(exc).strip().splitlines()
    first = lines[0].strip() if lines else type(exc).__name__
    if first.startswith(("Error merging override", "Error parsing override")) and exc.__cause__ is not None:
        return _first_line(exc.__cause__)
    if not isinstance(exc, (HydraException, OmegaConfBaseException)):
        first = f"{type(exc).__name__}: {first}"
    return first


def _yaml_error(recipe: Path, exc: Any) -> str:
    """``file: invalid YAML at line L, column C: problem (context at line l, column c)``."""
    mark, context, context_mark = (getattr(exc, a, None) for a in ("problem_mark", "context", "context_mark"))
    problem = getattr(exc, "problem", None) or str(exc).strip().splitlines()[0]
    name = mark.name if mark is not None and mark.name and not str(mark.name).startswith("<") else str(recipe)
    text = f"{name}: invalid YAML"
    if mark is not None:
        text += f" at line {mark.line + 1}, column {mark.column + 1}"
    text += f": {_one_line(problem)}"
    if context:
        where = f" at line {context_mark.line + 1}, column {context_mark.column + 1}" if context_mark is not None else ""
        text += f" ({_one_line(context)}{where})"
    return text


def _list_index_error(base: Any, key: str) -> str | None:
    """If ``key`` (dotted) indexes past the end of a list of ``base`` (or by a non-number), say so."""
    node, walked = base, []
    for part in key.split("."):
        if isinstance(node, list):
            where, n = ".".join(walked), len(node)
            if where == "data_sources":
                has = f"the recipe has {n} data source{'' if n == 1 else 's'}"
            else:
                has = f"{where} has {n} item{'' if n == 1 else 's'}"
            valid = ("it is empty; set the whole list instead" if n == 0 else "only index 0 exists" if n == 1
                     else f"indices 0 to {n - 1} exist")
            if not part.isdigit():
                return f"{where}.{part}: {where} is a list, indexed by number; {has}; {valid}"
            if int(part) >= n:
                return f"{where}.{part}: {has}; {valid}"
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            return None
        walked.append(part)
    return None


def _explain_compose_error(recipe: Path, overrides: list[str], expanded: list[str], exc: Exception) -> str:
    import yaml
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if isinstance(exc, yaml.YAMLError):
        return _yaml_error(recipe, exc)
    parser = OverridesParser.create()
    for given, item in zip(overrides, expanded):
        try:
            parser.parse_override(item)
        except Exception:
            return (f"override {given!r}: not valid override syntax; write key=value (quote a value with spaces "
                    "or brackets), +key=value to add a key, or ~key to delete one")
    # the recipe composes alone? then find the first override that breaks it, on what came before it
    base: Any = None
    for k in range(len(expanded) + 1):
        try:
            composed = _compose(recipe, expanded[:k])
        except Exception as inner:
            if k == 0:
                if isinstance(inner, yaml.YAMLError):
                    return _yaml_error(recipe, inner)
                if "must be a DictConfig" in str(inner):
                    kind = "list" if "ListConfig" in str(inner) else "single value"
                    return (f"{recipe}: a recipe is a mapping of config sections (run, model, data_sources, ...); "
                            f"this file holds a {kind}")
                return f"{recipe.name}: {_first_line(inner)}"
            key = expanded[k - 1].partition("=")[0].lstrip("+~")
            return _list_index_error(base, key) or f"override {overrides[k - 1]!r}: {_first_line(inner)}"
        base = composed
    return f"{recipe.name}: {_first_line(exc)}"


def validate(raw: dict[str, Any], registry: Any) -> Config:
    """Build the typed config and check every plugin spec; raise ConfigError (one line) if bad.

    Cheap entries (algorithms, agents, rewards, readers, schedulers) are built once here so their
    own range checks run before anything starts; engine and trainer backends, which load models,
    are checked against their signatures only.
    """
    cfg: Config = build_dataclass(Config, raw, "config")
    check_placement(cfg)
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
