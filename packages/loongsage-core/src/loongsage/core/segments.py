"""Multi-segment trajectories: every segment is scored as a sequence of its own.

A trajectory recorded over several prompts (history compaction, rewritten history, think blocks
stripped from the history) holds *segments*: consecutive spans of its flat token list
(``prompt_ids + response_ids``), each a whole rendered prompt followed by what the model generated
from it. The model produced a segment's tokens seeing only that segment, so training scores each
segment alone, with its own positions from 0 and attention only within it; scored over the flat
list, a later segment's tokens would attend to the earlier segments and their log-probs would not
be the rollout's (wrong importance ratios, wrong gradients).

How: the training batch keeps **one row per trajectory** in the flat layout (position ``t`` holds
token ``t``'s value), and only a model's forward splits a row into one row per segment and
scatters the per-token outputs back (:class:`SegmentLayout`). Chosen over a block-diagonal
attention mask with per-segment position ids because

- everything after the forward reads the flat layout and stays per trajectory unchanged: one reward
  and one advantage per trajectory (group statistics over trajectories), one sequence of the
  ``seq-mean-*`` aggregations and of the metrics, rows dealt to ranks and mini-batches whole;
- a split row costs the plain causal attention over each segment (the sum of the squared segment
  lengths, the engine's own computation), where a mask costs a ``[T, T]`` tensor per row, rules out
  the fused causal kernels and still attends over the whole row's length.

A row without segments, or with one, is not split: it is computed exactly as before. A segment's
first token has nothing before it in its segment, so it must be an untrained prompt token (its
log-prob, like position 0's, is 0): :func:`check_segments` rejects anything else.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from loongsage.core.types import Segment, TrainBatch


def check_segments(
    segments: Sequence[Segment], length: int, loss_mask: Sequence[int], prompt_length: int, where: str
) -> None:
    """Raise ``ValueError`` (one line naming ``where``) unless ``segments`` tile ``[0, length)`` in
    order, none empty, and no segment after the first starts on a trained token.

    ``loss_mask`` covers the response tokens, which start at ``prompt_length``.
    """
    if not segments:
        return
    spans = [(int(s.start), int(s.end)) for s in segments]
    expected = 0
    for k, (start, end) in enumerate(spans):
        if start != expected or end <= start:
            raise ValueError(
                f"{where}: segments {spans} must tile tokens [0, {length}) in order, none empty "
                f"(segment {k} is [{start}, {end}))"
            )
        expected = end
    if expected != length:
        raise ValueError(f"{where}: segments {spans} end at {expected}, not at the trajectory's {length} tokens")
    for k, (start, _) in enumerate(spans[1:], start=1):
        # the first segment's head is position 0, as for a trajectory without segments
        if start >= prompt_length and loss_mask[start - prompt_length]:
            raise ValueError(
                f"{where}: segment {k} starts at token {start}, which is trained; a segment "
                "starts with its prompt (its first token has nothing before it to be predicted from)"
            )


def is_split(segments: Sequence[Sequence[Segment]]) -> bool:
    """Whether any row has several segments (only such rows are scored apart)."""
    return any(len(s) > 1 for s in segments)


def forward_shape(segments: Sequence[Sequence[Segment]], lengths: Sequence[int]) -> tuple[list[int], list[int]]:
    """Per row, what its forward costs: ``(longest sequence, sequences)``, the row itself when it
    has fewer than two segments. Micro-batches are planned on these (``sequences x longest``)."""
    longest, counts = [], []
    for i, length in enumerate(lengths):
        spans = segments[i] if i < len(segments) else []
        if len(spans) > 1:
            longest.append(max(int(s.end) - int(s.start) for s in spans))
            counts.append(len(spans))
        else:
            longest.append(int(length))
            counts.append(1)
    return longest, counts


@dataclass(frozen=True)
class SegmentLayout:
    """Where the forward's sequences lie in a batch's rows: sequence ``k`` is row ``rows[k]``'s tokens
    ``starts[k] : starts[k] + lengths[k]`` (a row with fewer than two segments is one sequence)."""

    rows: Tensor  # [S] long
    starts: Tensor  # [S] long
    lengths: Tensor  # [S] long
    batch_rows: int  # B of the flat batch

    @property
    def width(self) -> int:
        """The longest sequence: the padded length of the split batch."""
        return int(self.lengths.max()) if len(self.lengths) else 0

    def _positions(self, first: int, out_first: int, steps: int) -> tuple[Tensor, Tensor, Tensor]:
        """Flat rows and positions (relative to ``out_first``) of sequence positions ``first ..
        first + steps - 1``, and where such a position is real and lands at or after ``out_first``."""
        offsets = torch.arange(first, first + steps)
        flat = self.starts[:, None] + offsets[None, :] - out_first
        valid = (offsets[None, :] < self.lengths[:, None]) & (flat >= 0)
        return self.rows[:, None].expand_as(flat), flat.clamp(min=0), valid

    def split(self, values: Tensor, fill: float | int = 0) -> Tensor:
        """``[B, T, ...]`` in the flat layout -> ``[S, width, ...]``, one sequence per row, right-padded
        with ``fill``."""
        rows, flat, valid = self._positions(0, 0, self.width)
        flat = flat.clamp(max=values.shape[1] - 1)
        out = values[rows, flat]
        pad = valid.view(*valid.shape, *([1] * (values.dim() - 2)))
        return torch.where(pad.to(out.device), out, torch.full_like(out, fill))

    def merge(self, values: Tensor, length: int, *, first: int = 0, out_first: int = 0) -> Tensor:
        """``[S, L - first, ...]`` (sequence positions ``first`` on) -> ``[B, length - out_first, ...]``
        (flat positions ``out_first`` on), zero where no sequence position lands. Differentiable:
        the gradient of a flat position flows to the sequence position it came from."""
        steps = values.shape[1]
        rows, flat, valid = self._positions(first, out_first, steps)
        valid = valid & (flat < length - out_first)
        device = values.device
        rows, flat, valid = rows.to(device), flat.to(device), valid.to(device)
        out = values.new_zeros((self.batch_rows, length - out_first, *values.shape[2:]))
        return out.index_put((rows[valid], flat[valid]), values[valid])

    def split_batch(self, batch: TrainBatch) -> TrainBatch:
        """The batch of the sequences, what a forward reads: every per-token tensor split, every
        per-row value repeated for each of its row's sequences (the rows' segments themselves are
        dropped: each sequence is whole now), and each sequence's routed experts (a row of several
        segments holds one record per segment). Left out, as no forward reads them: the teacher's
        own log-probs (over a full vocabulary a large copy)."""
        fields = {}
        for name in TrainBatch.tensor_fields():
            value = getattr(batch, name)
            if value is None or name == "teacher_dist_logprobs":
                fields[name] = None
            elif value.dim() >= 2:
                fields[name] = self.split(value)
            else:
                fields[name] = value.index_select(0, self.rows.to(value.device))
        sources = [batch.sources[i] for i in self.rows.tolist()] if batch.sources else []
        return TrainBatch(**fields, sources=sources, routed_experts=self._sequence_routes(batch.routed_experts))

    def _sequence_routes(self, records: list) -> list:
        """Each sequence's record: a split row's records one per segment, another row's its own."""
        if not records:
            return []
        counts = torch.bincount(self.rows, minlength=self.batch_rows).tolist()
        out: list = []
        for row, (record, count) in enumerate(zip(records, counts)):
            if count == 1:
                out.append(record)
            elif record is None:
                out += [None] * count
            elif isinstance(record, (list, tuple)) and len(record) == count:
                out += list(record)
            else:
                got = f"{len(record)} records" if isinstance(record, (list, tuple)) else "one for the whole row"
                raise ValueError(
                    f"routed_experts: row {row} has {count} segments; expected one record per "
                    f"segment (a list), got {got}"
                )
        return out


def segment_layout(batch: TrainBatch) -> SegmentLayout | None:
    """The layout of ``batch``'s forward, or None when no row has several segments (then the batch
    is its own forward, computed exactly as a batch without segments)."""
    if not is_split(batch.segments):
        return None
    lengths = batch.attention_mask.sum(-1).tolist()
    rows, starts, sizes = [], [], []
    for i, length in enumerate(lengths):
        spans = batch.segments[i] if len(batch.segments[i]) > 1 else [Segment(0, int(length))]
        for s in spans:
            if s.end > length:
                raise ValueError(f"row {i}: segment [{s.start}, {s.end}) reaches past its {int(length)} tokens")
            rows.append(i), starts.append(int(s.start)), sizes.append(int(s.end) - int(s.start))
    return SegmentLayout(
        torch.tensor(rows, dtype=torch.long),
        torch.tensor(starts, dtype=torch.long),
        torch.tensor(sizes, dtype=torch.long),
        len(lengths),
    )
