"""The mistakes a plugin author makes that pluggy alone registers silently, each refused in one line
naming the module (real pluggy, real registry)."""

from __future__ import annotations

import types

import pytest

from loongsage.core.plugins import Registry, load_registry
from loongsage.core.types import ConfigError


def load_error(module: str, category: str = "reward") -> str:
    with pytest.raises(ConfigError) as exc:
        load_registry([module]).names(category)  # the tables are built (and checked) on first use
    text = str(exc.value)
    assert "\n" not in text, f"error spans several lines: {text!r}"
    return text


def test_a_misspelt_hook_names_the_module_and_the_closest_hook(plugin_module) -> None:
    mod = plugin_module(
        """
        @hookimpl
        def loongsage_reward():
            return {}
        """
    )
    assert load_error(mod) == (
        f"plugins: module {mod!r}: @hookimpl loongsage_reward() is not a LoongSage hook "
        "(did you mean loongsage_rewards?), so it would never be called"
    )


def test_a_hook_name_far_from_any_lists_the_hooks(plugin_module) -> None:
    mod = plugin_module(
        """
        @hookimpl
        def my_scores():
            return {}
        """
    )
    msg = load_error(mod)
    assert msg.startswith(
        f"plugins: module {mod!r}: @hookimpl my_scores() is not a LoongSage hook (the hooks: "
        "loongsage_agents, loongsage_rewards, "
    )


@pytest.mark.parametrize(
    ("name", "hint"), [("loongsage_rewards", ""), ("loongsage_rewads", " (did you mean loongsage_rewards?)")]
)
def test_a_hook_without_hookimpl_is_refused(plugin_module, name, hint) -> None:
    mod = plugin_module(
        f"""
        @hookimpl
        def loongsage_agents():
            return {{}}

        def {name}():  # the marker forgotten
            return {{"mine": object}}
        """
    )
    assert load_error(mod) == (
        f"plugins: module {mod!r}: function {name}(){hint} is not marked @hookimpl, so it "
        "registers nothing; decorate it with @hookimpl (from loongsage.core.hookspecs import "
        "hookimpl)"
    )


def test_a_module_without_any_hookimpl_is_refused(plugin_module) -> None:
    mod = plugin_module(
        """
        def make_rewards():
            return {}
        """
    )
    msg = load_error(mod)
    assert msg.startswith(
        f"plugins: module {mod!r}: provides no @hookimpl function, so it adds nothing; a plugin "
        "module defines functions named after the hooks (loongsage_agents, "
    )


def test_helpers_and_imported_functions_are_not_mistaken_for_hooks(plugin_module) -> None:
    mod = plugin_module(
        """
        from loongsage.core.contracts import Reward
        from loongsage.core.plugins import load_registry as loongsage_registry  # another module's function

        @dataclass(frozen=True)
        class Zero(Reward):
            def __call__(self, trajectory, record):
                return 0.0

        def make_rewards():  # a helper whose name resembles a hook's
            return {"zero_mine": Zero}

        @hookimpl
        def loongsage_rewards():
            return make_rewards()
        """
    )
    assert load_registry([mod]).entry("reward", "zero_mine").provider == f"config plugins: {mod}"


def test_a_hookimpl_imported_under_another_name_is_refused_saying_so(plugin_module) -> None:
    mod = plugin_module(
        """
        from loongsage.core.builtin_plugins import loongsage_agents as core_agents

        @hookimpl
        def loongsage_rewards():
            return {}
        """
    )
    assert load_error(mod) == (
        f"plugins: module {mod!r}: @hookimpl core_agents() (imported from "
        "loongsage.core.builtin_plugins) is not a LoongSage hook (did you mean "
        "loongsage_agents?), so it would never be called"
    )


def test_a_hook_taking_arguments_is_refused_naming_the_module(plugin_module) -> None:
    mod = plugin_module(
        """
        @hookimpl
        def loongsage_rewards(config):
            return {}
        """
    )
    msg = load_error(mod)
    assert msg.startswith(f"plugins: module {mod!r}: ") and "config" in msg and "loongsage_rewards" in msg


@pytest.mark.parametrize(
    ("body", "said"),
    [
        (
            'return [("mine", Zero)]',
            "returned a list; a hook returns a mapping of entry names to factories, e.g. {'my_entry': MyClass}",
        ),
        (
            "return Zero",
            "returned a type; a hook returns a mapping of entry names to factories, e.g. {'my_entry': MyClass}",
        ),
        (
            'return {"mine": Zero()}',
            "maps 'mine' to a Zero, which is not callable; map it to the factory (a class or a "
            "function) that builds the entry",
        ),
        ("return {1: Zero}", "returned the key 1 (int); entry names are strings"),
        ('raise RuntimeError("no config file")', "raised RuntimeError: no config file"),
    ],
)
def test_what_a_hook_returns_is_checked_naming_the_plugin(plugin_module, body, said) -> None:
    mod = plugin_module(
        f"""
        class Zero:
            pass

        @hookimpl
        def loongsage_rewards():
            {body}
        """
    )
    assert load_error(mod) == f"loongsage_rewards() of config plugins: {mod} {said}"


def test_every_registered_module_is_checked_not_only_plugins_modules() -> None:
    """An entry point's module goes through the same checks (here registered as the loader does)."""
    module = types.ModuleType("someones_plugin")
    exec(
        "from loongsage.core.hookspecs import hookimpl\n\n@hookimpl\ndef loongsage_backend():\n    return {}\n",
        module.__dict__,
    )
    registry = Registry()
    with pytest.raises(ConfigError) as exc:
        registry.register_module(module, "someones-plugin 1.0 (someones_plugin)")
    assert str(exc.value) == (
        "plugin someones-plugin 1.0 (someones_plugin): @hookimpl loongsage_backend() is not a "
        "LoongSage hook (did you mean loongsage_backends?), so it would never be called"
    )
    assert not registry.pm.is_registered(module)


def test_the_installed_plugins_pass_the_checks() -> None:
    registry = load_registry()
    registry.pm.check_pending()  # pluggy's own view agrees: no hookimpl without its hook
    assert all(registry.pm.get_hookcallers(plugin) for _, plugin in registry.pm.list_name_plugin())
