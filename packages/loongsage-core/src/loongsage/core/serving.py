"""``loongsage serve``: a policy for agents outside a training run.

The target is a recipe (its model, engine and run services) or an HF model folder (the default
``native`` engine over it). Serving starts the engine replicas as Ray actors (no trainer, no
reward worker), the engine router over them, and the run services with a :class:`Serving` in their
context; the chat gateway is added when the recipe lists none. The core reaches the gateway by its
service name only: the ``gateway`` service of ``loongsage-agentflow`` opens sessions, prints where
clients point and records every session's tokens (see that package's ``serve`` module). It serves
until SIGINT or SIGTERM, then stops the services (which flush what they recorded) and the actors.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import signal
import socket
import tempfile
from pathlib import Path
from typing import Any

from loongsage.core.config import SUPPLIED, Config, find_recipe
from loongsage.core.services import RunServices, ServiceContext, Serving
from loongsage.core.types import ConfigError

log = logging.getLogger("loongsage")

GATEWAY = "gateway"
# the model's own chat template: served outside a recipe's training, it is the one the model knows
DEFAULT_GATEWAY = {"name": GATEWAY, "params": {"chat_template": "tokenizer"}}


def load_serve_config(target: str | None, overrides: list[str], *, config_dir: str | None = None) -> tuple[Config, Any]:
    """The config ``loongsage serve <target> [key=value ...]`` serves, and its plugin registry.

    Only what serving uses is checked (model, engine, placement, services): a recipe's data
    sources and training settings are not needed to serve its policy.
    """
    from loongsage.core.compose import compose
    from loongsage.core.plugins import load_registry
    from loongsage.core.schema import build_dataclass

    usage = "usage: loongsage serve <recipe | HF model folder> [key=value ...] [--port N] [--record DIR]"
    if target is None:
        raise ConfigError(f"serve: no recipe or model given; {usage}; `loongsage recipes` lists the recipes")
    folder = Path(target)
    if "=" in target and not folder.exists():
        raise ConfigError(f"serve: the recipe or model comes first, got the override {target!r}; {usage}")
    if folder.is_dir():
        if not (folder / "config.json").is_file():
            raise ConfigError(
                f"serve: {target!r} is a folder without config.json; pass a recipe (e.g. "
                "tiny/grpo_arith_cpu) or an HF model folder"
            )
        with tempfile.TemporaryDirectory() as tmp:  # a one-key recipe, so overrides compose as on a recipe
            recipe = Path(tmp) / "model.yaml"
            recipe.write_text(
                f"run: {{name: {_quoted(folder.resolve().name)}}}\nmodel: {{path: {_quoted(str(folder.resolve()))}}}\n"
            )
            raw = compose(recipe, overrides)
    else:
        raw = compose(find_recipe(target, config_dir), overrides)
    plugins = raw.get("plugins") or []
    registry = load_registry(plugins if isinstance(plugins, list) else [])
    cfg: Config = build_dataclass(Config, raw, "config")
    if cfg.model.path is None and cfg.model.builder is None:
        raise ConfigError("model: set model.path (a local HF folder) or model.builder")
    if cfg.model.builder is not None:
        registry.create("model_builder", cfg.model.builder, "model.builder")
    elif not (Path(cfg.model.path) / "config.json").is_file():
        raise ConfigError(f"model.path={cfg.model.path!r}: not an HF model folder (no config.json there)")
    registry.check("engine", cfg.rollout.engine, "rollout.engine", skip=SUPPLIED["engine"])
    # serving pushes no weights; the cpu transport's receiver needs no GPU package and is always there
    cfg.rollout.transport = {"name": "cpu"}
    names = [spec.get("name") if isinstance(spec, dict) else None for spec in cfg.services]
    if GATEWAY not in names:
        if GATEWAY not in registry.tables["service"]:
            raise ConfigError(
                f"serve: no provider of the run service {GATEWAY!r} is installed; pip install "
                f"loongsage-agentflow (services installed: {registry.names('service') or 'none'})"
            )
        cfg.services.append(dict(DEFAULT_GATEWAY))
        names.append(GATEWAY)
    for j, spec in enumerate(cfg.services):
        registry.check("service", spec, f"services.{j}")
        if names.count(spec["name"]) > 1:
            raise ConfigError(f"services.{j}: service {spec['name']!r} is listed twice; agents reach each by its name")
    return cfg, registry


def _port_error(port: int, exc: OSError) -> str:
    what = (
        "already in use on this machine" if exc.errno == errno.EADDRINUSE else f"cannot listen: {exc.strerror or exc}"
    )
    return f"--port {port}: {what}; choose another, or leave --port out for a free one"


def _quoted(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"  # a YAML single-quoted scalar


def serve(cfg: Config, registry: Any, *, record_dir: Path, port: int = 0, host: str | None = None) -> str:
    """Serve until SIGINT or SIGTERM; returns the line to end with (what the services recorded).

    Prints the services' lines (where clients point) once they started, flushed, on stdout.
    """
    from loongsage.core.controller import resolve_model_path
    from loongsage.core.ray_runtime import cluster_resources, init_ray_environment, ray_release_steps, start_ray_for

    init_ray_environment()
    from transformers import AutoTokenizer

    from loongsage.core.worker_group import Slot, WorkerGroup, wait_ready
    from loongsage.core.workers import EngineWorker

    # a SIGTERM during start-up stops it as Ctrl-C does (the cleanup below runs either way)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    started_ray, engines, summary = False, None, "stopped before serving"
    try:
        model_path = resolve_model_path(cfg, registry)
        log.info("serving %s", model_path)
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        p, count = cfg.placement, cfg.rollout.num_engines
        need = {"CPU": count * p.cpus_per_actor, **({"GPU": count * p.gpus_per_actor} if p.gpus_per_actor else {})}
        if start_ray_for(cfg, cpus=need["CPU"]):
            started_ray = True
            # ray.init puts its own SIGTERM handler in (it ends the process from inside whatever runs)
            signal.signal(signal.SIGTERM, signal.default_int_handler)
        total = cluster_resources()
        for key, amount in need.items():
            if total.get(key, 0.0) < amount - 1e-9:
                raise ConfigError(
                    f"serve: {count} engine{'s' if count > 1 else ''} need {amount:g} {key} "
                    f"(rollout.num_engines x placement.{key.lower()}s_per_actor) and this Ray has "
                    f"{total.get(key, 0.0):g}; lower rollout.num_engines or the per-actor resources"
                )
        options = {
            "num_cpus": p.cpus_per_actor,
            "max_concurrency": 1000,
            **({"num_gpus": p.gpus_per_actor} if p.gpus_per_actor else {}),
        }
        engines = WorkerGroup.start(
            "engine",
            EngineWorker,
            [Slot(None, options, (cfg, model_path, i, p.torch_threads, None)) for i in range(count)],
            ready="version",
        )
        wait_ready([engines])
        summary = asyncio.run(
            _serve(
                cfg,
                registry,
                engines.actors,
                tokenizer,
                model_path,
                Serving(record_dir=Path(record_dir), port=int(port), host=host),
            )
        )
    except KeyboardInterrupt:
        pass  # a signal during start-up: the summary says so
    finally:
        # one more Ctrl-C must not cut the cleanup short (it is quick; a kill -9 is reaped by the
        # launcher's watchdog)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        steps = ray_release_steps([engines] if engines is not None else [], None, started_ray)
        for what, release in steps:
            try:
                release()
            except Exception as exc:  # noqa: BLE001 - logged; serving's own outcome is what counts
                log.warning("cleanup: could not %s: %s: %s", what, type(exc).__name__, exc)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL if sig == signal.SIGTERM else signal.default_int_handler)
    return summary


async def _serve(
    cfg: Config, registry: Any, engines: list[Any], tokenizer: Any, model_path: str, serving: Serving
) -> str:
    """The services over the engine router until a signal; returns the line to end with."""
    from loongsage.core.rollout import EngineRouter

    loop, stop, got = asyncio.get_running_loop(), asyncio.Event(), []
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda s=sig: (got.append(s.name), stop.set()))
    router = EngineRouter(engines, health_timeout_s=cfg.rollout.engine_health_timeout_s)
    services = RunServices(cfg.services, registry)
    try:
        try:
            await services.start(
                ServiceContext(
                    engine=router,
                    tokenizer=tokenizer,
                    model_path=model_path,
                    run_dir=cfg.run_dir.resolve(),
                    registry=registry,
                    seed=cfg.run.seed,
                    serving=serving,
                )
            )
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            raise ConfigError(_port_error(serving.port, exc)) from None
        for line in serving.lines:
            print(line, flush=True)
        await stop.wait()
    finally:
        await services.stop()
    return f"stopped by {got[0]}" + "".join(f"; {s}" for s in serving.summary)


def prepare(cfg: Config, record: str | None, port: int, host: str | None = None) -> Path:
    """Check ``--port`` and create the record folder (``--record``, default ``<run_dir>/served``) and
    the log folder, before anything starts; returns the record folder."""
    if not 0 <= port <= 65535:
        raise ConfigError(f"--port {port}: must be in 0..65535 (0: a free port)")
    if port:  # a port in use is said now, not after the engines started (the gateway checks again)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host or "127.0.0.1", port))
            except OSError as exc:
                raise ConfigError(_port_error(port, exc)) from None
    record_dir = Path(record) if record else cfg.run_dir / "served"
    for key, path in (("--record" if record else "run.output_dir", record_dir), ("run.log_dir", Path(cfg.run.log_dir))):
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"{key}: cannot create the directory {str(path)!r}: {exc.strerror or exc}") from None
    return record_dir
