"""Placements of a workload on ``n`` cards, what each holds in memory, its step time, and the pick.

* ``colocated``: every card holds a trainer rank and an engine; the phases run in sequence
  (rollout on every card's engine, training data-parallel on every card, the push). Always
  synchronous: an asynchronous scheduler needs the roles on separate resources.
* ``disaggregated``: ``k`` cards of engines, ``n - k`` of trainer ranks. Synchronously the phases
  still run in sequence (each side idles while the other works); asynchronously they overlap
  (:func:`.phases.async_step_s`).
* ``shared``: engine and trainer as separate processes on fractions of the same cards
  (``gpus_per_actor < 1``). The card is time-sliced between them, so their GPU work does not
  overlap: the phases are counted in sequence whatever the scheduler.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from loongsage.core.throughput import constants as C
from loongsage.core.throughput.hardware import decode_cost, prefill_cost, push_bytes_per_s, roofline_cost
from loongsage.core.throughput.phases import Rollout, async_step_s, sync_rollout, throughput_rollout, train_flops
from loongsage.core.throughput.workload import Workload


@dataclass(frozen=True)
class Placement:
    kind: str  # colocated | disaggregated | shared
    gpus: int
    engines: int
    ranks: int
    asynchronous: bool = False
    staleness: int = 0

    def describe(self) -> str:
        sched = f"async (staleness {self.staleness})" if self.asynchronous else "sync"
        if self.kind == "colocated":
            return f"colocated on {self.gpus}: {self.engines} engine(s) + {self.ranks} trainer rank(s), {sched}"
        if self.kind == "shared":
            return f"shared {self.gpus} card(s): {self.engines} engine(s) + {self.ranks} rank(s) time-sliced, {sched}"
        return f"disaggregated: {self.engines} engine card(s) + {self.ranks} trainer card(s), {sched}"


@dataclass(frozen=True)
class Memory:
    """Bytes on the fullest card."""

    trainer_state: float
    activations: float
    engine: float
    card: float
    limit: float

    @property
    def fits(self) -> bool:
        return self.card <= self.limit


@dataclass(frozen=True)
class Prediction:
    placement: Placement
    rollout: Rollout  # the step's generation (asynchronously: a step's worth at the engines' pace)
    tail: Rollout  # the synchronous generation (what an asynchronous step must not fall behind)
    compute_s: float
    comm_s: float
    seams_s: float
    memory_s: float  # engine memory released and resumed, trainer offloaded, around training
    push_s: float
    step_s: float
    bound: str  # what sets the step: "sequence", or the asynchronous bound
    memory: Memory
    flops: float
    peak: float  # FLOP/s of one card in the model's dtype

    @property
    def train_s(self) -> float:
        return self.compute_s + self.comm_s + self.seams_s + self.memory_s

    @property
    def train_mfu(self) -> float:
        """MFU over the training phase, every trainer card counted."""
        return self.flops / (self.train_s * self.placement.ranks * self.peak)


def _state_bytes(work: Workload, ranks: int) -> float:
    """A trainer rank's weights, gradients, float32 masters (bf16/fp16 models) and AdamW moments."""
    params, b = float(work.shape.total_params), work.dtype_bytes
    masters = bool(work.trainer_params.get("master_weights", True)) and work.dtype != "float32"
    weights, grads, optimizer = params * b, params * (4 if masters else b), params * (8 + (4 if masters else 0))
    sharded = work.trainer == "torch" or work.trainer == "torch_compiled"
    if sharded and ranks > 1 and work.trainer_params.get("dp_mode", "fsdp2") == "fsdp2":
        return (weights + grads + optimizer) / ranks
    if work.trainer_params.get("distributed_optimizer"):
        optimizer /= ranks
    return weights + grads + optimizer


def _activation_bytes(work: Workload, ranks: int) -> float:
    s, scale = work.shape, work.dtype_bytes / 2  # the per-hidden figures are for 16-bit activations
    if work.trainer_params.get("gradient_checkpointing"):
        per_hidden = C.ACTIVATION_BYTES_PER_HIDDEN_CHECKPOINTED * s.layers + C.ACTIVATION_BYTES_PER_HIDDEN
    else:
        per_hidden = C.ACTIVATION_BYTES_PER_HIDDEN * s.layers
    tokens = min(work.micro_batch_tokens, work.batch.trained_tokens(work.shares_prompts) / ranks)
    chunk = int(work.trainer_params.get("head_chunk_tokens") or 0)  # the torch trainer's chunked FP32 head
    head_tokens = min(tokens, chunk) if chunk else tokens
    return float(tokens * per_hidden * s.hidden * scale + head_tokens * C.ACTIVATION_BYTES_PER_VOCAB * s.vocab)


def _engine_bytes(work: Workload, rows: float, card: float) -> float:
    """Weights and the KV cache; the native engine's cache grows by doubling up to its row limit.
    SGLang with ``mem_fraction_static`` takes that share of the card whatever it holds."""
    if work.engine_memory_fraction:
        return work.engine_memory_fraction * card
    slots = min(work.capacity, 2 ** math.ceil(math.log2(max(1.0, rows))))
    cache = slots * work.engine_context * work.shape.kv_bytes_per_token(work.dtype_bytes)
    return float(work.shape.weight_bytes(work.dtype_bytes) + cache)


def memory(work: Workload, place: Placement, rows: float, accel: C.Accelerator, release: bool) -> Memory:
    state, acts, engine = (
        _state_bytes(work, place.ranks),
        _activation_bytes(work, place.ranks),
        _engine_bytes(work, rows, accel.memory),
    )
    if place.kind == "colocated":
        resident = work.shape.weight_bytes(work.dtype_bytes) if work.offload_trainer else state
        card = max(engine + resident, state + acts + (0.0 if release else engine))
    elif place.kind == "shared":
        card = state + acts + engine
    else:
        card = max(state + acts, engine)
    return Memory(state, acts, engine, card, accel.memory * C.MEMORY_USABLE)


def _train(work: Workload, accel: C.Accelerator, place: Placement, release: bool) -> tuple[float, ...]:
    """FLOPs, compute, gradient all-reduce and memory moves of the training phase."""
    shape, b = work.shape, work.dtype_bytes
    flops = train_flops(shape.matmul_params, shape.attention_width, work.batch, work.passes, work.shares_prompts)
    compute = flops / (place.ranks * accel.peak(work.dtype) * C.TRAINER_MFU[work.trainer])
    ranks = place.ranks  # a ring all-reduce of the gradients, not overlapped with the backward
    comm = 2 * (ranks - 1) / ranks * shape.total_params * b / accel.link if ranks > 1 else 0.0
    moves = (C.ENGINE_MEMORY_FIXED_S + 2 * shape.weight_bytes(b) / C.HOST_LINK_BYTES_PER_S) if release else 0.0
    if work.offload_trainer and place.kind == "colocated":
        moves += 2 * _state_bytes(work, ranks) / C.HOST_LINK_BYTES_PER_S
    return flops, compute, comm, moves


def evaluate(work: Workload, accel: C.Accelerator, place: Placement, *, recipe: bool = False) -> Prediction:
    """The step time of ``work`` placed as ``place``; ``recipe``: the recipe's own placement (its
    transport and memory release apply as written)."""
    batch, shape = work.batch, work.shape
    decode = decode_cost(shape, work.dtype, accel, work.kernels)
    prefill, roof = prefill_cost(shape, work.dtype, accel), roofline_cost(shape, work.dtype, accel)
    host = C.HOST_S_PER_TRAJECTORY
    sync = sync_rollout(batch, place.engines, work.capacity, decode, prefill, host, roof)
    overlapped = place.kind == "disaggregated" and place.asynchronous
    if overlapped:  # an engine holds its share of (staleness + 1) steps in flight
        rollout = throughput_rollout(
            batch, place.engines, work.capacity, place.staleness + 1, decode, prefill, host, roof
        )
        live = min(work.capacity, batch.trajectories * (place.staleness + 1) / place.engines)
    else:  # the busiest engine holds its groups
        rollout, live = sync, batch.trajectories * math.ceil(batch.groups / place.engines) / batch.groups
    # colocated, a colocated recipe's choice holds; else the default of a colocated GPU placement (on)
    release = place.kind == "colocated" and (work.release_engine_memory if (recipe or work.colocate) else True)
    mem = memory(work, place, live, accel, release)
    flops, compute, comm, moves = _train(work, accel, place, release)
    default = "broadcast" if place.kind == "disaggregated" else "ipc"
    transport = work.transport if (recipe and work.transport) else default
    bytes_ = shape.weight_bytes(work.dtype_bytes)
    push = C.PUSH_FIXED_S + bytes_ / push_bytes_per_s(transport, work.engine, accel, on_gpu=True)
    train_s = compute + comm + C.TRAIN_SEAMS_S + moves
    if overlapped:
        step, bound = async_step_s(rollout, sync, place.staleness, train_s, push)
    else:
        step, bound = sync.total_s + train_s + push, "sequence"
    peak = accel.peak(work.dtype)
    return Prediction(place, rollout, sync, compute, comm, C.TRAIN_SEAMS_S, moves, push, step, bound, mem, flops, peak)


def recipe_placement(work: Workload) -> Placement | None:
    """The recipe's own placement (None for a CPU run)."""
    if not work.gpus_per_actor:
        return None
    kind = "colocated" if work.colocate else ("disaggregated" if work.gpus_per_actor >= 1 else "shared")
    return Placement(
        kind,
        int(work.recipe_gpus),
        work.num_engines,
        work.world_size,
        work.asynchronous and not work.colocate,
        work.staleness if not work.colocate else 0,
    )


def candidates(work: Workload, gpus: int, staleness: int) -> list[Placement]:
    """Colocated on every card, and every split of engines and trainer cards, synchronous and
    asynchronous (at most 64 splits, spread evenly, on many cards)."""
    out = [Placement("colocated", gpus, gpus, gpus)]
    splits = sorted({max(1, min(gpus - 1, round(1 + i * (gpus - 2) / 63))) for i in range(64)}) if gpus > 1 else []
    for k in splits:
        out.append(Placement("disaggregated", gpus, k, gpus - k))
        out.append(Placement("disaggregated", gpus, k, gpus - k, True, staleness))
    return out


@dataclass(frozen=True)
class Plan:
    gpus: int
    recipe: Prediction | None  # the recipe's own placement, when it is on these cards
    chosen: Prediction | None  # the fastest that fits, under the recipe's kind of scheduler
    considered: list[Prediction]
    best_sync: Prediction | None
    best_async: Prediction | None


def plan(work: Workload, accel: C.Accelerator, gpus: int) -> Plan:
    """Every candidate on ``gpus`` cards (and the recipe's own placement), the fastest fitting one."""
    staleness = work.staleness if work.asynchronous else 1
    considered = [evaluate(work, accel, p) for p in candidates(work, gpus, staleness)]
    own = recipe_placement(work)
    recipe = None
    if own is not None and own.gpus == gpus:
        recipe = evaluate(work, accel, own, recipe=True)
        considered = [p for p in considered if p.placement != own] + [recipe]
    fitting = [p for p in considered if p.memory.fits]
    same_kind = [p for p in fitting if p.placement.asynchronous == work.asynchronous]
    chosen = min(same_kind or fitting, key=lambda p: p.step_s, default=None)
    best_sync = min((p for p in fitting if not p.placement.asynchronous), key=lambda p: p.step_s, default=None)
    # a shared card overlaps nothing: the async gain is the disaggregated placements'
    overlapping = (p for p in fitting if p.placement.asynchronous and p.placement.kind == "disaggregated")
    best_async = min(overlapping, key=lambda p: p.step_s, default=None)
    considered.sort(key=lambda p: (not p.memory.fits, p.step_s))
    return Plan(gpus, recipe, chosen, considered, best_sync, best_async)
