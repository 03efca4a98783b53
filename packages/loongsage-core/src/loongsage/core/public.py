"""The core's plugin surface: the modules of ``loongsage.core`` a plugin package may import.

A plugin (any package beside the core: algorithms, engines, trainers, transports, agents,
sandboxes) builds on what is listed in :data:`PLUGIN_SURFACE` and on nothing else of the core. The
rest of the core (the controller, the workers, the loss wiring, config, placement, the rollout
service, the native engine) is free to change shape without a plugin noticing. Underscore-prefixed
names are private wherever they are defined: no plugin imports one from the core.

Each key is a module; a package stands for itself and every module under it. Its value says which
of the module's names a plugin may import: ``None`` for every public name, or the set of those names
when only a few are meant for plugins. ``tests/core/test_plugin_surface.py`` reads every module of
every plugin package and fails, naming file, line and module, on an import outside this surface.

A plugin that needs something of the core not listed here asks for it: the thing moves into a
module of the surface (or the surface names it), so that what plugins rely on is always said here.
"""

from __future__ import annotations

PLUGIN_SURFACE: dict[str, frozenset[str] | None] = {
    # what plugins implement and exchange
    "loongsage.core.contracts": None,  # one Protocol per extension point and backend kind
    "loongsage.core.types": None,  # the data that crosses them (records, trajectories, batches)
    "loongsage.core.hookspecs": None,  # the hooks a plugin module implements
    "loongsage.core.entries": None,  # registry entries made from pure functions (@entry)
    "loongsage.core.schema": frozenset({"ranged"}),  # bounds on a dataclass param
    # building blocks
    "loongsage.core.buckets": None,  # weights in flat buffers: the bucketing every transport shares
    "loongsage.core.transport": None,  # a push's commit and statistics; the ``cpu`` transport
    "loongsage.core.segments": None,  # multi-segment trajectories in a model's forward
    "loongsage.core.metrics": None,  # the metrics a step returns
    "loongsage.core.rollout.seeds": None,  # sampling seeds that follow the data stream
    "loongsage.core.concurrency": None,  # gather_all: a group's episodes, none outliving a cancel
    "loongsage.core.model_math": None,  # log-probs, entropies, the FP32 head, dtypes, rank sums, RNG state
    "loongsage.core.tinytask": None,  # tokenizer, tiny model, tasks, warm starts and the builds cache
    # a trainer backend: the trainer skeleton and the contract of the model adapter it drives; the
    # LoRA params a trainer refuses by type; the embedded teacher a teacher backend specialises
    "loongsage.core.trainer.skeleton": frozenset({"TrainerSkeleton", "check_dtype"}),
    "loongsage.core.trainer.adapter": None,
    "loongsage.core.trainer.lora": frozenset({"LoraConfig"}),
    "loongsage.core.trainer.teacher": frozenset({"EmbeddedTeacher"}),
    # single names plugins use from modules that are otherwise the core's own
    "loongsage.core.rollout.agents": frozenset({"AgentContext"}),  # what an agent's run() is given
    "loongsage.core.rewarding": frozenset({"call_reward"}),  # a wrapper reward calling the one it wraps
    "loongsage.core.plugins": frozenset({"load_registry"}),  # the registry, in a process of a plugin's own
    "loongsage.core.placement": frozenset({"free_port"}),  # a free port for a process group or a server
    "loongsage.core.validation": frozenset({"register_rule"}),  # a plugin's own check of a whole config
    "loongsage.core.engine.native": frozenset({"NativeEngine"}),  # the engine, driven in this process
    # a plugin's own runs at scale: simulated engines, faults, trainers and time, and the router that
    # puts engines behind a gateway or a service as a run does (after the rollout's own keys above,
    # which the first matching key decides)
    "loongsage.core.sim": None,
    "loongsage.core.rollout": frozenset({"EngineRouter"}),
}


def allowed(module: str, name: str | None = None) -> bool:
    """Whether a plugin may import ``module`` whole (``name`` None) or ``name`` from it; a module
    whose names are listed is imported by those names only."""
    if any(part.startswith("_") for part in module.split(".")) or (name is not None and name.startswith("_")):
        return False
    for key, names in PLUGIN_SURFACE.items():
        if module == key or module.startswith(key + "."):
            return names is None or (module == key and name in names)
    return False
