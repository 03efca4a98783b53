"""The algos plugin against the hook contracts: names, params schemas, class attributes."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import inspect
import typing
from pathlib import Path

import pluggy
import pytest

import loongsage.algos
from loongsage.algos import plugin
from loongsage.core import hookspecs

EXPECTED = {
    "loongsage_advantage_estimators": {"grpo", "rloo", "reinforce_pp", "gae"},
    "loongsage_policy_losses": {"ppo_clip", "nll", "gspo", "cispo"},
    "loongsage_corrections": {"is", "decoupled", "m2po", "opsm"},
    "loongsage_kl_estimators": {"k1", "k2", "k3", "low_var_kl", "topk_kl", "full_vocab_kl", "jsd", "topk_jsd"},
    "loongsage_rewards": {"exact_match", "math", "overlong_shaping", "format"},
    "loongsage_data_filters": {"dynamic_sampling", "status", "overlong", "length"},
}
CLASS_ATTRIBUTES = {
    "loongsage_advantage_estimators": {"needs_values": bool, "uses_token_rewards": bool},
    "loongsage_policy_losses": {"needs_old_logprobs": bool, "supported_aggregations": (tuple, type(None))},
    "loongsage_corrections": {"needs_logprobs": bool},
    "loongsage_kl_estimators": {"consumes": str},
    "loongsage_rewards": {},
    "loongsage_data_filters": {},
}


@pytest.fixture(scope="module")
def registered() -> dict[str, dict]:
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    pm.register(plugin)
    return {hook: {k: v for part in getattr(pm.hook, hook)() for k, v in part.items()} for hook in EXPECTED}


def test_names(registered) -> None:
    assert {hook: set(entries) for hook, entries in registered.items()} == EXPECTED


def test_every_hookimpl_matches_a_hookspec() -> None:
    impls = {name for name, _ in inspect.getmembers(plugin, inspect.isfunction) if name.startswith("loongsage_")}
    assert impls == set(EXPECTED) and impls <= set(hookspecs.HOOK_NAMES)


def test_factories_are_frozen_dataclasses_with_typed_defaulted_params(registered) -> None:
    for hook, entries in registered.items():
        for name, factory in entries.items():
            assert dataclasses.is_dataclass(factory) and factory.__dataclass_params__.frozen, name
            hints = typing.get_type_hints(factory)
            sig = inspect.signature(factory)
            fields = {f.name for f in dataclasses.fields(factory)}
            assert fields == set(sig.parameters), name  # fields ARE the params schema
            for f in dataclasses.fields(factory):
                assert f.name in hints and f.default is not dataclasses.MISSING, f"{name}.{f.name}"
            if hasattr(factory, "renamed_to"):  # an old name: building it names the new one (one line)
                assert factory.renamed_to in entries and factory.renamed_to != name, name
                with pytest.raises(ValueError, match=rf"'{factory.renamed_to}'"):
                    factory()
                continue
            instance = factory()
            assert callable(instance)
            with pytest.raises(dataclasses.FrozenInstanceError):
                instance.x = 1
            for attr, tp in CLASS_ATTRIBUTES[hook].items():
                assert isinstance(getattr(factory, attr), tp), f"{name}.{attr}"
                assert attr not in fields, f"{name}.{attr} must not be a param"
            if hook == "loongsage_kl_estimators":
                assert factory.consumes in ("logprobs", "topk", "full_vocab"), name
                if factory.consumes == "topk":  # how many teacher tokens per position to fetch
                    assert isinstance(instance.k, int) and instance.k >= 1, name


def test_entry_point_and_namespace_package() -> None:
    eps = importlib.metadata.entry_points(group=hookspecs.PROJECT)
    assert {ep.name: ep.value for ep in eps}.get("algos") == "loongsage.algos.plugin"
    src = Path(loongsage.algos.__file__).resolve().parents[1]
    assert not (src / "__init__.py").exists(), "loongsage is a PEP 420 namespace package"
