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
"""

from __future__ import annotations

import math
from collections.abc import Sequence

# A pass over a micro-batch costs about this many padded tokens beyond its rows x longest (the
# per-layer launches and Python of a forward and backward; measured on the tiny CPU model, where a
# 16 x 64 micro-batch costs about 1.1 x the per-token price of 128 x 40).
PASS_OVERHEAD_TOKENS = 128


def consecutive(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Rows in order, a new micro-batch whenever ``rows x longest`` would exceed the budget (a row
    longer than the budget on its own still forms one)."""
    groups: list[list[int]] = []
    start, n = 0, len(lengths)
    while start < n:
        end, longest = start, 0
        while end < n:
            new_longest = max(longest, int(lengths[end]))
            if end > start and new_longest * (end - start + 1) > token_budget:
                break
            longest, end = new_longest, end + 1
        groups.append(list(range(start, end)))
        start = end
    return groups


def cost(groups: list[list[int]], lengths: Sequence[int]) -> int:
    """Padded tokens plus the per-pass overhead of a plan."""
    return sum(len(g) * max(int(lengths[i]) for i in g) + PASS_OVERHEAD_TOKENS for g in groups if g)


def by_length(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Rows sorted by length (stably), cut where the cut pays: the cheapest plan among those that
    split the sorted order only between distinct lengths, each run then split by the budget."""
    order = sorted(range(len(lengths)), key=lambda i: int(lengths[i]))
    if not order:
        return []
    # runs of equal length in the sorted order: (end position, length)
    ends, values = [], []
    for pos, i in enumerate(order):
        if values and int(lengths[i]) == values[-1]:
            ends[-1] = pos + 1
        else:
            ends.append(pos + 1), values.append(int(lengths[i]))
    starts = [0] + ends[:-1]

    def span_cost(a: int, b: int) -> int:  # runs a..b (inclusive) as one segment, split by the budget
        rows, longest = ends[b] - starts[a], values[b]
        passes = max(1, math.ceil(rows * longest / max(token_budget, longest)))
        return rows * longest + passes * PASS_OVERHEAD_TOKENS

    m = len(values)
    best = [0] + [math.inf] * m  # best[k]: cheapest plan of the first k runs
    cut = [0] * (m + 1)
    for b in range(1, m + 1):
        for a in range(b):
            c = best[a] + span_cost(a, b - 1)
            if c < best[b]:
                best[b], cut[b] = c, a
    segments = []
    b = m
    while b > 0:
        segments.append((cut[b], b - 1))
        b = cut[b]
    groups: list[list[int]] = []
    for a, b in reversed(segments):
        rows = order[starts[a]:ends[b]]
        groups += [[rows[j] for j in g] for g in consecutive([lengths[i] for i in rows], token_budget)]
    return groups


def plan_micro_batches(lengths: Sequence[int], token_budget: int, *, group_by_length: bool = True,
                       min_saving: float = 0.1) -> list[list[int]]:
    """The micro-batches of a batch whose rows have ``lengths`` (real tokens), as lists of row
    indices: grouped by length when that saves at least ``min_saving`` of the consecutive plan's
    cost, else consecutive."""
    plain = consecutive(lengths, token_budget)
    if not group_by_length or len(lengths) < 2:
        return plain
    grouped = by_length(lengths, token_budget)
    return grouped if cost(grouped, lengths) <= (1.0 - min_saving) * cost(plain, lengths) else plain
