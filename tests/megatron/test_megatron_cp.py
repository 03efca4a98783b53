"""Context parallelism inside a ``megatron`` trainer replica (CPU, gloo): every sequence split over
two ranks (alone, with two tensor-parallel ranks, and in two pipeline stages), each rank holding two
of its four chunks, computes what the unsplit replica computes: log-probs and entropies, the
gradient norm, the step, the exported weights; a checkpoint resumes exactly. Layouts it does not
take are refused in one line."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "core" / "engine"))
from _engine_helpers import build_engine_test_model  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from _worker_server import run_worker  # noqa: E402

WORKER = Path(__file__).with_name("_cp_worker.py")


def _run(model_dir: str, work: Path, cp: int, tp: int = 1, pp: int = 1) -> dict:
    run = run_worker(WORKER, model_dir, str(work), str(cp), str(tp), str(pp), timeout=280)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    return torch.load(work / f"cp{cp}_tp{tp}_pp{pp}.pt", weights_only=False)


@pytest.fixture(scope="module")
def unsplit(tmp_path_factory):
    work = tmp_path_factory.mktemp("cp")
    model_dir = build_engine_test_model(work / "m")  # Qwen3 (q/k norms), tied embeddings
    return model_dir, work, _run(model_dir, work, 1)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)])
def test_sequences_split_over_two_context_parallel_ranks_compute_as_unsplit(unsplit, tp, pp):
    model_dir, work, one = unsplit
    two = _run(model_dir, work, 2, tp, pp)
    assert [d for d, _, _ in two["layouts"]] == [0] * (2 * tp * pp)  # one data-parallel rank: the same rows
    assert sum(lead for _, _, lead in two["layouts"]) == 1
    mask = one["logprobs"] != 0
    for key in ("logprobs", "entropy"):
        assert (one[key] - two[key])[mask].abs().max() < 1e-5, key
    assert (two["logprobs"][~mask] == 0).all()
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
    assert (one["after"] - two["after"])[mask].abs().max() < 1e-3  # AdamW's first step: lr x sign(gradient)
    diffs = {n: (t - two["exported"][n]).abs().max().item() for n, t in one["exported"].items()}
    assert one["exported"].keys() == two["exported"].keys() and max(diffs.values()) <= 2.5e-3, diffs
    assert two["resumed_exact"] and two["resumed_step_exact"]


def test_layouts_context_parallelism_does_not_take_are_refused_in_one_line(tmp_path):
    from loongsage.megatron.layout import Layout

    model_dir = build_engine_test_model(tmp_path / "m")
    config = __import__("json").loads((Path(model_dir) / "config.json").read_text())
    with pytest.raises(ValueError, match=r"^context_parallel=3 does not divide trainer.world_size=4; allowed"):
        Layout(cp=3).check(config, 4)
    with pytest.raises(
        ValueError,
        match=r"^tensor_parallel=2 x pipeline_parallel=1 x context_parallel=2 does not "
        r"divide trainer.world_size=6",
    ):
        Layout(tp=2, cp=2).check(config, 6)
    with pytest.raises(ValueError, match=r"^context_parallel=2 with expert_parallel=2 is not supported yet"):
        Layout(cp=2, ep=2).check(config, 4)
    with pytest.raises(ValueError, match=r"context_parallel=0; allowed: an integer >= 1"):
        Layout.of({"context_parallel": 0})
