"""Sandbox backends, registered under the ``loongsage`` entry-point group."""

from __future__ import annotations

from loongsage.core.hookspecs import Factories, hookimpl
from loongsage.sandbox.code_reward import CodeTestsReward
from loongsage.sandbox.local import LocalSandbox


@hookimpl
def loongsage_sandboxes() -> Factories:
    return {"local": LocalSandbox}


@hookimpl
def loongsage_rewards() -> Factories:
    return {"code_tests": CodeTestsReward}  # the model's code against the record's tests, in a sandbox
