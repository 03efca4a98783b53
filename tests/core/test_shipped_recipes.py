"""Every recipe in the repository's recipes/ that builds its own model (tiny/, gpu/) composes and
validates against the installed plugins (the workspace installs them all), so a renamed param or
plugin cannot leave a recipe broken. The recipes of published models need their model folders and
data files: tests/megatron/test_seed_recipes.py checks them with stand-ins."""

from __future__ import annotations

from pathlib import Path

import pytest

from loongsage.core.config import load_config

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
NAMES = sorted(
    str(p.relative_to(RECIPES).with_suffix("")) for d in ("tiny", "gpu") for p in (RECIPES / d).rglob("*.yaml")
)


def test_recipes_are_found():
    assert "tiny/grpo_arith_cpu" in NAMES and "tiny/tool_calc_cpu" in NAMES


@pytest.mark.parametrize("name", NAMES)
def test_recipe_validates(name):
    config, registry = load_config(name, config_dir=str(RECIPES))
    assert config.run.total_steps >= 1 and config.data_sources
    for source in config.data_sources:
        assert registry.entry("agent", source.agent["name"], "agent") is not None
