"""MOPD teachers held by the trainer (``teacher: {name: trainer}``) on the card: a step on the held
teacher's full-vocabulary distribution, computed beside the student's in each micro-batch, equals
the step on the same distribution shipped in the batch by a teacher worker; the held one never
puts ``[tokens, vocabulary]`` on the host. The torch and the megatron trainer, a bf16 Qwen3 of
hidden 1024 taught by a copy of itself with other weights."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_offload_gpu import _batch, _loss

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


class _ForwardKL:
    """KL(teacher || student) over the full vocabulary at every trained position, plus a PG term."""

    needs_student_distribution = True
    reads_vocab_shards = False
    teacher_support = (0, True)

    def __call__(self, lp, mb, student_dist=None):
        t = student_dist.shape[1]
        teacher = mb.teacher_dist_logprobs[:, -t:].to(student_dist.device)
        kl = (teacher.exp() * (teacher - student_dist)).sum(-1)
        mask = mb.response_mask[:, -t:].to(kl.device)
        return (kl * mask).sum() / 1000 + _loss(lp, mb)[0], _loss(lp, mb)[1]


def _teacher_dir(model_dir: str, out: Path) -> str:
    from transformers import AutoModelForCausalLM

    if not out.exists():
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_((torch.randn(p.shape, generator=gen) * 0.02).to(p.dtype))
        model.save_pretrained(out)
    return str(out)


@pytest.mark.parametrize("backend", ["torch", "megatron"])
def test_a_held_teacher_steps_as_a_teacher_worker(qwen3_1024_dir, tmp_path_factory, backend):
    if backend == "megatron":
        pytest.importorskip("megatron.core")
        from loongsage.megatron.teacher import MegatronTeacher as Worker
        from loongsage.megatron.trainer import MegatronTrainer as Trainer
    else:
        from loongsage.core.trainer.teacher import EmbeddedTeacher as Worker
        from loongsage.core.trainer.torch_trainer import TorchTrainer as Trainer
    teacher_dir = _teacher_dir(qwen3_1024_dir, tmp_path_factory.getbasetemp() / "teacher_1024")
    vocab = json.loads((Path(qwen3_1024_dir) / "config.json").read_text())["vocab_size"]
    b = replace(_batch(vocab), sources=["s"] * 4)
    loss = _ForwardKL()  # a LossFunction (its protocol is checked at run time) asking for the full vocabulary

    held = Trainer(qwen3_1024_dir, dtype="bfloat16", device="cuda")
    held.add_teacher(["s"], teacher_dir)
    held.setup_optimizer(1e-4, [0.9, 0.99], 1e-8, 0.0, 1.0, 0)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    lp_held = held.teacher_logprobs(b, 4096)
    norm_held = held.train_step(b, loss, 4096).gauges["train/grad_norm"]
    torch.cuda.synchronize()
    held_s, held_peak = time.perf_counter() - start, torch.cuda.max_memory_allocated()
    del held
    torch.cuda.empty_cache()

    worker = Worker(teacher_dir, dtype="bfloat16", device="cuda")
    start = time.perf_counter()
    scored = worker.score(b, full_vocab=True)
    shipped = replace(b, teacher_logprobs=scored["logprobs"], teacher_dist_logprobs=scored["dist_logprobs"])
    del worker
    torch.cuda.empty_cache()
    student = Trainer(qwen3_1024_dir, dtype="bfloat16", device="cuda")
    student.setup_optimizer(1e-4, [0.9, 0.99], 1e-8, 0.0, 1.0, 0)
    norm_shipped = student.train_step(shipped, loss, 4096).gauges["train/grad_norm"]
    torch.cuda.synchronize()
    shipped_s = time.perf_counter() - start
    mask = b.response_mask.bool()
    diff = (lp_held - scored["logprobs"])[mask].abs().max().item()
    print(
        f"{backend}: held teacher grad norm {norm_held:.6f} vs shipped {norm_shipped:.6f}; teacher log-prob "
        f"max |diff| {diff:.2e}; held step {held_s:.2f} s (peak {held_peak / 1e9:.2f} GB), teacher worker + "
        f"step {shipped_s:.2f} s; shipped distribution {scored['dist_logprobs'].numel() * 4 / 1e9:.2f} GB on the host"
    )
    assert diff < 1e-4
    assert norm_held == pytest.approx(norm_shipped, rel=1e-3)


ARITH4 = (
    'name: tiny_arith, params: {name: arith4-qwen3-25m-teacher, digits: 4, operations: "+-", hidden_size: 512, '
    "num_layers: 8, heads: 8, kv_heads: 4, intermediate_size: 1536, drop_prob: 0.0, steps: 2000, "
    "batch_size: 256, lr: 1.0e-3, warmup_steps: 100, device: cuda}"
)


@pytest.mark.timeout(1500)
def test_mopd_with_a_teacher_held_by_the_megatron_trainer_through_the_launcher(tmp_path):
    """``gpu/grpo_arith4_h200`` made MOPD: its source taught by a teacher held by the megatron trainer
    (the same shape, trained on correct answers), the full-vocabulary JSD beside PG shaping, the trainer
    and the teacher offloaded to host memory while the engine generates."""
    pytest.importorskip("megatron.core")
    from test_megatron_gpu import MEGATRON_CUDA, _launch

    rows = _launch(
        "gpu/grpo_arith4_h200",
        tmp_path / "mopd",
        MEGATRON_CUDA,
        f"data_sources.0.teacher={{name: trainer, params: {{builder: {{{ARITH4}}}}}}}",
        "algorithm.distill={pg_coef: 0.5, gkd_coef: 0.5, divergence: {name: jsd}}",
        "placement.offload_trainer=true",
        "run.total_steps=3",
        "evaluation.every_steps=0",
        "checkpoint.every_steps=0",
    )
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["engine/version"] for r in rows] == [1.0, 2.0, 3.0]  # every step's weights reached the engine
    for r in rows:
        assert torch.isfinite(torch.tensor(r["train/loss"])) and r["train/grad_norm"] > 0, r
        assert r["train/gkd"] > 0 and r["train/mopd_teacher_logprob"] < 0, r
        assert r["timing/trainer_offload_s"] > 0, r
    print(
        f"\nMOPD on megatron with a held teacher: gkd {[round(r['train/gkd'], 4) for r in rows]}, "
        f"mopd_kl {[round(r['train/mopd_kl'], 4) for r in rows]}, "
        f"step s {[round(r['timing/step_s'], 2) for r in rows]}, "
        f"offload s {[round(r['timing/trainer_offload_s'], 2) for r in rows]}"
    )
