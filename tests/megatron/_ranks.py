"""Start the gloo ranks of a Megatron test by forking a process that has Megatron-Core loaded.

Importing Megatron-Core (with the parts of torch it pulls in: DTensor, dynamo, inductor, sympy) costs
about 10 s of CPU per process. Started with ``spawn``, every rank pays it again; forked from a process
that imported it once, none does. Forking is safe here because the parent runs torch on one thread
(:func:`one_thread`, called before it computes anything): no OpenMP pool exists to be copied
half-alive into the children. The ranks are otherwise what ``torch.multiprocessing.spawn`` makes:
``fn(rank, *args)`` in ``nprocs`` processes, an error in any one raised here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def one_thread() -> None:
    """Keep this process's torch on one thread (call it before the first tensor operation)."""
    import torch

    torch.set_num_threads(1)


def start_ranks(fn: Callable[..., None], args: tuple[Any, ...], nprocs: int) -> None:
    one_thread()
    import megatron.core  # noqa: F401 - loaded once here, inherited by every rank
    import torch.multiprocessing

    from loongsage.megatron.cpu import apply_cpu_shims
    from loongsage.megatron.trainer import MegatronTrainer  # noqa: F401

    apply_cpu_shims()
    torch.multiprocessing.start_processes(fn, args=args, nprocs=nprocs, start_method="fork")
