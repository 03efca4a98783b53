"""R3 routing replay's inputs: the routes a micro-batch's rows carry (the experts the engine's MoE
layers chose for each token), laid out as the Megatron model's forward replays them
(:func:`~loongsage.megatron.forward.replayed_routes`), and the routes of a zero-weight filler pass."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from loongsage.core.segments import segment_layout
from loongsage.core.types import TrainBatch
from loongsage.megatron.convert import Shape


def micro_batch_routes(mb: TrainBatch, shape: Shape) -> Tensor | None:
    """The rows' recorded routes as one ``[rows, tokens, layers, topk]`` tensor, or None when no row
    carries any (a dense model, or an engine that records none). A batch with rows of several
    segments gives the routes of its forward's sequences (one per segment, each from its own
    record, as :meth:`~loongsage.core.segments.SegmentLayout.split_batch` lays them out).

    A row's record covers its tokens from the first (the prompt's, as the engine prefilled them);
    its last token was never fed to the engine, and padding never was: those positions get experts
    ``0..topk-1``, which change no trained log-prob (the last token's output predicts nothing, and
    right-padding comes after every real token).
    """
    records = mb.routed_experts
    if not records or all(r is None for r in records):
        return None
    if shape.experts == 0:
        raise ValueError("routed_experts: the batch carries routed experts but the model has no experts")
    layout = segment_layout(mb)
    if layout is not None:  # the routes of the forward's sequences, one per segment of a split row
        return micro_batch_routes(layout.split_batch(mb), shape)
    b, t = mb.input_ids.shape
    layers, topk = next(torch.as_tensor(r) for r in records if r is not None).shape[1:]
    routes = torch.arange(topk).expand(b, t, layers, topk).clone()
    lengths = mb.attention_mask.sum(1)
    for row, record in enumerate(records):
        if record is None:
            raise ValueError(f"routed_experts: row {row} has no routes while others do; replay needs every row's")
        record = torch.as_tensor(record, dtype=torch.long)
        if record.shape[1:] != (layers, topk) or len(record) < int(lengths[row]) - 1:
            raise ValueError(
                f"routed_experts: row {row} holds {list(record.shape)}; expected at least "
                f"[{int(lengths[row]) - 1}, {layers}, {topk}] (the row's tokens but the last)"
            )
        if int(record.min()) < 0 or int(record.max()) >= shape.experts:
            raise ValueError(f"routed_experts: row {row} names experts outside 0..{shape.experts - 1}")
        start = int(mb.attention_mask[row].argmax())  # the row's first token (after any left padding)
        n = min(len(record), t - start)
        routes[row, start : start + n] = record[:n]
    return routes


def padding_routes(
    plans: list[tuple[list[int], TrainBatch] | None], shape: Shape, config: Mapping[str, Any]
) -> Tensor | None:
    """Routes for a zero-weight padding pass when some rank's micro-batches are replayed with
    recomputation: every forward must then queue routes, or a recomputation would take another
    micro-batch's (experts ``0..k-1`` for the two padding tokens). A collective of every rank."""
    replays = torch.tensor(
        [
            int(
                any(
                    p is not None and p[1].routed_experts and any(r is not None for r in p[1].routed_experts)
                    for p in plans
                )
            )
        ]
    )
    dist.all_reduce(replays, op=dist.ReduceOp.MAX)
    if not int(replays):
        return None
    topk = int(config["num_experts_per_tok"])
    return torch.arange(topk).expand(1, 2, shape.layers, topk)
