"""Expert parallelism in the ``megatron`` trainer (CPU, gloo): two data-parallel ranks of a tiny
Qwen3-MoE with its experts split two ways compute what they compute with every expert on both
ranks. The ranks' micro-batches differ in count and shape (the all-gather dispatcher needs equal
token counts: the forward pads to the group's largest); an expert's gradient is summed over the
ranks that hold it, a dense one over all; the gradient norm counts each expert once; the exports
gather every expert on rank 0 in HF's fused layout; a checkpoint resumes exactly, each rank's
experts' optimizer state included; the distributed optimizer (the experts in a bucket of their
own) steps as the whole one and resumes exactly. The same on four ranks with tensor parallelism
(and sequence parallelism) as well, and on four ranks in two pipeline stages, replaying routes
through recomputed layers. Layouts that cannot split the experts are refused in one line."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _moe_worker import EXPERTS, build  # noqa: E402
from _worker_server import run_worker  # noqa: E402

WORKER = Path(__file__).with_name("_ep_worker.py")


def _run(model_dir: str, work: Path, tp: int, ep: int, world: int, pp: int = 1, etp: int | None = None) -> list[dict]:
    args = [str(tp), str(ep), str(world), str(pp)] + ([str(etp)] if etp is not None else [])
    run = run_worker(WORKER, model_dir, str(work), *args, timeout=500)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    name = f"tp{tp}_ep{ep}" + (f"_pp{pp}" if pp > 1 else "") + (f"_etp{etp}" if etp is not None else "")
    return torch.load(work / f"{name}.pt", weights_only=False)


def _same_step(one: dict, two: dict, what: str) -> None:
    """Two runs of one data-parallel rank's rows computed the same: log-probs, a step, a resume."""
    mask = torch.ones_like(one["logprobs"], dtype=torch.bool)
    mask[:, :8] = False
    for key in ("logprobs", "entropy", "replayed"):
        assert (one[key] - two[key])[mask].abs().max() < 1e-5, (what, key)
    assert (one["replayed"] - one["logprobs"])[mask].abs().max() > 1e-3  # the routes were replayed
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5), what
    assert (one["after"] - two["after"])[mask].abs().max() < 1e-3, what  # AdamW's first step: lr x sign(g)
    assert two["resumed_exact"] and two["resumed_step_exact"], what
    # replayed routes, every layer recomputed in the backward on its micro-batch's own routes
    assert two["replayed_grad_norm"] == pytest.approx(one["replayed_grad_norm"], rel=1e-5), what
    assert abs(one["replayed_grad_norm"] - one["grad_norm"]) > 1e-2, what
    # two held MOPD teachers split as the student (one without rows on a rank: a filler forward there)
    assert (one["teacher_logprobs"] - two["teacher_logprobs"])[mask].abs().max() < 1e-5, what
    assert two["distill_grad_norm"] == pytest.approx(one["distill_grad_norm"], rel=1e-5), what
    assert abs(one["distill_grad_norm"] - one["grad_norm"]) > 1e-3, what
    for r in (one, two):  # the distributed optimizer steps as the whole one
        assert r["split_grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-6), what
        assert (r["split_after"] - r["after"])[mask].abs().max() < 1e-5, what
        assert r["split_resumed_step_exact"], what


def _exports_agree(reference: dict, exported: dict) -> None:
    assert exported.keys() == reference.keys()
    assert exported["model.layers.1.mlp.experts.gate_up_proj"].shape[0] == EXPERTS
    diffs = {n: (t - exported[n]).abs().max().item() for n, t in reference.items()}
    assert max(diffs.values()) <= 2.5e-3, diffs


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    work = tmp_path_factory.mktemp("ep")
    model_dir = build(work / "moe")
    return model_dir, work, _run(model_dir, work, 1, 1, 2)  # every expert on both data-parallel ranks


@pytest.mark.timeout(900)
def test_experts_split_over_two_ranks_train_as_replicated_ones(moe):
    model_dir, work, whole = moe
    split = _run(model_dir, work, 1, 2, 2)
    assert [r["layout"] for r in split] == [(0, 2, True), (1, 2, True)]  # each rank a data-parallel rank
    assert [r["local_experts"] for r in whole] == [EXPERTS * 2] * 2  # per layer, two layers
    assert [r["local_experts"] for r in split] == [EXPERTS] * 2
    for rank, (one, two) in enumerate(zip(whole, split)):
        _same_step(one, two, f"ep2 rank {rank}")
    assert whole[0]["grad_norm"] == whole[1]["grad_norm"]  # the same gradients after the sum
    assert split[1]["exported"] == {}  # rank 0 gathers the experts; the other rank yields nothing
    _exports_agree(whole[0]["exported"], split[0]["exported"])


@pytest.mark.timeout(900)
def test_a_replica_split_by_tensor_and_expert_parallelism_trains_as_a_whole_one(moe):
    """Four ranks: two data-parallel replicas of two tensor-parallel ranks each, with sequence
    parallelism between the layers, the experts split over both (each expert's weights in halves
    too)."""
    model_dir, work, whole = moe
    split = _run(model_dir, work, 2, 2, 4)
    leaders = {r["layout"][0]: r for r in split if r["layout"][2]}
    assert [r["layout"] for r in split] == [(0, 2, True), (0, 2, False), (1, 2, True), (1, 2, False)]
    assert [r["local_experts"] for r in split] == [EXPERTS] * 4
    for rank in (0, 1):
        _same_step(whole[rank], leaders[rank], f"tp2 ep2 data-parallel rank {rank}")
    assert all(r["exported"] == {} for r in split[1:])
    _exports_agree(whole[0]["exported"], split[0]["exported"])


@pytest.mark.timeout(900)
def test_experts_split_in_two_pipeline_stages_train_as_replicated_ones(moe):
    """Four ranks: two data-parallel replicas in two pipeline stages (a layer each), the experts
    of each stage's layer split over the stage's two ranks. Rank 0's rows take two micro-batches,
    rank 1's one and a padding pass: in the one-forward-one-backward order two micro-batches are
    in flight on the first stage, and a recomputed layer must take the routes of the right one."""
    model_dir, work, whole = moe
    split = _run(model_dir, work, 1, 2, 4, pp=2)
    assert [r["layout"] for r in split] == [(0, 2, False), (1, 2, False), (0, 2, True), (1, 2, True)]
    assert [r["local_experts"] for r in split] == [EXPERTS // 2] * 4  # one layer per stage, half its experts
    leaders = {r["layout"][0]: r for r in split if r["layout"][2]}
    for rank in (0, 1):
        _same_step(whole[rank], leaders[rank], f"ep2 pp2 data-parallel rank {rank}")
    assert all(r["exported"] == {} for r in split[1:])  # every stage's tensors reach rank 0
    _exports_agree(whole[0]["exported"], split[0]["exported"])


@pytest.mark.timeout(900)
def test_whole_experts_over_the_tensor_parallel_ranks_train_as_replicated_ones(moe):
    """Four ranks: two replicas of two tensor-parallel ranks, each expert whole on its rank
    (``expert_tensor_parallel: 1``): the two tensor-parallel ranks of a replica hold different
    experts, as in Megatron's TP4 PP2 EP4 layouts."""
    model_dir, work, whole = moe
    split = _run(model_dir, work, 2, 2, 4, etp=1)
    assert [r["layout"] for r in split] == [(0, 2, True), (0, 2, False), (1, 2, True), (1, 2, False)]
    assert [r["local_experts"] for r in split] == [EXPERTS] * 4  # half of each layer's, two layers
    assert {r["expert_rows"] for r in split} == {2 * 32}  # gate and up whole (moe_intermediate_size 32)
    leaders = {r["layout"][0]: r for r in split if r["layout"][2]}
    for rank in (0, 1):
        _same_step(whole[rank], leaders[rank], f"tp2 ep2 etp1 data-parallel rank {rank}")
    assert all(r["exported"] == {} for r in split[1:])
    _exports_agree(whole[0]["exported"], split[0]["exported"])


def test_a_layout_that_cannot_split_the_experts_is_refused_in_one_line(tmp_path):
    from loongsage.megatron.trainer import MegatronTrainer

    model_dir = build(tmp_path / "moe")  # 8 experts
    cases = (
        (3, 3, "expert_parallel=3 does not divide num_experts=8; allowed: a divisor of 8"),
        (4, 2, "expert_parallel=4 does not divide trainer.world_size=2; allowed: a divisor of 2"),
    )
    for ep, world, message in cases:
        with pytest.raises(ValueError) as err:
            MegatronTrainer.preflight({"expert_parallel": ep}, model_dir, world_size=world)
        assert str(err.value) == message
    with pytest.raises(
        ValueError,
        match=r"^tensor_parallel=2 x expert_parallel=2 x pipeline_parallel=1 does not "
        r"divide trainer.world_size=2;",
    ):
        MegatronTrainer.preflight({"expert_parallel": 2, "tensor_parallel": 2}, model_dir, world_size=2)
    with pytest.raises(
        ValueError,
        match=r"^expert_tensor_parallel=2; allowed: 1 \(each expert whole on its rank\) "
        r"or tensor_parallel=4$",
    ):
        MegatronTrainer.preflight({"tensor_parallel": 4, "expert_tensor_parallel": 2}, model_dir, world_size=4)
