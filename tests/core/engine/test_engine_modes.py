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


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"quantization": "int4"}, r"quantization='int4': must be null or 'fp8'"),
        ({"batch_invariant": True, "deterministic": True}, "choose one"),
        ({"quantization": "fp8", "deterministic": True}, "it cannot hold batch_invariant or deterministic"),
        ({"steps_per_sync": 0}, r"steps_per_sync=0: must be an integer >= 1"),
        ({"max_batch_size": 0}, r"max_batch_size=0 must be >= 1"),
        ({"dtype": "float8"}, r"dtype='float8': must be one of"),
    ],
)
def test_bad_options_are_refused_before_the_model_loads(tmp_path, options, message):
    """No model at the path: each error names the option, not the missing model."""
    with pytest.raises(ValueError, match=message):
        NativeEngine(str(tmp_path / "no-model-here"), **options)
