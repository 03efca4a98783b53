"""A third-party distribution joins through its entry point alone: listed, selected, validated.

The fixture (tests/fixtures/third_party_plugin) is installed into a temporary ``--target``
directory and only subprocesses with ``PYTHONPATH=<target>`` see it; this process never does.
"""

from __future__ import annotations

import configparser
import importlib.util
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from loongsage.core.plugins import load_registry
from loongsage.core.types import AdvantageInput
from tests.e2e import _third_party as third_party

REPO = Path(__file__).resolve().parents[2]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve string annotations through sys.modules
    spec.loader.exec_module(module)
    return module


PROVIDER = f"{third_party.DISTRIBUTION} 0.1.0 ({third_party.MODULE})"


@pytest.fixture(scope="module")
def plugin_dir(tmp_path_factory) -> Path:
    return third_party.install_third_party_plugin(tmp_path_factory.mktemp("third_party_site"))


def test_installed_as_an_ordinary_distribution(plugin_dir) -> None:
    (dist_info,) = plugin_dir.glob("loongsage_centered_reward-0.1.0.dist-info")
    eps = configparser.ConfigParser()
    eps.read_string((dist_info / "entry_points.txt").read_text())
    assert dict(eps["loongsage"]) == {"centered_reward": third_party.MODULE}
    assert not (plugin_dir / "loongsage").exists(), "the plugin must not drag a copy of the framework along"


def test_invisible_without_the_install_on_the_path() -> None:
    assert "centered_reward" not in load_registry().names("advantage")


VALIDATE = textwrap.dedent(
    """
    import contextlib, io, json, sys
    import torch
    from loongsage.core import cli
    from loongsage.core.config import load_config
    from loongsage.core.types import AdvantageInput, ConfigError

    CONFIG_DIR = sys.argv[1]
    out = {}
    listing = io.StringIO()
    with contextlib.redirect_stdout(listing):
        out["plugins_rc"] = cli.main(["plugins", "--verbose"])
    out["plugins"] = listing.getvalue()
    cfg, registry = load_config("tiny/grpo_arith_cpu", ["algorithm.advantage.name=centered_reward",
                                                       "algorithm.advantage.params.scale=2"], config_dir=CONFIG_DIR)
    registry.pm.check_pending()
    out["spec"] = cfg.algorithm.advantage
    out["provider"] = registry.entry("advantage", "centered_reward").provider
    estimator = registry.create("advantage", cfg.algorithm.advantage, "algorithm.advantage")
    adv = estimator(AdvantageInput(rewards=torch.tensor([1.0, 0.0, 0.0, 0.0]), group_ids=torch.tensor([0, 0, 1, 1]),
                                   response_mask=torch.ones(4, 2)))
    out["advantages"] = adv[:, 0].tolist()
    out["errors"] = []
    for overrides in (["algorithm.advantage.params.scael=2"], ["algorithm.advantage.params.scale=big"],
                      ["algorithm.advantage.params.scale=0"]):
        try:
            cfg, registry = load_config("tiny/grpo_arith_cpu", ["algorithm.advantage.name=centered_reward", *overrides],
                                        config_dir=CONFIG_DIR)
            registry.create("advantage", cfg.algorithm.advantage, "algorithm.advantage")
            out["errors"].append(None)
        except ConfigError as exc:
            out["errors"].append(str(exc))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = cli.main(["train", "tiny/grpo_arith_cpu", "algorithm.advantage.name=centered_reward",
                       "algorithm.advantage.params.scael=2", "--config-dir", CONFIG_DIR])
    out["cli"] = [rc, err.getvalue()]
    out["ray_imported"] = "ray" in sys.modules
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def validated(plugin_dir, tmp_path_factory) -> dict:
    """One fresh interpreter that sees the install: `loongsage plugins`, then validation, then refusals."""
    cwd = tmp_path_factory.mktemp("third_party_cwd")
    proc = subprocess.run(
        [sys.executable, "-c", VALIDATE, str(REPO / "recipes")],
        cwd=cwd,
        env=third_party.env_with(plugin_dir),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr
    assert not any(cwd.iterdir()), "validation wrote files"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_loongsage_plugins_lists_it_with_its_distribution(validated) -> None:
    assert validated["plugins_rc"] == 0
    out = validated["plugins"]
    row = re.search(r"^loongsage_advantage_estimators\s+advantage\s+centered_reward\s+(.+)$", out, re.MULTILINE)
    assert row and row.group(1).strip() == PROVIDER, out
    assert "params: scale: float = 1.0" in out
    assert re.search(r"^loongsage_advantage_estimators\s+advantage\s+grpo\s+loongsage-algos ", out, re.MULTILINE)


def test_recipe_selects_it_by_name(validated) -> None:
    assert validated["spec"] == {"name": "centered_reward", "params": {"scale": 2.0}}
    assert validated["provider"] == PROVIDER
    # batch mean 0.25, scale 2: the whole batch is the baseline, not the group
    assert validated["advantages"] == pytest.approx([1.5, -0.5, -0.5, -0.5])
    assert validated["ray_imported"] is False


def test_wrong_params_name_the_key(validated) -> None:
    unknown, wrong_type, out_of_range = validated["errors"]
    assert unknown == "algorithm.advantage.params.scael: unknown key; allowed: scale"
    assert wrong_type == "algorithm.advantage.params.scale: got 'big'; expected a number"
    assert out_of_range is not None and out_of_range.startswith("algorithm.advantage.params: ")
    assert "scale=0.0: must be > 0" in out_of_range
    rc, err = validated["cli"]
    assert rc == 2 and err == f"loongsage: error: {unknown}\n"


def test_estimator_math_in_process(monkeypatch) -> None:
    """The fixture's estimator itself (loaded by path: nothing is registered in this process)."""
    monkeypatch.delitem(sys.modules, "loongsage_centered_reward_direct", raising=False)  # removed again after
    module = _load("loongsage_centered_reward_direct", third_party.FIXTURE / f"{third_party.MODULE}.py")
    mask = torch.tensor([[0, 1, 1], [0, 1, 0], [1, 1, 1], [0, 0, 1]], dtype=torch.float32)
    rewards = torch.tensor([1.0, 0.0, float("nan"), 0.5])
    adv = module.CenteredReward(scale=2.0)(
        AdvantageInput(rewards=rewards, group_ids=torch.arange(4), response_mask=mask)
    )
    expected = torch.tensor([1.0, -1.0, 0.0, 0.0])[:, None] * mask  # mean of the finite rewards is 0.5
    assert torch.allclose(adv, expected, atol=0, rtol=1e-6), adv  # (torch.testing's first call costs seconds)
    assert adv.dtype == torch.float32 and module.CenteredReward.needs_values is False
    with pytest.raises(ValueError, match="scale"):
        module.CenteredReward(scale=0.0)
    assert set(module.loongsage_advantage_estimators()) == {"centered_reward"}


def test_a_recipe_trains_with_it_by_name(plugin_dir, model_cache, tmp_path) -> None:
    """The real launcher, its own Ray, a short GRPO run whose advantage comes from the plugin."""
    (tmp_path / "recipes").symlink_to(REPO / "recipes")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "loongsage.core.cli",
            "train",
            "tiny/grpo_arith_cpu",
            "run.name=third_party",
            "algorithm.advantage.name=centered_reward",
            "algorithm.advantage.params.scale=0.5",
            "run.total_steps=2",
            "data_sources.0.prompts_per_step=4",
            "data_sources.0.samples_per_prompt=4",
            "evaluation.max_prompts=8",
            "evaluation.pass_k=0",
            "tracking.progress=false",
            "checkpoint.export_hf=false",
        ],
        cwd=tmp_path,
        env=third_party.env_with(plugin_dir),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = (tmp_path / "runs" / "third_party" / "config.yaml").read_text()
    assert "centered_reward" in config
    rows = [json.loads(line) for line in (tmp_path / "runs" / "third_party" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in trained] == [1, 2]
    # the plugin's estimator shaped the update: batch-centred rewards give non-zero advantages
    assert any(r["train/advantage_abs_mean"] > 0 for r in trained)
