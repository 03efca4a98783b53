"""The plugin manager: load order, merged tables, refusals, params checks and ``loongsage plugins``."""

from __future__ import annotations

import re

import pytest

from loongsage.core import cli, hookspecs
from loongsage.core.hookspecs import CATEGORIES
from loongsage.core.plugins import BACKEND_KINDS, load_registry
from loongsage.core.types import ConfigError

BUILTIN = "loongsage-core (built-in)"
CORE_NAMES = {
    "agent": {"single_turn"},
    "data_source": {"arith", "file"},
    "rollout_scheduler": {"sync"},
    "trainer": {"torch"},
    "engine": {"native"},
    "transport": {"cpu"},
    "tracker": {"jsonl", "tensorboard"},
    "model_builder": {"tiny_arith"},
}
ALGOS_NAMES = {
    "advantage": {"grpo"},
    "policy_loss": {"ppo_clip", "nll"},
    "kl": {"k1", "k2", "k3", "low_var_kl"},
    "reward": {"exact_match"},
}


def one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text, f"error spans several lines: {text!r}"
    return text


# ----------------------------------------------------------------------------- loading
def test_builtins_and_entry_points_are_registered(registry) -> None:
    for category, names in {**CORE_NAMES, **ALGOS_NAMES}.items():
        assert names <= set(registry.names(category)), category
    for category, names in CORE_NAMES.items():
        for name in names:
            assert registry.entry(category, name).provider == BUILTIN, (category, name)
    for category, names in ALGOS_NAMES.items():
        for name in names:
            provider = registry.entry(category, name).provider
            assert re.fullmatch(r"loongsage-algos \S+ \(loongsage\.algos\.plugin\)", provider), provider


def test_core_entry_point_is_not_registered_twice(registry) -> None:
    """The core is both the built-in and an entry point; loading it once keeps names unique."""
    providers = [name for name, _ in registry.pm.list_name_plugin()]
    assert providers.count(BUILTIN) == 1
    assert not any(p.startswith("loongsage-core ") and p != BUILTIN for p in providers), providers
    fresh = load_registry()
    assert fresh.names("trainer") == registry.names("trainer")


def test_every_backend_lands_in_its_kind(registry) -> None:
    for kind in BACKEND_KINDS:
        for name in registry.names(kind):
            entry = registry.entry(kind, name)
            assert entry.factory.kind == kind and entry.category == kind


def test_plugins_module_is_loaded_last_and_adds_names(registry, plugin_module) -> None:
    mod = plugin_module(
        """
        from dataclasses import dataclass

        @dataclass(frozen=True)
        class KeepAll:
            min_size: int = 1
            def __call__(self, group):
                return len(group) >= self.min_size

        @hookimpl
        def loongsage_data_filters():
            return {"keep_all": KeepAll}
        """
    )
    reg = load_registry([mod])
    entry = reg.entry("data_filter", "keep_all")
    assert entry.provider == f"config plugins: {mod}"
    assert reg.names("advantage") == registry.names("advantage")  # nothing else changed
    names = [name for name, _ in reg.pm.list_name_plugin()]  # registration order
    assert names[0] == BUILTIN and names[-1] == f"config plugins: {mod}"
    assert reg.create("data_filter", {"name": "keep_all", "params": {"min_size": 2}}, "f")([1, 2])


@pytest.mark.parametrize(
    ("hook", "category", "name", "first_provider"),
    [
        ("loongsage_advantage_estimators", "advantage", "grpo", r"loongsage-algos \S+ \(loongsage\.algos\.plugin\)"),
        ("loongsage_rollout_schedulers", "rollout_scheduler", "sync", re.escape(BUILTIN)),
    ],
)
def test_duplicate_name_from_plugins_module_names_both_providers(
    plugin_module, hook, category, name, first_provider
) -> None:
    mod = plugin_module(
        f"""
        class Impostor:
            pass

        @hookimpl
        def {hook}():
            return {{"{name}": Impostor}}
        """
    )
    reg = load_registry([mod])
    with pytest.raises(ConfigError) as exc:
        reg.entry(category, name)
    msg = one_line(exc)
    # load order shows in the message: the earlier provider first, the `plugins:` module second
    pattern = rf"{category} '{name}' is provided twice: by {first_provider} and by config plugins: {re.escape(mod)};"
    assert re.search(pattern, msg), msg


def test_duplicate_within_one_kind_but_not_across_kinds(plugin_module) -> None:
    """Backend names are unique within a kind: a tracker named `torch` is fine, a trainer is not."""
    ok = plugin_module(
        """
        class TorchTracker:
            kind = "tracker"

            def log(self, step, metrics):
                pass

            def close(self):
                pass

        @hookimpl
        def loongsage_backends():
            return {"torch": TorchTracker}
        """
    )
    reg = load_registry([ok])
    assert reg.entry("tracker", "torch").provider == f"config plugins: {ok}"
    assert reg.entry("trainer", "torch").provider == BUILTIN

    bad = plugin_module(
        """
        class OtherTrainer:
            kind = "trainer"

        @hookimpl
        def loongsage_backends():
            return {"torch": OtherTrainer}
        """
    )
    with pytest.raises(ConfigError) as exc:
        load_registry([bad]).names("trainer")
    msg = one_line(exc)
    assert f"by {BUILTIN} and by config plugins: {bad}" in msg


@pytest.mark.parametrize("kind_line", ['kind = "gpu_magic"', "pass"])
def test_backend_with_unknown_kind_is_refused(plugin_module, kind_line) -> None:
    mod = plugin_module(
        f"""
        class Odd:
            {kind_line}

        @hookimpl
        def loongsage_backends():
            return {{"odd": Odd}}
        """
    )
    with pytest.raises(ConfigError) as exc:
        load_registry([mod]).names("engine")  # the tables are merged on first use
    msg = one_line(exc)
    assert "backend 'odd'" in msg and f"config plugins: {mod}" in msg
    assert ("'gpu_magic'" if "gpu_magic" in kind_line else "None") in msg
    for kind in BACKEND_KINDS:
        assert kind in msg


def test_plugins_module_that_fails_to_import(plugin_module) -> None:
    broken = plugin_module("import loongsage_no_such_dependency\n")
    with pytest.raises(ConfigError) as exc:
        load_registry([broken])
    msg = one_line(exc)
    assert f"plugins: module {broken!r} failed to import" in msg and "loongsage_no_such_dependency" in msg
    with pytest.raises(ConfigError) as exc:
        load_registry(["loongsage_module_that_does_not_exist"])
    assert "'loongsage_module_that_does_not_exist'" in one_line(exc)


def test_misspelt_hookimpl_in_plugins_module_is_caught(plugin_module) -> None:
    mod = plugin_module(
        """
        @hookimpl
        def loongsage_advantage_estimator():  # missing the trailing s
            return {}
        """
    )
    with pytest.raises(ConfigError) as exc:
        load_registry([mod])
    assert one_line(exc) == (
        f"plugins: module {mod!r}: @hookimpl loongsage_advantage_estimator() is not a LoongSage "
        "hook (did you mean loongsage_advantage_estimators?), so it would never be called"
    )


# ----------------------------------------------------------------------------- lookups and params
def test_miss_lists_known_names(registry, monkeypatch) -> None:
    with pytest.raises(ConfigError) as exc:
        registry.entry("kl", "k4", "algorithm.kl")
    msg = one_line(exc)
    assert msg.startswith("algorithm.kl.name: unknown kl 'k4'; known: ")
    assert all(n in msg for n in ("k1", "k2", "k3", "low_var_kl"))
    with pytest.raises(ConfigError) as exc:
        registry.entry("sandbox", "kubernetes", "data_sources[0].sandbox")
    msg = one_line(exc)
    assert "unknown sandbox 'kubernetes'; known: " in msg and all(n in msg for n in ("docker", "local"))
    monkeypatch.setitem(registry.tables, "sandbox", {})  # a category no installed package provides
    with pytest.raises(ConfigError) as exc:
        registry.entry("sandbox", "docker", "data_sources[0].sandbox")
    assert "(none installed)" in one_line(exc)
    with pytest.raises(ConfigError) as exc:
        registry.entry("optimiser", "adam")
    msg = one_line(exc)
    assert "unknown plugin category 'optimiser'" in msg and "advantage" in msg and "tracker" in msg


def test_spec_shape_is_checked(registry) -> None:
    with pytest.raises(ConfigError) as exc:
        registry.check("advantage", "grpo", "algorithm.advantage")
    assert one_line(exc).startswith("algorithm.advantage: expected a mapping with 'name'")
    with pytest.raises(ConfigError) as exc:
        registry.check("advantage", {"name": "grpo", "parms": {}}, "algorithm.advantage")
    assert one_line(exc) == "algorithm.advantage.parms: unknown key; allowed: name, params"


def test_params_unknown_key_lists_allowed(registry) -> None:
    with pytest.raises(ConfigError) as exc:
        registry.check("advantage", {"name": "grpo", "params": {"std_norm": True}}, "algorithm.advantage")
    msg = one_line(exc)
    assert msg.startswith("algorithm.advantage.params.std_norm: unknown key; allowed: ")
    assert {"eps", "std_normalize"} <= set(msg.partition("allowed: ")[2].split(", "))


def test_params_wrong_type(registry) -> None:
    with pytest.raises(ConfigError) as exc:
        registry.check("advantage", {"name": "grpo", "params": {"std_normalize": "yes"}}, "algorithm.advantage")
    msg = one_line(exc)
    assert msg.startswith("algorithm.advantage.params.std_normalize: got 'yes'") and "true or false" in msg
    with pytest.raises(ConfigError) as exc:
        registry.check("data_source", {"name": "arith", "params": {"size": 1.5}}, "data_sources[0].reader")
    assert one_line(exc).startswith("data_sources[0].reader.params.size: got 1.5; expected an integer")
    with pytest.raises(ConfigError) as exc:
        registry.check("data_source", {"name": "arith", "params": {"split": "dev"}}, "data_sources[0].reader")
    assert one_line(exc) == "data_sources[0].reader.params.split: got 'dev'; allowed: 'train', 'test'"


def test_params_missing_required(registry) -> None:
    with pytest.raises(ConfigError) as exc:
        registry.check("data_source", {"name": "file"}, "data_sources[0].reader")
    assert one_line(exc) == "data_sources[0].reader.params.path: missing required key (type str)"


def test_params_are_coerced_and_framework_args_skipped(registry) -> None:
    params = registry.check("advantage", {"name": "grpo", "params": {"eps": 1}}, "a")
    assert params == {"eps": 1.0} and isinstance(params["eps"], float)
    # the trainer's model_path is supplied by the framework: required, but not the user's to set
    assert registry.check("trainer", {"name": "torch"}, "trainer.backend", skip=("model_path",)) == {}
    with pytest.raises(ConfigError) as exc:
        registry.check(
            "trainer", {"name": "torch", "params": {"model_path": "/x"}}, "trainer.backend", skip=("model_path",)
        )
    assert one_line(exc).startswith("trainer.backend.params.model_path: unknown key")


def test_create_reports_the_factorys_own_check_in_one_line(registry) -> None:
    estimator = registry.create("advantage", {"name": "grpo", "params": {"eps": 0.5}}, "algorithm.advantage")
    assert estimator.eps == 0.5 and estimator.std_normalize is True
    with pytest.raises(ConfigError) as exc:
        registry.create("advantage", {"name": "grpo", "params": {"eps": 0}}, "algorithm.advantage")
    msg = one_line(exc)
    assert msg.startswith("algorithm.advantage.params") and "eps" in msg  # its own check, or its declared range


# ----------------------------------------------------------------------------- `loongsage plugins`
def _rows(out: str) -> list[list[str]]:
    lines = out.strip().splitlines()
    assert lines[0].split() == ["hook", "extension", "point", "name", "provider"]
    assert set(lines[1].replace(" ", "")) == {"-"}
    return [re.split(r" {2,}", line.strip(), maxsplit=3) for line in lines[2:]]


def test_cli_plugins_lists_every_extension_point_with_providers(registry, capsys) -> None:
    assert cli.main(["plugins"]) == 0
    out = capsys.readouterr().out
    rows = _rows(out)
    assert {r[0] for r in rows} == set(hookspecs.HOOK_NAMES)
    labels = {r[1] for r in rows}
    assert set(CATEGORIES) | {f"backend:{k}" for k in BACKEND_KINDS} == labels
    listed = {(r[1], r[2]): r[3] if len(r) > 3 else "" for r in rows}
    for category in (*CATEGORIES, *BACKEND_KINDS):
        label = category if category in CATEGORIES else f"backend:{category}"
        names = registry.names(category)
        if not names:
            assert (label, "-") in listed, label
        for name in names:
            assert listed[(label, name)] == registry.entry(category, name).provider
    assert listed[("advantage", "grpo")].startswith("loongsage-algos ")
    assert listed[("backend:engine", "native")] == BUILTIN


def test_cli_plugins_verbose_and_extra_module(plugin_module, capsys) -> None:
    mod = plugin_module(
        """
        from dataclasses import dataclass

        @dataclass(frozen=True)
        class Shout:
            level: int = 3
            suffix: str = "!"

            async def __call__(self, request, call_next):
                return await call_next(request)

        @hookimpl
        def loongsage_gateway_middlewares():
            return {"shout": Shout}
        """
    )
    assert cli.main(["plugins", "--verbose", "--plugin", mod]) == 0
    out = capsys.readouterr().out
    assert re.search(rf"loongsage_gateway_middlewares\s+gateway_middleware\s+shout\s+config plugins: {mod}", out)
    assert "params: level: int = 3, suffix: str = '!'" in out
    assert re.search(r" grpo +loongsage-algos [^\n]*\n +params: [^\n]*std_normalize: bool = True", out), out


def test_cli_plugins_error_is_one_line_exit_2(plugin_module, capsys) -> None:
    mod = plugin_module(
        """
        class Dup:
            pass

        @hookimpl
        def loongsage_policy_losses():
            return {"nll": Dup}
        """
    )
    assert cli.main(["plugins", "--plugin", mod]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and captured.err.startswith("loongsage: error: policy_loss 'nll'")
    assert "loongsage-algos" in captured.err and f"config plugins: {mod}" in captured.err
