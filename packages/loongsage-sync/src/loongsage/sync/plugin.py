"""The transports, registered under the ``loongsage`` entry-point group."""

from __future__ import annotations

from loongsage.core.hookspecs import Factories, hookimpl
from loongsage.sync.broadcast import BroadcastTransport
from loongsage.sync.ipc import IpcTransport


@hookimpl
def loongsage_backends() -> Factories:
    return {
        "ipc": IpcTransport,  # same GPU: buckets shared by CUDA IPC handle (colocated)
        "broadcast": BroadcastTransport,  # other GPUs or CPU: a broadcast over a private NCCL/gloo group
    }
