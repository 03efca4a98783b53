"""FP8 training GEMMs of the torch trainer (``fp8``), on the CPU's ``torch._scaled_mm``.

The GEMMs are checked against float64 products of their own quantized operands (what the FP8
tensor cores compute, up to the bf16 output's rounding): that is where the scales' orientation
shows, rows against columns, in all three GEMMs. Then that the result is a gradient of the bf16
layer (within FP8's error) and that the trainer trains with it, under the same parameter names.
"""

from __future__ import annotations

import pytest
import torch

from loongsage.algos.policy_losses import PPOClip
from loongsage.core.loss import LossPlan
from loongsage.core.model_math.fp8_linear import Fp8Linear, fp8_linear, quantize
from loongsage.core.tinytask.tiny_model import build_tiny_qwen3
from loongsage.core.trainer.lora import LoraConfig
from loongsage.core.trainer.torch_trainer import TorchTrainer
from loongsage.core.types import TrainBatch


def _dequantized(x: torch.Tensor, fmt: str, rowwise: bool) -> torch.Tensor:
    x8, scale = quantize(x, fmt, rowwise)
    return x8.double() * scale.double()


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_each_gemm_is_the_product_of_its_quantized_operands(fmt, recipe):
    torch.manual_seed(0)
    rowwise, grad_fmt = recipe == "rowwise", "e5m2" if fmt == "hybrid" else "e4m3"
    # rows and columns of magnitudes 1e-2 to 1e2: a scale on the wrong side would show at once
    x = (torch.randn(37, 64) * torch.logspace(-2, 2, 37)[:, None]).bfloat16().requires_grad_()
    w = (torch.randn(48, 64) * torch.logspace(-2, 2, 64)[None, :]).bfloat16().requires_grad_()
    g = (torch.randn(37, 48) * torch.logspace(2, -2, 48)[None, :]).bfloat16()
    y = fp8_linear(x, w, None, fmt, recipe)
    y.backward(g)
    xs, ws, gs = x.detach(), w.detach(), g
    want_y = _dequantized(xs, "e4m3", rowwise) @ _dequantized(ws, "e4m3", rowwise).T
    want_gx = _dequantized(gs, grad_fmt, rowwise) @ _dequantized(ws.t().contiguous(), "e4m3", rowwise).T
    dequantized_x = _dequantized(xs.t().contiguous(), "e4m3", rowwise)  # the tokens' zero padding changes no scale
    want_gw = _dequantized(gs.t().contiguous(), grad_fmt, rowwise) @ dequantized_x.T
    assert y.shape == (37, 48) and x.grad.shape == (37, 64)  # 37 tokens, padded to 48 inside
    for got, want in ((y, want_y), (x.grad, want_gx), (w.grad, want_gw)):
        assert got.dtype == torch.bfloat16
        assert _relative(got, want) < 4e-3  # the bf16 output's rounding, nothing more


@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
def test_an_fp8_layer_is_the_bf16_layer_within_fp8s_error(fmt):
    torch.manual_seed(1)
    linear = torch.nn.Linear(64, 32, bias=True).bfloat16()
    fp8 = Fp8Linear(linear, fmt, "rowwise")
    assert fp8.weight is linear.weight and fp8.bias is linear.bias
    x = torch.randn(5, 7, 64, dtype=torch.bfloat16)
    g = torch.randn(5, 7, 32, dtype=torch.bfloat16)
    grads = []
    for layer in (linear, fp8):
        xi = x.clone().requires_grad_()
        layer.zero_grad()
        out = layer(xi)
        out.backward(g)
        grads.append((out.detach(), xi.grad, layer.weight.grad.clone(), layer.bias.grad.clone()))
    for plain, low in zip(*grads):
        assert _relative(low, plain) < (0.06 if fmt == "e4m3" else 0.1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    build_tiny_qwen3(path, hidden_size=32, num_layers=2, heads=2, kv_heads=1, intermediate_size=64, seed=3)
    return path


def _batch(B: int = 6, T: int = 12, vocab: int = 200) -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(B, T)
    mask[:, :4] = 0
    return TrainBatch(
        input_ids=torch.randint(3, vocab, (B, T), generator=g),
        attention_mask=torch.ones(B, T, dtype=torch.long),
        response_mask=mask,
        rollout_logprobs=torch.zeros(B, T),
        advantages=torch.randn(B, T, generator=g) * mask,
        rewards=torch.zeros(B),
        group_ids=torch.arange(B) // 3,
        old_logprobs=torch.full((B, T), -5.0) * mask,
    )


def test_the_trainer_trains_its_decoder_layers_in_fp8_under_the_same_names(model_dir):
    plain = TorchTrainer(str(model_dir), dtype="bfloat16")
    fp8 = TorchTrainer(str(model_dir), dtype="bfloat16", fp8="hybrid")
    layers = fp8.model.model.layers
    assert sum(isinstance(m, Fp8Linear) for m in layers.modules()) == 2 * 7  # q/k/v/o, gate/up/down
    assert not isinstance(fp8.model.lm_head, Fp8Linear)  # the head keeps its own (FP32) path
    assert list(dict(fp8.model.named_parameters())) == list(dict(plain.model.named_parameters()))
    batch = _batch()
    lp_plain, lp_fp8 = plain.logprobs(batch, 10_000)[0], fp8.logprobs(batch, 10_000)[0]
    mask = batch.response_mask.bool()
    assert 0 < (lp_fp8 - lp_plain)[mask].abs().mean() < 0.05
    before = {n: p.detach().clone() for n, p in fp8.model.named_parameters()}
    fp8.setup_optimizer(lr=1e-3, betas=[0.9, 0.999], eps=1e-8, weight_decay=0.0, grad_clip=1.0)
    plan = LossPlan(policy_loss=PPOClip(clip_low=0.2, clip_high=0.28))
    prepared, _ = plan.prepare(batch)
    metrics = fp8.train_step(prepared, plan.closure(), 10_000)
    assert torch.isfinite(torch.tensor(metrics.means()["train/grad_norm"]))
    moved = [n for n, p in fp8.model.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert any("layers.0.self_attn.q_proj" in n for n in moved) and any("mlp.down_proj" in n for n in moved)


def test_compiled_fp8_layers_train_as_the_eager_ones(model_dir):
    """``compile_layers`` traces the FP8 GEMMs' autograd function into each compiled layer (Inductor
    fuses the quantizations): one step gives the loss and the next log-probs of the eager FP8 layers."""
    import torch._dynamo

    batch = _batch()
    plan = LossPlan(policy_loss=PPOClip(clip_low=0.2, clip_high=0.28))
    prepared, _ = plan.prepare(batch)
    after = []
    for compiled in (False, True):
        torch._dynamo.reset()
        trainer = TorchTrainer(str(model_dir), dtype="bfloat16", fp8="hybrid", compile_layers=compiled)
        trainer.setup_optimizer(lr=1e-3, betas=[0.9, 0.999], eps=1e-8, weight_decay=0.0, grad_clip=1.0)
        captured = torch._dynamo.utils.counters["stats"]["calls_captured"]
        loss = trainer.train_step(prepared, plan.closure(), 10_000).totals["train/loss"]
        assert (torch._dynamo.utils.counters["stats"]["calls_captured"] > captured) == compiled
        after.append((loss, trainer.logprobs(batch, 10_000)[0]))
    (eager_loss, eager_lp), (compiled_loss, compiled_lp) = after
    assert abs(eager_loss - compiled_loss) < 1e-6 and torch.equal(eager_lp, compiled_lp)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"fp8": "e5m2"}, r"fp8='e5m2'; allowed: hybrid, e4m3, or null"),
        ({"fp8": "hybrid", "fp8_recipe": "delayed"}, r"fp8_recipe='delayed'; allowed: rowwise, tensorwise"),
        ({"fp8": "hybrid"}, r"fp8: FP8 GEMMs cannot train here: dtype float32 .*the model must be bfloat16"),
        ({"fp8": "e4m3", "dtype": "bfloat16", "lora": LoraConfig(rank=4)}, "fp8: not with lora"),
        ({"fp8": "e4m3", "dtype": "bfloat16", "batch_invariant": True}, "fp8: not with batch_invariant"),
    ],
)
def test_fp8_refuses_what_it_cannot_do(model_dir, params, message):
    with pytest.raises(ValueError, match=message):
        TorchTrainer(str(model_dir), **params)
