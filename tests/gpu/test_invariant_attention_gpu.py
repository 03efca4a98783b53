"""On a CUDA GPU: the trainer's causal attention on the batch-invariant path gives every token the
bits the engine's decode kernel gives it alone (one program a token, its columns in order), at the
1.7B shape's heads (16 query heads over 8 kv heads: 8 tokens a program) and a MHA and a wide-group
shape, while a program reads the columns of a whole block of tokens once.

The CPU suite checks the same in Triton's interpreter, whose ``tl.dot`` is numpy's; this checks the
compiled kernels, whose tensor-core sums are what the bits rest on.
Run with ``LOONGSAGE_RUN_GPU=1 pytest tests/gpu -m gpu``.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize(("heads", "kv"), [(16, 8), (8, 8), (32, 4)])
def test_causal_blocks_are_the_decode_kernels_bits(heads, kv):
    from loongsage.core.engine.fused.attention import causal_attention, decode_attention

    torch.manual_seed(0)
    rows, width, dim = 4, 389, 128
    dev = torch.device("cuda")
    q = torch.randn(rows * width, heads, dim, dtype=torch.bfloat16, device=dev)
    k = torch.randn(rows, kv, width, dim, dtype=torch.bfloat16, device=dev)
    v = torch.randn(rows, kv, width, dim, dtype=torch.bfloat16, device=dev)
    positions = torch.arange(width, device=dev).repeat(rows)
    sequences = torch.arange(rows, device=dev).repeat_interleave(width)
    alone = decode_attention(q, k, v, positions + 1, 0.088, width, cache_rows=sequences, splits=1)
    assert torch.equal(causal_attention(q, k, v, 0.088), alone)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.view(rows, width, heads, dim).transpose(1, 2).float(),
        k.float().repeat_interleave(heads // kv, 1),
        v.float().repeat_interleave(heads // kv, 1),
        is_causal=True,
        scale=0.088,
    ).transpose(1, 2)
    assert ((alone.float() - want.reshape(rows * width, -1)).norm() / want.norm()).item() < 1e-2
