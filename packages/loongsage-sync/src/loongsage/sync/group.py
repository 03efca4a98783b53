"""The process group of a weight push, formed the way SGLang's servers form theirs.

Rank 0 is the sender (trainer rank 0); it hosts a ``TCPStore`` at ``host:port`` and every other
rank joins it through a ``tcp://`` rendezvous. The store is prefixed with the group's name and the
group made with torch's own group helper, so that an SGLang server told
``/init_weights_update_group`` with the same address, name and world (its
``init_custom_process_group``) lands in the same group as the framework's own receivers. It is
not the default group (none is needed): a trainer's data-parallel group is untouched, and an
engine process can hold several over its life (one per set of engines).
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


def weight_group(*, host: str, port: int, name: str, rank: int, world: int, backend: str, timeout_s: float) -> Any:
    """Join (rank 0: host) the group ``name`` of ``world`` ranks; returns the process group."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world = next(rendezvous(f"tcp://{host}:{port}", rank, world, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(
        world,
        rank,
        [],
        Backend(backend),
        PrefixStore(name, store),
        group_name=name,
        backend_options=None,
        timeout=timeout,
    )
    _world.pg_group_ranks[group] = {i: i for i in range(world)}
    return group


def broadcast_from_sender(group: Any, flat: Tensor) -> None:
    """``flat`` from rank 0 to every rank of ``group`` (in place on the receivers)."""
    dist.broadcast(flat, src=0, group=group)


def leave(group: Any) -> None:
    """Free a group no longer used (a new set of engines formed another)."""
    try:
        dist.destroy_process_group(group)
    except (RuntimeError, ValueError):  # already gone with its peers
        pass


def cuda_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())
