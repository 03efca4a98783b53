"""The run's Ray: its environment switch, its start (or, with ``RAY_ADDRESS`` set, joining a running
cluster) with a one-line failure, and its actors' output routed to the run's log instead of the
terminal."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Sequence
from typing import Any


def start_ray_for(cfg: Any, cpus: float | None = None) -> bool:
    """Ray for a run, unless this process is connected already: the cluster at ``RAY_ADDRESS`` when
    it is set, else a local Ray with ``placement.num_cpus`` or else the usable cores and at least
    ``cpus`` (default: what the run's bundles reserve). True when connected here (the run's end
    then disconnects; a local Ray stops with it, a cluster keeps running)."""
    import ray

    from loongsage.core.config import placement_demand

    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        if cfg.placement.num_cpus:
            logging.getLogger("loongsage").warning(
                "placement.num_cpus=%s is ignored: the run joins the Ray cluster at RAY_ADDRESS=%s, which "
                "has the resources its nodes were started with",
                cfg.placement.num_cpus,
                os.environ["RAY_ADDRESS"],
            )
        start_ray(num_cpus=None)
        return True
    need = placement_demand(cfg)[0]["CPU"] if cpus is None else cpus
    start_ray(num_cpus=cfg.placement.num_cpus or max(len(os.sched_getaffinity(0)), math.ceil(need - 1e-9)))
    return True


# what a joined cluster's workers need of the launcher's environment: the model cache and the
# project's switches, the plugin path, the Hugging Face cache and offline switches
FORWARDED = ("LOONGSAGE_", "HF_", "TRANSFORMERS_", "PYTHONPATH", "RAY_ENABLE_UV_RUN_RUNTIME_ENV")


def forwarded_environment() -> dict[str, str]:
    """The launcher's variables a joined cluster's actors get (a local Ray's inherit them all)."""
    return {k: v for k, v in os.environ.items() if k.startswith(FORWARDED)}


def cluster_resources() -> dict[str, float]:
    """What the running Ray holds in all (CPU, GPU, ...)."""
    import ray

    return dict(ray.cluster_resources())


def ray_release_steps(groups: Sequence[Any], placement: Any, started: bool) -> list[tuple[str, Callable[[], Any]]]:
    """What ends a run's use of Ray, each step named (the caller runs each on its own): kill every
    group's actors, remove the placement group and, when the run started Ray, shut it down."""
    import ray
    from ray.util.placement_group import remove_placement_group

    steps: list[tuple[str, Callable[[], Any]]] = []
    if ray.is_initialized():
        # a group kills every actor it started, an engine's replacement not yet in use included
        steps += [(f"kill the {group.role} actors", group.kill) for group in groups]
        if placement is not None:
            steps.append(("remove placement group", lambda: remove_placement_group(placement.pg)))
    if started:
        steps.append(("shut Ray down", ray.shutdown))
        steps.append(("restore Ray's printing", restore_worker_output))
    return steps


def start_ray(num_cpus: int | None) -> None:
    """Start a local Ray of ``num_cpus`` CPUs for this run, or with ``RAY_ADDRESS`` set join that
    cluster (``num_cpus`` unused: the nodes have what they were started with). Its workers' output
    (and the raylets' messages) go to the run's log rather than the terminal, which keeps the
    launcher's own lines; a Ray that does not come up is one :class:`RunError` line."""
    import ray

    from loongsage.core.failures import RunError, launched, reinstall_stop_handlers

    address = os.environ.get("RAY_ADDRESS")
    try:
        if address:
            _reachable(address)
            ray.init(
                address=address,
                runtime_env={"env_vars": forwarded_environment()},
                log_to_driver=True,
                logging_level=logging.WARNING,
            )
        else:
            ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=True, logging_level=logging.WARNING)
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        if address:
            raise RunError(
                f"could not join the Ray cluster at RAY_ADDRESS={address}: {first}; start it first (`ray start "
                "--head` on the head node, `ray start --address=HEAD:6379` on the others) or unset RAY_ADDRESS "
                "so that the run starts a Ray of its own"
            ) from exc
        if isinstance(exc, TimeoutError) or "timed out" in str(exc):
            load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
            hint = (
                f"the machine is too busy for Ray to come up in time (load average {load:.1f} on {os.cpu_count()} "
                "cores); try again when it is less busy"
            )
        else:
            hint = "see the traceback"
        raise RunError(f"Ray did not start: {first}; {hint}") from exc
    if launched():  # the launcher's run: its log files are set up to take the actors' output
        reinstall_stop_handlers()  # ray.init replaced SIGTERM's
        _route_worker_output()


def _reachable(address: str) -> None:
    """Raise ``ConnectionError`` at once when nothing listens at a ``HOST:PORT`` address (Ray itself
    retries for a minute); other forms (``auto``, ``ray://...``) are left to Ray."""
    import socket

    host, _, port = address.rpartition(":")
    if not host or "://" in address or not port.isdigit():
        return
    try:
        socket.create_connection((host, int(port)), timeout=10).close()
    except OSError as exc:
        raise ConnectionError(f"nothing answers at {address} ({exc.strerror or exc})") from exc


def _route_worker_output() -> None:
    """Send what Ray prints for the actors (their stdout and stderr, the raylet's error messages) to
    the ``loongsage.workers`` logger, which writes only to the log files. Ray prints them through
    one handler of its stream dispatcher and one function; where a Ray version has neither, its own
    printing stays."""
    try:
        from ray._private import worker as ray_worker
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
    except ImportError:
        return
    if not hasattr(dispatcher, "remove_handler") or not hasattr(ray_worker, "print_to_stdstream"):
        return
    workers = logging.getLogger("loongsage.workers")

    events = getattr(ray_worker, "filter_autoscaler_events", lambda lines: ())

    def to_log(data: dict[str, Any], ignore_prefix: bool = False) -> None:
        pid = data.get("pid")
        lines = data.get("lines", ())
        if pid == "autoscaler":  # its periodic status report every few seconds; only its events, as Ray does
            lines = list(events(lines))
        who = data.get("actor_name") or data.get("task_name") or ""
        prefix = f"({pid}) " if pid in ("raylet", "autoscaler") else f"({who} pid={pid}) "
        for line in lines:
            workers.info("%s%s", prefix, line, extra={"file_only": True})

    dispatcher.remove_handler("ray_print_logs")
    dispatcher.add_handler("ray_print_logs", to_log)  # ray.shutdown removes it
    _ray_printing.setdefault("print_to_stdstream", ray_worker.print_to_stdstream)
    ray_worker.print_to_stdstream = to_log


_ray_printing: dict[str, Any] = {}  # what _route_worker_output replaced in Ray, put back after the run


def restore_worker_output() -> None:
    if "print_to_stdstream" in _ray_printing:
        from ray._private import worker as ray_worker

        ray_worker.print_to_stdstream = _ray_printing.pop("print_to_stdstream")


def init_ray_environment() -> None:
    """Call before the first ``import ray``: Ray reads this switch at import time.

    Workers run in this very environment (same interpreter, same site-packages); Ray's `uv run` hook
    would instead try to rebuild a uv project inside every worker's working directory."""
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
