"""A name registered by one of the project's optional packages, asked for where that package is not
installed, names the package to install; the table behind it is what the packages register."""

from __future__ import annotations

import importlib

import pytest

from loongsage.core.plugins import BUILTIN_MODULE, Registry
from loongsage.core.project_packages import PROJECT_PACKAGES
from loongsage.core.types import ConfigError


def test_the_table_is_what_the_installed_packages_register():
    registry = Registry().load()  # the workspace installs every package
    registered = {
        (category, name): entry.provider.split()[0]
        for category, table in registry.tables.items()
        for name, entry in table.items()
        if not entry.provider.startswith("loongsage-core")
    }
    assert registered == PROJECT_PACKAGES


@pytest.mark.parametrize(
    ("category", "name", "path", "package"),
    [
        ("model_builder", "tiny_tool_calc", "model.builder", "loongsage-agentflow"),
        ("trainer", "megatron", "trainer.backend", "loongsage-megatron"),
        ("reward", "code_tests", "data_sources[0].reward", "loongsage-sandbox"),
        ("advantage", "grpo", "algorithm.advantage", "loongsage-algos"),
    ],
)
def test_a_miss_names_the_package_that_provides_the_name(category, name, path, package):
    registry = Registry()  # the core alone, as a `pip install loongsage-core` has it
    registry.register_module(importlib.import_module(BUILTIN_MODULE), "loongsage-core (built-in)")
    with pytest.raises(ConfigError) as exc:
        registry.entry(category, name, path)
    assert str(exc.value).endswith(f"(the {name!r} {category} is in {package}: pip install {package})"), exc.value
    assert str(exc.value).startswith(f"{path}.name: unknown {category} {name!r}; known: ")
