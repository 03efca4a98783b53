"""Continuous batching for the native engine over a slot-based KV cache.

The cache is ``slots x max_model_len`` per layer (keys and values ``[slots, kv_heads, L, head_dim]``);
each sample row of a request owns one slot and its own length, so a row's token ``j`` sits in column
``j`` at position ``j`` (no left padding) and attention masks each row to its own filled span.

One :meth:`SlotBatch.step`:

1. prefills waiting rows, at most ``prefill_chunk_tokens`` prompt tokens per step (a long prompt
   spans several steps, so decoding rows are never stalled for a whole long prefill); the ``n``
   sample rows of a request share one prefill, copied into their slots when it completes;
2. one decode forward over slots ``[0, hi)`` (``hi``: one past the highest decoding slot): every
   decoding row writes its key at its own column; rows in that range that are not decoding compute
   throw-away values that land past their valid span (overwritten before being read);
3. one vectorised sampling call for the decoding rows (plus one for rows whose prefill just ended),
   bookkeeping, and finished rows leave at once: their slots are free for the next step's admissions.

Requests join at any step boundary (:meth:`admit`); holes left by finished rows are refilled from
the lowest slot up and, when the range gets sparse, the highest decoding rows move down
(:meth:`_compact`), so a step costs about the number of live rows.

Prefix reuse: a finished row's slot is *retained* with the tokens its cache holds (prompt plus all
but the last output token) and the weight version that computed them. A new request whose input
shares a prefix with a retained slot of the current version takes that slot and prefills only the
rest (a session's next turn). Retained slots are evicted least-recently-used whenever a slot is
needed; the cache grows (doubling, up to ``max_slots``) only when no slot is free or retained, so
memory is bounded by ``max_slots x max_model_len`` and follows the peak number of live rows.
"""

from __future__ import annotations

from collections import deque

import torch
from torch import Tensor

from loongsage.core.engine.cuda_graphs import DecodeGraphs
from loongsage.core.engine.kv_cache import DecoderRunner
from loongsage.core.engine.sampling import SamplingTensors, draw_uniforms, sample
from loongsage.core.types import FinishReason, GenerationResult

FREE, PREFILL, WAIT, DECODE, RETAINED = range(5)  # WAIT: sibling row waiting for its prompt's prefill


class _Prefill:
    __slots__ = ("group", "slot", "siblings", "pos", "version")

    def __init__(self, group, slot: int, siblings: list[int], pos: int, version: int):
        self.group, self.slot, self.siblings, self.pos, self.version = group, slot, siblings, pos, version


class SlotBatch:
    """Live sample rows over one slot cache; see the module docstring.

    ``groups`` passed to :meth:`admit` are the engine's request records: ``request``, ``n``,
    ``prompt`` (the ids to prefill), ``max_new`` (new tokens allowed), ``stops`` (stop ids incl. eos)
    and ``put(sample, result) -> bool`` (True once complete).
    """

    def __init__(
        self,
        runner: DecoderRunner,
        *,
        max_slots: int,
        max_model_len: int,
        generator: torch.Generator,
        stats: dict[str, int],
        prefill_chunk_tokens: int = 2048,
        prefix_cache: bool = True,
        initial_slots: int = 8,
        cuda_graphs: bool = False,
    ):
        self.runner, self.stats, self.generator = runner, stats, generator
        self.max_slots, self.L = int(max_slots), int(max_model_len)
        self.chunk, self.prefix_cache = max(1, int(prefill_chunk_tokens)), prefix_cache
        self.device = runner.device
        # recording routes (R3) reads each forward's router choices on the host side: no graph replay
        self.recording = runner.recording
        # rows without top-k/top-p/min-p are sampled by one fused kernel where the decoder is fused
        self.fused_sampling = None
        if runner.fused is not None:
            from loongsage.core.engine.fused.sampling import sample_rows

            self.fused_sampling = sample_rows
        self.graphs = (
            DecodeGraphs(self.L) if cuda_graphs and self.device.type == "cuda" and not self.recording else None
        )
        self.cap, self.stop_width = 0, 1
        self.keys: list[Tensor] = []
        self.values: list[Tensor] = []
        self.t: dict[str, Tensor] = {}  # per-slot state, first dim = slot
        self.status: list[int] = []
        self.slot_group: list = []
        self.slot_sample: list[int] = []
        self.slot_version: list[int] = []  # weight version when the row's prefill started
        self.retained: dict[int, tuple[list[int], int, int]] = {}  # slot -> (cached tokens, version, last use)
        self.prefilling: deque[_Prefill] = deque()
        self.clock = 0
        self.version = 0  # the newest weight version seen; retained caches of older ones are freed
        # decoding slots, hi, their sampling, their longest length; rebuilt when the set changes
        self._dec: tuple[Tensor, int, SamplingTensors, int] | None = None
        self._dec_steps = 0  # decode steps since it was built
        self.initial_slots = min(self.max_slots, max(1, initial_slots))
        self._grow(self.initial_slots)

    # ----------------------------------------------------------------------------- slots

    def _grow(self, cap: int) -> None:
        old, dev, r = self.cap, self.device, self.runner
        weight = r.inner.embed_tokens.weight
        shape = (cap, r.kv_heads, self.L, r.head_dim)

        def grown(buf: Tensor | None, tail: tuple, dtype, fill=0) -> Tensor:
            out = torch.full((cap, *tail), fill, dtype=dtype, device=dev)
            if buf is not None:
                out[:old] = buf
            return out

        # Zero-filled, never ``empty``: masked columns still enter attention as 0 x value, and an
        # uninitialised NaN there would poison the row.
        self.keys = [grown(k, shape[1:], weight.dtype) for k in (self.keys or [None] * len(r.layers))]
        self.values = [grown(v, shape[1:], weight.dtype) for v in (self.values or [None] * len(r.layers))]
        t = self.t
        spec = {
            "lens": ((), torch.long, 0),
            "gen": ((), torch.long, 0),
            "limit": ((), torch.long, 1),
            "last": ((), torch.long, 0),
            "tokens": ((self.L,), torch.long, 0),
            "logprobs": ((self.L,), torch.float32, 0),
            "versions": ((self.L,), torch.int32, 0),
            "uniforms": ((self.L,), torch.float32, 0),
            "stops": ((self.stop_width,), torch.long, -1),
            "inv_t": ((), torch.float32, 1),
            "greedy": ((), torch.bool, True),
            "top_k": ((), torch.long, 0),
            "top_p": ((), torch.float32, 1),
            "min_p": ((), torch.float32, 0),
        }
        if self.recording:  # per slot and column, as the keys: the experts each MoE layer chose
            spec["routes"] = ((self.L, len(r.moe_gates), r.topk), torch.int16, 0)
        self.t = {name: grown(t.get(name), tail, dtype, fill) for name, (tail, dtype, fill) in spec.items()}
        if self.graphs is not None:  # the captured buffers are gone
            self.graphs.clear()
        extra = cap - old
        self.status += [FREE] * extra
        self.slot_group += [None] * extra
        self.slot_sample += [0] * extra
        self.slot_version += [0] * extra
        self.cap = cap
        self.record_size()

    def record_size(self) -> None:
        self.stats["kv_slots"] = self.cap
        self.stats["kv_cache_bytes"] = sum(k.numel() * k.element_size() for k in self.keys + self.values)

    def _widen_stops(self, width: int) -> None:
        stops = self.t["stops"]
        wider = torch.full((self.cap, width), -1, dtype=torch.long, device=self.device)
        wider[:, : stops.shape[1]] = stops
        self.t["stops"], self.stop_width = wider, width

    def available(self) -> int:
        """Slots a new request may take now (free, retained or not yet allocated)."""
        return sum(1 for s in self.status if s in (FREE, RETAINED)) + self.max_slots - self.cap

    def _claim(self) -> int:
        for s, status in enumerate(self.status):
            if status == FREE:
                return s
        if self.retained:  # evict the least recently used retained slot
            s = min(self.retained, key=lambda k: self.retained[k][2])
            del self.retained[s]
            return s
        if self.cap < self.max_slots:
            s = self.cap
            self._grow(min(self.max_slots, 2 * self.cap))
            return s
        raise RuntimeError("native engine: no free KV slot (admission should have checked)")

    def _match(self, ids: list[int], version: int) -> tuple[int | None, int]:
        """The retained slot (of this weight version) sharing the longest prefix with ``ids``."""
        best, best_len = None, 0
        for s, (cached, v, _) in self.retained.items():
            if v != version or not cached or cached[0] != ids[0]:
                continue
            m, limit = 0, min(len(cached), len(ids) - 1)  # at least one token left to prefill
            while m < limit and cached[m] == ids[m]:
                m += 1
            if m > best_len:
                best, best_len = s, m
        # A short shared prefix (a chat template's header) is not worth a prefill of its own: such a
        # prompt joins the batched fresh prefill instead. A later turn of a session shares most of it.
        if 2 * best_len < len(ids):
            return None, 0
        return best, best_len

    # ----------------------------------------------------------------------------- admission

    def _see_version(self, version: int) -> None:
        """Free retained caches of older weights as soon as newer ones arrive: they can never be
        reused, and as free slots they cost nothing to compact over."""
        if version == self.version:
            return
        self.version = version
        for s, (_, v, _) in list(self.retained.items()):
            if v != version:
                del self.retained[s]
                self.status[s] = FREE

    def admit(self, group, version: int) -> None:
        """Give ``group``'s ``n`` rows slots (the caller checked :meth:`available`); prefill follows."""
        self._see_version(version)
        ids, sp, n = group.prompt, group.request.sampling, group.n
        slot, reuse = self._match(ids, version) if self.prefix_cache else (None, 0)
        if slot is not None:
            del self.retained[slot]
            self.stats["prefix_hit_tokens"] += reuse
        else:
            slot = self._claim()
        self.status[slot] = PREFILL  # claimed before the siblings look for free slots
        siblings = []
        for _ in range(n - 1):
            s = self._claim()
            self.status[s] = WAIT
            siblings.append(s)
        rows = [slot, *siblings]
        limit = min(group.max_new, self.L - len(ids))
        if len(group.stops) > self.stop_width:
            self._widen_stops(len(group.stops))
        t, dev = self.t, self.device
        idx = torch.tensor(rows, device=dev)
        for j, s in enumerate(rows):
            self.slot_group[s], self.slot_sample[s], self.slot_version[s] = group, j, version
        t["lens"][idx] = reuse
        t["gen"][idx] = 0
        t["limit"][idx] = limit
        t["stops"][idx] = -1
        if group.stops:
            t["stops"][idx, : len(group.stops)] = torch.tensor(group.stops, device=dev)
        greedy = sp.temperature == 0
        t["greedy"][idx] = greedy
        t["inv_t"][idx] = 1.0 if greedy else 1.0 / sp.temperature
        vocab = self.runner.vocab_size
        t["top_k"][idx] = sp.top_k if 0 < sp.top_k < vocab else vocab
        t["top_p"][idx], t["min_p"][idx] = sp.top_p, sp.min_p
        if not greedy:
            t["uniforms"][idx, :limit] = draw_uniforms([n], [sp.seed], [limit], limit, self.generator, dev)
        self.prefilling.append(_Prefill(group, slot, siblings, reuse, version))
        self.stats["prefill_rows"] += 1

    # ----------------------------------------------------------------------------- steps

    @property
    def done(self) -> bool:
        return not self.prefilling and not any(s == DECODE for s in self.status)

    def live_groups(self) -> list:
        return list(
            dict.fromkeys(self.slot_group[s] for s, st in enumerate(self.status) if st in (PREFILL, WAIT, DECODE))
        )

    def live_rows(self) -> int:
        return sum(1 for st in self.status if st in (PREFILL, WAIT, DECODE))

    def _prefill(self) -> tuple[list[int], Tensor | None]:
        """Run up to ``chunk`` prompt tokens; return the rows whose prefill ended and their logits."""
        budget, rows, logits = self.chunk, [], []
        while True:  # queued prompts that fit the budget, in batched forwards
            left = self._prefill_together(budget, rows, logits)
            if left == budget:
                break
            budget = left
        while self.prefilling and budget > 0:  # one request alone, or a chunk of a long prompt
            e = self.prefilling[0]
            ids = e.group.prompt
            take = min(len(ids) - e.pos, budget)
            start, end = e.pos, e.pos + take
            dev = self.device
            x = torch.tensor([ids[start:end]], dtype=torch.long, device=dev)
            positions = torch.arange(start, end, device=dev).unsqueeze(0)
            q_idx = torch.arange(start, end, device=dev)
            mask = torch.arange(end, device=dev)[None, :] <= q_idx[:, None]
            s = e.slot
            out = self.runner.forward_slots(
                x, positions, [k[s : s + 1] for k in self.keys], [v[s : s + 1] for v in self.values], end, mask
            )
            self.stats["prefill_forwards"] += 1
            if self.recording:
                self.t["routes"][s, start:end] = self.runner.last_routes[0]
            e.pos, budget = end, budget - take
            self.t["lens"][s] = end  # the decode forward's throw-away write for this row lands past it
            self.stats["prefill_tokens"] += take
            if e.pos < len(ids):
                break
            self.prefilling.popleft()
            for sib in e.siblings:  # n samples share the prompt's cache
                for buf in self.keys + self.values:
                    buf[sib, :, :end] = buf[s, :, :end]
                if self.recording:
                    self.t["routes"][sib, :end] = self.t["routes"][s, :end]
            group_rows = [s, *e.siblings]
            self.t["lens"][torch.tensor(group_rows, device=dev)] = end
            rows += group_rows
            logits.append(out.expand(len(group_rows), -1))
        return rows, (torch.cat(logits) if logits else None)

    def _prefill_together(self, budget: int, rows: list[int], logits: list[Tensor]) -> int:
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
        batch = []
        while self.prefilling:
            e = self.prefilling[0]
            rest = len(e.group.prompt) - e.pos
            if rest > budget:
                break
            batch.append(self.prefilling.popleft())
            budget -= rest
        if len(batch) < 2:  # one request: the direct path prefills it in its slot without copies
            for e in reversed(batch):
                self.prefilling.appendleft(e)
            return budget + sum(len(e.group.prompt) - e.pos for e in batch)
        dev, B = self.device, len(batch)
        pre = [e.pos for e in batch]
        rest = [len(e.group.prompt) - e.pos for e in batch]
        P, S = max(pre), max(rest)
        W = P + S
        x = torch.zeros(B, S, dtype=torch.long, device=dev)
        for b, e in enumerate(batch):
            x[b, S - rest[b] :] = torch.tensor(e.group.prompt[e.pos :], dtype=torch.long, device=dev)
        pre_t, pad_t = torch.tensor(pre, device=dev), torch.tensor([S - r for r in rest], device=dev)
        j = torch.arange(S, device=dev)
        positions = (pre_t[:, None] + j[None, :] - pad_t[:, None]).clamp(min=0)
        c = torch.arange(W, device=dev)[None, None, :]  # key column
        q = (P + j)[None, :, None]  # query column
        prefix = (c >= P - pre_t[:, None, None]) & (c < P)
        own = (c >= P + pad_t[:, None, None]) & (c <= q)
        mask = prefix | own | (c == q)
        scratch_k = [k.new_zeros(B, k.shape[1], W, k.shape[3]) for k in self.keys]
        scratch_v = [v.new_zeros(B, v.shape[1], W, v.shape[3]) for v in self.values]
        # Cached prefixes into the scratch, all rows at once: (row b, its slot column i) pairs.
        pb = [b for b in range(B) for _ in range(pre[b])]
        if pb:
            slot_i = torch.tensor([batch[b].slot for b in pb], device=dev)
            col_i = torch.tensor([i for b in range(B) for i in range(pre[b])], device=dev)
            b_i = torch.tensor(pb, device=dev)
            dst_i = col_i + P - pre_t[b_i]
            for buf, scratch in zip(self.keys + self.values, scratch_k + scratch_v):
                scratch[b_i, :, dst_i] = buf[slot_i, :, col_i]
        out = self.runner.forward_slots(x, positions, scratch_k, scratch_v, W, mask[:, None])
        self.stats["prefill_forwards"] += 1
        # The whole prompt back into every sample row's slot: (slot, column) <- (row b, scratch column).
        slots, cols, src_b, src_c = [], [], [], []
        for b, e in enumerate(batch):
            n = pre[b] + rest[b]
            group_rows = [e.slot, *e.siblings]
            src = list(range(P - pre[b], P)) + list(range(W - rest[b], W))
            for r in group_rows:
                slots += [r] * n
                cols += range(n)
                src_b += [b] * n
                src_c += src
            self.t["lens"][torch.tensor(group_rows, device=dev)] = n
            if self.recording:  # the slot holds its reused prefix's routes; the rest were computed here
                self.t["routes"][e.slot, pre[b] : n] = self.runner.last_routes[b, S - rest[b] :]
                for sib in e.siblings:
                    self.t["routes"][sib, :n] = self.t["routes"][e.slot, :n]
            e.pos = n
            self.stats["prefill_tokens"] += rest[b]
            rows += group_rows
            logits.append(out[b : b + 1].expand(len(group_rows), -1))
        slots_t, cols_t = torch.tensor(slots, device=dev), torch.tensor(cols, device=dev)
        src_b_t, src_c_t = torch.tensor(src_b, device=dev), torch.tensor(src_c, device=dev)
        for buf, scratch in zip(self.keys + self.values, scratch_k + scratch_v):
            buf[slots_t, :, cols_t] = scratch[src_b_t, :, src_c_t]
        return budget

    def _decoding(self) -> tuple[Tensor, int, SamplingTensors, int]:
        if self._dec is None:
            slots = [s for s, st in enumerate(self.status) if st == DECODE]
            idx = torch.tensor(slots, dtype=torch.long, device=self.device)
            # Read back once per change of the decoding set (every row then grows by one per step),
            # so a steady decode step needs no device-to-host sync before its forward.
            longest = int(self.t["lens"][idx].max()) if slots else 0
            self._dec = (idx, slots[-1] + 1 if slots else 0, self._sampling(slots), longest)
            self._dec_steps = 0
        return self._dec

    def _sampling(self, slots: list[int]) -> SamplingTensors:
        idx, t = torch.tensor(slots, dtype=torch.long, device=self.device), self.t
        return SamplingTensors._from(
            t["inv_t"][idx], t["greedy"][idx], t["top_k"][idx], t["top_p"][idx], t["min_p"][idx], self.runner.vocab_size
        )

    def step(self, version: int) -> list:
        """Prefill (chunk-limited), one decode step for every decoding row; return completed groups."""
        t = self.t
        self._see_version(version)
        dec, hi, st, longest = self._decoding()
        new_rows, new_logits = self._prefill()
        parts = []
        if hi:
            end = min(longest + self._dec_steps + 1, self.L)
            self._dec_steps += 1
            if self.graphs is not None:
                logits = self.graphs.run(self._decode_forward, hi, end, self.cap)
            else:
                logits = self._decode_forward(hi, end)
            t["lens"][dec] += 1
            parts.append((dec, logits, dec, st))  # slots, their logits' source and rows there, sampling
        if new_rows:
            parts.append((torch.tensor(new_rows, device=self.device), new_logits, None, self._sampling(new_rows)))
            for s in new_rows:
                self.status[s] = DECODE
            self._dec = None
        if not parts:
            return []
        rows = torch.cat([p[0] for p in parts])
        toks, lps = [], []
        for idx, source, at, s in parts:
            u = None if s.all_greedy else t["uniforms"][idx, t["gen"][idx]]
            if self.fused_sampling is not None and not s.needs_filter:  # one kernel, reading the rows where they are
                at = torch.arange(idx.numel(), device=self.device) if at is None else at
                tok, lp = self.fused_sampling(source, at, u, s.inv_temperature, s.greedy)
            else:
                tok, lp = sample(source if at is None else source[at], s, u)
            toks.append(tok)
            lps.append(lp)
        tokens, logprobs = torch.cat(toks), torch.cat(lps)
        gen = t["gen"][rows]
        t["tokens"][rows, gen] = tokens
        t["logprobs"][rows, gen] = logprobs
        t["versions"][rows, gen] = version
        t["last"][rows] = tokens
        gen += 1
        t["gen"][rows] = gen
        self.stats["steps"] += 1
        self.stats["generated_tokens"] += rows.numel()
        stopped = (tokens.unsqueeze(1) == t["stops"][rows]).any(dim=1)
        finished = stopped | (gen >= t["limit"][rows])
        if not bool(finished.any()):
            return []
        hit = finished.nonzero().flatten()
        reasons = [FinishReason.STOP if x else FinishReason.LENGTH for x in stopped[hit].tolist()]
        completed = self._emit(rows[hit].tolist(), reasons, version)
        self._compact()
        return completed

    def _decode_forward(self, rows: int, end: int) -> Tensor:
        """One decode token for slots ``[0, rows)`` attending over columns ``[0, end)``.

        Each slot writes its new key/value at its own length. Slots that are not decoding write a
        throw-away column past their valid span (a finished row's length may equal
        ``max_model_len``: the write is clamped into the buffer, beyond anything a prefix match reuses).
        """
        t = self.t
        lens = t["lens"][:rows]
        mask = (torch.arange(end, device=self.device)[None, :] <= lens[:, None])[:, None, None, :]
        cols = lens.clamp(max=self.L - 1)
        out = self.runner.forward_slots(
            t["last"][:rows].unsqueeze(1),
            lens.unsqueeze(1),
            [k[:rows] for k in self.keys],
            [v[:rows] for v in self.values],
            end,
            mask,
            cols=cols,
        )
        if self.recording:  # where each row wrote its key
            t["routes"][torch.arange(rows, device=self.device), cols] = self.runner.last_routes[:, 0].to(torch.int16)
        return out

    def _emit(self, slots: list[int], reasons: list[FinishReason], version: int | None) -> list:
        """Results of ``slots`` (tokens so far); their slots are retained (``version`` given) or freed."""
        t, completed = self.t, []
        idx = torch.tensor(slots, dtype=torch.long, device=self.device)
        gens = t["gen"][idx].tolist()
        width = max(gens) if gens else 0
        tokens = t["tokens"][idx, :width].tolist()
        logprobs = t["logprobs"][idx, :width].tolist()
        versions = t["versions"][idx, :width].tolist()
        lens = t["lens"][idx].tolist()
        for k, s in enumerate(slots):
            g, n = self.slot_group[s], gens[k]
            result = GenerationResult(g.request.request_id, tokens[k][:n], logprobs[k][:n], versions[k][:n], reasons[k])
            if self.recording:  # every token fed to the model: the prompt's and the output's but the last
                result.routed_experts = t["routes"][s, : lens[k]].cpu().clone()
            keep = (
                version is not None
                and self.prefix_cache
                and n > 0
                and self.slot_version[s] == version
                and versions[k][0] == version
            )
            if keep:
                self.clock += 1
                cached = (g.prompt + tokens[k][:n])[: lens[k]]
                self.retained[s] = (cached, version, self.clock)
                self.status[s] = RETAINED
            else:
                self.status[s] = FREE
            self.slot_group[s] = None
            if g.put(self.slot_sample[s], result):
                completed.append(g)
        self._dec = None
        return completed

    def _compact(self) -> None:
        """Move the highest decoding rows into lower free slots when the decode range is sparse.

        A retained cache in the way is not dropped: it swaps places with the row moving down, so
        it leaves the decode range and stays reusable.
        """
        decoding = [s for s, st in enumerate(self.status) if st == DECODE]
        if not decoding:
            return
        hi = decoding[-1] + 1
        if hi - len(decoding) <= max(4, len(decoding) // 4):
            return
        holes = [s for s in range(hi) if self.status[s] in (FREE, RETAINED)]
        for dst, src in zip(holes, reversed(decoding)):
            if dst >= src:
                break
            self._move(src, dst)
        self._dec = None

    def _move(self, src: int, dst: int) -> None:
        """Move row ``src`` to slot ``dst``; a retained cache at ``dst`` goes to ``src`` in exchange."""
        kept = self.retained.pop(dst, None)
        n = int(self.t["lens"][src]) + 1
        if kept is not None:
            n = max(n, int(self.t["lens"][dst]) + 1)
        n = min(n, self.L)
        for buf in list(self.t.values()) + [b[:, :, :n] for b in self.keys + self.values]:
            if kept is None:
                buf[dst] = buf[src]
            else:
                buf[[dst, src]] = buf[[src, dst]]
        self.status[dst], self.status[src] = self.status[src], RETAINED if kept is not None else FREE
        self.slot_group[dst], self.slot_group[src] = self.slot_group[src], None
        self.slot_sample[dst], self.slot_version[dst] = self.slot_sample[src], self.slot_version[src]
        if kept is not None:
            self.retained[src] = kept
            self.slot_version[src] = kept[1]

    def abort(self, groups: set) -> list:
        """End the rows of ``groups`` with ``ABORT`` (tokens so far); return those groups completed."""
        self.prefilling = deque(e for e in self.prefilling if e.group not in groups)
        hit = [s for s, st in enumerate(self.status) if st in (PREFILL, WAIT, DECODE) and self.slot_group[s] in groups]
        if not hit:
            return []
        completed = self._emit(hit, [FinishReason.ABORT] * len(hit), None)
        self._compact()
        return completed

    def drop_retained(self) -> int:
        """Forget every retained prefix (live rows untouched); returns how many were dropped."""
        dropped = len(self.retained)
        for s in self.retained:
            self.status[s] = FREE
        self.retained.clear()
        return dropped

    def release(self) -> None:
        """Drop the whole cache (no live rows): memory goes back until :meth:`reallocate`."""
        self.reset()
        self.keys, self.values, self.t = [], [], {}
        if self.graphs is not None:
            self.graphs.clear()
        self.status, self.slot_group, self.slot_sample, self.slot_version = [], [], [], []
        self.cap = 0
        self.record_size()

    def reallocate(self) -> None:
        """An empty cache of the initial size after :meth:`release`."""
        if not self.cap:
            self._grow(self.initial_slots)

    def reset(self) -> None:
        """Forget every row (after a failed step); retained caches are dropped too."""
        self.prefilling.clear()
        self.retained.clear()
        self.status = [FREE] * self.cap
        self.slot_group = [None] * self.cap
        self._dec = None
