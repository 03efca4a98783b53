"""The sandbox plugin: registered under its name, held to the Sandbox contract, params validated."""

from __future__ import annotations

import pytest

from loongsage.core import plugins
from loongsage.core.types import ConfigError
from loongsage.sandbox.local import LocalSandbox


@pytest.fixture(scope="module")
def registry():
    return plugins.load_registry(["loongsage.sandbox.plugin"])


def test_local_is_registered_and_meets_the_contract(registry):
    entry = registry.entry("sandbox", "local", "sandbox")
    assert entry.factory is LocalSandbox and LocalSandbox.reusable


def test_bad_params_are_one_line(registry):
    with pytest.raises(ConfigError, match="limits.memory_mb") as err:
        registry.check("sandbox", {"name": "local", "params": {"limits": {"memory_mb": "lots"}}}, "sandbox")
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="unknown key"):
        registry.check("sandbox", {"name": "local", "params": {"cpu": 1}}, "sandbox")
