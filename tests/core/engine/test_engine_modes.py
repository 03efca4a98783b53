"""The engine's GPU modes refuse, in one line, where they cannot run or what they cannot hold.

What they compute is checked where their kernels run: in Triton's interpreter
(``_fused_interpreted.py``: the batch-invariant mode bit for bit against the trainer's forward, FP8
weights against bf16) and on a GPU (``tests/gpu/``)."""

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


def test_fp8_weights_are_refused_where_they_cannot_run_or_what_they_cannot_hold(model_dir):
    with pytest.raises(ValueError, match=r"quantization='int4': must be null or 'fp8'"):
        NativeEngine(model_dir, quantization="int4")
    with pytest.raises(ValueError, match=r"quantization=fp8 runs on the fused decode kernels, not here: device 'cpu'"):
        NativeEngine(model_dir, quantization="fp8")
    for mode in ({"batch_invariant": True}, {"deterministic": True}):
        with pytest.raises(ValueError, match="it cannot hold batch_invariant or deterministic"):
            NativeEngine(model_dir, quantization="fp8", **mode)
