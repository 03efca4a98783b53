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


@pytest.mark.parametrize(("heads", "kv"), [(16, 8), (24, 8), (32, 4)])  # 8, 5 and 2 rows a tile
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])  # float32: no rounding hides a sum
def test_shared_prefix_tiles_on_the_invariant_path_are_each_rows_bits_alone(heads, kv, dtype):
    """Decode rows in shared-prefix tiles as tall as a decode program's (8 samples of a 200-token
    prompt, 3 of a 70-token one, one row alone), one program a row: each row carries on from its
    tile's state at the prompt's last whole block and gets the bits it gets reading its whole
    cache alone."""
    from loongsage.core.engine.fused.attention import decode_attention, tile_members, tile_tables

    torch.manual_seed(1)
    rows, dim, columns = 12, 128, 512
    dev = torch.device("cuda")
    q = torch.randn(rows, heads, dim, dtype=dtype, device=dev)
    k = torch.randn(rows, kv, columns, dim, dtype=dtype, device=dev)
    v = torch.randn(rows, kv, columns, dim, dtype=dtype, device=dev)
    groups = [(list(range(8)), 200), ([8, 9, 10], 70), ([11], 300)]
    for members, prefix in groups:  # each sample's slot holds its own copy of the prompt
        k[members, :, :prefix], v[members, :, :prefix] = k[members[0], :, :prefix], v[members[0], :, :prefix]
    lengths = torch.tensor([201, 260, 333, 450, 202, 211, 499, 390, 71, 140, 100, 301], device=dev)
    alone = decode_attention(q, k, v, lengths, 0.088, columns, splits=1)
    tables = tile_tables(groups, tile_members(heads // kv, invariant=True), rows // 2, rows)
    assert tables.first.tolist() == [192] * 8 + [64] * 3 + [0]
    shared = type(tables)(tables.tiles.to(dev), tables.first.to(dev))
    assert torch.equal(decode_attention(q, k, v, lengths, 0.088, columns, splits=1, shared=shared), alone)
