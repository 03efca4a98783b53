"""The config tree and how a recipe becomes one.

A recipe is a small YAML over the defaults of these dataclasses. ``load_config`` finds it, composes
it with command-line overrides (:mod:`loongsage.core.compose`) and hands the result to
:func:`loongsage.core.validation.validate`, which builds the typed tree, resolves the defaults that
follow from other keys and checks every key, every plugin's ``params`` and the cross-field rules,
raising :class:`ConfigError` with one line naming the key path and what is allowed. What the tree
implies for placement (the Ray bundles, the weight transport) is computed here too.
"""

from __future__ import annotations

import importlib.resources
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from loongsage.core.aggregation import AGGREGATION_MODES
from loongsage.core.compose import compose
from loongsage.core.schema import ranged
from loongsage.core.types import ConfigError, SamplingParams

SUPPLIED: dict[str, tuple[str, ...]] = {
    "trainer": ("model_path", "dtype", "fp32_lm_head"),
    "engine": ("model_path", "dtype", "fp32_lm_head", "seed"),
    "teacher": ("model_path",),
}
"""What the framework passes a backend's factory itself, by kind: never a recipe's param."""

Spec = dict[str, Any]  # {name: ..., params: {...}}


@dataclass
class RunConfig:
    name: str = "run"  # the run's folder under output_dir, and its name in the trackers
    seed: int = ranged(0, ge=0)  # seeds the trainer ranks, the engines' sampling and the data order
    total_steps: int = ranged(10, ge=1)  # optimizer steps of the whole run (a resumed run counts on)
    output_dir: str = "runs"  # outputs go to <output_dir>/<name>/
    log_dir: str = "log"  # the launcher's log, one trainer_<timestamp>.log per launch
    # steps (as metrics.jsonl numbers them) whose work every actor records with torch.profiler, to
    # <profile_dir>/step<N>.<role>.<rank>.trace.json.gz (loongsage.core.profiling)
    profile_steps: list[int] = ranged(default_factory=list, ge=1, note="the first step is 1")
    profile_dir: str | None = None  # where the profile traces go; null = <output_dir>/<name>/profile

    def __post_init__(self) -> None:
        if self.name.strip() in ("", ".", ".."):
            raise ValueError(f"name={self.name!r}: must name a directory under run.output_dir (e.g. my_run)")
        late = [s for s in self.profile_steps if s > self.total_steps]
        if late:
            raise ValueError(
                f"profile_steps={self.profile_steps}: step {late[0]} is past run.total_steps={self.total_steps}, "
                f"so it would never be profiled; list steps from 1 to {self.total_steps}"
            )


@dataclass
class ModelConfig:
    path: str | None = None  # local HF folder
    builder: Spec | None = None  # a model_builder backend that makes the folder offline (cached)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # the policy's weights in trainer and engines
    fp32_lm_head: bool = True  # the LM head (and so every log-prob) in float32 under a bf16/fp16 dtype


@dataclass
class DataSourceConfig:
    name: str  # unique among the sources; names the source in metrics, checkpoints and batches.jsonl
    # the training prompts, a data_source entry: e.g. a file's rows, {name: file, params: {path: train.jsonl,
    # prompt_key: prompt, label_key: label}}
    reader: Spec
    prompts_per_step: int = ranged(8, ge=1)  # B_i: prompts this source adds to every step's batch
    samples_per_prompt: int = ranged(8, ge=1)  # N_i: responses generated per prompt (the group size)
    agent: Spec = field(default_factory=lambda: {"name": "single_turn"})  # an agent entry: a record -> its group
    reward: Spec = field(default_factory=lambda: {"name": "exact_match"})  # a reward entry scoring each trajectory
    eval_reader: Spec | None = None  # held-out prompts (a data_source entry) for evaluation; null = not evaluated
    eval_agent: Spec | None = None  # agent for evaluation (default: ``agent``), e.g. a generating one for SFT
    teacher: Spec | None = None  # MOPD: {name: <teacher backend>, params: {path | builder, ...}}
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams fields except n
    # a malformed row of the reader or the eval_reader: skipped (logged; the next row takes its
    # place) or the run stops
    on_bad_row: Literal["skip", "error"] = "skip"


@dataclass
class RolloutConfig:
    engine: Spec = field(default_factory=lambda: {"name": "native"})  # the generation engine (an engine backend)
    num_engines: int = ranged(1, ge=1)  # engine replicas, each an actor of its own
    # when groups are generated against training (a rollout_scheduler entry): sync, or asynchronous
    scheduler: Spec = field(default_factory=lambda: {"name": "sync"})
    # the weight push trainer -> engines (docs/weight_sync.md); null: by placement, `cpu` without
    # GPUs, on GPUs `ipc` colocated and `broadcast` disaggregated (both from loongsage-sync)
    transport: Spec | None = None
    # extra generation rounds to replace groups that filters dropped
    max_refill_rounds: int = ranged(0, ge=0, note="0 = no refill")
    refill_oversample: float = ranged(1.0, ge=1)  # prompts asked per missing group in a refill round
    # partial rollout (asynchronous schedulers): tokens generated by an older policy version than a
    # trajectory's newest leave the loss
    mask_old_tokens: bool = False
    # engine failover: a call that fails, or stays silent this long, is followed by a health probe
    # bounded by the same time; an engine that died or does not answer is replaced in its bundle
    engine_health_timeout_s: float = ranged(30.0, gt=0)
    # engines replaced in a run before a lost one fails it
    max_engine_restarts: int = ranged(3, ge=0, note="replacements per run; 0 = a lost engine fails the run")


@dataclass
class DistillConfig:
    """MOPD: on-policy distillation, each data source from its own ``teacher``.

    PG branch: ``A_t <- A_t - pg_coef * sg(log pi_s - log pi_t)`` on every response token. GKD
    branch: ``L = (1 - gkd_coef) L_RL + gkd_coef L_GKD`` with ``divergence`` per token (a KL-estimator
    entry: k2/k3 on the sampled token, topk_kl / topk_jsd on the teacher's top-k, full_vocab_kl / jsd
    on the whole vocabulary).
    """

    pg_coef: float = ranged(1.0, ge=0)  # PG branch: weight of the teacher's log-ratio in every token's advantage
    gkd_coef: float = ranged(0.0, ge=0, le=1)  # GKD branch: share of the divergence loss in the total loss
    divergence: Spec | None = None  # GKD branch: the per-token divergence to the teacher (a kl entry)

    def __post_init__(self) -> None:
        if self.pg_coef == 0 and self.gkd_coef == 0:
            raise ValueError(
                "pg_coef=0 and gkd_coef=0: distillation would do nothing; set either > 0 or drop algorithm.distill"
            )
        if self.gkd_coef > 0 and self.divergence is None:
            raise ValueError(
                f"divergence=null: gkd_coef={self.gkd_coef} needs one, e.g. {{name: jsd}}, "
                "{name: topk_kl, params: {k: 16}}, {name: k3}"
            )
        if self.gkd_coef == 0 and self.divergence is not None:
            raise ValueError(
                "divergence: set but gkd_coef=0, so it would never be computed; set gkd_coef > 0 or drop the divergence"
            )


@dataclass
class AlgorithmConfig:
    advantage: Spec = field(default_factory=lambda: {"name": "grpo"})  # the advantage estimator entry
    policy_loss: Spec = field(default_factory=lambda: {"name": "ppo_clip"})  # the per-token policy loss entry
    kl: Spec | None = None  # the KL estimator to the reference policy (a kl entry); null = no KL term
    kl_coef: float = ranged(0.0, ge=0)  # weight of the KL term (needs kl)
    kl_in_reward: bool = False  # KL as a token reward before advantages (else a loss term)
    corrections: list[Spec] = field(default_factory=list)  # train-inference corrections (correction entries)
    filters: list[Spec] = field(default_factory=list)  # data filters dropping groups before training
    # how per-token losses become one scalar: token-mean, seq-mean-token-mean, seq-mean-token-sum,
    # seq-mean-token-sum-norm (loongsage.core.aggregation)
    aggregation: str = "token-mean"
    aggregation_constant: float | None = ranged(None, gt=0)  # C of seq-mean-token-sum-norm
    distill: DistillConfig | None = None  # MOPD; null = off (then no source may name a teacher)

    def __post_init__(self) -> None:
        if self.aggregation not in AGGREGATION_MODES:
            raise ValueError(f"aggregation={self.aggregation!r}; allowed: {', '.join(AGGREGATION_MODES)}")


@dataclass
class OptimizerConfig:
    lr: float = ranged(1e-4, gt=0)  # AdamW's peak learning rate
    betas: list[float] = ranged(default_factory=lambda: [0.9, 0.999], ge=0, lt=1)  # AdamW's [beta1, beta2]
    eps: float = ranged(1e-8, gt=0)  # AdamW's epsilon
    weight_decay: float = ranged(0.0, ge=0)  # AdamW's decoupled weight decay
    grad_clip: float = ranged(1.0, gt=0, note="max gradient norm; inf = no clipping")  # gradient-norm clipping
    warmup_steps: int = ranged(0, ge=0, note="0 = no warm-up")  # steps of linear learning-rate warm-up

    def __post_init__(self) -> None:
        if len(self.betas) != 2:
            raise ValueError(f"betas={self.betas}: must be two numbers [beta1, beta2], e.g. [0.9, 0.999]")


@dataclass
class CriticConfig:
    """A value model trained beside the policy (PPO with GAE); one rank, in the trainer's bundle."""

    backend: Spec = field(default_factory=lambda: {"name": "torch_critic"})  # a trainer backend that has values
    optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=1e-3))  # the critic's own AdamW
    value_clip: float = ranged(0.2, gt=0)  # clip range of the value loss around the old values


@dataclass
class TrainerConfig:
    backend: Spec = field(default_factory=lambda: {"name": "torch"})  # the policy's trainer backend
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)  # the policy's AdamW
    micro_batch_tokens: int = ranged(8192, ge=1)  # token budget of one micro-batch (padded length x rows)
    mini_batches_per_step: int = ranged(1, ge=1)  # optimizer updates per step, each on its share of the batch
    world_size: int = ranged(1, ge=1)  # data-parallel ranks (FSDP2; gloo on CPU)
    critic: CriticConfig | None = None  # a value model (PPO with GAE); null = none


@dataclass
class PlacementConfig:
    colocate: bool = True  # trainer ranks and engines share bundles (else each gets its own)
    cpus_per_actor: float = ranged(1.0, gt=0)  # CPUs of one bundle (see placement_bundles)
    gpus_per_actor: float = ranged(0.0, ge=0)  # GPUs of one bundle; 0 = a CPU run
    # colocated: the engines free their KV cache (and move their weights off the accelerator) while
    # the trainer trains, and take them back before the weight push; null: when colocated on GPUs
    release_engine_memory: bool | None = None
    # colocated: the trainer moves its optimizer state, float32 masters and weights to host memory while
    # the engines generate, and takes them back to train (for models whose trainer state and engine do
    # not fit on a card together)
    offload_trainer: bool = False
    # Ray's num_cpus when this run starts Ray itself (null = every core; unused when it joins RAY_ADDRESS)
    num_cpus: int | None = ranged(None, ge=1)
    # intra-op threads per actor; 0 = every core (sync steps never overlap)
    torch_threads: int = ranged(0, ge=0, note="0 = every core")


@dataclass
class TrackingConfig:
    # each a tracker name (jsonl, tensorboard, wandb) or a spec with params: {name: wandb, params: {...}}
    backends: list[str | Spec] = field(default_factory=lambda: ["jsonl", "tensorboard"])
    progress: bool = True  # a progress bar of the steps on the terminal
    # <run_dir>/batches.jsonl: every trained group with its source, record, staleness, rank and
    # mini-batch (an audit of proportions and staleness)
    batches: bool = False


@dataclass
class EvaluationConfig:
    every_steps: int = ranged(0, ge=0, note="0 = only at start and end")  # held-out evaluation interval
    # at the first and last evaluation, also pass@k with k samples (0 = off)
    pass_k: int = ranged(0, ge=0, note="0 = off")
    max_prompts: int = ranged(256, ge=1)  # the first rows of each eval_reader that are evaluated
    success_threshold: float = 1.0  # a response with reward >= this counts as correct


@dataclass
class CheckpointConfig:
    every_steps: int = ranged(0, ge=0, note="0 = only at the end")  # checkpoint interval in steps
    resume: bool = False  # continue from the run folder's latest checkpoint (short form: resume=true)
    keep_last: int = ranged(2, ge=0, note="0 = keep all")  # checkpoints kept, the newest
    export_hf: bool = True  # write the trained policy as an HF folder to <run_dir>/final/ at the end


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)  # the run's name, seed, length and output folders
    model: ModelConfig = field(default_factory=ModelConfig)  # the policy model: an HF folder, or a builder of one
    # the tasks trained on, mixed with exact per-source proportions in every batch
    data_sources: list[DataSourceConfig] = field(default_factory=list)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)  # generation: engines, scheduler, weight push
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)  # advantages, loss, KL, corrections
    trainer: TrainerConfig = field(default_factory=TrainerConfig)  # the policy's trainer backend and optimizer
    placement: PlacementConfig = field(default_factory=PlacementConfig)  # how roles share Ray bundles and devices
    tracking: TrackingConfig = field(default_factory=TrackingConfig)  # where metrics go
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)  # held-out evaluation
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)  # saving and resuming
    # run-scoped services agents reach, started in order with the run (the chat gateway:
    # {name: gateway, params: {...}}); see loongsage.core.services
    services: list[Spec] = field(default_factory=list)
    # plugin modules to import, by name: installed, beside the recipe or in the working directory
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


def transport_for(placement: PlacementConfig) -> dict[str, Any]:
    """The weight transport a placement implies: ``cpu`` without GPUs; on GPUs ``ipc`` when every
    engine shares its trainer's card (colocated), else ``broadcast`` (NCCL)."""
    if not placement.gpus_per_actor:
        return {"name": "cpu"}
    return {"name": "ipc" if placement.colocate else "broadcast"}


def placement_demand(cfg: Config) -> tuple[dict[str, float], dict[str, str]]:
    """The resources all bundles need together (``{"CPU": 2.0}``) and, per resource, how that number
    comes about, for messages: ``2 bundles (disaggregated: ...) x placement.cpus_per_actor=1``."""
    bundles = placement_bundles(cfg)
    need: dict[str, float] = {}
    for bundle in bundles:
        for key, amount in bundle.items():
            need[key] = need.get(key, 0.0) + amount
    world, engines = cfg.trainer.world_size, cfg.rollout.num_engines
    layout = (
        f"colocated: max(trainer.world_size={world}, rollout.num_engines={engines})"
        if cfg.placement.colocate
        else f"disaggregated: trainer.world_size={world} + rollout.num_engines={engines}"
    )
    count = f"{len(bundles)} bundle{'' if len(bundles) == 1 else 's'} ({layout})"
    per = {
        "CPU": ("cpus_per_actor", cfg.placement.cpus_per_actor),
        "GPU": ("gpus_per_actor", cfg.placement.gpus_per_actor),
    }
    how = {key: f"{count} x placement.{per[key][0]}={per[key][1]:g}" for key in need}
    return need, how


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


# ----------------------------------------------------------------------------- loading
def load_config(
    recipe: str, overrides: list[str] | None = None, *, config_dir: str | None = None, registry: Any = None
) -> tuple[Config, Any]:
    """Find, compose and validate a recipe (:func:`loongsage.core.validation.validate`); returns the
    config, its defaults resolved, and the plugin registry."""
    from loongsage.core.plugins import load_registry
    from loongsage.core.validation import validate

    path = find_recipe(recipe, config_dir)
    raw = compose(path, list(overrides or []), search_dirs=recipe_search_path(config_dir))
    plugins = raw.get("plugins") or []
    if registry is None:  # a plugins: module may sit beside the recipe or in the working directory
        registry = load_registry(plugins if isinstance(plugins, list) else [], search_dirs=(path.parent, Path.cwd()))
    return validate(raw, registry), registry
