"""Sandbox backends, registered under the ``loongsage`` entry-point group."""

from __future__ import annotations

from loongsage.core.hookspecs import Factories, hookimpl
from loongsage.sandbox.local import LocalSandbox


@hookimpl
def loongsage_sandboxes() -> Factories:
    return {"local": LocalSandbox}
