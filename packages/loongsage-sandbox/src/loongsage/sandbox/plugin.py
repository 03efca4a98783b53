"""Sandbox backends, registered under the ``loongsage`` entry-point group."""

from __future__ import annotations

from loongsage.core.hookspecs import Factories, hookimpl
from loongsage.sandbox.code_reward import CodeTestsReward
from loongsage.sandbox.code_task import CodeFnTask, TinyCodeFnModel
from loongsage.sandbox.docker_backend import DockerSandbox
from loongsage.sandbox.local import LocalSandbox
from loongsage.sandbox.service import SERVICE, SandboxService


@hookimpl
def loongsage_sandboxes() -> Factories:
    return {
        "local": LocalSandbox,  # a bubblewrap jail per exec on this machine (root)
        "docker": DockerSandbox,  # a container per sandbox on a Docker Engine API (Docker, Podman)
    }


@hookimpl
def loongsage_rewards() -> Factories:
    return {"code_tests": CodeTestsReward}  # the model's code against the record's tests, in a sandbox


@hookimpl
def loongsage_data_sources() -> Factories:
    return {"code_fn": CodeFnTask}  # write f(x) = a*x+b; its unit tests for code_tests


@hookimpl
def loongsage_backends() -> Factories:
    return {
        "tiny_code_fn": TinyCodeFnModel,  # the code_fn warm start (model_builder)
        SERVICE: SandboxService,  # the run's sandbox pool, shared by agents and rewards (service)
    }
