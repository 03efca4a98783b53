"""The native engine's construction options: each checked in one line before its model loads, and
the ones resolved from the device (:func:`resolve_steps_per_sync`)."""

from __future__ import annotations

import torch

from loongsage.core.model_math.dtypes import DTYPES


def engine_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``dtype`` by name (or as given), or a one-line error naming the allowed ones."""
    resolved = DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"native engine: dtype={dtype!r}: must be one of {sorted(DTYPES)}")
    return resolved


def check_options(
    *,
    max_batch_size: int,
    max_model_len: int,
    batch_invariant: bool,
    deterministic: bool,
    quantization: str | None,
    steps_per_sync: int | None,
) -> None:
    """Refuse, in one line, a value or a combination the engine cannot run."""
    if max_batch_size < 1 or max_model_len < 2:
        raise ValueError(
            f"native engine: max_batch_size={max_batch_size} must be >= 1 and max_model_len={max_model_len} >= 2"
        )
    if batch_invariant and deterministic:
        raise ValueError(
            "native engine: batch_invariant and deterministic are two ways to the trainer's numbers: choose one"
        )
    if quantization not in (None, "fp8"):
        raise ValueError(f"native engine: quantization={quantization!r}: must be null or 'fp8'")
    if quantization and (batch_invariant or deterministic):
        raise ValueError(
            "native engine: quantization=fp8 moves the engine's numbers away from the trainer's; "
            "it cannot hold batch_invariant or deterministic"
        )
    steps = steps_per_sync
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise ValueError(f"native engine: steps_per_sync={steps!r}: must be an integer >= 1 (or None: automatic)")


def resolve_steps_per_sync(steps: int | None, *, cuda_graphs: bool, device: torch.device, routes: bool) -> int:
    """Decode steps per host read-back: ``None`` picks 8 where the steps replay as CUDA graphs
    (there the host's round trip is a fifth of a step) and 1 elsewhere (recorded routes turn the
    graphs off)."""
    if steps is None:
        return 8 if cuda_graphs and device.type == "cuda" and not routes else 1
    return steps
