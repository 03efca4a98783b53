"""On a CUDA GPU: the ``megatron`` trainer backend against the ``torch`` one, and through the launcher.

* Log-prob parity on the same HF weights and tokens (a Qwen3-shaped model, hidden 1024, 8 layers):
  float32 near-exact, bfloat16 (FP32 head on both sides) within the rounding of a different GEMM
  layout (Megatron merges q/k/v and gate/up).
* A training step and a checkpoint that resumes exactly, on the card.
* Each of those on the TE-free ``sdpa`` spec and on Transformer Engine's layer (``te``) where it
  imports; packed rows against padded ones on both.
* The launcher: ``gpu/grpo_arith4_h200`` with the backend switched (weights converted and pushed to
  the engine every step, a checkpoint, a resumed run), and the Qwen3-1.7B-shaped random recipe.

The measured numbers are printed (run with ``-s``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

REPO = Path(__file__).resolve().parents[2]


def _te_missing() -> str | None:
    from loongsage.megatron.model import transformer_engine_error

    return transformer_engine_error()


# the TE-free spec, and Transformer Engine's layer where it imports on the card
SPECS = [
    "sdpa",
    pytest.param("te", marks=pytest.mark.skipif(_te_missing() is not None, reason="no Transformer Engine")),
]


def _batch(vocab: int, rows: int = 4, seq: int = 512):
    from loongsage.core.types import TrainBatch

    ids = torch.randint(3, vocab, (rows, seq), generator=torch.Generator().manual_seed(0))
    attention = torch.ones_like(ids)
    attention[1, seq - 100 :] = 0  # right-padded rows, as the rollouts make them
    attention[3, seq // 2 :] = 0
    response = torch.zeros(ids.shape)
    response[:, 64:] = 1
    response *= attention
    return TrainBatch(
        input_ids=ids,
        attention_mask=attention,
        response_mask=response,
        rollout_logprobs=torch.zeros(ids.shape),
        advantages=torch.ones(ids.shape) * 0.5,
        rewards=torch.zeros(rows),
        group_ids=torch.arange(rows),
    )


def _loss(lp, mb):
    from loongsage.core.metrics import Metrics

    return -(lp * mb.advantages.to(lp.device) * mb.response_mask.to(lp.device)).sum() / 1000, Metrics()


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logprobs_match_the_torch_backend(qwen3_1024_dir, dtype, spec):
    from loongsage.core.trainer.torch_trainer import TorchTrainer
    from loongsage.megatron.trainer import MegatronTrainer

    vocab = json.loads((Path(qwen3_1024_dir) / "config.json").read_text())["vocab_size"]
    batch = _batch(vocab)
    mask = batch.response_mask.bool()
    ref = TorchTrainer(qwen3_1024_dir, dtype=dtype, device="cuda")
    lp_ref, ent_ref = ref.logprobs(batch, 4096)
    del ref
    ours = MegatronTrainer(qwen3_1024_dir, dtype=dtype, device="cuda", layer_spec=spec)
    lp, ent = ours.logprobs(batch, 4096)
    diff, ent_diff = (lp_ref - lp)[mask].abs(), (ent_ref - ent)[mask].abs()
    print(
        f"\nmegatron ({spec}) vs torch log-probs, {dtype}: max |d| {diff.max():.3e}, mean |d| {diff.mean():.3e}; "
        f"entropy max |d| {ent_diff.max():.3e}"
    )
    if dtype == "float32" and spec == "te":  # its float32 GEMMs: measured 2.1e-3 max, 5.0e-4 mean on an H200
        assert diff.max() < 1e-2 and diff.mean() < 2e-3, (diff.max(), diff.mean())
    elif dtype == "float32":
        assert diff.max() < 1e-3 and diff.mean() < 1e-5, (diff.max(), diff.mean())
    else:
        assert diff.mean() < 0.05 and diff.max() < 1.0, (diff.max(), diff.mean())


@pytest.mark.parametrize("spec", SPECS)
def test_a_step_trains_and_a_checkpoint_resumes_exactly_on_the_card(qwen3_1024_dir, tmp_path, spec):
    """The checkpoint holds HF-named tensors: one written on Transformer Engine's layer resumes on
    the TE-free one as well (the same step from the same state, up to the layers' own kernels)."""
    from loongsage.megatron.trainer import MegatronTrainer

    vocab = json.loads((Path(qwen3_1024_dir) / "config.json").read_text())["vocab_size"]
    batch = _batch(vocab)
    ours = MegatronTrainer(qwen3_1024_dir, dtype="bfloat16", device="cuda", layer_spec=spec)
    ours.setup_optimizer(1e-5, [0.9, 0.99], 1e-8, 0.0, 1.0, 0)
    before = ours.logprobs(batch, 4096)[0]
    metrics = ours.train_step(batch, _loss, 4096)
    after = ours.logprobs(batch, 4096)[0]
    assert torch.isfinite(torch.tensor(metrics.gauges["train/grad_norm"]))
    assert not torch.equal(before, after)
    ours.save(tmp_path / "ckpt")
    resumed = MegatronTrainer(qwen3_1024_dir, dtype="bfloat16", device="cuda", layer_spec=spec)
    resumed.setup_optimizer(1e-5, [0.9, 0.99], 1e-8, 0.0, 1.0, 0)
    resumed.load(tmp_path / "ckpt")
    assert torch.equal(resumed.logprobs(batch, 4096)[0], after)
    g1, g2 = (t.train_step(batch, _loss, 4096).gauges["train/grad_norm"] for t in (ours, resumed))
    if spec == "te":  # cuDNN's fused attention backward is not deterministic by default (5.7e-5 apart measured)
        assert abs(g1 - g2) <= 1e-3 * g1, (g1, g2)
    else:
        assert g1 == g2  # the same weights gave the same gradients
    exported = dict(ours.export_weights())
    assert all(t.is_cuda for t in exported.values()) and "model.layers.0.self_attn.q_proj.weight" in exported
    assert {"model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight"} <= set(exported)
    if spec == "te":  # HF-named: the TE-free layer reads the same checkpoint
        other = MegatronTrainer(qwen3_1024_dir, dtype="bfloat16", device="cuda", layer_spec="sdpa")
        other.load(tmp_path / "ckpt")
        moved = (other.logprobs(batch, 4096)[0] - after)[batch.response_mask.bool()].abs()
        print(
            f"\na checkpoint of the te layer read by the sdpa one: log-probs max |d| {moved.max():.3e}, "
            f"mean {moved.mean():.3e}"
        )
        assert moved.mean() < 0.05, moved


@pytest.mark.parametrize("spec", SPECS)
def test_packed_rows_match_padded_ones_on_the_card(qwen3_1024_dir, spec):
    """``pack_sequences``: the rows' real tokens back to back (cuDNN's packed attention on ``te``,
    torch's fused kernel per row on ``sdpa``) against the same rows padded, bf16."""
    import time

    from loongsage.megatron.trainer import MegatronTrainer

    vocab = json.loads((Path(qwen3_1024_dir) / "config.json").read_text())["vocab_size"]
    batch = _batch(vocab, rows=8, seq=2048)
    for row in range(8):
        batch.attention_mask[row, 256 * (row + 1) :] = 0  # 256 .. 2048 real tokens
    batch.response_mask *= batch.attention_mask
    mask = batch.response_mask.bool()
    out = {}
    for packed in (False, True):
        trainer = MegatronTrainer(
            qwen3_1024_dir, dtype="bfloat16", device="cuda", layer_spec=spec, pack_sequences=packed
        )
        trainer.setup_optimizer(1e-5, [0.9, 0.99], 1e-8, 0.0, 1.0, 0)
        lp = trainer.logprobs(batch, 8 * 2048)[0]
        times = []
        for _ in range(4):
            torch.cuda.synchronize()
            start = time.perf_counter()
            grad_norm = trainer.train_step(batch, _loss, 8 * 2048).gauges["train/grad_norm"]
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        out[packed] = lp, grad_norm, sorted(times[1:])[1]
        del trainer
        torch.cuda.empty_cache()
    diff = (out[False][0] - out[True][0])[mask].abs()
    print(
        f"\npacked vs padded rows ({spec}, bf16, 8 rows of 256..2048 tokens): log-probs max |d| {diff.max():.3e}, "
        f"mean {diff.mean():.3e}; first grad norm {out[False][1]:.4f} vs {out[True][1]:.4f}; "
        f"step s padded {out[False][2]:.3f}, packed {out[True][2]:.3f}"
    )
    assert diff.mean() < 0.02 and diff.max() < 0.5, diff
    assert abs(out[False][1] - out[True][1]) < 0.05 * out[False][1]


def _launch(recipe: str, work: Path, *overrides: str) -> list[dict]:
    cmd = [
        sys.executable,
        "-m",
        "loongsage.core.cli",
        "train",
        recipe,
        f"run.output_dir={work / 'runs'}",
        f"run.log_dir={work / 'log'}",
        "tracking.progress=false",
        *overrides,
    ]
    env = dict(os.environ, LOONGSAGE_CACHE=str(work.parent / "cache"), RAY_AUTH_MODE="disabled")
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=1200)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    rows = [json.loads(line) for line in next((work / "runs").glob("*/metrics.jsonl")).read_text().splitlines()]
    return [r for r in rows if "train/loss" in r]


MEGATRON_CUDA = "trainer.backend={name: megatron, params: {device: cuda}}"


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("spec", SPECS)
def test_the_arith4_recipe_trains_checkpoints_and_resumes_on_megatron(tmp_path, spec):
    """With the trainer offloaded to host memory while the engine generates (its state back on the
    card for each step, its checkpoint and its resume). ``te`` asked for explicitly: a worker where
    Transformer Engine does not import would refuse it rather than fall back."""
    work = tmp_path / "arith4"
    common = (
        "gpu/grpo_arith4_h200",
        work,
        f"trainer.backend={{name: megatron, params: {{device: cuda, layer_spec: {spec}}}}}",
        "evaluation.every_steps=0",
        "checkpoint.every_steps=2",
        "placement.offload_trainer=true",
    )
    first = _launch(*common, "run.total_steps=4")
    assert [r["step"] for r in first] == [1, 2, 3, 4]
    assert [r["engine/version"] for r in first] == [1.0, 2.0, 3.0, 4.0]  # every step's weights reached the engine
    resumed = _launch(*common, "run.total_steps=6", "resume=true")
    steps = [r["step"] for r in resumed]
    assert steps[-2:] == [5, 6] and resumed[-1]["engine/version"] == 6.0, steps
    for r in first + resumed:
        assert all(torch.isfinite(torch.tensor(r[k])) for k in ("train/loss", "train/grad_norm")), r
        assert r["timing/trainer_offload_s"] > 0, r
    print(
        f"\narith4 on megatron ({spec}): reward {[round(r['rollout/reward_mean'], 3) for r in first + resumed[-2:]]}, "
        f"step s {[round(r['timing/step_s'], 2) for r in first + resumed[-2:]]}, "
        f"offload s {[round(r['timing/trainer_offload_s'], 2) for r in first + resumed[-2:]]}"
    )


@pytest.mark.timeout(1500)
def test_the_1p7b_random_recipe_runs_on_megatron(tmp_path):
    rows = _launch(
        "gpu/grpo_qwen3_1p7b_random_h200",
        tmp_path / "big",
        "trainer.backend={name: megatron, params: {device: cuda}}",
        "run.total_steps=4",
    )
    assert [r["engine/version"] for r in rows] == [1.0, 2.0, 3.0, 4.0]
    keep = rows[1:]
    timing = {k: sorted(r[f"timing/{k}_s"] for r in keep)[len(keep) // 2] for k in ("step", "rollout", "train", "sync")}
    print("\n1.7B random on megatron, median of steps 2-4: " + ", ".join(f"{k} {v:.2f} s" for k, v in timing.items()))


@pytest.mark.parametrize("spec", SPECS)
def test_moe_logprobs_match_the_torch_backend_with_and_without_routing_replay(tmp_path, spec):
    """A Qwen3-MoE shape (random bf16 weights, 16 experts, top 4): Megatron against the torch trainer,
    routing on its own and replaying the routes the HF model chose (R3)."""
    import dataclasses

    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from loongsage.core.trainer.torch_trainer import TorchTrainer
    from loongsage.megatron.trainer import MegatronTrainer

    layers, topk = 4, 4
    config = Qwen3MoeConfig(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2048,
        moe_intermediate_size=512,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        num_experts=16,
        num_experts_per_tok=topk,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).to(torch.bfloat16).save_pretrained(str(tmp_path / "moe"))
    batch = _batch(32000)
    mask = batch.response_mask.bool()
    ref = TorchTrainer(str(tmp_path / "moe"), dtype="bfloat16", device="cuda")
    lp_ref = ref.logprobs(batch, 4096)[0]
    chosen: list[torch.Tensor] = []
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda _m, _a, out: chosen.append(out[2]))
        for layer in ref.model.model.layers
    ]
    with torch.no_grad():
        ref.model(input_ids=batch.input_ids.cuda(), attention_mask=batch.attention_mask.cuda())
    for hook in hooks:
        hook.remove()
    rows, t = batch.input_ids.shape
    per = torch.stack(chosen, 1).view(rows, t, layers, topk).cpu()
    routes = [per[r][batch.attention_mask[r].bool()] for r in range(rows)]
    del ref
    ours = MegatronTrainer(str(tmp_path / "moe"), dtype="bfloat16", device="cuda", layer_spec=spec)
    own = (lp_ref - ours.logprobs(batch, 4096)[0])[mask].abs()
    replayed = (lp_ref - ours.logprobs(dataclasses.replace(batch, routed_experts=routes), 4096)[0])[mask].abs()
    print(
        f"\nMoE megatron ({spec}) vs torch log-probs, bf16: own routing max |d| {own.max():.3e} mean {own.mean():.3e}; "
        f"replaying HF's routes (R3) max |d| {replayed.max():.3e} mean {replayed.mean():.3e}"
    )
    assert replayed.mean() < 0.05 and replayed.max() <= own.max() + 1e-6, (own, replayed)


@pytest.mark.timeout(1500)
def test_r3_through_the_launcher_lowers_the_train_inference_mismatch(tmp_path):
    """tiny/grpo_moe_r3_cpu on the card with a 4-layer Qwen3-30B-A3B shape (random bf16 weights):
    the native engine records its routes; the megatron trainer replays them or routes on its own."""
    k3 = {}
    for replay in ("true", "false"):
        rows = _launch(
            "tiny/grpo_moe_r3_cpu",
            tmp_path / f"r3_{replay}",
            "run.total_steps=3",
            "checkpoint.every_steps=0",
            "model.builder={name: random_init, params: {preset: qwen3-30b-a3b, num_layers: 4, dtype: "
            "bfloat16, device: cuda, max_position_embeddings: 4096}}",
            "model.dtype=bfloat16",
            "data_sources.0.prompts_per_step=16",
            "data_sources.0.samples_per_prompt=4",
            "data_sources.0.reader.params.length=64",
            "data_sources.0.sampling.max_new_tokens=64",
            "rollout.engine={name: native, params: {device: cuda, return_routed_experts: true, max_model_len: 256}}",
            f"trainer.backend={{name: megatron, params: {{device: cuda, routing_replay: {replay}}}}}",
            "placement.colocate=true",
            "placement.gpus_per_actor=1",
        )
        for done in (tmp_path / f"r3_{replay}" / "runs").glob("*/checkpoints"):
            shutil.rmtree(done)  # the final checkpoint (tens of GB with float32 masters and AdamW state)
        k3[replay] = sorted(r["train/is_approx_k3_kl"] for r in rows)[len(rows) // 2]
        if replay == "true":
            assert all(r["train/r3_replayed_tokens"] == 64 * 128 for r in rows)
    print(f"\nR3 through the launcher, median train/is_approx_k3_kl: with {k3['true']:.3e}, without {k3['false']:.3e}")
    assert k3["true"] < k3["false"]
