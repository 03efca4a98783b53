"""Config validation before any actor: every bad key is one line naming its path; nothing starts Ray."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest
import yaml

from loongsage.core import cli
from loongsage.core.aggregation import AGGREGATION_MODES
from loongsage.core.config import (
    Config,
    find_recipe,
    list_recipes,
    load_config,
    packaged_recipe_dir,
    recipe_search_path,
)
from loongsage.core.types import ConfigError

REPO = Path(__file__).resolve().parents[2]
RECIPE = "tiny/grpo_arith_cpu"
TOP_LEVEL = (
    "checkpoint",
    "data_sources",
    "evaluation",
    "model",
    "placement",
    "plugins",
    "rollout",
    "run",
    "tracking",
    "trainer",
    "algorithm",
)


@pytest.fixture(autouse=True)
def no_ray_started():
    """Validation never starts Ray (it may be imported by other tests of the session, never initialised here)."""
    before = "ray" in sys.modules and sys.modules["ray"].is_initialized()
    yield
    if not before:
        assert not ("ray" in sys.modules and sys.modules["ray"].is_initialized()), "config validation started Ray"


@pytest.fixture
def at_repo(monkeypatch) -> Path:
    monkeypatch.chdir(REPO)
    return REPO


def config_error(overrides: list[str], recipe: str = RECIPE, **kwargs) -> str:
    with pytest.raises(ConfigError) as exc:
        load_config(recipe, overrides, **kwargs)
    text = str(exc.value)
    assert "\n" not in text, f"error spans several lines: {text!r}"
    return text


def tiny_raw() -> dict:
    return yaml.safe_load((REPO / "recipes" / "tiny" / "grpo_arith_cpu.yaml").read_text())


def write_recipe(directory: Path, name: str, raw: dict) -> Path:
    path = directory / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(raw))
    return path


# ----------------------------------------------------------------------------- the valid recipe
def test_tiny_recipe_validates(at_repo) -> None:
    cfg, registry = load_config(RECIPE)
    assert isinstance(cfg, Config)
    assert cfg.run.name == "grpo_arith_cpu" and cfg.model.builder == {"name": "tiny_arith", "params": {}}
    (src,) = cfg.data_sources
    assert (src.name, src.prompts_per_step, src.samples_per_prompt) == ("arith", 8, 8)
    assert cfg.sampling_for(src).n == 8 and cfg.sampling_for(src).max_new_tokens == 5
    assert cfg.trainer.optimizer.lr == pytest.approx(1e-4)
    assert cfg.placement.colocate is True and cfg.checkpoint.resume is False
    assert "grpo" in registry.names("advantage")


def test_overrides_reach_keys_the_recipe_leaves_to_defaults(at_repo) -> None:
    cfg, _ = load_config(
        RECIPE,
        [
            "tracking.progress=false",
            "trainer.world_size=2",
            "trainer.mini_batches_per_step=4",
            "algorithm.advantage.params.std_normalize=false",
            "model.builder.params.steps=40",
        ],
    )
    assert cfg.tracking.progress is False
    assert (cfg.trainer.world_size, cfg.trainer.mini_batches_per_step) == (2, 4)  # 8 prompts = 2 x 4
    assert cfg.algorithm.advantage == {"name": "grpo", "params": {"std_normalize": False}}
    assert cfg.model.builder["params"] == {"steps": 40}


# ----------------------------------------------------------------------------- plugin names
@pytest.mark.parametrize(
    ("override", "prefix", "known"),
    [
        ("algorithm.advantage.name=nope", "algorithm.advantage.name: unknown advantage 'nope'; known: ", "grpo"),
        ("algorithm.policy_loss.name=nope", "algorithm.policy_loss.name: unknown policy_loss 'nope'", "ppo_clip"),
        ("++algorithm.kl={name: k9}", "algorithm.kl.name: unknown kl 'k9'", "low_var_kl"),
        ("rollout.engine.name=vllm", "rollout.engine.name: unknown engine 'vllm'; known: ", "native"),
        ("data_sources.0.reward.name=nope", "data_sources[0].reward.name: unknown reward 'nope'", "exact_match"),
        ("data_sources.0.agent.name=nope", "data_sources[0].agent.name: unknown agent 'nope'", "single_turn"),
        (
            "data_sources.0.reader.name=csv",
            "data_sources[0].reader.name: unknown data_source 'csv'",
            "arith, digit_sort, file",
        ),
        ("model.builder.name=nope", "model.builder.name: unknown model_builder 'nope'", "tiny_arith"),
        ("tracking.backends=[jsonl,nope]", "tracking.backends[1].name: unknown tracker 'nope'", "tensorboard"),
        ("++algorithm.filters=[{name: nope}]", "algorithm.filters[0].name: unknown data_filter 'nope'", ""),
    ],
)
def test_unknown_plugin_name_lists_known(at_repo, override, prefix, known) -> None:
    msg = config_error([override])
    assert msg.startswith(prefix), msg
    listed = msg.partition("known: ")[2].split(", ")
    assert all(name in listed for name in known.split(", ") if name), msg


def test_plugin_params_are_checked_against_the_factory(at_repo) -> None:
    msg = config_error(["algorithm.advantage.params.std_norm=true"])
    assert msg.startswith("algorithm.advantage.params.std_norm: unknown key; allowed: ")
    assert {"eps", "std_normalize"} <= set(msg.partition("allowed: ")[2].split(", "))
    msg = config_error(["algorithm.policy_loss.params.clip_low=wide"])
    assert msg.startswith("algorithm.policy_loss.params.clip_low: got 'wide'; expected a number")
    msg = config_error(["data_sources.0.reader.name=file", "~data_sources.0.reader.params"])
    assert msg == "data_sources[0].reader.params.path: missing required key (type str)"
    msg = config_error(["rollout.engine.params.model_path=/x"])  # supplied by the framework, not settable
    assert msg.startswith("rollout.engine.params.model_path: unknown key; allowed: ")
    assert config_error(["algorithm.advantage={name: grpo, parms: {}}"]) == (
        "algorithm.advantage.parms: unknown key; allowed: name, params"
    )


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("algorithm.advantage.params=5", "algorithm.advantage.params: got 5; expected a mapping"),
        ("algorithm.advantage.params=[1,2]", "algorithm.advantage.params: got [1, 2]; expected a mapping"),
        ("algorithm.advantage.name=[grpo]", "algorithm.advantage: expected a mapping with 'name'"),
        ("algorithm.advantage.name=null", "algorithm.advantage: expected a mapping with 'name'"),
        ("~algorithm.advantage.name", "algorithm.advantage: expected a mapping with 'name'"),
        ("rollout.engine=native", "config.rollout.engine: got 'native'; expected a mapping"),
    ],
)
def test_malformed_plugin_spec(at_repo, override, expected) -> None:
    assert config_error([override]).startswith(expected)


# ----------------------------------------------------------------------------- keys and types
def test_missing_required_key_from_a_recipe_file(at_repo, tmp_path) -> None:
    raw = tiny_raw()
    del raw["data_sources"][0]["reader"]
    write_recipe(tmp_path, "no_reader", raw)
    msg = config_error([], recipe="no_reader", config_dir=str(tmp_path))
    assert msg.startswith("config.data_sources[0].reader: missing required key")

    raw = tiny_raw()
    del raw["data_sources"][0]["name"]
    write_recipe(tmp_path, "no_name", raw)
    assert config_error([], recipe="no_name", config_dir=str(tmp_path)).startswith(
        "config.data_sources[0].name: missing required key (type str)"
    )


def test_unknown_top_level_key(at_repo, tmp_path) -> None:
    msg = config_error(["foo=1"])
    assert msg.startswith("config.foo: unknown key; allowed: ")
    assert all(k in msg for k in TOP_LEVEL)
    raw = tiny_raw()
    raw["trainers"] = raw.pop("trainer")  # a typo in a recipe file
    write_recipe(tmp_path, "typo", raw)
    assert config_error([], recipe="typo", config_dir=str(tmp_path)).startswith("config.trainers: unknown key")


@pytest.mark.parametrize(
    ("override", "path", "allowed"),
    [
        ("trainer.optimizer.lrr=0.1", "config.trainer.optimizer.lrr", {"betas", "eps", "grad_clip", "lr"}),
        (
            "data_sources.0.prompts_per_stp=4",
            "config.data_sources[0].prompts_per_stp",
            {"prompts_per_step", "samples_per_prompt", "reader", "sampling"},
        ),
        ("run.nmae=x", "config.run.nmae", {"name", "seed", "total_steps", "output_dir"}),
    ],
)
def test_unknown_nested_key(at_repo, override, path, allowed) -> None:
    msg = config_error([override])
    assert msg.startswith(f"{path}: unknown key; allowed: ")
    assert allowed <= set(msg.partition("allowed: ")[2].split(", "))


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("trainer.micro_batch_tokens=abc", "config.trainer.micro_batch_tokens: got 'abc'; expected an integer"),
        ("run.seed=1.5", "config.run.seed: got 1.5; expected an integer"),
        ("run.profile_steps=[2,2.5]", "config.run.profile_steps[1]: got 2.5; expected an integer"),
        ("run.profile_steps=2", "config.run.profile_steps: got 2; expected a list"),
        ("placement.colocate=maybe", "config.placement.colocate: got 'maybe'; expected true or false"),
        ("trainer.optimizer.lr=fast", "config.trainer.optimizer.lr: got 'fast'; expected a number"),
        ("trainer.optimizer.betas=0.9", "config.trainer.optimizer.betas: got 0.9; expected a list"),
        ("tracking.backends=jsonl", "config.tracking.backends: got 'jsonl'; expected a list"),
        ("data_sources=7", "config.data_sources: got 7; expected a list"),
        ("data_sources.0.on_bad_row=maybe", "config.data_sources[0].on_bad_row: got 'maybe'; allowed: 'skip', 'error'"),
        ("model.dtype=fp8", "config.model.dtype: got 'fp8'; allowed: 'float32', 'bfloat16', 'float16'"),
    ],
)
def test_wrong_type(at_repo, override, expected) -> None:
    assert config_error([override]) == expected


@pytest.mark.parametrize(
    ("override", "section", "key"),
    [
        ("run.total_steps=0", "run", "total_steps"),
        ("trainer.micro_batch_tokens=0", "trainer", "micro_batch_tokens"),
        ("trainer.optimizer.lr=0", "trainer.optimizer", "lr"),
        ("data_sources.0.samples_per_prompt=0", "data_sources[0]", "samples_per_prompt"),
        ("rollout.num_engines=0", "rollout", "num_engines"),
    ],
)
def test_value_out_of_range_names_the_key(at_repo, override, section, key) -> None:
    msg = config_error([override])
    assert msg.startswith(f"config.{section}"), msg
    assert f"{key}=0" in msg and "must be" in msg


def test_nonexistent_model_path(at_repo) -> None:
    msg = config_error(["model.path=/nonexistent", "model.builder=null"])
    assert msg.startswith("model.path='/nonexistent': ") and "config.json" in msg
    assert config_error(["model.builder=null"]).startswith("model: set model.path")


def test_model_path_without_config_json(at_repo, tmp_path) -> None:
    assert config_error([f"model.path={tmp_path}", "model.builder=null"]).startswith(f"model.path='{tmp_path}'")
    (tmp_path / "config.json").write_text("{}")
    cfg, _ = load_config(RECIPE, [f"model.path={tmp_path}", "model.builder=null"])
    assert cfg.model.path == str(tmp_path)


def test_bad_aggregation(at_repo) -> None:
    msg = config_error(["algorithm.aggregation=bogus"])
    # names the section and the key: "config.algorithm: aggregation='bogus'; allowed: ..."
    assert msg.startswith("config.algorithm") and "aggregation='bogus'" in msg
    assert msg.endswith(", ".join(AGGREGATION_MODES))
    for mode in AGGREGATION_MODES:
        cfg, _ = load_config(RECIPE, [f"algorithm.aggregation={mode}"])
        assert cfg.algorithm.aggregation == mode


def test_kl_coef_needs_an_estimator(at_repo) -> None:
    assert config_error(["algorithm.kl_coef=0.1"]).startswith("algorithm.kl_coef is set but algorithm.kl is null")
    cfg, _ = load_config(RECIPE, ["algorithm.kl_coef=0.1", "algorithm.kl={name: k3}"])
    assert cfg.algorithm.kl == {"name": "k3"}


@pytest.mark.parametrize(
    ("overrides", "dp_mb"),
    [
        (["trainer.world_size=3"], 3),
        (["trainer.mini_batches_per_step=3"], 3),
        (["trainer.world_size=2", "trainer.mini_batches_per_step=2", "data_sources.0.prompts_per_step=6"], 4),
    ],
)
def test_prompts_per_step_divisible_by_dp_times_mini_batches(at_repo, overrides, dp_mb) -> None:
    msg = config_error(overrides)
    assert msg.startswith("data_sources[0].prompts_per_step=")
    assert f"must be divisible by trainer.world_size x trainer.mini_batches_per_step = {dp_mb}" in msg


def test_divisible_split_is_accepted(at_repo) -> None:
    cfg, _ = load_config(
        RECIPE, ["trainer.world_size=2", "trainer.mini_batches_per_step=2", "data_sources.0.prompts_per_step=12"]
    )
    assert cfg.data_sources[0].prompts_per_step == 12


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("data_sources.0.sampling.temperature=-1", "data_sources[0].sampling.temperature=-1.0: must be >= 0"),
        ("data_sources.0.sampling.top_p=0", "data_sources[0].sampling.top_p=0.0: must be in (0, 1]"),
        ("data_sources.0.sampling.top_k=-2", "data_sources[0].sampling.top_k=-2: must be >= 0"),
        ("data_sources.0.sampling.min_p=1", "data_sources[0].sampling.min_p=1.0: must be in [0, 1)"),
        ("data_sources.0.sampling.max_new_tokens=0", "data_sources[0].sampling.max_new_tokens=0: must be > 0"),
        (
            "data_sources.0.sampling.temperature=hot",
            "data_sources[0].sampling.temperature: got 'hot'; expected a number",
        ),
        ("data_sources.0.sampling.n=4", "data_sources[0].sampling.n: set data_sources[0].samples_per_prompt instead"),
        ("data_sources.0.sampling.temprature=0.5", "data_sources[0].sampling.temprature: unknown key; allowed: "),
    ],
)
def test_bad_sampling_value(at_repo, override, expected) -> None:
    assert config_error([override]).startswith(expected)


def test_data_sources_list_rules(at_repo, tmp_path) -> None:
    assert config_error(["data_sources=[]"]) == "data_sources: at least one data source is required"
    raw = tiny_raw()
    raw["data_sources"].append(dict(raw["data_sources"][0]))
    write_recipe(tmp_path, "twice", raw)
    msg = config_error([], recipe="twice", config_dir=str(tmp_path))
    assert msg == "data_sources: names must be unique, got ['arith', 'arith']"
    raw["data_sources"][1]["name"] = "arith_sub"
    raw["data_sources"][1]["sampling"] = {"temperature": -0.5}
    write_recipe(tmp_path, "second_bad", raw)
    msg = config_error([], recipe="second_bad", config_dir=str(tmp_path))
    assert msg.startswith("data_sources[1].sampling.temperature=-0.5")


def test_hydra_syntax_error_is_one_line(at_repo) -> None:
    msg = config_error(["trainer.micro_batch_tokens=[1,"])
    assert msg.startswith("override 'trainer.micro_batch_tokens=[1,': not valid override syntax; write key=value")
    assert config_error(["trainer.world_size"]).startswith("override 'trainer.world_size': no '='; write key=value")
    assert config_error(["run.name=${nope}"]) == "override 'run.name=${nope}': Interpolation key 'nope' not found"


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["data_sources.5.prompts_per_step=4"], "data_sources.5: the recipe has 1 data source; only index 0 exists"),
        (["~data_sources.1"], "data_sources.1: the recipe has 1 data source; only index 0 exists"),
        (
            ["data_sources.x.name=y"],
            "data_sources.x: data_sources is a list, indexed by number; the recipe has 1 data "
            "source; only index 0 exists",
        ),
        (
            ["trainer.optimizer.betas.2=0.5"],
            "trainer.optimizer.betas.2: trainer.optimizer.betas has 2 items; indices 0 to 1 exist",
        ),
        # counted after the overrides before it: the list an earlier override set
        (["data_sources=[]", "data_sources.0.name=a"], "data_sources.0: the recipe has 0 data sources; it is empty"),
    ],
)
def test_list_index_past_the_end_names_the_count(at_repo, overrides, expected) -> None:
    assert config_error(overrides).startswith(expected)


def test_malformed_recipe_yaml_names_file_line_and_column(tmp_path) -> None:
    bad = tmp_path / "broken.yaml"
    bad.write_text("run: {name: x\n")
    expected = (
        f"{bad}: invalid YAML at line 2, column 1: expected ',' or '}}', but got '<stream end>' "
        "(while parsing a flow mapping at line 1, column 6)"
    )
    assert config_error([], recipe=str(bad)) == expected
    assert config_error([], recipe="broken", config_dir=str(tmp_path)) == expected
    (tmp_path / "tabs.yaml").write_text("run:\n\tname: x\n")
    assert config_error([], recipe="tabs", config_dir=str(tmp_path)).startswith(
        f"{tmp_path / 'tabs.yaml'}: invalid YAML at line 2, column 1: found character '\\t'"
    )


def test_nonexistent_config_dir_is_refused(tmp_path) -> None:
    missing = tmp_path / "nope"
    msg = config_error([], config_dir=str(missing))
    assert msg == f"--config-dir '{missing}': no such directory; pass a folder of recipe YAML files"
    with pytest.raises(ConfigError, match="no such directory"):
        list_recipes(str(missing))
    (tmp_path / "file").write_text("")
    assert "is a file, not a directory" in config_error([], config_dir=str(tmp_path / "file"))


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("evaluation.every_steps=-5", "config.evaluation.every_steps=-5: must be >= 0 (0 = only at start and end)"),
        ("evaluation.pass_k=-1", "config.evaluation.pass_k=-1: must be >= 0 (0 = off)"),
        ("evaluation.max_prompts=0", "config.evaluation.max_prompts=0: must be >= 1"),
        ("checkpoint.every_steps=-1", "config.checkpoint.every_steps=-1: must be >= 0 (0 = only at the end)"),
        ("checkpoint.keep_last=-1", "config.checkpoint.keep_last=-1: must be >= 0 (0 = keep all)"),
        ("run.seed=-1", "config.run.seed=-1: must be >= 0"),
        ("run.total_steps=-3", "config.run.total_steps=-3: must be >= 1"),
        ("run.profile_steps=[-1]", "config.run.profile_steps[0]=-1: must be >= 1 (the first step is 1)"),
        (
            "run.profile_steps=[2,101]",
            "config.run.profile_steps=[2, 101]: step 101 is past run.total_steps=100, so it would never be "
            "profiled; list steps from 1 to 100",
        ),
        ("placement.cpus_per_actor=-1", "config.placement.cpus_per_actor=-1.0: must be > 0"),
        ("placement.gpus_per_actor=-1", "config.placement.gpus_per_actor=-1.0: must be >= 0"),
        ("placement.num_cpus=0", "config.placement.num_cpus=0: must be >= 1"),
        ("placement.torch_threads=-1", "config.placement.torch_threads=-1: must be >= 0 (0 = every core)"),
        ("rollout.max_refill_rounds=-1", "config.rollout.max_refill_rounds=-1: must be >= 0 (0 = no refill)"),
        (
            "trainer.optimizer.warmup_steps=-1",
            "config.trainer.optimizer.warmup_steps=-1: must be >= 0 (0 = no warm-up)",
        ),
        ("trainer.optimizer.eps=0", "config.trainer.optimizer.eps=0.0: must be > 0"),
        ("trainer.optimizer.weight_decay=-0.1", "config.trainer.optimizer.weight_decay=-0.1: must be >= 0"),
        ("trainer.optimizer.grad_clip=0", "config.trainer.optimizer.grad_clip=0.0: must be > 0"),
        ("trainer.optimizer.lr=nan", "config.trainer.optimizer.lr=nan: must be > 0"),
        ("trainer.optimizer.betas=[0.9,1.5]", "config.trainer.optimizer.betas[1]=1.5: must be in [0, 1)"),
        ("trainer.optimizer.betas=[0.9]", "config.trainer.optimizer.betas=[0.9]: must be two numbers"),
        ("trainer.world_size=0", "config.trainer.world_size=0: must be >= 1"),
        ("algorithm.kl_coef=-1", "config.algorithm.kl_coef=-1.0: must be >= 0"),
        ("algorithm.aggregation_constant=0", "config.algorithm.aggregation_constant=0.0: must be > 0"),
        ("run.name=", "config.run.name='': must name a directory under run.output_dir"),
    ],
)
def test_every_numeric_key_has_a_range(at_repo, override, expected) -> None:
    assert config_error([override]).startswith(expected)


def test_zero_still_means_never(at_repo) -> None:
    cfg, _ = load_config(
        RECIPE,
        [
            "evaluation.every_steps=0",
            "checkpoint.every_steps=0",
            "checkpoint.keep_last=0",
            "evaluation.pass_k=0",
            "placement.torch_threads=0",
            "trainer.optimizer.grad_clip=inf",
        ],
    )
    assert (cfg.evaluation.every_steps, cfg.checkpoint.every_steps, cfg.checkpoint.keep_last) == (0, 0, 0)


@pytest.mark.parametrize(
    ("overrides", "need"),
    [
        (
            ["colocate=false", "placement.num_cpus=1"],
            "needs 2 CPUs, 2 bundles (disaggregated: trainer.world_size=1 + "
            "rollout.num_engines=1) x placement.cpus_per_actor=1",
        ),
        (
            ["placement.cpus_per_actor=3", "placement.num_cpus=2"],
            "needs 3 CPUs, 1 bundle (colocated: max(trainer.world_size=1, rollout.num_engines=1))",
        ),
        (["rollout.num_engines=3", "placement.num_cpus=2"], "needs 3 CPUs"),
        (["colocate=false", "placement.cpus_per_actor=0.5", "placement.num_cpus=0"], "num_cpus=0: must be >= 1"),
    ],
)
def test_num_cpus_too_small_for_the_bundles(at_repo, overrides, need) -> None:
    msg = config_error(overrides)
    assert "placement.num_cpus=" in msg and need in msg, msg


def test_num_cpus_enough_for_the_bundles(at_repo) -> None:
    load_config(RECIPE, ["colocate=false", "placement.num_cpus=2"])
    load_config(RECIPE, ["colocate=false", "placement.cpus_per_actor=0.5", "placement.num_cpus=1"])


# ----------------------------------------------------------------------------- aliases
def test_alias_overrides(at_repo) -> None:
    cfg, _ = load_config(RECIPE, ["colocate=false", "resume=true"])
    assert cfg.placement.colocate is False and cfg.checkpoint.resume is True
    cfg, _ = load_config(RECIPE, ["colocate=true", "resume=false"])
    assert cfg.placement.colocate is True and cfg.checkpoint.resume is False
    assert config_error(["colocate=sometimes"]) == "config.placement.colocate: got 'sometimes'; expected true or false"
    assert config_error(["resume=1"]) == "config.checkpoint.resume: got 1; expected true or false"


# ----------------------------------------------------------------------------- finding recipes
def test_search_order_is_config_dir_then_cwd_then_packaged(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    extra = tmp_path / "extra"
    assert recipe_search_path(str(extra)) == [extra, tmp_path / "recipes", packaged_recipe_dir()]
    assert recipe_search_path() == [tmp_path / "recipes", packaged_recipe_dir()]


def test_cwd_recipes_then_config_dir_take_precedence(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    raw = tiny_raw()
    raw["run"]["name"] = "from_cwd"
    in_cwd = write_recipe(tmp_path / "recipes", RECIPE, raw)
    raw["run"]["name"] = "from_config_dir"
    in_extra = write_recipe(tmp_path / "extra", RECIPE, raw)
    raw["run"]["name"] = "only_here"
    write_recipe(tmp_path / "extra", "mine/only_here", raw)

    assert find_recipe(RECIPE) == in_cwd.resolve()
    assert load_config(RECIPE)[0].run.name == "from_cwd"
    assert find_recipe(RECIPE, str(tmp_path / "extra")) == in_extra.resolve()
    assert load_config(RECIPE, config_dir=str(tmp_path / "extra"))[0].run.name == "from_config_dir"
    assert load_config("mine/only_here", config_dir=str(tmp_path / "extra"))[0].run.name == "only_here"
    assert {RECIPE, "mine/only_here"} <= set(list_recipes(str(tmp_path / "extra")))
    # a path to a YAML file works from anywhere
    assert load_config(str(in_extra))[0].run.name == "from_config_dir"


def test_packaged_recipe_dir_matches_the_wheel_layout() -> None:
    """The core's sdist carries recipes/tiny inside the package, where its wheel build hook (and a
    wheel built straight from the repository) puts them and packaged_recipe_dir() looks."""
    core = REPO / "packages" / "loongsage-core"
    meta = tomllib.loads((core / "pyproject.toml").read_text())
    ((source, target),) = meta["tool"]["hatch"]["build"]["targets"]["sdist"]["force-include"].items()
    assert (core / source).resolve() == REPO / "recipes" / "tiny"
    assert target == "src/loongsage/core/recipes/tiny"
    assert 'PACKAGED = "loongsage/core/recipes/tiny"' in (core / "hatch_build.py").read_text()  # hatchling's hook
    # installed from a wheel: inside the package; editable: the repository's recipes/ itself
    assert (
        packaged_recipe_dir().parts[-3:] == ("loongsage", "core", "recipes")
        or packaged_recipe_dir() == REPO / "recipes"
    )


def test_packaged_recipe_found_from_any_directory(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    found = find_recipe(RECIPE)
    assert found.read_text() == (REPO / "recipes" / "tiny" / "grpo_arith_cpu.yaml").read_text()


def test_recipe_not_found_lists_known(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    write_recipe(tmp_path / "recipes", "tiny/a_recipe", tiny_raw())
    write_recipe(tmp_path / "extra", "b/other", tiny_raw())
    msg = config_error([], recipe="tiny/nope", config_dir=str(tmp_path / "extra"))
    assert msg.startswith("recipe 'tiny/nope' not found; looked in: ")
    assert str(tmp_path / "extra") in msg and str(tmp_path / "recipes") in msg
    known = msg.partition("; known: ")[2].split(", ")
    assert {"tiny/a_recipe", "b/other"} <= set(known)


# ----------------------------------------------------------------------------- through the launcher
@pytest.mark.parametrize(
    ("args", "start"),
    [
        (["algorithm.advantage.name=nope"], "algorithm.advantage.name: unknown advantage 'nope'; known: "),
        (["trainer.micro_batch_tokens=abc"], "config.trainer.micro_batch_tokens: got 'abc'"),
        (["model.path=/nonexistent", "model.builder=null"], "model.path='/nonexistent'"),
        (["data_sources.0.sampling.temperature=-1"], "data_sources[0].sampling.temperature=-1.0"),
        (["run.profile_steps=[0]"], "config.run.profile_steps[0]=0: must be >= 1"),
    ],
)
def test_cli_train_bad_config_exits_2_with_one_line(tmp_path, monkeypatch, capsys, args, start) -> None:
    monkeypatch.chdir(tmp_path)
    rc = cli.main(["train", RECIPE, *args, "--config-dir", str(REPO / "recipes")])
    captured = capsys.readouterr()
    assert rc == 2
    assert captured.err.startswith(f"loongsage: error: {start}"), captured.err
    assert captured.err.count("\n") == 1 and captured.err.endswith("\n")
    assert captured.out == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "nothing may be written before validation passes"


def test_cli_train_recipe_from_config_dir_missing_a_key(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    raw = tiny_raw()
    del raw["data_sources"][0]["reader"]
    write_recipe(tmp_path / "extra", "no_reader", raw)
    assert cli.main(["train", "no_reader", "--config-dir", str(tmp_path / "extra")]) == 2
    err = capsys.readouterr().err
    assert err == "loongsage: error: config.data_sources[0].reader: missing required key (type dict[str, Any])\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["extra"]


def test_cli_train_missing_recipe(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    write_recipe(tmp_path / "extra", "mine/ok", tiny_raw())
    assert cli.main(["train", "mine/missing", "--config-dir", str(tmp_path / "extra")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("loongsage: error: recipe 'mine/missing' not found")
    assert "mine/ok" in err


def test_cli_validation_never_imports_ray(tmp_path) -> None:
    """In a fresh interpreter, rejected configs leave Ray unimported (no actor, no cluster)."""
    script = textwrap.dedent(
        f"""
        import contextlib, io, json, sys
        from loongsage.core import cli
        results = []
        for args in ({["algorithm.advantage.name=nope"]!r}, {["trainer.world_size=3"]!r},
                     {["colocate=maybe"]!r}):
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                rc = cli.main(["train", "{RECIPE}", *args, "--config-dir", {str(REPO / "recipes")!r}])
            results.append([rc, err.getvalue()])
        print(json.dumps({{"results": results, "ray": "ray" in sys.modules}}))
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["ray"] is False
    for rc, err in out["results"]:
        assert rc == 2 and err.count("\n") == 1 and err.startswith("loongsage: error: "), err
    assert not any(tmp_path.iterdir())


def test_plugins_key_loads_modules(at_repo, tmp_path, monkeypatch) -> None:
    (tmp_path / "loongsage_cfg_plugin_ok.py").write_text(
        textwrap.dedent(
            """
        from dataclasses import dataclass
        from loongsage.core.hookspecs import hookimpl

        @dataclass(frozen=True)
        class NonEmpty:
            def __call__(self, group):
                return bool(group)

        @hookimpl
        def loongsage_data_filters():
            return {"non_empty": NonEmpty}
        """
        )
    )
    (tmp_path / "loongsage_cfg_plugin_dup.py").write_text(
        textwrap.dedent(
            """
        from loongsage.core.hookspecs import hookimpl

        @hookimpl
        def loongsage_advantage_estimators():
            return {"grpo": object}
        """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("loongsage_cfg_plugin_ok", "loongsage_cfg_plugin_dup"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    cfg, registry = load_config(RECIPE, ["plugins=[loongsage_cfg_plugin_ok]", "algorithm.filters=[{name: non_empty}]"])
    assert cfg.plugins == ["loongsage_cfg_plugin_ok"]
    assert registry.entry("data_filter", "non_empty").provider == "config plugins: loongsage_cfg_plugin_ok"
    msg = config_error(["plugins=[loongsage_cfg_plugin_dup]"])
    assert msg.startswith("advantage 'grpo' is provided twice: by loongsage-algos ")
    assert "and by config plugins: loongsage_cfg_plugin_dup" in msg


def test_incompatible_algorithm_combinations_are_refused() -> None:
    msg = config_error(["algorithm.policy_loss.name=gspo"])  # the recipe aggregates token-mean
    assert msg == ("algorithm.aggregation='token-mean' is not supported by 'gspo'; allowed: seq-mean-token-mean")
    cfg, _ = load_config(
        RECIPE,
        [
            "algorithm.policy_loss.name=gspo",
            "algorithm.policy_loss.params={}",
            "algorithm.aggregation=seq-mean-token-mean",
        ],
    )
    assert cfg.algorithm.policy_loss["name"] == "gspo"
    msg = config_error(["algorithm.advantage.name=gae"])
    assert msg.startswith("algorithm.advantage.name='gae' needs critic values")


def test_nested_reward_specs_are_validated_before_anything_starts() -> None:
    bad = "data_sources.0.reward={name: overlong_shaping, params: {inner: {name: exact_match, params: {nope: 1}}}}"
    msg = config_error([bad])
    assert msg.startswith("data_sources[0].reward.params.inner.params.nope: unknown key; allowed: ")
    good = (
        "data_sources.0.reward={name: overlong_shaping, params: {inner: {name: exact_match}, max_length: 5, buffer: 2}}"
    )
    load_config(RECIPE, [good])


def test_kl_in_reward_needs_an_estimator_that_reads_token_rewards() -> None:
    msg = config_error(["algorithm.kl={name: k3}", "algorithm.kl_coef=0.1", "algorithm.kl_in_reward=true"])
    assert msg.startswith("algorithm.kl_in_reward=true: advantage 'grpo' ignores token rewards")
    load_config(
        RECIPE,
        [
            "algorithm.kl={name: k3}",
            "algorithm.kl_coef=0.1",
            "algorithm.kl_in_reward=true",
            "algorithm.advantage.name=reinforce_pp",
        ],
    )


def test_critic_and_value_estimators_go_together() -> None:
    assert load_config("tiny/ppo_arith_cpu")[0].trainer.critic.optimizer.lr == pytest.approx(1e-3)
    msg = config_error(["+trainer.critic={backend: {name: torch_critic}}"])
    assert msg == "trainer.critic is set but algorithm.advantage 'grpo' does not use values; use gae or drop the critic"
    msg = config_error(["trainer.critic.value_clip=0"], recipe="tiny/ppo_arith_cpu")
    assert msg.startswith("config.trainer.critic.value_clip=0.0: must be > 0")


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ([], "cpu"),
        (["placement.gpus_per_actor=1"], "ipc"),  # colocated on GPUs: every engine on its trainer's card
        (["placement.gpus_per_actor=1", "colocate=false"], "broadcast"),  # cards of their own: NCCL
        (["placement.gpus_per_actor=1", "rollout.transport={name: cpu}"], "cpu"),  # the config can force one
    ],
)
def test_the_weight_transport_follows_the_placement(overrides, expected) -> None:
    cfg, _ = load_config(RECIPE, overrides)
    assert cfg.rollout.transport == {"name": expected} or cfg.rollout.transport["name"] == expected
