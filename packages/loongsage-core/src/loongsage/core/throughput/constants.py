"""Every constant of the throughput model, each with where it was measured.

The H200 figures were measured on the H200 the benchmarks ran on (``bench/results/``); the H100 and
A100 are that H200 scaled by datasheet ratios (SXM parts), not measured. The efficiencies (a share
of the bandwidth roofline for decoding, an MFU for training) were measured on the H200 and are
assumed to carry over to the other cards. :mod:`.calibration` derives each calibrated value below
from the result files, and ``tests/core/test_throughput.py`` checks that they still agree.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Accelerator:
    name: str
    peak_bf16: float  # FLOP/s of a large dense bf16 matmul
    peak_fp32: float  # FLOP/s of a float32 matmul (no tensor cores: torch's default leaves TF32 off)
    bandwidth: float  # B/s of device memory (a large device-to-device copy: read plus write)
    memory: float  # B of device memory, as torch reports the card's total
    link: float  # B/s one way between two cards of a node (NVLink)
    source: str

    def peak(self, dtype: str) -> float:
        return self.peak_fp32 if dtype == "float32" else self.peak_bf16


# Datasheets (SXM): bf16 dense TFLOP/s, fp32 TFLOP/s, memory TB/s, memory GB, NVLink GB/s one way.
DATASHEET = {
    "h200": (989.0, 67.0, 4.8, 141.0, 450.0),
    "h100": (989.0, 67.0, 3.35, 80.0, 450.0),
    "a100": (312.0, 19.5, 2.039, 80.0, 300.0),
}
# Measured on the H200: the bf16 matmul rate of bench/train_mfu.py at d8485dc (train_mfu.json
# "matmul_tflops"; the other runs measured 774-791), the copy bandwidth of bench/engine_gpu.py at
# d8485dc (engine_gpu.json "copy_bandwidth_tb_s"), the card's memory as torch reports it (139.80 GiB,
# the out-of-memory message in history/train_mfu.c7ef7f5.json).
H200_PEAK_BF16 = 786.459e12
H200_BANDWIDTH = 4.21898e12
H200_MEMORY = 139.80 * 2**30


def _accelerator(name: str) -> Accelerator:
    bf16, fp32, bandwidth, memory, link = DATASHEET[name]
    h_bf16, h_fp32, h_bandwidth, h_memory, _ = DATASHEET["h200"]
    measured = "measured: bench/results" if name == "h200" else "not measured: the H200's figures x datasheet ratios"
    return Accelerator(
        name=name.upper(),
        peak_bf16=H200_PEAK_BF16 * bf16 / h_bf16,
        peak_fp32=H200_PEAK_BF16 * fp32 / h_bf16,  # float32 at the datasheet's fp32 : bf16 ratio
        bandwidth=H200_BANDWIDTH * bandwidth / h_bandwidth,
        memory=H200_MEMORY * memory / h_memory,
        link=link * 1e9,  # datasheet, not measured here
        source=measured,
    )


ACCELERATORS = {name: _accelerator(name) for name in DATASHEET}

# ---------------------------------------------------------------- rollout
# Share of the decode roofline (every decode step reads the weights and each live row's keys and
# values once, at the copy bandwidth) the engine reaches: bench/results/engine_gpu.json at d8485dc,
# Qwen3-1.7B shape, 128-token prompts + 256 sampled tokens at batch 64/128/256, the prefill of the
# prompts (modelled below) taken out; one value fitted over the three batches (each batch alone:
# fused 0.454-0.513, torch 0.197-0.245, sglang 0.261-0.276).
DECODE_EFFICIENCY = {
    "fused": 0.4889,  # native engine, fused Triton kernels under CUDA graphs (bf16/fp16)
    "torch": 0.2247,  # native engine, torch kernels under CUDA graphs (kernels: torch, or float32)
    "sglang": 0.2693,  # SGLang 0.5.16 through its HTTP API with log-probs, same card, same run
}
# A decode step outside the graphed forward (sampling, bookkeeping, the host round trip):
# bench/results/engine_profile_gpu.json at d8485dc, batch 128. No step is shorter (tiny models).
DECODE_STEP_FLOOR_S = 0.94e-3
# Prefill runs the torch path (an HF-style forward), so its MFU is taken to be the eager trainer's
# in-step MFU (TRAINER_MFU["torch"]): an assumption, prefill is not timed on its own anywhere.
PREFILL_MFU = 0.4173
NATIVE_MAX_ROWS = 256  # the native engine's default max_batch_size (rows it decodes at once)
SGLANG_MAX_ROWS = 256  # assumed for SGLang (its own limit follows its memory fraction)
# The controller's host work per trajectory (agent, reward, trajectory assembly, Ray calls, and the
# engine's own steps beyond its modelled compute): bench/results/gpu_runs/grpo_arith4_bf16_h200.metrics.jsonl
# (b4c3fa5), median rollout 0.2305 s (steps 2-60) for 512 trajectories of at most 8 tokens, the
# engine's own modelled time taken out. Serial: it does not shrink with more engines. (The float32
# run at fb011ee, before the engine's whole-step graph, gave 1.06 ms.)
HOST_S_PER_TRAJECTORY = 0.4311e-3

# ---------------------------------------------------------------- training
# MFU of the trainer's compute against H200_PEAK_BF16, FLOPs counted as 6 x matmul params x tokens
# plus causal attention (bench/train_mfu.py's count):
TRAINER_MFU = {
    # eager torch: the GRPO step at de085c6 (history/gpu_rl_step.de085c6.json: train 1.61 s less the
    # seams below), micro-batches of 32 x 384 tokens
    "torch": 0.4173,
    # torch with compile_layers: the GRPO step at 05257a0 (gpu_rl_step.json, timing/trainer_compute_s),
    # every layer compiled (at d8485dc, history/gpu_rl_step.d8485dc.json, 8 of 28 were: 0.4729)
    "torch_compiled": 0.7065,
    # megatron, sdpa layer and Transformer Engine's: bench/train_mfu.py at c7ef7f5
    # (history/train_mfu.c7ef7f5.json, 4 x 4096 tokens; in that bench the torch trainer ran 39.4%
    # where it runs 41.5% in the step, so these may be low for a step's shapes)
    "megatron": 0.4252,
    "megatron_te": 0.4836,
}
# Batch building and the transfers to the trainer around its compute: gpu_rl_step.json at 05257a0,
# train_s - trainer_compute_s (0.045 s for 128 x 384 tokens; 0.035 s at d8485dc). Per step: the
# bf16 arith4 run shows about the same for 512 short rows (0.037 s).
TRAIN_SEAMS_S = 0.0448
# Activation memory per token of a micro-batch: 34 bytes x hidden per layer (16-bit activations
# without recomputation, flash attention; Korthikanti et al. 2022), 2 bytes x hidden per layer
# with gradient checkpointing (each layer's input) plus one layer's 34; and bytes per vocabulary
# entry for the logits, their float32 log-softmax and gradients, calibrated on the eager trainer's
# peak of bench/train_mfu.py at d8485dc (116.0 GB for 4 x 4096 tokens).
ACTIVATION_BYTES_PER_HIDDEN = 34
ACTIVATION_BYTES_PER_HIDDEN_CHECKPOINTED = 2
ACTIVATION_BYTES_PER_VOCAB = 21.3
MEMORY_USABLE = 0.95  # of the card's memory, the rest for the CUDA context and fragmentation (assumed)

# ---------------------------------------------------------------- the weight push and memory moves
# The ipc transport in place: bench/results/weight_sync.json (6c4443d), 3.44 GB in 9.0 ms.
IPC_BYTES_PER_S = 382.46e9
# NCCL broadcast across cards: not measured here (weight_sync needs two GPUs): assumed a third of
# NVLink's 450 GB/s one way on the H200, the pack copy and the bucket pipeline taken into account.
NCCL_BROADCAST_BYTES_PER_S = 150e9
# gloo broadcast and the cpu transport on CPU: bench/results/weight_sync_cpu.json (a3e7b6e), 256 MiB
# buckets, 127 MB in 137 ms and 320 ms.
GLOO_BROADCAST_BYTES_PER_S = 0.93e9
CPU_TRANSPORT_BYTES_PER_S = 0.40e9
# SGLang's weight update (update_weights_from_tensor): 3.44 GB in 71 ms, docs/weight_sync.md.
SGLANG_UPDATE_BYTES_PER_S = 48e9
# The push's per-step work whatever the size (pausing generation, the update's bookkeeping, the
# Ray round trips): grpo_arith4_h200.metrics.jsonl, median sync_s 13.6 ms for a 101 MB model.
PUSH_FIXED_S = 0.01337
# Colocated with placement.release_engine_memory: the engines free their cache and move their
# weights to the host and back around training. Host <-> device: 2.4 GB offloaded in 0.05 s and
# onloaded in 0.04 s (tests/gpu/test_offload_gpu.py on the H200, docs/weight_sync.md); the fixed
# part from grpo_arith4_h200.metrics.jsonl (median timing/engine_memory_s 0.116 s, 101 MB).
HOST_LINK_BYTES_PER_S = 53e9
ENGINE_MEMORY_FIXED_S = 0.1127
