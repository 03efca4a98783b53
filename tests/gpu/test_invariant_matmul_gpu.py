"""On a CUDA GPU: the batch-invariant GEMM's rows do not depend on the batch, bit for bit, at the
1.7B shape's projections, in each of its layouts (small, medium or large tiles; a chunk of K per
program, or a tile per program; on Hopper, TMA loads with programs walking the tiles).

The CPU suite checks the same in Triton's interpreter, whose ``tl.dot`` is numpy's; this checks the
compiled kernels: that the layouts' tensor-core sums add the same products in the same order
(the tile's size changes the MMA instructions' N, not their K).
Run with ``LOONGSAGE_RUN_GPU=1 pytest tests/gpu -m gpu``.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# (N, K) of the Qwen3-1.7B shape: merged q/k/v, o, merged gate/up, down, and the FP32 head
SHAPES = [(4096, 2048, None), (2048, 2048, None), (12288, 2048, None), (2048, 6144, None), (151936, 2048, "fp32")]


@pytest.mark.parametrize(("n", "k", "head"), SHAPES)
def test_rows_are_the_same_bits_in_every_batch_and_layout(n, k, head, monkeypatch):
    from loongsage.core.engine.fused import matmul

    torch.manual_seed(0)
    dev = torch.device("cuda")
    out_dtype = torch.float32 if head else None
    weight = torch.randn(n, k, dtype=torch.bfloat16, device=dev) * 0.02
    probe = torch.randn(4, k, dtype=torch.bfloat16, device=dev)
    alone = torch.cat([matmul.invariant_matmul(probe[i : i + 1], weight, out_dtype=out_dtype) for i in range(4)])
    want = probe.float() @ weight.float().T
    torch.testing.assert_close(alone.float(), want, atol=2e-2 if head is None else 1e-3, rtol=1e-2)
    for rows in (7, 64, 128, 256, 4096):
        batch = torch.randn(rows, k, dtype=torch.bfloat16, device=dev)
        at = [0, rows // 3, rows // 2, rows - 1]
        batch[at] = probe
        got = matmul.invariant_matmul(batch, weight, out_dtype=out_dtype)[at]
        assert torch.equal(got, alone), (n, k, rows)
    # each layout forced on every shape, at a decode's rows and at a trainer's: the same bits
    trainer = batch  # the last batch: 4096 rows holding the probe
    sizes = (matmul.SMALL_TILES, matmul.MEDIUM_TILES, matmul.MEDIUM_WIDE_OUT_TILES, matmul.LARGE_TILES)
    layouts = [(t, layout) for t in sizes for layout in ("split", "tile")]
    if torch.cuda.get_device_capability()[0] == 9:  # TMA where the large layout uses it
        layouts += [(matmul.TMA_TILES if head is None else matmul.TMA_WIDE_OUT_TILES, "tma")]
    for layout in layouts:
        monkeypatch.setattr(matmul, "_layout", lambda m, n, k, device, wide_out, layout=layout: layout)
        got = matmul.invariant_matmul(probe, weight, out_dtype=out_dtype)
        assert torch.equal(got, alone), (n, k, "layout", layout)
        got = matmul.invariant_matmul(trainer, weight, out_dtype=out_dtype)[at]
        assert torch.equal(got, alone), (n, k, "layout", layout, "4096 rows")


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9, reason="TMA layout: a Hopper GPU"
)
@pytest.mark.parametrize("out_dtype", [None, torch.float32])
def test_the_tma_layout_runs_and_gives_the_other_layouts_bits(out_dtype, monkeypatch):
    """A trainer's rows on Hopper run the TMA layout (checked, not assumed): the same bits as the
    pointer kernels' large and small tiles, with a bias, ``x`` a column slice of a wider tensor, the
    result written into columns of a wider one, and a K whose last chunk is short (Qwen2.5-1.5B's
    intermediate size, 8960 = 4 chunks of 2,560, the last 1,280 long)."""
    from loongsage.core.engine.fused import matmul

    torch.manual_seed(1)
    dev = torch.device("cuda")
    runs, run_tma = [], matmul._run_tma
    monkeypatch.setattr(matmul, "_run_tma", lambda *args: runs.append(1) or run_tma(*args))
    for n, k in ((1536, 8960), (2048, 2048)):
        x = torch.randn(4096, k + 64, dtype=torch.bfloat16, device=dev)[:, 64:]
        weight = torch.randn(n, k, dtype=torch.bfloat16, device=dev) * 0.02
        bias = torch.randn(n, dtype=torch.bfloat16, device=dev)
        tma = matmul.invariant_matmul(x, weight, bias, out_dtype)
        assert len(runs) == 1, "the trainer's rows did not run the TMA layout"
        runs.clear()
        wider = torch.zeros(4096, n + 16, dtype=tma.dtype, device=dev)
        matmul.invariant_matmul(x, weight, bias, out_dtype, out=wider[:, 8 : 8 + n])
        assert len(runs) == 1, "columns of a wider result did not run the TMA layout"
        runs.clear()
        assert torch.equal(wider[:, 8 : 8 + n], tma) and not wider[:, :8].any() and not wider[:, 8 + n :].any()
        for layout in ((matmul.LARGE_TILES, "tile"), (matmul.SMALL_TILES, "split"), (matmul.SMALL_TILES, "tile")):
            with monkeypatch.context() as forced:
                forced.setattr(matmul, "_layout", lambda m, n, k, device, wide_out, layout=layout: layout)
                assert torch.equal(matmul.invariant_matmul(x, weight, bias, out_dtype), tma), (n, k, layout)
        want = x.float() @ weight.float().T + bias.float()
        torch.testing.assert_close(tma.float(), want, atol=2e-2 if out_dtype is None else 1e-3, rtol=1e-2)


def test_projections_written_side_by_side_are_each_ones_bits():
    """The trainer's q/k/v as its modules hold them (a bias on k only), written into one result by
    :class:`InvariantLinears` at a trainer's and a decode step's rows: each block the bits of its
    projection alone."""
    from loongsage.core.engine.fused import matmul

    torch.manual_seed(2)
    dev = torch.device("cuda")
    weights = [torch.randn(n, 2048, dtype=torch.bfloat16, device=dev) * 0.02 for n in (2048, 1024, 1024)]
    biases = [None, torch.randn(1024, dtype=torch.bfloat16, device=dev), None]
    for rows in (6144, 128):
        x = torch.randn(rows, 2048, dtype=torch.bfloat16, device=dev)
        alone = torch.cat([matmul.invariant_matmul(x, w, b) for w, b in zip(weights, biases)], 1)
        assert torch.equal(matmul.invariant_linears(x, weights, biases), alone), rows
