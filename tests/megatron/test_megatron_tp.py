"""Tensor and pipeline parallelism inside a ``megatron`` trainer replica (CPU, gloo): split two ways,
or two ways in each of two pipeline stages, a replica computes what the unsplit one computes.
Log-probs and entropies come from the vocabulary shards without gathering the logits; the gradient
norm counts the shards over the ranks, the replicated norms once and the last stage's copy of the
tied embedding not at all; the two copies of the tied embedding take the same step; the exported
HF tensors are gathered on the replica's first rank; a checkpoint resumes exactly, every shard's
optimizer state included. A layout that does not divide is refused in one line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "core" / "engine"))
from _engine_helpers import build_engine_test_model  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from _worker_server import run_worker  # noqa: E402

WORKER = Path(__file__).with_name("_tp_worker.py")


def _run(model_dir: str, work: Path, tp: int, pp: int = 1) -> dict:
    run = run_worker(WORKER, model_dir, str(work), str(tp), str(pp), timeout=280)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    return torch.load(work / (f"tp{tp}" + (f"_pp{pp}" if pp > 1 else "") + ".pt"), weights_only=False)


@pytest.fixture(scope="module")
def unsplit(tmp_path_factory):
    work = tmp_path_factory.mktemp("tp")
    model_dir = build_engine_test_model(work / "m")  # Qwen3 (q/k norms), tied embeddings
    return model_dir, work, _run(model_dir, work, 1)


@pytest.mark.timeout(600)
def test_a_replica_split_two_ways_computes_as_one(unsplit):
    model_dir, work, one = unsplit
    two = _run(model_dir, work, 2)
    assert two["layouts"] == [(0, 1, True), (0, 1, False)]  # one data-parallel rank; rank 0 answers
    _same(one, two)


@pytest.mark.timeout(600)
def test_a_replica_in_two_pipeline_stages_of_two_tensor_parallel_ranks_computes_as_one(unsplit):
    """Two layers in two stages, three micro-batches in flight in the one-forward-one-backward
    order; the embedding on the first stage and its tied copy on the last."""
    model_dir, work, one = unsplit
    four = _run(model_dir, work, 2, 2)
    # one data-parallel rank; the last stage's first rank answers (its log-probs and losses)
    assert four["layouts"] == [(0, 1, False), (0, 1, False), (0, 1, True), (0, 1, False)]
    assert four["others_exported"] == [{}, {}, {}]  # every stage's tensors reach rank 0
    _same(one, four)


def _same(one: dict, two: dict) -> None:
    mask = torch.ones_like(one["logprobs"], dtype=torch.bool)
    mask[:, :8] = False
    for key in ("logprobs", "entropy"):
        assert (one[key] - two[key])[mask].abs().max() < 1e-5, key
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
    # after one AdamW step (lr 1e-3): its first update is about lr x sign(gradient), so gradients that
    # round apart move weights apart by up to 2e-3 where they are near zero
    assert (one["after"] - two["after"])[mask].abs().max() < 1e-3
    assert one["exported"].keys() == two["exported"].keys()
    diffs = {n: (t - two["exported"][n]).abs().max().item() for n, t in one["exported"].items()}
    assert max(diffs.values()) <= 2.5e-3, diffs
    assert two["resumed_exact"] and two["resumed_step_exact"]
    assert two["bf16_masters"] and two["bf16_grad_norm"] == pytest.approx(one["bf16_grad_norm"], rel=2e-2)
    assert two["bf16_split_grad_norm"] == pytest.approx(two["bf16_grad_norm"], rel=1e-5)  # the distributed optimizer
    # a held MOPD teacher, split as the student: its log-probs, and steps on its full and top-k distributions
    assert (one["teacher_logprobs"] - two["teacher_logprobs"])[mask].abs().max() < 1e-5
    assert not torch.equal(one["teacher_logprobs"][mask], one["logprobs"][mask])  # another model than the student
    assert two["distill_grad_norms"] == pytest.approx(one["distill_grad_norms"], rel=1e-4)
    # a teacher worker's whole distribution in the batch: the held teacher's first step
    assert two["shipped_grad_norm"] == pytest.approx(one["distill_grad_norms"][0], rel=1e-4)
    assert one["shipped_grad_norm"] == pytest.approx(one["distill_grad_norms"][0], rel=1e-4)


def test_a_layout_that_does_not_divide_is_refused_in_one_line(tmp_path):
    from loongsage.megatron.trainer import MegatronTrainer

    model_dir = build_engine_test_model(tmp_path / "m")  # 4 heads, 2 key/value groups, ffn 128, 2 layers
    config = json.loads((Path(model_dir) / "config.json").read_text())
    cases = (
        ({"tensor_parallel": 2}, 3, "tensor_parallel=2 does not divide trainer.world_size=3; allowed: a divisor of 3"),
        ({"tensor_parallel": 4}, 4, "tensor_parallel=4 does not divide num_key_value_heads=2; allowed: a divisor of 2"),
        (
            {"pipeline_parallel": 4},
            4,
            "pipeline_parallel=4 does not divide num_hidden_layers=2; allowed: a divisor of 2 (equal stages)",
        ),
        (
            {"pipeline_parallel": 2, "tensor_parallel": 2},
            2,
            "tensor_parallel=2 x pipeline_parallel=2 does not divide "
            "trainer.world_size=2; allowed: a product that divides it (the ranks of one replica)",
        ),
    )
    for params, world, message in cases:
        with pytest.raises(ValueError) as err:
            MegatronTrainer.preflight(params, model_dir, world_size=world)
        assert str(err.value) == message and "\n" not in str(err.value)
    assert config["num_key_value_heads"] == 2 and config["num_hidden_layers"] == 2
