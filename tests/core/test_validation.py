"""Validation as named rules (core/validation.py): defaults resolved first, rules run in order and
change nothing, plugins add rules by registering them."""

from __future__ import annotations

import copy
import dataclasses
import inspect
from pathlib import Path

import pytest

from loongsage.core import validation
from loongsage.core.compose import compose
from loongsage.core.config import Config, load_config
from loongsage.core.schema import build_dataclass
from loongsage.core.types import ConfigError

REPO = Path(__file__).resolve().parents[2]
RECIPE = "tiny/grpo_arith_cpu"


@pytest.fixture
def at_repo(monkeypatch) -> Path:
    monkeypatch.chdir(REPO)
    return REPO


@pytest.fixture
def raw(at_repo) -> dict:
    return compose(REPO / "recipes" / "tiny" / "grpo_arith_cpu.yaml", [])


def one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text, f"error spans several lines: {text!r}"
    return text


def test_every_rule_is_a_small_named_function_of_the_config_and_the_registry() -> None:
    names = [rule.__name__ for rule in validation.RULES]
    assert len(names) == len(set(names)) and len(names) >= 15
    assert names[0] == "placement_fits" and names[-1] == "trackers"
    for rule in validation.RULES:
        assert list(inspect.signature(rule).parameters) == ["cfg", "registry"], rule.__name__
        assert rule.__module__ == validation.__name__
    for source_check in validation.SOURCE_CHECKS:
        assert list(inspect.signature(source_check).parameters) == ["cfg", "registry", "src", "path"]


def test_defaults_are_resolved_in_a_step_of_their_own_on_a_copy(raw, registry) -> None:
    cfg = build_dataclass(Config, raw, "config")
    assert cfg.rollout.transport is None and cfg.placement.release_engine_memory is None
    resolved = validation.resolve_defaults(cfg)
    assert resolved is not cfg
    assert cfg.rollout.transport is None and cfg.placement.release_engine_memory is None  # unchanged
    assert resolved.rollout.transport == {"name": "cpu"} and resolved.placement.release_engine_memory is False
    gpus = validation.resolve_defaults(
        dataclasses.replace(cfg, placement=dataclasses.replace(cfg.placement, gpus_per_actor=1.0))
    )
    assert gpus.rollout.transport == {"name": "ipc"} and gpus.placement.release_engine_memory is True
    given = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, transport={"name": "cpu", "params": {}}))
    assert validation.resolve_defaults(given).rollout.transport == {"name": "cpu", "params": {}}  # a given one stays


def test_the_rules_change_nothing(raw, registry) -> None:
    cfg = validation.resolve_defaults(build_dataclass(Config, raw, "config"))
    before = copy.deepcopy(cfg.to_dict())
    validation.check(cfg, registry)
    assert cfg.to_dict() == before


def test_validate_is_build_resolve_check(raw, registry) -> None:
    cfg = validation.validate(raw, registry)
    assert cfg == validation.resolve_defaults(build_dataclass(Config, raw, "config"))
    loaded, _ = load_config(RECIPE)
    assert loaded == cfg


def test_a_rule_stops_validation_with_its_one_line(raw, registry) -> None:
    raw["data_sources"] = []
    with pytest.raises(ConfigError) as exc:
        validation.validate(raw, registry)
    assert one_line(exc) == "data_sources: at least one data source is required"


@pytest.mark.parametrize(
    ("engine", "trainer", "message"),
    [
        (
            {"batch_invariant": True},
            {},
            "rollout.engine.params.batch_invariant=true: the log-probs agree only when both sides run the "
            "invariant path; set trainer.backend.params.batch_invariant=true too (the native engine and the "
            "torch trainer), or drop it",
        ),
        ({}, {"batch_invariant": True}, "trainer.backend.params.batch_invariant=true: the log-probs agree only"),
        (
            {"deterministic": True, "quantization": "fp8"},
            {},
            "rollout.engine.params.quantization: FP8 moves the numbers away from the other side's, which "
            "rollout.engine.params.deterministic=true asks to match exactly; drop one of them",
        ),
    ],
)
def test_a_consistency_mode_needs_both_sides_alike(raw, registry, engine, trainer, message) -> None:
    raw["rollout"]["engine"] = {"name": "native", "params": engine}
    raw["trainer"]["backend"] = {"name": "torch", "params": trainer}
    with pytest.raises(ConfigError) as exc:
        validation.validate(raw, registry)
    assert one_line(exc).startswith(message)


def test_an_implied_transport_that_is_not_installed_is_named(raw, registry, monkeypatch) -> None:
    raw["placement"] = {**raw.get("placement", {}), "gpus_per_actor": 1.0}
    monkeypatch.setitem(
        registry.tables, "transport", {k: v for k, v in registry.tables["transport"].items() if k == "cpu"}
    )
    with pytest.raises(ConfigError) as exc:
        validation.validate(raw, registry)
    assert one_line(exc) == (
        "rollout.transport: placement on GPUs (colocate=True) uses the 'ipc' transport of "
        "loongsage-sync, which is not installed: pip install loongsage-sync, or set "
        "rollout.transport={name: cpu}"
    )


def test_a_registered_rule_runs_after_the_built_in_ones(raw, registry, monkeypatch) -> None:
    monkeypatch.setattr(validation, "_registered", [])
    seen: list[str] = []

    @validation.register_rule
    def one_source_only(cfg, registry):
        seen.append(cfg.data_sources[0].name)
        if len(cfg.data_sources) > 1:
            raise ConfigError("data_sources: this plugin reads one source")

    assert validation.register_rule(one_source_only) is one_source_only  # registered once
    assert validation._registered == [one_source_only]
    validation.validate(raw, registry)
    assert seen == ["arith"]
    raw["data_sources"] = raw["data_sources"] * 2
    with pytest.raises(ConfigError) as exc:  # the built-in rule about names comes first
        validation.validate(raw, registry)
    assert one_line(exc).startswith("data_sources: names must be unique")
    raw["data_sources"][1] = {**raw["data_sources"][1], "name": "other"}
    with pytest.raises(ConfigError) as exc:
        validation.validate(raw, registry)
    assert one_line(exc) == "data_sources: this plugin reads one source"


def test_a_tracker_gets_only_what_it_receives_and_one_needing_more_is_refused(at_repo, plugin_module) -> None:
    mod = plugin_module(
        """
        from loongsage.core.contracts import Tracker

        @dataclass
        class Named(Tracker):
            kind = "tracker"
            receives = ("run_name",)
            run_name: str
            prefix: str = ""

            def log(self, step, metrics): pass
            def close(self): pass

        @dataclass
        class Needy(Tracker):  # takes run_dir but does not declare it
            kind = "tracker"
            run_dir: str

            def log(self, step, metrics): pass
            def close(self): pass

        @hookimpl
        def loongsage_backends():
            return {"named": Named, "needy": Needy}
        """
    )
    from loongsage.core.tracking import create_trackers

    cfg, registry = load_config(
        RECIPE, [f"plugins=[{mod}]", "tracking.backends=[{name: named, params: {prefix: p}}]", "run.name=mine"]
    )
    [tracker] = create_trackers(registry, cfg, Path("/nowhere"))
    assert (tracker.run_name, tracker.prefix) == ("mine", "p")
    with pytest.raises(ConfigError) as exc:
        load_config(RECIPE, [f"plugins=[{mod}]", "tracking.backends=[needy]"])
    assert one_line(exc) == "tracking.backends[0].params.run_dir: missing required key (type str)"
    with pytest.raises(ConfigError) as exc:  # the framework's arguments are never the user's
        load_config(RECIPE, [f"plugins=[{mod}]", "tracking.backends=[{name: named, params: {run_name: x}}]"])
    assert one_line(exc).startswith("tracking.backends[0].params.run_name: unknown key")
