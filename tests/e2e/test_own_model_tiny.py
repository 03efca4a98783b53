"""The own-model template end to end: an HF model folder and a JSONL data set made here (chat rows,
the answer nested, one malformed line), trained for two GRPO steps on the CPU through the real
launcher with the overrides the template's comments give for the CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROWS = [
    {
        "prompt": [{"role": "user", "content": f"What is {a} + {b}?"}],
        "reward_model": {"ground_truth": str(a + b), "style": "rule"},
    }
    for a, b in [(1, 2), (3, 4), (2, 2), (5, 1), (6, 3), (7, 0)]
]
# the template's CPU line, then a CI-sized run: 2 prompts x 2 samples, 4 new tokens, no progress bar
CPU = [
    "placement.gpus_per_actor=0",
    "trainer.backend.params.device=cpu",
    "rollout.engine.params.device=cpu",
    "model.dtype=float32",
]
SMALL = [
    "run.name=own_model",
    "run.total_steps=2",
    "data_sources.0.prompts_per_step=2",
    "data_sources.0.samples_per_prompt=2",
    "data_sources.0.sampling.max_new_tokens=4",
    "rollout.engine.params.max_model_len=256",
    "tracking.progress=false",
    "tracking.batches=true",
]


@pytest.fixture(scope="module")
def own_files(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny Qwen3 of random weights with the embedded tokenizer (seconds to build, nothing
    downloaded), and the data set with its second line broken."""
    from loongsage.core.tinytask.tiny_model import build_tiny_qwen3

    root = tmp_path_factory.mktemp("own")
    model = root / "my-model"
    build_tiny_qwen3(model, hidden_size=32, num_layers=1, heads=2, kv_heads=1, intermediate_size=64, seed=3)
    lines = [json.dumps(row) for row in ROWS]
    lines.insert(1, '{"prompt": [{"role": "user", "content": "cut off')
    data = root / "train.jsonl"
    data.write_text("\n".join(lines) + "\n")
    return model, data


def test_the_template_trains_a_model_folder_on_a_data_file(launched, own_files) -> None:
    model, data = own_files
    where = launched(
        [
            "train",
            "templates/grpo_own_model",
            f"model.path={model}",
            f"data_sources.0.reader.params.path={data}",
            "data_sources.0.reader.params.label_key=reward_model.ground_truth",
            *CPU,
            *SMALL,
        ]
    )
    run_dir = where / "runs" / "own_model"
    trained = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [row for row in trained if "train/loss" in row]
    assert [row["step"] for row in trained] == [1, 2]
    assert all(row["rollout/trajectories"] == 4 and 0.0 <= row["rollout/reward_mean"] <= 1.0 for row in trained)
    # the groups trained were the file's good rows (the broken line, row 1, never)
    audit = [json.loads(line) for line in (run_dir / "batches.jsonl").read_text().splitlines()]
    indices = {group["index"] for step in audit for group in step["groups"]}
    assert len(indices) == 4 and indices <= {0, 2, 3, 4, 5, 6}
    log = (run_dir / "run.log").read_text()
    assert f"data source math: 1 of 7 rows of {data} are malformed and left out (on_bad_row: skip)" in log
    assert f"data source math: skipped row 1: {data} row 1: not valid JSON" in log  # each, in the log
    assert (run_dir / "final" / "config.json").is_file()  # the trained policy, an HF folder like the one given
    saved = (run_dir / "config.yaml").read_text()
    assert str(data) in saved and "reward_model.ground_truth" in saved


def test_on_bad_row_error_stops_the_launcher_in_one_line_before_training(in_tmp, own_files, capsys) -> None:
    from loongsage.core.cli import main

    model, data = own_files
    argv = ["train", "templates/grpo_own_model", f"model.path={model}", f"data_sources.0.reader.params.path={data}"]
    mapping = ["data_sources.0.reader.params.label_key=reward_model.ground_truth", "data_sources.0.on_bad_row=error"]
    assert main([*argv, *mapping, *CPU, *SMALL]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"loongsage: error: data source 'math': {data} row 1: not valid JSON (Unterminated string starting at: "
        f"column 41); fix the row, or set on_bad_row: skip (1 of 7 rows of {data} are malformed); the traceback "
        "is in runs/own_model/run.log"
    )
    # nothing trained, nothing to keep: the same command runs once the row is fixed
    assert not (in_tmp / "runs" / "own_model" / "metrics.jsonl").exists()
