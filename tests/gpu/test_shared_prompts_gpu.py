"""On a CUDA GPU: ``share_prompts`` in bf16 with compiled layers, against the plain step.

The two passes run sdpa with an additive 4D mask (the memory-efficient kernel), the plain forward
sdpa on its own causal mask; in bf16 they round differently, so the log-probs and the gradients are
compared at bf16's scale, and the step's saving is read from its metric.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    )
    path = tmp_path_factory.mktemp("shared")
    Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return path


def _batch():
    from loongsage.core.tinytask.shapes import grouped_train_batch

    return grouped_train_batch(4, 8, 96, (40, 160), vocab=4096, seed=1)


def _step(model_dir, share: bool, batch):
    from loongsage.algos.policy_losses import PPOClip
    from loongsage.core.loss import LossPlan
    from loongsage.core.trainer.torch_trainer import TorchTrainer

    trainer = TorchTrainer(
        str(model_dir),
        dtype="bfloat16",
        device="cuda",
        compile_layers=True,
        master_weights=False,  # the bf16 gradients themselves, on the model
        share_prompts=share,
    )
    trainer.setup_optimizer(lr=1e-30, betas=[0.9, 0.999], eps=1e-8, weight_decay=0.0, grad_clip=1e9)
    lp, _ = trainer.logprobs(batch, token_budget=8192)
    plan = LossPlan(policy_loss=PPOClip(clip_low=0.2, clip_high=0.28), aggregation="token-mean")
    prepared, _ = plan.prepare(batch)
    metrics = trainer.train_step(prepared, plan.closure(), 8192)
    grads = {n.replace("._orig_mod", ""): p.grad.float() for n, p in trainer.model.named_parameters()}
    return lp, metrics, grads


def test_shared_prompts_in_bf16_give_the_plain_step(model_dir):
    batch = _batch()
    lp_plain, m_plain, g_plain = _step(model_dir, False, batch)
    lp_shared, m_shared, g_shared = _step(model_dir, True, batch)
    trained = batch.response_mask.bool()
    diff = (lp_shared - lp_plain)[trained].abs()
    assert diff.mean() < 2e-3 and diff.max() < 5e-2, (diff.mean(), diff.max())  # bf16 activations
    assert m_shared.totals["train/shared_prompt_tokens"] == 4 * 7 * 96
    for name, grad in g_plain.items():
        rel = (g_shared[name] - grad).norm() / grad.norm().clamp(min=1e-12)
        assert rel < 3e-2, (name, float(rel))
