"""The GPU recipes of published models (recipes/qwen3_*/): each composes and validates with stand-ins
for its model folder (a config.json of the model's shape, dense or a mixture of experts, the
embedded tokenizer), its data file and, for an OpenCode agent, its install folder (validating the
agent only checks the install's layout; the CLI itself runs in tests/agentflow and tests/e2e),
its parallel layout passes the trainer's checks against that shape, it asks for exactly the cards
of its node, and its step's rows split evenly over the data-parallel ranks and mini-batches."""

from __future__ import annotations

from pathlib import Path

import pytest

from loongsage.core.config import load_config, placement_demand
from loongsage.core.workers import model_args

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
# recipe -> (the shape's preset, its architecture, the cards of its node)
SEED = {
    "qwen3_4b/dapo_h800_1node": ("qwen3-4b", "Qwen3ForCausalLM", 8),
    "qwen3_30b_a3b/dapo_h20_1node": ("qwen3-30b-a3b", "Qwen3MoeForCausalLM", 8),
    "qwen3_30b_a3b/mopd_h20_1node": ("qwen3-30b-a3b", "Qwen3MoeForCausalLM", 8),
    "qwen3_coder_30b_a3b/opencode_h20_4node": ("qwen3-30b-a3b", "Qwen3MoeForCausalLM", 32),
}


def test_every_recipe_of_a_published_model_is_checked_here():
    found = sorted(str(p.relative_to(RECIPES).with_suffix("")) for p in RECIPES.glob("qwen3_*/*.yaml"))
    assert found == sorted(SEED)


def _stand_ins(tmp_path: Path, preset: str, arch: str) -> tuple[Path, Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import Qwen3Config, Qwen3MoeConfig

    from loongsage.core.tinytask.shapes import PRESETS
    from loongsage.core.tinytask.tokenizer import build_tokenizer

    model = tmp_path / "model"
    kind = Qwen3MoeConfig if "Moe" in arch else Qwen3Config
    kind(**PRESETS[preset], architectures=[arch]).save_pretrained(model)
    build_tokenizer().save_pretrained(model)
    data = tmp_path / "data.parquet"
    pq.write_table(pa.table({"prompt": ["1+1?", "2+2?"], "label": ["2", "4"]}), data)
    return model, data


def _opencode_stand_in(root: Path) -> Path:
    """The layout of an OpenCode install (``opencode_install``), its binary a stub that never runs here."""
    for name in ("opencode-linux-x64", "opencode-linux-x64-baseline", "opencode-linux-arm64"):
        binary = root / "node_modules" / name / "bin" / "opencode"
        binary.parent.mkdir(parents=True)
        binary.write_text("#!/bin/sh\nexit 1\n")
        binary.chmod(0o755)
    (root / "config" / "node_modules" / "@opencode-ai" / "plugin").mkdir(parents=True)
    return root


@pytest.mark.parametrize("name", sorted(SEED))
def test_a_seed_recipe_fits_its_model_and_its_node(name, tmp_path):
    preset, arch, cards = SEED[name]
    model, data = _stand_ins(tmp_path, preset, arch)
    import yaml

    # every source reads the stand-in data; a teacher held by the trainer is the stand-in model
    raw = yaml.safe_load((RECIPES / f"{name}.yaml").read_text())
    overrides = [f"model.path={model}"]
    for i, source in enumerate(raw["data_sources"]):
        overrides.append(f"data_sources.{i}.reader.params.path={data}")
        if (source.get("teacher") or {}).get("name") == "trainer":
            overrides.append(f"data_sources.{i}.teacher.params.path={model}")
        if (source.get("agent") or {}).get("name") == "opencode":
            install = _opencode_stand_in(tmp_path / f"opencode_{i}")
            overrides.append(f"data_sources.{i}.agent.params.install_dir={install}")
    cfg, registry = load_config(name, overrides, config_dir=str(RECIPES))
    spec = cfg.trainer.backend
    params = registry.check("trainer", spec, "trainer.backend", skip=tuple(model_args(cfg, str(model))))
    preflight = registry.entry("trainer", spec["name"], "trainer.backend").preflight
    preflight(params, str(model), world_size=cfg.trainer.world_size)  # the layout against the shape
    assert placement_demand(cfg)[0]["GPU"] == cards
    dp = cfg.trainer.world_size // (int(params.get("tensor_parallel", 1)) * int(params.get("pipeline_parallel", 1)))
    rows = sum(s.prompts_per_step * s.samples_per_prompt for s in cfg.data_sources)
    assert rows % (dp * cfg.trainer.mini_batches_per_step) == 0
    # a layout the shape does not allow is refused in one line
    with pytest.raises(
        ValueError, match=rf"^tensor_parallel=3 does not divide trainer.world_size={cfg.trainer.world_size}"
    ):
        preflight({**params, "tensor_parallel": 3}, str(model), world_size=cfg.trainer.world_size)
