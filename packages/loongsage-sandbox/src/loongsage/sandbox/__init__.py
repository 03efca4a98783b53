"""Sandboxes for agents and rewards: the ``local`` bubblewrap backend and the pool around any backend."""

from loongsage.sandbox.limits import Limits
from loongsage.sandbox.local import LocalSandbox
from loongsage.sandbox.pool import Lease, SandboxPool

__all__ = ["Lease", "Limits", "LocalSandbox", "SandboxPool"]
