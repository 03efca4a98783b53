"""Prefill for the slot batch (:class:`~loongsage.core.engine.continuous.SlotBatch`): at most
``prefill_chunk_tokens`` prompt tokens a step, the queued prompts that fit in one batched forward,
a long prompt in chunks of its own; the ``n`` sample rows of a request share one prefill."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from loongsage.core.engine.continuous import SlotBatch


def prefill(batch: SlotBatch) -> tuple[list[int], Tensor | None]:
    """Run up to ``chunk`` prompt tokens; return the rows whose prefill ended and their logits."""
    budget, rows, logits = batch.chunk, [], []
    if batch.runner.invariant:  # the queued prompts that fit, each token at its own cache column
        budget = _prefill_invariant(batch, budget, rows, logits)
    while not batch.runner.invariant:  # queued prompts that fit the budget, in batched forwards
        left = _prefill_together(batch, budget, rows, logits)
        if left == budget:
            break
        budget = left
    while batch.prefilling and budget > 0:  # one request alone, or a chunk of a long prompt
        e = batch.prefilling[0]
        ids = e.group.prompt
        take = min(len(ids) - e.pos, budget)
        start, end = e.pos, e.pos + take
        s = e.slot
        if batch.runner.invariant:  # a chunk of a long prompt, each token at its own column
            out = batch.runner.prefill_invariant(
                ids[start:end], list(range(start, end)), [s] * take, [take - 1], batch.keys, batch.values
            )
        else:
            dev = batch.device
            x = torch.tensor([ids[start:end]], dtype=torch.long, device=dev)
            positions = torch.arange(start, end, device=dev).unsqueeze(0)
            q_idx = torch.arange(start, end, device=dev)
            mask = torch.arange(end, device=dev)[None, :] <= q_idx[:, None]
            out = batch.runner.forward_slots(
                x, positions, [k[s : s + 1] for k in batch.keys], [v[s : s + 1] for v in batch.values], end, mask
            )
        batch.stats["prefill_forwards"] += 1
        if batch.recording:
            batch.t["routes"][s, start:end] = batch.runner.last_routes[0]
        e.pos, budget = end, budget - take
        batch.t["lens"][s] = end  # the decode forward's throw-away write for this row lands past it
        batch.stats["prefill_tokens"] += take
        if e.pos < len(ids):
            break
        batch.prefilling.popleft()
        if batch.recording:
            for sib in e.siblings:
                batch.t["routes"][sib, :end] = batch.t["routes"][s, :end]
        _finish(batch, e, end, out, rows, logits)
    return rows, (torch.cat(logits) if logits else None)


def _take_fitting(batch: SlotBatch, budget: int) -> list:
    """The queued prompts, in order, whose remaining tokens fit ``budget`` together."""
    queued = []
    while batch.prefilling:
        e = batch.prefilling[0]
        rest = len(e.group.prompt) - e.pos
        if rest > budget:
            break
        queued.append(batch.prefilling.popleft())
        budget -= rest
    return queued


def _finish(batch: SlotBatch, e, n: int, out: Tensor, rows: list[int], logits: list[Tensor]) -> None:
    """Request ``e``'s prompt (``n`` tokens) is in its slot: copy it to its sibling samples' slots
    and hand its rows the prompt's last logits ``out`` ``[1, V]``."""
    for sib in e.siblings:  # n samples share the prompt's cache
        for buf in batch.keys + batch.values:
            buf[sib, :, :n] = buf[e.slot, :, :n]
    group_rows = [e.slot, *e.siblings]
    batch.t["lens"][torch.tensor(group_rows, device=batch.device)] = n
    rows += group_rows
    logits.append(out.expand(len(group_rows), -1))


def _prefill_invariant(batch: SlotBatch, budget: int, rows: list[int], logits: list[Tensor]) -> int:
    """Batch-invariant mode: the queued prompts that fit the budget in ONE pass, without padding.

    Every token goes at its own position into its own slot's cache and attends over that slot's
    columns up to itself (a reused prefix included), as the trainer's invariant forward computes
    it; the kernels compute a token the same way whatever else runs, so this is each prompt
    prefilled alone, in one launch sequence instead of one per prompt. Returns the budget left."""
    queued = _take_fitting(batch, budget)
    if not queued:
        return budget
    tokens, positions, slots, last = [], [], [], []
    for e in queued:
        prompt = e.group.prompt
        tokens += prompt[e.pos :]
        positions += range(e.pos, len(prompt))
        slots += [e.slot] * (len(prompt) - e.pos)
        last.append(len(tokens) - 1)
    out = batch.runner.prefill_invariant(tokens, positions, slots, last, batch.keys, batch.values)
    batch.stats["prefill_forwards"] += 1
    for b, e in enumerate(queued):
        n = len(e.group.prompt)
        batch.stats["prefill_tokens"] += n - e.pos
        budget -= n - e.pos
        e.pos = n
        _finish(batch, e, n, out[b : b + 1], rows, logits)
    return budget


def _prefill_together(batch: SlotBatch, budget: int, rows: list[int], logits: list[Tensor]) -> int:
    """Prefill, in ONE forward, the queued prompts whose remaining tokens fit the budget.

    Requests that arrive together (a step of many prompts, or the next turns of many sessions)
    then cost one forward instead of one each. Row ``b`` has ``pre`` tokens already cached in
    its slot (a reused prefix; 0 for a fresh prompt) and ``rest`` tokens to prefill. In a
    scratch cache of width ``P + S`` (``P``, ``S``: the largest ``pre`` and ``rest``) its cached
    keys/values are copied to columns ``[P - pre, P)`` and its remaining tokens, left-padded to
    ``S``, are computed at ``[P, P + S)`` with their true positions (RoPE). A query sees its
    row's prefix and its own real tokens up to itself; pad keys are masked (a pad query sees
    itself, so no row attends to nothing). Afterwards columns ``[0, pre + rest)`` of each row's
    slots (and its sibling samples') hold the whole prompt, as the one-request path leaves them.
    """
    queued = _take_fitting(batch, budget)
    budget -= sum(len(e.group.prompt) - e.pos for e in queued)
    if len(queued) < 2:  # one request: the direct path prefills it in its slot without copies
        for e in reversed(queued):
            batch.prefilling.appendleft(e)
        return budget + sum(len(e.group.prompt) - e.pos for e in queued)
    dev, B = batch.device, len(queued)
    pre = [e.pos for e in queued]
    rest = [len(e.group.prompt) - e.pos for e in queued]
    P, S = max(pre), max(rest)
    W = P + S
    x = torch.zeros(B, S, dtype=torch.long, device=dev)
    for b, e in enumerate(queued):
        x[b, S - rest[b] :] = torch.tensor(e.group.prompt[e.pos :], dtype=torch.long, device=dev)
    pre_t, pad_t = torch.tensor(pre, device=dev), torch.tensor([S - r for r in rest], device=dev)
    j = torch.arange(S, device=dev)
    positions = (pre_t[:, None] + j[None, :] - pad_t[:, None]).clamp(min=0)
    c = torch.arange(W, device=dev)[None, None, :]  # key column
    q = (P + j)[None, :, None]  # query column
    prefix = (c >= P - pre_t[:, None, None]) & (c < P)
    own = (c >= P + pad_t[:, None, None]) & (c <= q)
    mask = prefix | own | (c == q)
    scratch_k = [k.new_zeros(B, k.shape[1], W, k.shape[3]) for k in batch.keys]
    scratch_v = [v.new_zeros(B, v.shape[1], W, v.shape[3]) for v in batch.values]
    # Cached prefixes into the scratch, all rows at once: (row b, its slot column i) pairs.
    pb = [b for b in range(B) for _ in range(pre[b])]
    if pb:
        slot_i = torch.tensor([queued[b].slot for b in pb], device=dev)
        col_i = torch.tensor([i for b in range(B) for i in range(pre[b])], device=dev)
        b_i = torch.tensor(pb, device=dev)
        dst_i = col_i + P - pre_t[b_i]
        for buf, scratch in zip(batch.keys + batch.values, scratch_k + scratch_v):
            scratch[b_i, :, dst_i] = buf[slot_i, :, col_i]
    out = batch.runner.forward_slots(x, positions, scratch_k, scratch_v, W, mask[:, None])
    batch.stats["prefill_forwards"] += 1
    # The whole prompt back into every sample row's slot: (slot, column) <- (row b, scratch column).
    slots, cols, src_b, src_c = [], [], [], []
    for b, e in enumerate(queued):
        n = pre[b] + rest[b]
        group_rows = [e.slot, *e.siblings]
        src = list(range(P - pre[b], P)) + list(range(W - rest[b], W))
        for r in group_rows:
            slots += [r] * n
            cols += range(n)
            src_b += [b] * n
            src_c += src
        batch.t["lens"][torch.tensor(group_rows, device=dev)] = n
        if batch.recording:  # the slot holds its reused prefix's routes; the rest were computed here
            batch.t["routes"][e.slot, pre[b] : n] = batch.runner.last_routes[b, S - rest[b] :]
            for sib in e.siblings:
                batch.t["routes"][sib, :n] = batch.t["routes"][e.slot, :n]
        e.pos = n
        batch.stats["prefill_tokens"] += rest[b]
        rows += group_rows
        logits.append(out[b : b + 1].expand(len(group_rows), -1))
    slots_t, cols_t = torch.tensor(slots, device=dev), torch.tensor(cols, device=dev)
    src_b_t, src_c_t = torch.tensor(src_b, device=dev), torch.tensor(src_c, device=dev)
    for buf, scratch in zip(batch.keys + batch.values, scratch_k + scratch_v):
        buf[slots_t, :, cols_t] = scratch[src_b_t, :, src_c_t]
    return budget
