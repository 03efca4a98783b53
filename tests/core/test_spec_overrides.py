"""A layer that gives a {name, params} spec another name replaces it; the same name merges into it.

Layers are command-line overrides over the recipe and a recipe over the recipe its ``defaults``
list. Nothing here starts Ray.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from loongsage.core.compose import compose
from loongsage.core.config import find_recipe, load_config
from loongsage.core.types import ConfigError

REPO = Path(__file__).resolve().parents[2]
MIXED = "tiny/mixed_async_cpu"  # rollout.scheduler: {name: no_window, params: {max_staleness: 1}}
CLIP = {"clip_low": 0.2, "clip_high": 0.28}  # its policy_loss: ppo_clip's params


def composed(overrides: list[str], recipe: str = MIXED, config_dir: str | None = None) -> dict:
    return compose(find_recipe(recipe, config_dir), overrides)


@pytest.mark.parametrize(
    "override",
    [
        "rollout.scheduler={name: sync}",
        "rollout.scheduler.name=sync",
        "rollout={scheduler: {name: sync}}",
        "++rollout.scheduler={name: sync}",
    ],
)
def test_an_override_with_another_name_replaces_the_entry(override) -> None:
    assert composed([override])["rollout"]["scheduler"] == {"name": "sync"}
    cfg, _ = load_config(MIXED, [override, "algorithm.corrections=[]"])  # valid: no max_staleness for sync
    assert cfg.rollout.scheduler == {"name": "sync"}


def test_the_replacing_entry_keeps_its_own_params() -> None:
    out = composed(["rollout.scheduler={name: windowed_fifo, params: {max_staleness: 3}}"])
    assert out["rollout"]["scheduler"] == {"name": "windowed_fifo", "params": {"max_staleness": 3}}
    # the name first, then params: the later override adds to the new entry
    out = composed(["rollout.scheduler.name=windowed_fifo", "rollout.scheduler.params.max_staleness=2"])
    assert out["rollout"]["scheduler"] == {"name": "windowed_fifo", "params": {"max_staleness": 2}}


def test_the_old_way_of_dropping_params_still_works() -> None:
    assert composed(["rollout.scheduler={name: sync, params: null}"])["rollout"]["scheduler"] == {
        "name": "sync",
        "params": None,
    }
    for dropped in ("rollout.scheduler.params", "rollout.scheduler.params.max_staleness"):
        assert composed(["rollout.scheduler.name=sync", f"~{dropped}"])["rollout"]["scheduler"] == {"name": "sync"}
    # a key the rename did not remove is still Hydra's to refuse
    with pytest.raises(ConfigError, match="Could not delete from config"):
        composed(["rollout.scheduler.name=sync", "~rollout.scheduler.nothing"])


def test_the_same_name_keeps_merging_params() -> None:
    out = composed(["algorithm.policy_loss={name: ppo_clip, params: {clip_high: 0.3}}"])
    assert out["algorithm"]["policy_loss"] == {"name": "ppo_clip", "params": {**CLIP, "clip_high": 0.3}}
    out = composed(["algorithm.policy_loss={params: {clip_low: 0.1}}", "algorithm.policy_loss.name=ppo_clip"])
    assert out["algorithm"]["policy_loss"] == {"name": "ppo_clip", "params": {**CLIP, "clip_low": 0.1}}
    assert composed(["rollout.scheduler.params.max_staleness=2"])["rollout"]["scheduler"]["params"] == {
        "max_staleness": 2
    }


def test_overrides_apply_in_order() -> None:
    out = composed(
        [
            "rollout.scheduler={name: sync}",
            "rollout.scheduler={name: no_window, params: {max_staleness: 2}}",
            "rollout.scheduler.params.max_staleness=4",
        ]
    )
    assert out["rollout"]["scheduler"] == {"name": "no_window", "params": {"max_staleness": 4}}
    # a spec deleted first is added anew
    assert composed(["~rollout.scheduler", "+rollout.scheduler={name: sync}"])["rollout"]["scheduler"] == {
        "name": "sync"
    }


def test_a_mapping_that_is_not_a_spec_still_merges() -> None:
    # a data source has a name and other keys: renaming it keeps its reader, agent, ...
    out = composed(["data_sources.0={name: plus}"])
    assert out["data_sources"][0]["name"] == "plus" and out["data_sources"][0]["reader"]["name"] == "arith"
    # a spec nested in the value is replaced when its name changes
    out = composed(["data_sources.1={reader: {name: arith}}"])
    assert out["data_sources"][1]["reader"] == {"name": "arith"}


def test_an_override_error_still_names_the_override() -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(MIXED, ["rollout.scheduler={name: sync}", "rollout.scheduler.params.max_staleness=[1"])
    assert str(exc.value).startswith("override 'rollout.scheduler.params.max_staleness=[1': "), str(exc.value)
    # what the replaced entry had is gone: a param of the old scheduler is refused by the new one
    with pytest.raises(ConfigError) as exc:
        load_config(
            MIXED,
            ["rollout.scheduler={name: sync}", "rollout.scheduler.params.max_staleness=1", "algorithm.corrections=[]"],
        )
    assert "rollout.scheduler.params.max_staleness" in str(exc.value), str(exc.value)


# ----------------------------------------------------------------------------- recipe layers
def write(directory: Path, name: str, raw: dict) -> None:
    (directory / f"{name}.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))


@pytest.fixture
def layered(tmp_path) -> Path:
    """parent: mixed_async_cpu with a ppo_clip policy loss with params and an advantage spec holding a
    (made-up) nested spec."""
    parent = yaml.safe_load((REPO / "recipes" / "tiny" / "mixed_async_cpu.yaml").read_text())
    parent["algorithm"]["policy_loss"] = {"name": "ppo_clip", "params": {"clip_low": 0.1, "clip_high": 0.3}}
    parent["algorithm"]["advantage"] = {"name": "grpo", "params": {"norm": {"name": "std", "params": {"eps": 1}}}}
    write(tmp_path, "parent", parent)
    return tmp_path


def child(directory: Path, name: str, algorithm: dict, parents: tuple[str, ...] = ("parent",)) -> str:
    write(directory, name, {"defaults": [*parents, "_self_"], "run": {"name": name}, "algorithm": algorithm})
    return name


def test_a_recipe_layer_with_another_name_replaces_the_parents_entry(layered) -> None:
    name = child(layered, "sft", {"policy_loss": {"name": "nll"}})
    assert composed([], name, str(layered))["algorithm"]["policy_loss"] == {"name": "nll"}
    # (the parent's made-up nested advantage spec replaced too, so that it validates)
    cfg, _ = load_config(
        name,
        ["rollout.scheduler={name: sync}", "algorithm.corrections=[]", "algorithm.advantage={name: rloo}"],
        config_dir=str(layered),
    )
    assert cfg.algorithm.policy_loss == {"name": "nll"}

    name = child(layered, "other", {"policy_loss": {"name": "vanilla", "params": {"a": 1}}})
    out = composed(["algorithm.policy_loss.params.b=2"], name, str(layered))
    assert out["algorithm"]["policy_loss"] == {"name": "vanilla", "params": {"a": 1, "b": 2}}
    # an override renaming it back starts from nothing, too
    out = composed(["algorithm.policy_loss={name: ppo_clip}"], name, str(layered))
    assert out["algorithm"]["policy_loss"] == {"name": "ppo_clip"}


def test_a_recipe_layer_with_the_same_name_merges(layered) -> None:
    name = child(layered, "same", {"policy_loss": {"name": "ppo_clip", "params": {"clip_high": 0.4}}})
    assert composed([], name, str(layered))["algorithm"]["policy_loss"] == {
        "name": "ppo_clip",
        "params": {"clip_low": 0.1, "clip_high": 0.4},
    }


def test_layers_over_layers_and_nested_specs(layered) -> None:
    # middle renames the nested spec only; the top keeps the outer name: the outer params merge, the
    # nested spec is middle's
    child(layered, "middle", {"advantage": {"name": "grpo", "params": {"norm": {"name": "mean"}}}})
    name = child(layered, "top", {"advantage": {"params": {"extra": True}}}, parents=("middle",))
    assert composed([], name, str(layered))["algorithm"]["advantage"] == {
        "name": "grpo",
        "params": {"norm": {"name": "mean"}, "extra": True},
    }
    # a rename in the top layer drops what both earlier layers gave
    name = child(layered, "top2", {"advantage": {"name": "rloo"}}, parents=("middle",))
    assert composed([], name, str(layered))["algorithm"]["advantage"] == {"name": "rloo"}
    # ... nested specs included, even one renamed in between
    child(layered, "middle3", {"advantage": {"params": {"norm": {"name": "mean", "params": {"k": 2}}}}})
    name = child(
        layered, "top3", {"advantage": {"name": "rloo", "params": {"norm": {"name": "mean"}}}}, parents=("middle3",)
    )
    assert composed([], name, str(layered))["algorithm"]["advantage"] == {
        "name": "rloo",
        "params": {"norm": {"name": "mean"}},
    }


def test_the_packaged_sft_recipe_replaces_grpo_s_policy_loss() -> None:
    out = composed([], "tiny/sft_chat_cpu")
    assert out["algorithm"]["policy_loss"] == {"name": "nll"}
    assert out["model"]["builder"] == {"name": "tiny_arith", "params": {"steps": 1}}  # the same name: merged
