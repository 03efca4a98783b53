"""A user's own recipe, in any folder: it extends a shipped recipe through ``defaults``, loads the
``plugins:`` module beside it, and starts from the model it names (``model.path`` over a builder).

Composition and validation only, except one run of the real launcher; nothing here starts Ray.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from loongsage.core.compose import compose
from loongsage.core.config import load_config
from loongsage.core.types import ConfigError

REPO = Path(__file__).resolve().parents[2]
TINY_BUILDER = {"name": "tiny_arith", "params": {}}

PLUGIN = textwrap.dedent(
    """
    from dataclasses import dataclass
    from loongsage.core.hookspecs import hookimpl

    @dataclass(frozen=True)
    class KeepAll:
        def __call__(self, group):
            return True

    @hookimpl
    def loongsage_data_filters():
        return {"keep_all_mine": KeepAll}
    """
)


def one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text, f"error spans several lines: {text!r}"
    return text


def write(folder: Path, name: str, text: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(textwrap.dedent(text))
    return path


@pytest.fixture
def elsewhere(tmp_path, monkeypatch) -> Path:
    """A working directory with no recipes/ of its own (the shipped recipes are still found)."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "path", list(sys.path))  # what loading a plugins: module adds is undone
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    return tmp_path


@pytest.fixture
def hf_folder(tmp_path) -> Path:
    folder = tmp_path / "my_model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    return folder


# ----------------------------------------------------------------------------- defaults: a shipped recipe
def test_a_recipe_in_any_folder_extends_a_shipped_one(elsewhere) -> None:
    mine = write(
        elsewhere / "mine",
        "grpo_short.yaml",
        """
        defaults:
          - tiny/grpo_arith_cpu
          - _self_
        run: {name: grpo_short, total_steps: 3}
        algorithm:
          advantage: {name: rloo}
        """,
    )
    cfg, _ = load_config(str(mine))
    assert (cfg.run.name, cfg.run.total_steps, cfg.run.seed) == ("grpo_short", 3, 1)  # seed from the shipped one
    assert cfg.model.builder == TINY_BUILDER and cfg.algorithm.advantage == {"name": "rloo"}
    assert cfg.data_sources[0].prompts_per_step == 8


def test_a_shipped_recipe_with_defaults_of_its_own_is_extended_whole(elsewhere) -> None:
    mine = write(
        elsewhere / "mine",
        "dapo.yaml",
        """
        defaults:
          - tiny/dapo_arith_cpu
          - _self_
        rollout: {max_refill_rounds: 1}
        """,
    )
    raw = compose(mine.resolve(), ["run.total_steps=2"])
    assert raw["run"] == {"name": "dapo_arith_cpu", "seed": 1, "total_steps": 2}  # dapo over grpo, then mine
    assert raw["algorithm"]["filters"] == [{"name": "dynamic_sampling"}]
    assert raw["rollout"]["max_refill_rounds"] == 1 and raw["rollout"]["refill_oversample"] == 1.5
    assert raw["data_sources"][0]["reward"]["name"] == "overlong_shaping"


def test_a_recipe_renaming_a_shipped_spec_drops_its_params(elsewhere) -> None:
    mine = write(
        elsewhere / "mine",
        "gspo.yaml",
        """
        defaults:
          - tiny/grpo_arith_cpu
          - _self_
        algorithm:
          policy_loss: {name: gspo}
          aggregation: seq-mean-token-mean
        """,
    )
    assert compose(mine.resolve(), [])["algorithm"]["policy_loss"] == {"name": "gspo"}  # not ppo_clip's clip_high


def test_a_default_that_names_no_recipe_says_where_it_looked(elsewhere) -> None:
    mine = write(
        elsewhere / "mine",
        "typo.yaml",
        """
        defaults:
          - tiny/grpo_arith_cpuu
          - _self_
        """,
    )
    with pytest.raises(ConfigError) as exc:
        load_config(str(mine))
    msg = one_line(exc)
    assert msg.startswith(
        f"{mine.resolve()}: defaults: recipe 'tiny/grpo_arith_cpuu' not found; looked in {mine.resolve().parent}, "
    )
    assert str(REPO / "recipes") in msg and "`loongsage recipes` lists the recipes" in msg


# ----------------------------------------------------------------------------- plugins: beside the recipe
def test_a_plugins_module_beside_the_recipe_is_found(elsewhere) -> None:
    folder = elsewhere / "mine"
    write(folder, "my_filters_beside.py", PLUGIN)
    mine = write(
        folder,
        "with_plugin.yaml",
        """
        defaults:
          - tiny/grpo_arith_cpu
          - _self_
        plugins: [my_filters_beside]
        algorithm:
          filters: [{name: keep_all_mine}]
        """,
    )
    try:
        cfg, registry = load_config(str(mine))
        assert registry.entry("data_filter", "keep_all_mine").provider == "config plugins: my_filters_beside"
        # the run's worker processes import it by name too: its folder is on their path
        assert str(folder.resolve()) in sys.path
        assert str(folder.resolve()) in os.environ["PYTHONPATH"].split(os.pathsep)
    finally:
        sys.modules.pop("my_filters_beside", None)


def test_a_plugins_module_in_the_working_directory_is_found(elsewhere) -> None:
    write(Path.cwd(), "my_filters_cwd.py", PLUGIN)
    mine = write(
        elsewhere / "mine",
        "cwd_plugin.yaml",
        """
        defaults:
          - tiny/grpo_arith_cpu
          - _self_
        plugins: [my_filters_cwd]
        """,
    )
    try:
        _, registry = load_config(str(mine))
        assert "keep_all_mine" in registry.names("data_filter")
    finally:
        sys.modules.pop("my_filters_cwd", None)


def test_a_plugins_module_found_nowhere_says_where_it_looked(elsewhere) -> None:
    mine = write(
        elsewhere / "mine",
        "missing_plugin.yaml",
        """
        defaults:
          - tiny/grpo_arith_cpu
          - _self_
        plugins: [my_filters_nowhere]
        """,
    )
    with pytest.raises(ConfigError) as exc:
        load_config(str(mine))
    assert one_line(exc) == (
        "plugins: module 'my_filters_nowhere' failed to import: ModuleNotFoundError: No module named "
        f"'my_filters_nowhere'; looked in the installed packages (sys.path) and in {mine.resolve().parent}, "
        f"{Path.cwd()}; a plugins: module must be importable: put my_filters_nowhere.py beside the recipe or in the "
        "working directory, pip install its package, or add its folder to PYTHONPATH"
    )


def test_loongsage_plugins_finds_a_module_in_the_working_directory(tmp_path) -> None:
    """`loongsage plugins --plugin my_module` where my_module.py is: the console script's own folder
    is first on its path, not the working directory, so it is searched on purpose."""
    write(tmp_path, "my_listed_filters.py", PLUGIN)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    loongsage = Path(sys.executable).parent / "loongsage"
    proc = subprocess.run(
        [str(loongsage), "plugins", "--plugin", "my_listed_filters"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"data_filter +keep_all_mine +config plugins: my_listed_filters", proc.stdout), proc.stdout


def test_the_launcher_runs_a_recipe_from_another_folder_with_its_plugin(tmp_path) -> None:
    """`loongsage train /elsewhere/mine.yaml` from a third folder, no PYTHONPATH: the recipe composes over
    the shipped one and its plugin loads, so the only error is the invalid step count given last."""
    folder = tmp_path / "my_recipes"
    write(folder, "my_launcher_filters.py", PLUGIN)
    write(
        folder,
        "mine.yaml",
        """
        defaults:
          - tiny/grpo_arith_cpu
          - _self_
        plugins: [my_launcher_filters]
        algorithm:
          filters: [{name: keep_all_mine}]
        """,
    )
    cwd = tmp_path / "somewhere"
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-m", "loongsage.core.cli", "train", str(folder / "mine.yaml"), "run.total_steps=0"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (proc.returncode, proc.stderr) == (2, "loongsage: error: config.run.total_steps=0: must be >= 1\n")
    assert not any(cwd.iterdir())


# ----------------------------------------------------------------------------- model.path over model.builder
def test_a_model_path_override_wins_over_the_recipes_builder(hf_folder) -> None:
    cfg, _ = load_config("tiny/grpo_arith_cpu", [f"model.path={hf_folder}"])
    assert (cfg.model.path, cfg.model.builder) == (str(hf_folder), None)
    cfg, _ = load_config("tiny/grpo_arith_cpu", [f"model={{path: {hf_folder}}}"])
    assert (cfg.model.path, cfg.model.builder) == (str(hf_folder), None)


def test_a_builder_override_wins_over_the_recipes_path(elsewhere, hf_folder) -> None:
    mine = write(
        elsewhere / "mine",
        "own_model.yaml",
        f"""
        defaults:
          - tiny/grpo_arith_cpu
          - _self_
        model:
          path: {hf_folder}
        """,
    )
    raw = compose(mine.resolve(), [])
    assert raw["model"]["path"] == str(hf_folder) and raw["model"]["builder"] is None  # the later layer's
    raw = compose(mine.resolve(), ["model.builder={name: tiny_arith}"])
    assert raw["model"]["path"] is None and raw["model"]["builder"] == TINY_BUILDER
    raw = compose(mine.resolve(), ["model.builder.params.steps=5"])
    assert raw["model"]["path"] is None and raw["model"]["builder"] == {"name": "tiny_arith", "params": {"steps": 5}}


def test_one_recipe_file_setting_both_is_refused(elsewhere, hf_folder) -> None:
    mine = write(
        elsewhere / "mine",
        "both.yaml",
        f"""
        defaults:
          - tiny/grpo_arith_cpu
          - _self_
        model:
          path: {hf_folder}
          builder: {{name: tiny_arith}}
        """,
    )
    with pytest.raises(ConfigError) as exc:
        load_config(str(mine))
    assert one_line(exc) == (
        f"{mine.resolve()}: model.path and model.builder are both set, and a run starts from "
        "one model: keep model.path (an HF folder) or model.builder (a model_builder that "
        "makes one)"
    )
    # an override settles it: the command line is a later layer
    cfg, _ = load_config(str(mine), ["model.builder=null"])
    assert cfg.model.path == str(hf_folder)


def test_the_command_line_setting_both_is_refused(hf_folder) -> None:
    with pytest.raises(ConfigError) as exc:
        load_config("tiny/grpo_arith_cpu", [f"model.path={hf_folder}", "model.builder.params.steps=5"])
    assert one_line(exc).startswith("the command line: model.path and model.builder are both set")


def test_a_config_given_whole_with_both_is_refused(hf_folder) -> None:
    from loongsage.core.plugins import load_registry
    from loongsage.core.validation import validate

    raw = compose(REPO / "recipes" / "tiny" / "grpo_arith_cpu.yaml", [])
    raw["model"]["path"] = str(hf_folder)
    with pytest.raises(ConfigError) as exc:
        validate(raw, load_registry())
    assert one_line(exc).startswith("model: model.path and model.builder are both set")
