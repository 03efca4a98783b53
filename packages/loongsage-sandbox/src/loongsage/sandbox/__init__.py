"""Sandboxes for agents and rewards: the ``local`` bubblewrap backend and the pool around any backend.

The names below load on first use: an agent program importing a light module of the package
(``loongsage.sandbox.code_agent``) starts in milliseconds, without the core and torch.
"""

import importlib

_EXPORTS = {"Limits": "limits", "LocalSandbox": "local", "Lease": "pool", "SandboxPool": "pool"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"loongsage.sandbox.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'loongsage.sandbox' has no attribute {name!r}")
