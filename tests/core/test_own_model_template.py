"""The template for a model and data of one's own (recipes/templates/grpo_own_model.yaml) and its
guide (docs/own_model_and_data.md): every command of the guide and every override line of the
template's comments validates once the two placeholder paths name a model folder and a data file,
with the cards and the weight transport it says; left as written, the template names the path to
set. Composition and validation only, no Ray: tests/e2e/test_own_model_tiny.py runs the template.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from loongsage.core.config import load_config, placement_bundles
from loongsage.core.types import ConfigError

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = "templates/grpo_own_model"
GUIDE = REPO / "docs" / "own_model_and_data.md"
PLACEHOLDERS = ("<HF model folder>", "<data file>")


@pytest.fixture
def own_files(tmp_path) -> dict[str, str]:
    """Stand-ins for what a user brings (validation reads the data file, and of the model folder
    only that it has a config.json)."""
    model = tmp_path / "my-model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"prompt": "What is 1 + 1?", "label": "2"}) + "\n")
    return dict(zip(PLACEHOLDERS, (str(model), str(data))))


def guide_commands() -> list[str]:
    """The guide's `loongsage train` commands of the template, continued lines joined."""
    found, held = [], ""
    for line in GUIDE.read_text().splitlines():
        line = held + line.strip()
        if line.endswith("\\"):
            held = line[:-1].rstrip() + " "
            continue
        held = ""
        if line.startswith("uv run loongsage train " + TEMPLATE):
            found.append(line)
    return found


def test_the_guide_shows_the_template_commands() -> None:
    commands = guide_commands()
    assert len(commands) == 4 and all(all(p in c for p in PLACEHOLDERS) for c in commands), commands


@pytest.mark.parametrize("command", guide_commands())
def test_each_command_of_the_guide_validates_with_the_users_files(command, own_files) -> None:
    for placeholder, path in own_files.items():
        command = command.replace(placeholder, path)
    assert "<" not in command, f"a placeholder the test does not fill: {command}"
    argv = shlex.split(command)[4:]  # after `uv run loongsage train`
    cfg, _ = load_config(argv[0], argv[1:])
    assert (cfg.model.path, cfg.data_sources[0].reader["params"]["path"]) == tuple(own_files.values())
    cards = sum(bundle.get("GPU", 0) for bundle in placement_bundles(cfg))
    if cfg.placement.colocate:  # a card holds a trainer rank and an engine, and the weights go by CUDA IPC
        assert cards == cfg.trainer.world_size == cfg.rollout.num_engines
        assert cfg.rollout.transport == {"name": "ipc"}
    else:  # cards of their own, the weights by NCCL
        assert cards == cfg.trainer.world_size + cfg.rollout.num_engines == 8
        assert cfg.rollout.transport == {"name": "broadcast"}


def _comment_overrides(title: str) -> list[str]:
    """The override line under ``title`` in the template's header comment, N and T, E made 8 and 4."""
    lines = (REPO / "recipes" / f"{TEMPLATE}.yaml").read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(f"# {title}"))
    words = shlex.split(lines[at + 1].lstrip("#"))
    return [re.sub(r"=N$", "=8", re.sub(r"=[TE]$", "=4", w)) for w in words]


@pytest.mark.parametrize(
    ("title", "cards"),
    [("N GPUs of one node", 8), ("Disaggregated", 8), ("On the CPU", 0)],
)
def test_the_overrides_in_the_templates_comments_validate(title, cards, own_files) -> None:
    paths = [
        f"model.path={own_files['<HF model folder>']}",
        f"data_sources.0.reader.params.path={own_files['<data file>']}",
    ]
    cfg, _ = load_config(TEMPLATE, paths + _comment_overrides(title))
    assert sum(bundle.get("GPU", 0) for bundle in placement_bundles(cfg)) == cards
    if cards == 0:
        assert cfg.rollout.transport == {"name": "cpu"} and cfg.model.dtype == "float32"


def test_as_written_the_template_names_the_path_to_set(own_files) -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(TEMPLATE)
    assert str(exc.value) == "model.path='models/my-model': not an HF model folder (no config.json there)"
    with pytest.raises(ConfigError) as exc:
        load_config(TEMPLATE, [f"model.path={own_files['<HF model folder>']}"])
    assert str(exc.value) == "data_sources[0].reader.params.path='data/train.jsonl': file not found"


def test_the_template_is_grpo_with_the_math_reward_colocated_on_one_gpu(own_files) -> None:
    cfg, registry = load_config(
        TEMPLATE,
        [
            f"model.path={own_files['<HF model folder>']}",
            f"data_sources.0.reader.params.path={own_files['<data file>']}",
        ],
    )
    source = cfg.data_sources[0]
    assert cfg.algorithm.advantage == {"name": "grpo"} and source.reward == {"name": "math"}
    assert registry.entry("reward", "math", "reward").provider.startswith("loongsage-algos")
    assert cfg.placement.colocate and placement_bundles(cfg) == [{"CPU": 1.0, "GPU": 1.0}]
    assert source.on_bad_row == "skip"
    reader = registry.create("data_source", source.reader)
    assert reader[0].prompt.endswith("put your final answer within \\boxed{}.")  # the template's prompt_format
