"""Which rows of a batch go into which micro-batch: consecutive, or grouped by length.

A micro-batch is right-padded to its longest row, so its cost is about ``rows x longest`` tokens
plus a fixed cost per forward/backward pass. Consecutive splitting (rows in batch order, a new
micro-batch when the token budget would be exceeded) is what a batch of similar lengths wants. A
batch that mixes short and long rows (two data sources with different response lengths, a long
tail of responses) pays for padding: 64 two-token arithmetic answers trained beside 64 sorted lists
of twenty digits are padded to the lists' length. Grouping by length sorts the rows and cuts the
sorted order where a cut saves more padding than another pass costs (an exact dynamic programme
over the distinct lengths), which is how TRL's and verl's dynamic batch sizes avoid the waste.

:func:`plan_micro_batches` takes the grouping only when it saves at least ``min_saving`` of the
consecutive plan's cost; otherwise it keeps the consecutive plan, in batch order, so a batch of
uniform lengths is computed exactly as before (the same rows, the same order, the same sums).

A row may cost several sequences: a trajectory with several segments is scored as one sequence per
segment (:mod:`loongsage.core.segments`), so its forward is ``widths[i]`` sequences no longer than
``lengths[i]`` (then its longest segment). Without ``widths`` every row is one sequence.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

from loongsage.core.segments import forward_shape, is_split
from loongsage.core.trainer.shared_prompts import RowPrompts
from loongsage.core.types import TrainBatch

# A pass over a micro-batch costs about this many padded tokens beyond its rows x longest (the
# per-layer launches and Python of a forward and backward; measured on the tiny CPU model, where a
# 16 x 64 micro-batch costs about 1.1 x the per-token price of 128 x 40).
PASS_OVERHEAD_TOKENS = 128


def consecutive(lengths: Sequence[int], token_budget: int, widths: Sequence[int] | None = None) -> list[list[int]]:
    """Rows in order, a new micro-batch whenever ``sequences x longest`` would exceed the budget (a
    row over the budget on its own still forms one)."""
    widths = _widths(widths, len(lengths))
    groups: list[list[int]] = []
    start, n = 0, len(lengths)
    while start < n:
        end, longest, sequences = start, 0, 0
        while end < n:
            new_longest, new_sequences = max(longest, int(lengths[end])), sequences + widths[end]
            if end > start and new_longest * new_sequences > token_budget:
                break
            longest, sequences, end = new_longest, new_sequences, end + 1
        groups.append(list(range(start, end)))
        start = end
    return groups


def cost(groups: list[list[int]], lengths: Sequence[int], widths: Sequence[int] | None = None) -> int:
    """Padded tokens plus the per-pass overhead of a plan."""
    widths = _widths(widths, len(lengths))
    return sum(sum(widths[i] for i in g) * max(int(lengths[i]) for i in g) + PASS_OVERHEAD_TOKENS for g in groups if g)


def _widths(widths: Sequence[int] | None, n: int) -> list[int]:
    if widths is None:
        return [1] * n
    if len(widths) != n or any(int(w) < 1 for w in widths):
        raise ValueError(f"widths: expected {n} counts >= 1 (one per row), got {list(widths)}")
    return [int(w) for w in widths]


def by_length(lengths: Sequence[int], token_budget: int, widths: Sequence[int] | None = None) -> list[list[int]]:
    """Rows sorted by length (stably), cut where the cut pays: the cheapest plan among those that
    split the sorted order only between distinct lengths, each run then split by the budget."""
    widths = _widths(widths, len(lengths))
    order = sorted(range(len(lengths)), key=lambda i: int(lengths[i]))
    if not order:
        return []
    before = [0]  # before[pos]: sequences of the sorted rows ahead of position pos
    for i in order:
        before.append(before[-1] + widths[i])
    # runs of equal length in the sorted order: (end position, length)
    ends, values = [], []
    for pos, i in enumerate(order):
        if values and int(lengths[i]) == values[-1]:
            ends[-1] = pos + 1
        else:
            ends.append(pos + 1), values.append(int(lengths[i]))
    starts = [0] + ends[:-1]

    def span_cost(a: int, b: int) -> int:  # runs a..b (inclusive) as one piece, split by the budget
        sequences, longest = before[ends[b]] - before[starts[a]], values[b]
        passes = max(1, math.ceil(sequences * longest / max(token_budget, longest)))
        return sequences * longest + passes * PASS_OVERHEAD_TOKENS

    m = len(values)
    best = [0] + [math.inf] * m  # best[k]: cheapest plan of the first k runs
    cut = [0] * (m + 1)
    for b in range(1, m + 1):
        for a in range(b):
            c = best[a] + span_cost(a, b - 1)
            if c < best[b]:
                best[b], cut[b] = c, a
    pieces = []
    b = m
    while b > 0:
        pieces.append((cut[b], b - 1))
        b = cut[b]
    groups: list[list[int]] = []
    for a, b in reversed(pieces):
        rows = order[starts[a] : ends[b]]
        groups += [
            [rows[j] for j in g]
            for g in consecutive([lengths[i] for i in rows], token_budget, [widths[i] for i in rows])
        ]
    return groups


def plan_micro_batches(
    lengths: Sequence[int],
    token_budget: int,
    *,
    group_by_length: bool = True,
    min_saving: float = 0.1,
    widths: Sequence[int] | None = None,
) -> list[list[int]]:
    """The micro-batches of a batch whose rows have ``lengths`` (real tokens; with ``widths``, each
    row's sequence count and ``lengths`` their longest), as lists of row indices: grouped by length
    when that saves at least ``min_saving`` of the consecutive plan's cost, else consecutive."""
    plain = consecutive(lengths, token_budget, widths)
    if not group_by_length or len(lengths) < 2:
        return plain
    grouped = by_length(lengths, token_budget, widths)
    return grouped if cost(grouped, lengths, widths) <= (1.0 - min_saving) * cost(plain, lengths, widths) else plain


def micro_batches(batch: TrainBatch, token_budget: int) -> Iterator[TrainBatch]:
    """Split rows into consecutive micro-batches whose padded size (rows x max length) fits the budget.

    Rows are trimmed to the micro-batch's own longest sequence, so short rows do not pay for long
    ones elsewhere in the batch. A single row longer than the budget still forms its own micro-batch.
    """
    for _, mb in planned_micro_batches(batch, token_budget, group_by_length=False):
        yield mb


def planned_micro_batches(
    batch: TrainBatch, token_budget: int, *, group_by_length: bool, share_prompts: bool = False
) -> Iterator[tuple[list[int], TrainBatch]]:
    """``(row indices, micro-batch)`` pairs as :func:`~loongsage.core.trainer.micro_batching.plan_micro_batches`
    plans them, each micro-batch trimmed to its own longest row.

    A row with several segments is planned at what its forward costs: one sequence per segment, as
    long as its longest (:func:`~loongsage.core.segments.forward_shape`). With ``share_prompts``
    (a forward that computes a prompt once for its rows, :mod:`.shared_prompts`), a batch of whole
    rows may instead be planned with each prompt's rows together, by what that forward computes,
    when that plan costs less.
    """
    lengths = batch.attention_mask.sum(-1).tolist()
    planned_lengths, widths = forward_shape(batch.segments, lengths) if is_split(batch.segments) else (lengths, None)
    plan = plan_micro_batches(planned_lengths, token_budget, group_by_length=group_by_length, widths=widths)
    if share_prompts and widths is None and len(lengths) > 1:
        rows = RowPrompts.of(batch.input_ids, batch.attention_mask, batch.response_mask)
        shared = rows.plan(token_budget)
        if rows.plan_cost(shared, PASS_OVERHEAD_TOKENS) < rows.plan_cost(plan, PASS_OVERHEAD_TOKENS):
            plan = shared
    for rows_of in plan:
        yield rows_of, _trim(batch.select(rows_of), max(int(lengths[i]) for i in rows_of))


def _trim(batch: TrainBatch, length: int) -> TrainBatch:
    for name in TrainBatch.tensor_fields():
        value = getattr(batch, name)
        if value is not None and value.dim() >= 2:  # [B, T] and [B, T, K] (teacher distributions)
            setattr(batch, name, value[:, :length].contiguous())
    return batch
