"""The batch-invariant mode's refusals, on the CPU. Its bit-for-bit agreement between the engine's
decode and prefill and the trainer's forward is checked where its kernels run: in Triton's
interpreter (``_fused_interpreted.py``) and on a GPU (``tests/gpu/test_consistency_gpu.py``)."""

from __future__ import annotations

import pytest

from loongsage.core.engine.native import NativeEngine


def test_the_engine_refuses_batch_invariant_where_its_kernels_cannot_run(model_dir):
    with pytest.raises(
        ValueError, match=r"^native engine: batch_invariant needs the fused kernels, which cannot run: "
    ):
        NativeEngine(model_dir, batch_invariant=True)
    with pytest.raises(ValueError, match="batch_invariant and deterministic are two ways .*: choose one"):
        NativeEngine(model_dir, batch_invariant=True, deterministic=True)
    with pytest.raises(ValueError, match=r"kernels=torch"):
        NativeEngine(model_dir, batch_invariant=True, kernels="torch")
