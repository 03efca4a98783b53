"""The ``plan`` command's answer as text: the workload, the predicted step and its phases, the GPU
use, the async gain, and the placements considered."""

from __future__ import annotations

from loongsage.core.throughput import constants as C
from loongsage.core.throughput.placement import Plan, Prediction
from loongsage.core.throughput.workload import Workload

KERNELS = {"fused": "fused kernels", "torch": "torch kernels", "sglang": "SGLang"}


def _gb(b: float) -> str:
    return f"{b / 1e9:.1f} GB"


def step_lines(p: Prediction, work: Workload) -> list[str]:
    """The phases of one prediction."""
    r, place = p.rollout, p.placement
    traj = work.batch.trajectories
    overlapped = place.kind == "disaggregated" and place.asynchronous
    what = "a step's worth at the engines' pace" if overlapped else f"{r.steps:.0f} decode steps"
    lines = [
        f"  step      {p.step_s:.3g} s   ({traj / p.step_s:.1f} trajectories/s; "
        + ("the phases in sequence)" if p.bound == "sequence" else f"overlapped, bound by {p.bound})"),
        f"  rollout   {r.total_s:.3g} s   prefill {r.prefill_s:.3f} + decode {r.decode_s:.3f} ({what}) + host "
        f"{r.host_s:.3f} ({traj} trajectories x {C.HOST_S_PER_TRAJECTORY * 1e3:.2f} ms)",
    ]
    if overlapped:
        lines.append(f"            the synchronous generation would take {p.tail.engine_s:.3g} s (its longest sample)")
    extra = (f" + all-reduce {p.comm_s:.3f}" if p.comm_s else "") + (
        f" + memory moves {p.memory_s:.3f}" if p.memory_s else ""
    )
    lines += [
        f"  train     {p.train_s:.3g} s   compute {p.compute_s:.3f} ({p.flops:.3g} FLOPs on {place.ranks} card(s) at "
        f"{C.TRAINER_MFU[work.trainer]:.0%} MFU) + seams {p.seams_s:.3f}{extra}",
        f"  push      {p.push_s:.3g} s",
        "  GPU use   " + _use(p),
        f"  memory    {_gb(p.memory.card)} of {_gb(p.memory.limit)} usable on the fullest card (trainer state "
        f"{_gb(p.memory.trainer_state)}, activations {_gb(p.memory.activations)}, engine {_gb(p.memory.engine)})",
    ]
    return lines


def _use(p: Prediction) -> str:
    r, place = p.rollout, p.placement
    roof = f"rollout at {_pct(r.roofline_s / r.total_s)} of the bandwidth roofline over its phase"
    mfu = f"training at {_pct(p.train_mfu)} MFU over its phase"
    if place.kind == "disaggregated":
        engines, trainers = min(1.0, r.engine_s / p.step_s), p.train_s / p.step_s
        busy = f"engine cards busy {engines:.0%} of the step, trainer cards {trainers:.0%}"
    else:
        busy = f"every card: rollout {r.total_s / p.step_s:.0%}, training {p.train_s / p.step_s:.0%} of the step"
    return f"{roof}; {mfu}; {busy}"


def _pct(x: float) -> str:
    return f"{x:.0%}" if x >= 0.01 else f"{x:.2%}"


def _gain(plan: Plan) -> str:
    if plan.best_async is None:
        why = "none fits" if plan.gpus > 1 else "it needs cards of its own for engines and trainer"
        return (
            f"async over sync: no overlapping placement on {plan.gpus} card(s): {why} (a card shared by both "
            "roles is time-sliced: it overlaps nothing)"
        )
    if plan.best_sync is None:
        return "async over sync: no synchronous placement fits"
    a, s = plan.best_async, plan.best_sync
    return (
        f"async over sync: {s.step_s / a.step_s:.2f}x (best async {a.step_s:.3g} s, {a.placement.describe()}, bound "
        f"by {a.bound}; best sync {s.step_s:.3g} s, {s.placement.describe()})"
    )


def render(recipe: str, work: Workload, accel: C.Accelerator, plan: Plan) -> str:
    b = work.batch
    sched = f"{work.scheduler} (staleness {work.staleness})" if work.asynchronous else work.scheduler
    lines = [
        f"plan {recipe} on {plan.gpus} x {accel.name} ({accel.source})",
        f"model      {work.model}: {work.shape.describe()}; {work.dtype}",
        f"step       {b.groups} prompts, {b.trajectories} trajectories; {work.prompt_note}",
        f"responses  {work.lengths_note}",
        f"engine     {work.engine} ({KERNELS[work.kernels]}: {C.DECODE_EFFICIENCY[work.kernels]:.0%} of the decode "
        f"roofline), {work.capacity} rows at once; trainer {work.trainer} ({C.TRAINER_MFU[work.trainer]:.0%} MFU); "
        f"scheduler {sched}",
        "",
    ]
    if plan.recipe is not None:
        lines += [f"the recipe's placement: {plan.recipe.placement.describe()}", *step_lines(plan.recipe, work), ""]
    if plan.chosen is None:
        return "\n".join(lines)
    kind = "an asynchronous" if work.asynchronous else "a synchronous"
    why = f"the fastest that fits with {kind} scheduler, as the recipe's"
    if plan.recipe is not None and plan.chosen is plan.recipe:
        lines.append(f"picked: the recipe's placement ({why})")
    else:
        lines += [f"picked ({why}): {plan.chosen.placement.describe()}", *step_lines(plan.chosen, work)]
    lines += ["", _gain(plan), "", f"placements considered on {plan.gpus} card(s), fastest first:"]
    shown = plan.considered[:12]
    for p in shown:
        mark = " <- picked" if p is plan.chosen else (" (the recipe's)" if p is plan.recipe else "")
        fits = "" if p.memory.fits else f"  does not fit: {_gb(p.memory.card)} > {_gb(p.memory.limit)}"
        lines.append(f"  {p.step_s:8.3g} s  {p.placement.describe()}{fits}{mark}")
    if len(plan.considered) > len(shown):
        lines.append(f"  ... and {len(plan.considered) - len(shown)} more")
    return "\n".join(lines)
