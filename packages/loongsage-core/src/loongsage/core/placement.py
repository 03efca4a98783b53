"""Where a run's actors go: one Ray placement group, its bundles per role, and CPU core pinning.

Colocated roles share bundle ``i`` (rank ``i`` of every role); disaggregated roles get bundles of
their own. The bundles themselves are :func:`loongsage.core.config.placement_bundles` (computed from
the config alone, so that a bad placement is refused before Ray starts).

With ``placement.gpus_per_actor`` every actor in a bundle claims an equal share of the bundle's
GPUs (``num_gpus``), the roles riding along included (the critic, the teachers): Ray then shows
each actor exactly its bundle's GPU (``CUDA_VISIBLE_DEVICES``), so colocated trainer rank ``i`` and
engine ``i`` see the same card and disaggregated roles see cards of their own.
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import time
from pathlib import Path
from typing import Any

from loongsage.core.config import Config, placement_bundles, placement_demand
from loongsage.core.types import ConfigError
from loongsage.core.worker_group import Slot


class Placement:
    """Ray placement group: colocated roles share one bundle; disaggregated roles get their own.

    The bundles (:func:`placement_bundles`) are checked against what Ray has before anything is
    reserved: more than the cluster holds is refused at once, and more than is free now is waited
    for at most ``free_wait_s`` (resources of a run that just ended come back within moments),
    each as one ConfigError line naming both numbers.
    """

    free_wait_s = 15.0

    def __init__(self, cfg: Config, riders: list[int] | None = None):
        """``riders``: the bundles of the roles that ride along with the trainer ranks (the critic,
        the teachers), one entry per actor: they take their share of the bundle's GPUs too."""
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._strategy = PlacementGroupSchedulingStrategy
        p = cfg.placement
        world, engines = cfg.trainer.world_size, cfg.rollout.num_engines
        self.colocate = p.colocate
        self._cpus_per_actor, self._gpus = p.cpus_per_actor, p.gpus_per_actor
        bundles = placement_bundles(cfg)
        # colocated, rank i of every role shares bundle i (extra engines take their own bundles);
        # disaggregated, every trainer rank and engine has a bundle of its own
        self.trainer_bundles = list(range(world))
        self.engine_bundles = list(range(engines)) if p.colocate else list(range(world, world + engines))
        roles = [0] * len(bundles)  # trainer ranks and engines per bundle: they split its CPUs
        for i in self.trainer_bundles + self.engine_bundles:
            roles[i] += 1
        self._share = {i: p.cpus_per_actor / n for i, n in enumerate(roles)}
        riding = [0] * len(bundles)  # the riders take no CPUs but a share of the GPUs, as every member
        for i in riders or []:
            riding[i] += 1
        self._gpu_share = (
            {i: p.gpus_per_actor / (n + r) for i, (n, r) in enumerate(zip(roles, riding))} if p.gpus_per_actor else {}
        )
        self._check_resources(cfg)
        self.pg = placement_group(bundles, strategy="PACK")
        try:
            ray.get(self.pg.ready(), timeout=120)
        except ray.exceptions.GetTimeoutError:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.pg)
            raise ConfigError(
                f"placement: Ray could not reserve the bundles {bundles} within 120 s; "
                f"free: {ray.available_resources()}, in all: {ray.cluster_resources()}"
            ) from None

    def _check_resources(self, cfg: Config) -> None:
        """Refuse bundles this Ray cannot hold, instead of waiting for them."""
        import ray

        need, how = placement_demand(cfg)
        total = ray.cluster_resources()
        for key, amount in need.items():
            if total.get(key, 0.0) < amount - 1e-9:
                raise ConfigError(
                    f"placement: the run needs {amount:g} {key}{'' if amount == 1 else 's'} ({how[key]}) "
                    "and this Ray cluster has "
                    f"{total.get(key, 0.0):g} in all; lower placement.cpus_per_actor / gpus_per_actor, "
                    "trainer.world_size or rollout.num_engines, or start Ray with more"
                )
        deadline = time.monotonic() + self.free_wait_s
        while True:
            free = ray.available_resources()
            short = {k: free.get(k, 0.0) for k, amount in need.items() if free.get(k, 0.0) < amount - 1e-9}
            if not short:
                return
            if time.monotonic() >= deadline:
                key, has = next(iter(short.items()))
                raise ConfigError(
                    f"placement: the run needs {need[key]:g} {key}{'' if need[key] == 1 else 's'} "
                    f"({how[key]}) "
                    "and this Ray cluster has "
                    f"{has:g} free of {total.get(key, 0.0):g} (other work holds the rest); wait for "
                    "it to finish, or lower placement.cpus_per_actor"
                )
            time.sleep(0.2)

    def cores(self) -> dict[int, list[int]]:
        """Disjoint CPU cores per bundle of a disaggregated CPU placement on one machine: bundle ``b``
        gets ``cpus_per_actor`` cores of its own, in order. Empty (no pinning) when colocated, on
        GPUs, or when the bundles need more cores than this machine has."""
        per = max(1, int(self._cpus_per_actor))
        bundles = len(self._share)
        usable = sorted(os.sched_getaffinity(0))
        if self.colocate or self._gpus or bundles * per > len(usable):
            return {}
        return {b: usable[b * per : (b + 1) * per] for b in range(bundles)}

    def options(self, bundle: int) -> dict[str, Any]:
        out = {
            "num_cpus": self._share[bundle],
            "scheduling_strategy": self._strategy(placement_group=self.pg, placement_group_bundle_index=bundle),
        }
        if bundle in self._gpu_share:
            out["num_gpus"] = self._gpu_share[bundle]
        return out

    def slot(self, bundle: int, args: tuple, *, num_cpus: float | None = None, **options: Any) -> Slot:
        """A member started in ``bundle`` with constructor ``args``: it takes its share of the bundle's
        CPUs, or ``num_cpus`` (0 for a role riding along in another's bundle), plus Ray ``options``."""
        placed = self.options(bundle)
        if num_cpus is not None:
            placed["num_cpus"] = num_cpus
        return Slot(bundle, {**placed, **options}, args)


# A port chosen here is bound seconds later by another process (a process group's store, a server).
# The kernel gives every bind to port 0 and every outgoing connection of any process a port of its
# ephemeral range, so a port taken from that range can be gone by then (EADDRINUSE at the store's
# start). Ray's workers listen on 10002-19999 unless told otherwise. Between the two only an explicit
# choice lands: the port is drawn at random from there.
EXPLICIT_PORTS_FROM = 20000
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now (for a process group's store, a server's listener), outside the
    ports the kernel hands out on its own."""
    draw = random.SystemRandom()
    window = range(EXPLICIT_PORTS_FROM, _ephemeral_start())
    for _ in range(64 if window else 0):
        port = draw.choice(window)
        with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, port))
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # no room between: any free port
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (Linux's default where it cannot be read)."""
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
