"""The phases of a step, as pure functions of a batch and cost models.

A decode step of a continuous-batching engine costs a fixed part (on a GPU: reading the weights
once), a part per live row, and a part per token of context the live rows hold (reading their keys
and values). Summed over a rollout, those are three totals whatever the scheduling: the number of
decode steps, the row-steps (= the tokens sampled) and the context-steps (= Σ over samples of
``Σ_{t < L} (prompt + t)``). Only the number of steps depends on how the rows are scheduled:

* synchronously the engine decodes until its longest sample is done: ``E[max L]`` steps (or, when
  it holds more rows than it can run at once, its tokens over its rows);
* asynchronously the scheduler keeps ``(staleness + 1)`` steps' worth of groups in flight, so the
  engine runs at that many rows and a step's worth of tokens takes ``tokens / rows`` steps; no step
  waits for the tail, but a sample must finish within ``staleness + 1`` steps of the trainer to be
  trained, so a step is at least the longest generation over ``staleness + 1``.

The same functions take the simulation's latency model (a fixed cost and a cost per row) and a GPU
roofline with an efficiency (:mod:`.hardware`), which is how the async-gain formula is checked
against the simulated service (``bench/plan_vs_measured.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from loongsage.core.throughput.lengths import Lengths, expected_max


@dataclass(frozen=True)
class Source:
    """One data source's share of a step: ``prompts`` groups of ``samples``."""

    prompts: int
    samples: int
    prompt_tokens: int
    lengths: Lengths


@dataclass(frozen=True)
class Batch:
    """The groups one step generates and trains."""

    sources: tuple[Source, ...]

    @property
    def groups(self) -> int:
        return sum(s.prompts for s in self.sources)

    @property
    def trajectories(self) -> int:
        return sum(s.prompts * s.samples for s in self.sources)

    def sampled_tokens(self) -> float:
        return math.fsum(s.prompts * s.samples * s.lengths.mean() for s in self.sources)

    def context_tokens(self) -> float:
        """Σ over samples and their decode steps of the tokens in the cache: what decoding reads."""
        return math.fsum(
            s.prompts * s.samples * (s.prompt_tokens * s.lengths.mean() + s.lengths.generated_context())
            for s in self.sources
        )

    def trained_tokens(self, share_prompts: bool = False) -> float:
        """Tokens the training forward computes; with ``share_prompts`` each group's prompt once."""
        return math.fsum(
            s.prompts * ((1 if share_prompts else s.samples) * s.prompt_tokens + s.samples * s.lengths.mean())
            for s in self.sources
        )

    def trained_square(self, share_prompts: bool = False) -> float:
        """Σ over rows of ``E[(prompt + L)^2]``: the attention part of the training FLOPs; with
        ``share_prompts`` a group's prompt attends over itself once."""
        return math.fsum(
            s.prompts
            * (
                (1 if share_prompts else s.samples) * s.prompt_tokens**2
                + s.samples * (2 * s.prompt_tokens * s.lengths.mean() + s.lengths.mean_square())
            )
            for s in self.sources
        )

    def longest(self) -> float:
        """The expected longest sample of the step."""
        return expected_max([(s.lengths, s.prompts * s.samples) for s in self.sources])


@dataclass(frozen=True)
class DecodeCost:
    """Seconds of decoding: per step ``fixed_s + per_row_s × rows + per_context_s × context``, no
    step shorter than ``floor_s``."""

    fixed_s: float
    per_row_s: float = 0.0
    per_context_s: float = 0.0
    floor_s: float = 0.0

    def seconds(self, steps: float, row_steps: float, context_steps: float) -> float:
        busy = steps * self.fixed_s + row_steps * self.per_row_s + context_steps * self.per_context_s
        return max(busy, steps * self.floor_s)


@dataclass(frozen=True)
class PrefillCost:
    """Seconds to prefill one prompt of ``p`` tokens: ``fixed_s + per_token_s × p + per_square_s × p²``."""

    fixed_s: float = 0.0
    per_token_s: float = 0.0
    per_square_s: float = 0.0

    def seconds(self, prompts: float, tokens: int) -> float:
        return prompts * (self.fixed_s + self.per_token_s * tokens + self.per_square_s * tokens**2)


@dataclass(frozen=True)
class Rollout:
    """One engine's rollout of a step: ``steps`` decode steps; ``host_s`` is the controller's share
    (agents, rewards, bookkeeping), serial over the whole step's trajectories."""

    prefill_s: float
    decode_s: float
    host_s: float
    steps: float
    roofline_s: float  # the same decoding at the device's full bandwidth (0 when not on a GPU)

    @property
    def engine_s(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def total_s(self) -> float:
        return self.engine_s + self.host_s


def _share(batch: Batch, engines: int, busiest: bool) -> float:
    """The fraction of the step one engine gets: groups go whole to the least-loaded engine, so the
    busiest holds ``ceil(groups / engines)`` of them; on average an engine holds ``1 / engines``."""
    if busiest:
        return math.ceil(batch.groups / engines) / batch.groups
    return 1.0 / engines


def _rollout(
    batch: Batch,
    share: float,
    steps: float,
    decode: DecodeCost,
    prefill: PrefillCost,
    host_s: float,
    roofline: DecodeCost | None,
) -> Rollout:
    rows, context = batch.sampled_tokens() * share, batch.context_tokens() * share
    return Rollout(
        prefill_s=math.fsum(prefill.seconds(s.prompts * share, s.prompt_tokens) for s in batch.sources),
        decode_s=decode.seconds(steps, rows, context),
        host_s=host_s,
        steps=steps,
        roofline_s=roofline.seconds(steps, rows, context) if roofline else 0.0,
    )


def sync_rollout(
    batch: Batch,
    engines: int,
    capacity: int,
    decode: DecodeCost,
    prefill: PrefillCost,
    host_per_trajectory_s: float = 0.0,
    roofline: DecodeCost | None = None,
) -> Rollout:
    """A synchronous step's generation: it ends when the busiest engine's longest sample does."""
    share = _share(batch, engines, busiest=True)
    rows = batch.trajectories * share
    steps = max(batch.longest(), batch.sampled_tokens() * share / min(capacity, rows))
    return _rollout(batch, share, steps, decode, prefill, host_per_trajectory_s * batch.trajectories, roofline)


def throughput_rollout(
    batch: Batch,
    engines: int,
    capacity: int,
    in_flight: float,
    decode: DecodeCost,
    prefill: PrefillCost,
    host_per_trajectory_s: float = 0.0,
    roofline: DecodeCost | None = None,
) -> Rollout:
    """A step's worth of generation when the engines never wait for a tail: each holds ``in_flight``
    steps' worth of its share live (at most ``capacity`` rows), so a step's tokens take
    ``tokens / rows`` decode steps."""
    share = _share(batch, engines, busiest=False)
    rows = max(1.0, min(float(capacity), in_flight * batch.trajectories * share))
    steps = batch.sampled_tokens() * share / rows
    return _rollout(batch, share, steps, decode, prefill, host_per_trajectory_s * batch.trajectories, roofline)


def async_step_s(
    throughput: Rollout, sync: Rollout, staleness: int, train_s: float, push_s: float
) -> tuple[float, str]:
    """An asynchronous step on separate resources, and what bounds it: generation keeps pace with
    training (``rollout``), the trainer (``train``), the controller's host work (``host``: it runs
    beside both, but is serial), or the tail (``tail``: a sample must be generated within
    ``staleness + 1`` trainer steps)."""
    bounds = {
        "rollout": throughput.engine_s,
        "host": throughput.host_s,
        "train": train_s,
        "tail": sync.engine_s / (staleness + 1),
    }
    bound = max(bounds, key=lambda k: bounds[k])
    return bounds[bound] + push_s, bound


def train_flops(
    shape_matmul: int, attention_width: int, batch: Batch, passes: float, share_prompts: bool = False
) -> float:
    """A step's training FLOPs: ``passes / 3`` times a forward and backward (``6 × params × tokens``
    plus causal attention ``6 × width × Σ seq²``); ``passes = 3`` is one forward and its backward,
    each extra forward (old or reference log-probs, a checkpointed layer's recompute) adds 1. With
    ``share_prompts`` (the torch trainer's) each group's prompt is computed once."""
    tokens, square = batch.trained_tokens(share_prompts), batch.trained_square(share_prompts)
    return passes / 3 * (6 * shape_matmul * tokens + 6 * attention_width * square)
