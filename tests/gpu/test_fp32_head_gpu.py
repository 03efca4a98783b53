"""On a CUDA GPU: the FP32 LM head as a half GEMM with float32 output, forward and backward.

The trainer and the engine both run :class:`HalfGemmFp32Out`; this checks it against float32
arithmetic on the same bf16 operands (the products are exact in float32, only the order of the sums
differs in the forward; the backward rounds the logits' gradient to bf16 as a bf16 head would).
"""

from __future__ import annotations

import pytest
import torch

from loongsage.core.model_math.head import HalfGemmFp32Out, fp32_head
from loongsage.core.model_math.logprobs import policy_logits

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_forward_and_backward_match_float32_arithmetic():
    torch.manual_seed(0)
    hidden = torch.randn(3, 50, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(1000, 256, device="cuda") * 0.05).to(torch.bfloat16).requires_grad_()
    logits = HalfGemmFp32Out.apply(hidden, weight)
    assert logits.dtype == torch.float32 and logits.shape == (3, 50, 1000)
    ref_h, ref_w = hidden.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    ref = ref_h @ ref_w.T
    torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-5)  # exact products, other summation order
    target = torch.randint(0, 1000, (3, 50), device="cuda")
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten()).backward()
    torch.nn.functional.cross_entropy(ref.flatten(0, 1), target.flatten()).backward()
    assert hidden.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.bfloat16
    for got, want in ((hidden.grad, ref_h.grad), (weight.grad, ref_w.grad)):
        rel = (got.float() - want).norm() / want.norm()
        assert rel < 1e-2, rel  # the bf16 rounding of the gradient, nothing more


def test_trainer_and_engine_heads_agree_on_the_same_rows():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=True,
    )
    model = Qwen3ForCausalLM(config).cuda().to(torch.bfloat16)
    ids = torch.randint(0, 512, (2, 16), device="cuda")
    with torch.no_grad():
        logits = policy_logits(model, ids, torch.ones_like(ids))
        hidden = model.model(input_ids=ids).last_hidden_state
        engine = fp32_head(hidden.reshape(-1, 128), model.lm_head.weight).view(2, 16, 512)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, engine, rtol=1e-5, atol=1e-5)


def test_the_chunked_head_matches_the_one_piece_head_on_bf16():
    """:class:`ChunkedHeadLogprobs` on the GPU (bf16 operands, float32 logits): log-probs as the
    one-piece head's (same GEMM per row, same log-softmax), gradients within bf16 rounding."""
    from loongsage.core.model_math.chunked_head import ChunkedHeadLogprobs

    torch.manual_seed(0)
    hidden = torch.randn(300, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(5000, 256, device="cuda") * 0.05).to(torch.bfloat16).requires_grad_()
    target = torch.randint(0, 5000, (300,), device="cuda")
    upstream = torch.randn(300, device="cuda")
    lp, ent = ChunkedHeadLogprobs.apply(hidden, weight, target, 64, True)
    (lp * upstream).sum().backward()
    got = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    logp = torch.log_softmax(fp32_head(hidden, weight), -1)
    ref = logp.gather(-1, target[:, None]).squeeze(-1)
    (ref * upstream).sum().backward()
    torch.testing.assert_close(lp, ref.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, -(logp.exp() * logp).sum(-1).detach(), atol=1e-4, rtol=0)
    for mine, want in zip(got, (hidden.grad, weight.grad), strict=True):
        rel = (mine.float() - want.float()).norm() / want.float().norm()
        assert rel < 1e-2, rel
