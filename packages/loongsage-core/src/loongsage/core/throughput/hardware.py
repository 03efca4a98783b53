"""Cost models of one accelerator, from :mod:`.constants`: decoding against the bandwidth roofline,
prefill and training against the matmul peak, the weight push over its transport."""

from __future__ import annotations

from loongsage.core.throughput import constants as C
from loongsage.core.throughput.phases import DecodeCost, PrefillCost
from loongsage.core.throughput.shape import ModelShape

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def roofline_cost(shape: ModelShape, dtype: str, accel: C.Accelerator) -> DecodeCost:
    """A decode step reading the weights and every live row's keys and values once, at full bandwidth."""
    b = DTYPE_BYTES[dtype]
    return DecodeCost(
        fixed_s=shape.weight_bytes(b) / accel.bandwidth,
        per_context_s=shape.kv_bytes_per_token(b) / accel.bandwidth,
    )


def decode_cost(shape: ModelShape, dtype: str, accel: C.Accelerator, kernels: str) -> DecodeCost:
    """The roofline at the engine's measured share of it (``kernels``: a key of DECODE_EFFICIENCY)."""
    roof, eta = roofline_cost(shape, dtype, accel), C.DECODE_EFFICIENCY[kernels]
    return DecodeCost(fixed_s=roof.fixed_s / eta, per_context_s=roof.per_context_s / eta, floor_s=C.DECODE_STEP_FLOOR_S)


def prefill_cost(shape: ModelShape, dtype: str, accel: C.Accelerator, mfu: float = C.PREFILL_MFU) -> PrefillCost:
    """A prompt's forward at ``mfu``: the layers for every token, causal attention, the LM head for
    the last token only (the first sampled one)."""
    rate = accel.peak(dtype) * mfu
    return PrefillCost(
        fixed_s=2 * shape.head_params / rate,
        per_token_s=2 * shape.body_matmul_params / rate,
        per_square_s=2 * shape.attention_width / rate,
    )


def trainer_kind(backend: str, params: dict[str, object]) -> str:
    """The TRAINER_MFU key of a trainer backend and its params (``None`` when none applies)."""
    if backend == "torch":
        return "torch_compiled" if params.get("compile_layers") else "torch"
    if backend == "megatron":
        # auto: Transformer Engine's layer where it imports on a GPU (the verified GPU stack has it)
        return "megatron" if params.get("layer_spec") in ("sdpa", "local") else "megatron_te"
    raise ValueError(
        f"trainer.backend.name={backend!r}: no measured MFU; the model knows torch (compile_layers on or off) "
        "and megatron"
    )


def push_bytes_per_s(transport: str, engine: str, accel: C.Accelerator, on_gpu: bool) -> float:
    """The weight push's bandwidth: the engine's own update for SGLang, else the transport's."""
    if engine == "sglang":
        return C.SGLANG_UPDATE_BYTES_PER_S
    if transport == "ipc":
        return C.IPC_BYTES_PER_S * accel.bandwidth / C.H200_BANDWIDTH  # a device copy: scales with it
    if transport == "broadcast":
        if not on_gpu:
            return C.GLOO_BROADCAST_BYTES_PER_S
        return C.NCCL_BROADCAST_BYTES_PER_S * accel.link / (C.DATASHEET["h200"][4] * 1e9)
    if transport == "cpu":
        return C.CPU_TRANSPORT_BYTES_PER_S
    raise ValueError(
        f"rollout.transport.name={transport!r}: no measured bandwidth; the model knows ipc, broadcast, cpu"
    )
