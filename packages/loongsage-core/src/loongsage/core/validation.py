"""Validation of a config before any actor starts: the typed tree, its defaults, then named rules.

:func:`validate` builds the typed :class:`~loongsage.core.config.Config` from the composed
mapping (unknown, missing and mistyped keys), resolves the defaults that follow from other keys
(:func:`resolve_defaults`: a new config, nothing validated is changed afterwards), then runs
:data:`RULES` in order, then the rules plugins registered (:func:`register_rule`). A rule is a small
function ``rule(cfg, registry) -> None`` that raises :class:`~loongsage.core.types.ConfigError`
with one line naming the key path and what is allowed; the first problem stops validation.

Every plugin spec's ``params`` are checked against the plugin's own signature. Cheap entries
(algorithms, agents, rewards, readers, schedulers) are built so their own range checks run here;
engine and trainer backends, which load models, are checked against their signatures only. A rule
that needs an entry's flags builds it again rather than sharing state with another rule: they are
cheap, and each rule stays readable on its own.

How a plugin adds rules: :func:`register_rule`, called when its module is imported (a plugin
module is imported before any config is validated). Not a hook: the twelve hookspecs are the
extension points that contribute *named entries* a recipe selects, and a new hook would change
that set and every table derived from it, for something a recipe never names. Not a flag on an
entry's contract either: a rule about the whole config is no capability of one entry, and it
would run only for configs that select that entry. A registered rule sees every config validated
in the process once its module is imported, so it checks only what concerns its own entries::

    from loongsage.core.validation import register_rule

    @register_rule
    def my_service_needs_a_gateway(cfg, registry):
        names = {spec.get("name") for spec in cfg.services}
        if "my_service" in names and "gateway" not in names:
            raise ConfigError("services: my_service reaches the policy through the gateway; add {name: gateway}")

:func:`check_machine` is separate: it judges the placement against this machine, for a run that
starts Ray here (the CLI runs it; a Ray cluster has other machines).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loongsage.core.config import SUPPLIED, Config, DataSourceConfig, placement_demand, transport_for
from loongsage.core.contracts import Critic
from loongsage.core.distill import check_teacher, held_by_trainer
from loongsage.core.schema import build_dataclass
from loongsage.core.types import ConfigError, SamplingParams

Rule = Callable[[Config, Any], None]
"""``rule(cfg, registry) -> None``: raises a one-line ConfigError for a config it refuses."""

# what the framework hands every trainer and engine backend (no params of the user's)


# ----------------------------------------------------------------------------- the pipeline
def validate(raw: dict[str, Any], registry: Any) -> Config:
    """Build the typed config from ``raw``, resolve its defaults and check it; raise ConfigError
    (one line) if bad. Returns the resolved config."""
    cfg: Config = build_dataclass(Config, raw, "config")
    cfg = resolve_defaults(cfg)
    check(cfg, registry)
    return cfg


def check(cfg: Config, registry: Any) -> None:
    """Run :data:`RULES`, then the registered rules, in order; the first problem raises."""
    for rule in (*RULES, *_registered):
        rule(cfg, registry)


def resolve_defaults(cfg: Config) -> Config:
    """``cfg`` with the defaults that follow from other keys filled in (a copy; ``cfg`` is unchanged).

    * ``placement.release_engine_memory`` null: true when colocated on GPUs;
    * ``rollout.transport`` null: the transport the placement implies (:func:`~loongsage.core.config.transport_for`).
    """
    placement = cfg.placement
    if placement.release_engine_memory is None:  # colocated (hence synchronous) on GPUs
        placement = dataclasses.replace(
            placement, release_engine_memory=bool(placement.colocate and placement.gpus_per_actor > 0)
        )
    rollout = cfg.rollout
    if rollout.transport is None:
        rollout = dataclasses.replace(rollout, transport=transport_for(placement))
    return dataclasses.replace(cfg, placement=placement, rollout=rollout)


# ----------------------------------------------------------------------------- extension
_registered: list[Rule] = []


def register_rule(rule: Rule) -> Rule:
    """Add ``rule`` to the rules run after :data:`RULES` (once, however often it is registered);
    returns it, so it serves as a decorator."""
    if rule not in _registered:
        _registered.append(rule)
    return rule


# ----------------------------------------------------------------------------- the rules
def placement_fits(cfg: Config, registry: Any) -> None:
    """``placement.num_cpus`` holds the bundles (Ray would wait for them forever)."""
    need, how = placement_demand(cfg)
    num_cpus = cfg.placement.num_cpus
    if num_cpus is not None and num_cpus < need["CPU"] - 1e-9:
        raise ConfigError(
            f"placement.num_cpus={num_cpus}: the placement needs {need['CPU']:g} CPUs, {how['CPU']}; "
            f"set placement.num_cpus >= {math.ceil(need['CPU'] - 1e-9)}, lower placement.cpus_per_actor, "
            "or leave placement.num_cpus null"
        )


def data_sources_named(cfg: Config, registry: Any) -> None:
    """At least one data source, each name once."""
    if not cfg.data_sources:
        raise ConfigError("data_sources: at least one data source is required")
    names = [s.name for s in cfg.data_sources]
    if len(set(names)) != len(names):
        raise ConfigError(f"data_sources: names must be unique, got {names}")


def model_source(cfg: Config, registry: Any) -> None:
    """One starting model: an HF folder (``model.path``) or a builder that makes one."""
    if cfg.model.path is None and cfg.model.builder is None:
        raise ConfigError("model: set model.path (a local HF folder) or model.builder")
    if cfg.model.path is not None and cfg.model.builder is not None:  # composing keeps one; a dict given here may not
        raise ConfigError(
            "model: model.path and model.builder are both set; keep one (the run would start from one model)"
        )
    if cfg.model.builder is not None:
        registry.create("model_builder", cfg.model.builder, "model.builder")
    elif not (Path(cfg.model.path) / "config.json").is_file():
        raise ConfigError(f"model.path={cfg.model.path!r}: not an HF model folder (no config.json there)")


def data_source_entries(cfg: Config, registry: Any) -> None:
    """Each data source in turn, all of its checks before the next source's
    (:data:`SOURCE_CHECKS`)."""
    for i, src in enumerate(cfg.data_sources):
        for source_check in SOURCE_CHECKS:
            source_check(cfg, registry, src, f"data_sources[{i}]")


def _source_readers(cfg: Config, registry: Any, src: DataSourceConfig, path: str) -> None:
    registry.create("data_source", src.reader, f"{path}.reader")
    if src.eval_reader is not None:
        registry.create("data_source", src.eval_reader, f"{path}.eval_reader")


def _source_agents(cfg: Config, registry: Any, src: DataSourceConfig, path: str) -> None:
    """The agents, and the run services they reach."""
    services = {spec.get("name") for spec in cfg.services if isinstance(spec, dict)}
    for where, spec in (("agent", src.agent), ("eval_agent", src.eval_agent)):
        if spec is None:
            continue
        agent = registry.create("agent", spec, f"{path}.{where}")
        missing = [name for name in agent.required_services if name not in services]
        if missing:
            raise ConfigError(
                f"{path}.{where}: agent {spec['name']!r} needs the run service {missing[0]!r}; add "
                f"services: [{{name: {missing[0]}}}] (services now: {sorted(services) or 'none'})"
            )


def _source_reward(cfg: Config, registry: Any, src: DataSourceConfig, path: str) -> None:
    registry.create("reward", src.reward, f"{path}.reward")


def _source_teacher(cfg: Config, registry: Any, src: DataSourceConfig, path: str) -> None:
    """A teacher exactly when distilling."""
    if src.teacher is not None:
        check_teacher(registry, src.teacher, f"{path}.teacher", cfg.trainer.backend)
        if cfg.algorithm.distill is None:
            # refused rather than ignored: a teacher costs a model's memory and a forward per step
            raise ConfigError(
                f"{path}.teacher is set but algorithm.distill is null, so the teacher would never "
                "be called; set algorithm.distill (e.g. {pg_coef: 1.0}) or drop the teacher"
            )
    elif cfg.algorithm.distill is not None:
        raise ConfigError(
            f"{path}.teacher: algorithm.distill is set, so every data source needs a teacher and "
            f"{src.name!r} has none; add one (e.g. {{name: embedded, params: {{path: <HF folder>}}}}) "
            "or drop algorithm.distill"
        )


def _source_sampling(cfg: Config, registry: Any, src: DataSourceConfig, path: str) -> None:
    if "n" in src.sampling:
        raise ConfigError(f"{path}.sampling.n: set {path}.samples_per_prompt instead")
    sampling = build_dataclass(SamplingParams, {**src.sampling, "n": src.samples_per_prompt}, f"{path}.sampling")
    try:
        sampling.validate()
    except ValueError as exc:
        raise ConfigError(f"{path}.{exc}") from None


def _source_proportions(cfg: Config, registry: Any, src: DataSourceConfig, path: str) -> None:
    dp_mb = cfg.trainer.world_size * cfg.trainer.mini_batches_per_step
    if src.prompts_per_step % dp_mb:
        raise ConfigError(
            f"{path}.prompts_per_step={src.prompts_per_step}: must be divisible by trainer.world_size x "
            f"trainer.mini_batches_per_step = {dp_mb} so every rank and mini-batch gets exact proportions"
        )


SOURCE_CHECKS: tuple[Callable[[Config, Any, DataSourceConfig, str], None], ...] = (
    _source_readers,
    _source_agents,
    _source_reward,
    _source_teacher,
    _source_sampling,
    _source_proportions,
)
"""What :func:`data_source_entries` checks of each source, in order: ``check(cfg, registry, src, path)``."""


def teachers_placed_alike(cfg: Config, registry: Any) -> None:
    held = {held_by_trainer(src.teacher) for src in cfg.data_sources if src.teacher is not None}
    if len(held) > 1:
        raise ConfigError(
            "data_sources: some teachers are held by the trainer (name: trainer) and some run in teacher "
            "workers; one run uses one placement for all its teachers"
        )


def engine(cfg: Config, registry: Any) -> None:
    registry.check("engine", cfg.rollout.engine, "rollout.engine", skip=SUPPLIED["engine"])


def scheduler(cfg: Config, registry: Any) -> None:
    """An asynchronous scheduler generates while the trainer trains: not colocated."""
    built = registry.create("rollout_scheduler", cfg.rollout.scheduler, "rollout.scheduler")
    if built.asynchronous and cfg.placement.colocate:
        raise ConfigError(
            f"rollout.scheduler.name={cfg.rollout.scheduler['name']!r} generates while the trainer "
            "trains, so engines and trainers need separate resources: set placement.colocate=false "
            "(colocate=false), or use rollout.scheduler.name='sync'"
        )


def memory_handover(cfg: Config, registry: Any) -> None:
    """Engines and trainer hand each other a device's memory only when they share it (colocated)."""
    if cfg.placement.release_engine_memory and not cfg.placement.colocate:
        raise ConfigError(
            "placement.release_engine_memory=true: engines give their memory to a trainer on the same "
            "device, which needs placement.colocate=true; drop it for a disaggregated placement"
        )
    if cfg.placement.offload_trainer and not cfg.placement.colocate:
        raise ConfigError(
            "placement.offload_trainer=true: the trainer gives its memory to engines on the same "
            "device, which needs placement.colocate=true; drop it for a disaggregated placement"
        )


def transport(cfg: Config, registry: Any) -> None:
    """The weight transport, given or implied by the placement, is installed and its params fit."""
    spec = cfg.rollout.transport
    if spec == transport_for(cfg.placement) and spec["name"] not in registry.tables["transport"]:
        raise ConfigError(
            f"rollout.transport: placement on GPUs (colocate={cfg.placement.colocate}) uses the "
            f"{spec['name']!r} transport of loongsage-sync, which is not installed: "
            "pip install loongsage-sync, or set rollout.transport={name: cpu}"
        )
    registry.create("transport", spec, "rollout.transport")


def trainer(cfg: Config, registry: Any) -> None:
    registry.check("trainer", cfg.trainer.backend, "trainer.backend", skip=SUPPLIED["trainer"])


def consistency_modes(cfg: Config, registry: Any) -> None:
    """A mode that makes the engine's log-probs the trainer's bit for bit holds only when both sides
    compute alike: ``batch_invariant`` on one side needs it on the other, and FP8 on either side
    cannot hold it (nor the engine's ``deterministic`` mode)."""
    engine = cfg.rollout.engine.get("params") or {}
    trainer = cfg.trainer.backend.get("params") or {}
    if bool(engine.get("batch_invariant")) != bool(trainer.get("batch_invariant")):
        on, off = (
            ("rollout.engine", "trainer.backend")
            if engine.get("batch_invariant")
            else ("trainer.backend", "rollout.engine")
        )
        raise ConfigError(
            f"{on}.params.batch_invariant=true: the log-probs agree only when both sides run the invariant "
            f"path; set {off}.params.batch_invariant=true too (the native engine and the torch trainer), or drop it"
        )
    exact = [k for k in ("batch_invariant", "deterministic") if engine.get(k)]
    fp8 = [
        f"{key}.params.{name}"
        for key, params, name in (("rollout.engine", engine, "quantization"), ("trainer.backend", trainer, "fp8"))
        if params.get(name)
    ]
    if exact and fp8:
        raise ConfigError(
            f"{fp8[0]}: FP8 moves the numbers away from the other side's, which rollout.engine.params."
            f"{exact[0]}=true asks to match exactly; drop one of them"
        )


def _advantage(cfg: Config, registry: Any) -> Any:
    return registry.create("advantage", cfg.algorithm.advantage, "algorithm.advantage")


def _policy_loss(cfg: Config, registry: Any) -> Any:
    return registry.create("policy_loss", cfg.algorithm.policy_loss, "algorithm.policy_loss")


def advantage(cfg: Config, registry: Any) -> None:
    """An estimator that reads critic values needs a critic."""
    if _advantage(cfg, registry).needs_values and cfg.trainer.critic is None:
        raise ConfigError(
            f"algorithm.advantage.name={cfg.algorithm.advantage['name']!r} needs critic values, and "
            "this config trains no critic; set trainer.critic (e.g. {backend: {name: torch_critic}}) "
            "or choose an outcome estimator (e.g. grpo, rloo)"
        )


def critic(cfg: Config, registry: Any) -> None:
    """A critic gives values (the Critic contract) to an estimator that reads them."""
    if cfg.trainer.critic is None:
        return
    registry.check(
        "trainer", cfg.trainer.critic.backend, "trainer.critic.backend", skip=SUPPLIED["trainer"], contract=Critic
    )
    if not _advantage(cfg, registry).needs_values:
        raise ConfigError(
            f"trainer.critic is set but algorithm.advantage {cfg.algorithm.advantage['name']!r} "
            "does not use values; use gae or drop the critic"
        )


def group_size(cfg: Config, registry: Any) -> None:
    """Enough samples per prompt for the estimator's baseline, where the loss reads advantages."""
    policy_loss = _policy_loss(cfg, registry)
    # MOPD shapes every token's advantage with its teacher, so a group of one still learns
    if policy_loss.uses_advantages and cfg.algorithm.distill is None:
        need = _advantage(cfg, registry).min_group_size
        for i, src in enumerate(cfg.data_sources):
            if src.samples_per_prompt < need:
                raise ConfigError(
                    f"data_sources[{i}].samples_per_prompt={src.samples_per_prompt}: advantage "
                    f"{cfg.algorithm.advantage['name']!r} compares the samples of a prompt with each "
                    f"other, so it needs >= {need} (with fewer every advantage is 0 and the run trains "
                    "nothing); raise samples_per_prompt, or use an estimator with a batch baseline "
                    "(e.g. reinforce_pp)"
                )


def aggregation(cfg: Config, registry: Any) -> None:
    """The policy loss is defined for ``algorithm.aggregation``."""
    supported = _policy_loss(cfg, registry).supported_aggregations
    if supported is not None and cfg.algorithm.aggregation not in supported:
        raise ConfigError(
            f"algorithm.aggregation={cfg.algorithm.aggregation!r} is not supported by "
            f"{cfg.algorithm.policy_loss['name']!r}; allowed: {', '.join(supported)}"
        )


def reference_kl(cfg: Config, registry: Any) -> None:
    """The reference KL reads sampled-token log-probs, and its coefficient needs an estimator."""
    if cfg.algorithm.kl is not None:
        kl = registry.create("kl", cfg.algorithm.kl, "algorithm.kl")
        if kl.consumes != "logprobs":
            raise ConfigError(
                f"algorithm.kl.name={cfg.algorithm.kl['name']!r} consumes {kl.consumes!r}; the reference "
                "KL reads log-probs only (k1, k2, k3, low_var_kl); distribution divergences serve "
                "algorithm.distill.divergence"
            )
    elif cfg.algorithm.kl_coef:
        raise ConfigError("algorithm.kl_coef is set but algorithm.kl is null; name a KL estimator, e.g. {name: k3}")


def kl_in_reward(cfg: Config, registry: Any) -> None:
    """A KL put in the reward needs an estimator that reads token rewards."""
    if cfg.algorithm.kl_in_reward and not _advantage(cfg, registry).uses_token_rewards:
        raise ConfigError(
            f"algorithm.kl_in_reward=true: advantage {cfg.algorithm.advantage['name']!r} ignores token "
            "rewards, so the KL would have no effect; use an estimator that consumes them (e.g. "
            "reinforce_pp) or put the KL in the loss"
        )


def distill_divergence(cfg: Config, registry: Any) -> None:
    distill = cfg.algorithm.distill
    if distill is not None and distill.divergence is not None:
        registry.create("kl", distill.divergence, "algorithm.distill.divergence")


def corrections_and_filters(cfg: Config, registry: Any) -> None:
    for j, spec in enumerate(cfg.algorithm.corrections):
        registry.create("correction", spec, f"algorithm.corrections[{j}]")
    for j, spec in enumerate(cfg.algorithm.filters):
        registry.create("data_filter", spec, f"algorithm.filters[{j}]")


def services(cfg: Config, registry: Any) -> None:
    """Each run service known, its params fitting, listed once (agents reach each by its name)."""
    names = [spec.get("name") if isinstance(spec, dict) else None for spec in cfg.services]
    for j, spec in enumerate(cfg.services):
        registry.check("service", spec, f"services.{j}")
        if names.count(spec["name"]) > 1:
            raise ConfigError(f"services.{j}: service {spec['name']!r} is listed twice; agents reach each by its name")


def trackers(cfg: Config, registry: Any) -> None:
    from loongsage.core.tracking import check_trackers  # tracking imports this module's users, not the reverse

    check_trackers(registry, cfg.tracking.backends)


RULES: tuple[Rule, ...] = (
    placement_fits,
    data_sources_named,
    model_source,
    data_source_entries,
    teachers_placed_alike,
    engine,
    scheduler,
    memory_handover,
    transport,
    trainer,
    consistency_modes,
    advantage,
    critic,
    group_size,
    aggregation,
    reference_kl,
    kl_in_reward,
    distill_divergence,
    corrections_and_filters,
    services,
    trackers,
)
"""The built-in rules, in the order they run: a config with several problems is refused for the
first, so the order is part of what users see."""


# ----------------------------------------------------------------------------- this machine
def check_machine(cfg: Config, cores: int | None = None) -> None:
    """For a run that starts Ray on this machine: refuse a placement asking for more CPUs than the
    machine has where nothing needs it. One actor of ``placement.cpus_per_actor`` CPUs must fit on
    the machine; ``placement.num_cpus`` (what Ray is told it has) may exceed the cores only as far
    as the bundles need (several one-CPU actors on one core), never beyond. Otherwise Ray would
    take the number at its word and the run would start, oversubscribed, without a word."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    p = cfg.placement
    if p.cpus_per_actor > cores:
        raise ConfigError(
            f"placement.cpus_per_actor={p.cpus_per_actor:g}: this machine has {cores} CPU core"
            f"{'' if cores == 1 else 's'}, so one actor cannot have more; set placement.cpus_per_actor "
            f"<= {cores} (it starts Ray itself here; on a Ray cluster, start Ray there first)"
        )
    need = math.ceil(placement_demand(cfg)[0]["CPU"] - 1e-9)
    if p.num_cpus is not None and p.num_cpus > max(cores, need):
        raise ConfigError(
            f"placement.num_cpus={p.num_cpus}: this machine has {cores} CPU core{'' if cores == 1 else 's'} "
            f"and the placement needs {need}; set placement.num_cpus <= {max(cores, need)}, or leave it "
            "null (every core)"
        )
