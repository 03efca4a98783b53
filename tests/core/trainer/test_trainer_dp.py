"""Micro-batching and data parallelism change nothing, for every policy loss and aggregation mode.

One batch (rows of different lengths and prompt lengths, padding, an empty row, ratios != 1 in
both directions) is prepared once over the whole mini-batch, as the controller does, and stepped:

* in one process as a whole (1x8, the reference), in micro-batches of 2 rows (4x2) and of 1 (8x1);
* over DP 2 (gloo) with ``dp_mode`` fsdp2 and replicate, 6 + 2 rows, micro-batches of 2 rows (and,
  for one mode per loss, 0 + 8 rows).

Loss, metric sums and full gradients must match the reference to fp32 rounding, for ppo_clip,
cispo, nll and gspo (seq-mean-token-mean only), ppo_clip with a k3 KL-in-loss term, and ppo_clip
with masking corrections decided once per mini-batch (masked IS with veto, M2PO) or per
micro-batch from the current policy (OPSM). Every DP case runs in one pair of processes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from loongsage.core.aggregation import AGGREGATION_MODES
from loongsage.core.placement import free_port
from loongsage.core.tinytask.tiny_model import build_tiny_qwen3
from loongsage.core.trainer.micro_batching import micro_batches

WORKER = Path(__file__).with_name("_dp_worker.py")
sys.path.insert(0, str(WORKER.parent))
from _dp_worker import (  # noqa: E402
    CASE_IDS,
    CASES,
    DP_BUDGET,
    DP_ROWS,
    IDLE_CASE_IDS,
    LENGTHS,
    LOSS_CASES,
    SPLITS,
    build_batch,
    new_trainer,
    pipeline_for,
    run_case,
)

LOSS_RTOL = LOSS_ATOL = 1e-6
GRAD_ATOL, GRAD_RTOL = 1e-6, 1e-4
DP_MODES = ("fsdp2", "replicate")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """A tiny model on a shared machine: intra-op threads only add contention (and slow it 10x+)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-dp")
    build_tiny_qwen3(path, hidden_size=32, num_layers=2, heads=2, kv_heads=1, intermediate_size=64, seed=4)
    return str(path)


@pytest.fixture(scope="module")
def batch_file(model_dir, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("dp-batch") / "batch.pt"
    torch.save(build_batch(model_dir), path)
    return path


@pytest.fixture(scope="module")
def batch(batch_file):
    return torch.load(batch_file, weights_only=False)


@pytest.fixture(scope="module")
def single(model_dir, batch) -> dict[str, dict[str, dict]]:
    """``{split: {case_id: result}}`` from one process, one trainer (lr 0) for every step."""
    trainer = new_trainer(model_dir)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    rows = list(range(len(batch)))
    out = {
        split: {f"{case}/{mode}": run_case(trainer, batch, case, mode, rows, budget) for case, mode in CASES}
        for split, (budget, _) in SPLITS.items()
    }
    for name, p in trainer.model.named_parameters():
        assert torch.equal(p, before[name]), f"lr 0 moved {name}: cases would not share a point"
    return out


@pytest.fixture(scope="module")
def dp2(model_dir, batch_file, tmp_path_factory) -> dict[str, dict[str, dict]]:
    """``{layout: {case_id: result}}`` from one pair of gloo ranks running every case in both modes."""
    work = tmp_path_factory.mktemp("dp2")
    out = work / "results.pt"
    port = str(free_port())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(WORKER.parent), os.environ.get("PYTHONPATH", "")])}
    logs = [open(work / f"rank{r}.log", "w+") for r in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(r), "2", port, model_dir, ",".join(DP_MODES), str(batch_file), str(out)],
            env=env,
            stdout=logs[r],
            stderr=subprocess.STDOUT,
        )
        for r in range(2)
    ]
    deadline = time.monotonic() + 600
    while any(p.poll() is None for p in procs):  # a rank that dies leaves the other in a collective
        if any(p.returncode not in (None, 0) for p in procs) or time.monotonic() > deadline:
            for p in procs:
                p.kill()
        time.sleep(0.1)
    failures = []
    for rank, (p, log) in enumerate(zip(procs, logs)):
        log.seek(0)
        if p.returncode != 0:
            failures.append(f"rank {rank} exited with {p.returncode}:\n{log.read()[-3000:]}")
        log.close()
    assert not failures, "\n".join(failures)
    return torch.load(out, weights_only=False)


def _assert_same(got: dict, ref: dict, what: str) -> None:
    assert got["loss"] == pytest.approx(ref["loss"], rel=LOSS_RTOL, abs=LOSS_ATOL), f"{what}: loss"
    assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5), f"{what}: grad norm"
    assert got["metrics"].keys() == ref["metrics"].keys(), what
    for key, value in ref["metrics"].items():
        assert got["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-5), f"{what}: {key}"
    assert got["grads"].keys() == ref["grads"].keys(), what
    for name, grad in ref["grads"].items():
        torch.testing.assert_close(got["grads"][name], grad, atol=GRAD_ATOL, rtol=GRAD_RTOL, msg=f"{what}: {name}")


# ---------------------------------------------------------------- the batch and the cases can fail


def test_batch_is_nontrivial(batch):
    assert len(set(LENGTHS)) > 1 and (batch.attention_mask == 0).any()  # padding
    lengths = batch.response_mask.sum(-1)
    assert lengths.min() == 0 and (lengths == 1).any() and len(set(lengths.tolist())) > 3
    for name, (budget, sizes) in SPLITS.items():
        assert [len(mb) for mb in micro_batches(batch, budget)] == sizes, name
    assert sorted(i for rows in DP_ROWS for i in rows) == list(range(len(batch)))
    assert [len(mb) for mb in micro_batches(batch.select(DP_ROWS[0]), DP_BUDGET)] == [2, 2, 2]


def _frac(result: dict, key: str) -> float:
    sums = {
        **result["metrics"],
        **{f"{k}_sum": v[0] for k, v in result["corrections"].ratios.items()},
        **{f"{k}_count": v[1] for k, v in result["corrections"].ratios.items()},
    }
    return sums[f"train/{key}_sum"] / sums[f"train/{key}_count"]


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_reference_is_nontrivial(single, case_id):
    """Non-zero finite gradients; clipping and masking are active on some tokens, not on all."""
    ref = single["1x8"][case_id]
    assert ref["grad_norm"] > 1e-4
    assert all(torch.isfinite(g).all() for g in ref["grads"].values())
    assert sum(bool(g.abs().max() > 0) for g in ref["grads"].values()) >= len(ref["grads"]) - 1
    case = case_id.split("/")[0]
    if not case.startswith("nll"):
        assert 0.05 < _frac(ref, "clipfrac") < 0.95, case_id
    if case.endswith("+k3"):
        assert _frac(ref, "kl") > 1e-3
    if case.endswith("+is_mask"):
        assert 0.05 < _frac(ref, "is_maskfrac") < 0.5 and _frac(ref, "is_vetofrac") > 0
    if case.endswith("+m2po"):
        assert 0.05 < _frac(ref, "m2po_masked_frac") < 0.9
    if case.endswith("+opsm"):
        assert 0.05 < _frac(ref, "opsm_clipfrac") < 0.5


@pytest.mark.parametrize("case", LOSS_CASES)
def test_aggregation_modes_give_different_gradients(single, case):
    """Each mode really weights differently here, so the invariance below is not vacuous."""
    refs = [single["1x8"][f"{case}/{mode}"] for mode in AGGREGATION_MODES if f"{case}/{mode}" in single["1x8"]]
    for i, a in enumerate(refs):
        for b in refs[i + 1 :]:
            assert not torch.allclose(
                a["grads"]["model.embed_tokens.weight"],
                b["grads"]["model.embed_tokens.weight"],
                atol=GRAD_ATOL,
                rtol=GRAD_RTOL,
            )


@pytest.mark.parametrize("case_id", ["ppo_clip/token-mean", "ppo_clip/seq-mean-token-mean", "ppo_clip+m2po/token-mean"])
def test_shard_local_preparation_would_be_caught(model_dir, batch, single, case_id):
    """Negative control: deciding weights and corrections per DP shard breaks the comparison."""
    case, mode = case_id.split("/")
    trainer = new_trainer(model_dir)
    pipeline = pipeline_for(case, mode)
    loss, grads = 0.0, {}
    for rows in DP_ROWS:
        prepared, _ = pipeline.prepare(batch.select(rows))
        loss += trainer.train_step(prepared, pipeline.closure(), DP_BUDGET).totals["train/loss"]
        for name, p in trainer.model.named_parameters():
            grads[name] = grads.get(name, 0) + p.grad
    ref = single["1x8"][case_id]
    assert loss != pytest.approx(ref["loss"], rel=100 * LOSS_RTOL, abs=100 * LOSS_ATOL) or not all(
        torch.allclose(grads[n], g, atol=GRAD_ATOL, rtol=GRAD_RTOL) for n, g in ref["grads"].items()
    )


# ---------------------------------------------------------------- the invariances


@pytest.mark.parametrize("split", [s for s in SPLITS if s != "1x8"])
@pytest.mark.parametrize("case_id", CASE_IDS)
def test_micro_batching_is_invariant(single, case_id, split):
    _assert_same(single[split][case_id], single["1x8"][case_id], f"{case_id} {split}")


@pytest.mark.parametrize("case_id", CASE_IDS)
@pytest.mark.parametrize("dp_mode", DP_MODES)
def test_dp2_equals_dp1(dp2, single, dp_mode, case_id):
    _assert_same(dp2[dp_mode][case_id], single["1x8"][case_id], f"{case_id} DP2 {dp_mode}")


@pytest.mark.parametrize("case_id", IDLE_CASE_IDS)
@pytest.mark.parametrize("dp_mode", DP_MODES)
def test_dp2_with_an_idle_rank_equals_dp1(dp2, single, dp_mode, case_id):
    """Rank 0 gets no rows (fewer groups than ranks): it only joins the collectives."""
    _assert_same(dp2[f"{dp_mode}+idle"][case_id], single["1x8"][case_id], f"{case_id} DP2 {dp_mode}, rank 0 idle")
