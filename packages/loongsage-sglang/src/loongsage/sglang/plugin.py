"""The SGLang engine, registered under the ``loongsage`` entry-point group."""

from __future__ import annotations

from loongsage.core.hookspecs import Factories, hookimpl
from loongsage.sglang.engine import SGLangEngine


@hookimpl
def loongsage_backends() -> Factories:
    return {"sglang": SGLangEngine}  # one SGLang server per engine replica
