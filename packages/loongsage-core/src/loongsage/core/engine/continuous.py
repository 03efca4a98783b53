"""Continuous batching for the native engine over a slot-based KV cache.

The cache is ``slots x max_model_len`` per layer (keys and values ``[slots, kv_heads, L, head_dim]``);
each sample row of a request owns one slot and its own length, so a row's token ``j`` sits in column
``j`` at position ``j`` (no left padding) and attention masks each row to its own filled span.

One :meth:`SlotBatch.step`:

1. prefills waiting rows (:mod:`loongsage.core.engine.prefill`), at most ``prefill_chunk_tokens``
   prompt tokens per step (a long prompt spans several steps, so decoding rows are never stalled
   for a whole long prefill); the ``n`` sample rows of a request share one prefill, copied into
   their slots when it completes;
2. one decode forward over slots ``[0, hi)`` (``hi``: one past the highest decoding slot): every
   decoding row writes its key at its own column; rows in that range that are not decoding compute
   throw-away values that land past their valid span (overwritten before being read);
3. one vectorised sampling call and the bookkeeping over the same range, masked by each slot's
   ``active`` flag, so a row that finishes stops in place: the decode step reads and writes only
   the batch's own tensors, has no data-dependent shapes and no host round trip, and on a CUDA
   device forward, sampling and bookkeeping replay as ONE captured graph;
4. (rows whose prefill just ended get their first token by a second sampling call;) the finished
   rows are read back and leave: their slots are free for the next step's admissions.

While nothing is prefilling, one :meth:`SlotBatch.step` runs up to ``steps_per_sync`` decode steps
back to back before reading back which rows finished (multi-step decoding, as vLLM's multi-step
scheduling): the GPU never waits for the host between them. The burst ends early at the first step
a row can reach its length limit (known on the host), so only a stop token can leave a finished
row idle, for at most ``steps_per_sync - 1`` steps; a request arriving meanwhile joins at the
burst's end.

Requests join at any step boundary (:meth:`admit`); holes left by finished rows are refilled from
the lowest slot up and, when the range gets sparse, the highest decoding rows move down
(:meth:`_compact`), so a step costs about the number of live rows.

Shared prefixes (``shared_prefix_decode``, fused kernels, the batch-invariant mode too): the decoding
rows of one request, each slot holding a copy of its prompt, are tiled (up to ``16 // group`` rows a
tile) when the decoding set changes, and decode attention reads a tile's prompt columns (its whole
blocks of 64) once, from one member's slot (:mod:`loongsage.core.engine.fused.attention`). The
copies stay: a row keeps its whole cache when it moves, finishes or is retained.

Prefix reuse: a finished row's slot is *retained* with the tokens its cache holds (prompt plus all
but the last output token) and the weight version that computed them. A new request whose input
shares a prefix with a retained slot of the current version takes that slot and prefills only the
rest (a session's next turn). Retained slots are evicted least-recently-used whenever a slot is
needed; the cache grows (doubling, up to ``max_slots``) only when no slot is free or retained, so
memory is bounded by ``max_slots x max_model_len`` and follows the peak number of live rows.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

import torch
from torch import Tensor

from loongsage.core.engine.cuda_graphs import DecodeGraphs
from loongsage.core.engine.kv_cache import DecoderRunner
from loongsage.core.engine.prefill import prefill
from loongsage.core.engine.sampling import SamplingTensors, draw_uniforms, sample
from loongsage.core.engine.slot_state import PrefixTiles, grown, slot_spec
from loongsage.core.types import FinishReason, GenerationResult

FREE, PREFILL, WAIT, DECODE, RETAINED = range(5)  # WAIT: sibling row waiting for its prompt's prefill


class _Decoding(NamedTuple):
    hi: int  # one past the highest decoding slot
    sampling: SamplingTensors  # of slots [0, hi); the slots not decoding count as greedy
    longest: int  # the longest decoding row's length
    steps_left: int  # decode steps until a row can first reach its length limit


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
        steps_per_sync: int = 1,
        shared_prefix_decode: bool = False,
    ):
        self.runner, self.stats, self.generator = runner, stats, generator
        self.max_slots, self.L = int(max_slots), int(max_model_len)
        self.chunk, self.prefix_cache = max(1, int(prefill_chunk_tokens)), prefix_cache
        self.steps_per_sync = max(1, int(steps_per_sync))
        self.device = runner.device
        # the weight version the decode step writes beside each token (a tensor: graphs read it)
        self.version_t = torch.zeros((), dtype=torch.int32, device=self.device)
        self._version_written = 0
        # tokens the decode steps generated since the last read-back, counted on the device
        self.generated_t = torch.zeros((), dtype=torch.long, device=self.device)
        # recording routes (R3) reads each forward's router choices on the host side: no graph replay
        self.recording = runner.recording
        # rows without top-k/top-p/min-p are sampled by one fused kernel where the decoder is fused
        self.fused_sampling = None
        if runner.fused is not None:
            from loongsage.core.engine.fused.sampling import sample_rows

            self.fused_sampling = sample_rows
        # batch-invariant mode: the log-prob of a sampled token is computed by the kernels the
        # trainer's forward runs, with the vocabulary cut the same way whatever the batch
        self.invariant_logprobs = None
        if runner.invariant:
            from functools import partial

            from loongsage.core.engine.fused.sampling import sample_rows, token_logprobs_rows

            self.fused_sampling = partial(sample_rows, fixed_chunks=True)
            self.invariant_logprobs = token_logprobs_rows
        # shared-prefix tiles of decode attention (None: each row reads its whole cache)
        self.prefixes: PrefixTiles | None = None
        if shared_prefix_decode and runner.fused is not None:
            from loongsage.core.engine.fused.attention import tile_members  # Triton: only where fused

            members = tile_members(runner.num_heads // runner.kv_heads, invariant=runner.invariant)
            self.prefixes = PrefixTiles(members) if members >= 2 else None
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
        # decoding slots, hi, their sampling, their longest length, the fewest steps until one of
        # them reaches its length limit; rebuilt when the set changes
        self._dec: _Decoding | None = None
        self._dec_steps = 0  # decode steps since it was built
        self.initial_slots = min(self.max_slots, max(1, initial_slots))
        self._grow(self.initial_slots)

    # ----------------------------------------------------------------------------- slots

    def _grow(self, cap: int) -> None:
        old, dev, r = self.cap, self.device, self.runner
        weight = r.inner.embed_tokens.weight
        kv_tail = (r.kv_heads, self.L, r.head_dim)
        self.keys = [grown(k, cap, kv_tail, weight.dtype, 0, dev) for k in (self.keys or [None] * len(r.layers))]
        self.values = [grown(v, cap, kv_tail, weight.dtype, 0, dev) for v in (self.values or [None] * len(r.layers))]
        routes = (len(r.moe_gates), r.topk) if self.recording else None
        spec = slot_spec(self.L, self.stop_width, routes).items()
        self.t = {name: grown(self.t.get(name), cap, tail, dtype, fill, dev) for name, (tail, dtype, fill) in spec}
        if self.prefixes is not None:
            self.prefixes.grow(cap, dev)
            self._dec = None  # the tiles are made again, in these buffers
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
        t["active"][idx] = t["finished"][idx] = t["stopped"][idx] = False
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

    def _decoding(self) -> _Decoding:
        if self._dec is None:
            slots = [s for s, st in enumerate(self.status) if st == DECODE]
            idx = torch.tensor(slots, dtype=torch.long, device=self.device)
            hi = slots[-1] + 1 if slots else 0
            # Read back once per change of the decoding set (every row then grows by one per step),
            # so a steady decode step needs no device-to-host sync before its forward.
            longest, steps_left = 0, 1
            if slots:
                t = self.t
                longest, steps_left = torch.stack(
                    [t["lens"][idx].max(), (t["limit"][idx] - t["gen"][idx]).min()]
                ).tolist()
            # the slots not decoding count as greedy: they pick no slower sampling path for the others
            idle = [s for s in range(hi) if self.status[s] != DECODE]
            self._dec = _Decoding(hi, self._sampling(list(range(hi)), idle=idle), longest, max(1, steps_left))
            self._dec_steps = 0
            if self.prefixes is not None:
                self.prefixes.tile(slots, self.slot_group)
        return self._dec

    def _sampling(self, slots: list[int], idle: list[int] = ()) -> SamplingTensors:
        idx, t = torch.tensor(slots, dtype=torch.long, device=self.device), self.t
        greedy = t["greedy"][idx]
        if idle:
            greedy[torch.tensor(idle, dtype=torch.long, device=self.device)] = True
        return SamplingTensors._from(
            t["inv_t"][idx], greedy, t["top_k"][idx], t["top_p"][idx], t["min_p"][idx], self.runner.vocab_size
        )

    def step(self, version: int) -> list:
        """Prefill (chunk-limited) and decode every decoding row, a burst of up to
        ``steps_per_sync`` steps while nothing prefills; return the groups completed."""
        self._see_version(version)
        if version != self._version_written:
            self.version_t.fill_(version)
            self._version_written = version
        hi, st, longest, steps_left = self._decoding()
        new_rows, new_logits = prefill(self)
        steps = 0
        if hi:
            # A burst stops where a row can first reach its length limit, so a row finishing by
            # length never waits; a prefill under way advances every step.
            steps = 1 if new_rows or self.prefilling else min(self.steps_per_sync, steps_left - self._dec_steps)
            steps = max(1, steps)
            for _ in range(steps):
                end = min(longest + self._dec_steps + 1, self.L)
                self._dec_steps += 1
                self._decode(hi, end, st)
        if new_rows:
            self._first_tokens(new_rows, new_logits)
            steps = max(steps, 1)
        if not steps:
            return []
        self.stats["steps"] += steps
        return self._read_back(max(hi, max(new_rows, default=-1) + 1), version)

    def _decode(self, hi: int, end: int, st: SamplingTensors) -> None:
        fused = self.fused_sampling is not None and not st.needs_filter
        if self.graphs is None:
            self._advance(self._decode_forward(hi, end), hi, st, fused)
        elif fused:  # forward, sampling and bookkeeping replay as one graph
            t = self.t
            state = (t["last"], t["lens"], t["gen"], t["active"], t["finished"], t["stopped"], self.generated_t)
            self.graphs.run(self._decode_step, hi, end, self.cap, keep=state)
        else:  # the filters' sampling (sorts, top-k) runs eagerly after the captured forward
            self._advance(self.graphs.run(self._decode_forward, hi, end, self.cap), hi, st, fused)

    def _decode_step(self, rows: int, end: int) -> None:
        """One whole decode step of slots ``[0, rows)`` on the fused sampler (what a graph captures)."""
        self._advance(self._decode_forward(rows, end), rows, None, True)

    def _advance(self, logits: Tensor, rows: int, st: SamplingTensors | None, fused: bool) -> None:
        """Sample a token for every active slot of ``[0, rows)`` and book it, masked by ``active``:
        no host sync, no shape that depends on the data. A slot that is not active writes its
        token to column ``L - 1``, which no row uses (a row's limit leaves at least its prompt's
        first token of room), and keeps its state."""
        t, dev = self.t, self.device
        act, gen = t["active"][:rows], t["gen"][:rows]
        u = t["uniforms"][:rows].gather(1, gen.unsqueeze(1)).squeeze(1)
        at = torch.arange(rows, device=dev)
        if fused:
            tokens, logprobs = self.fused_sampling(logits, at, u, t["inv_t"][:rows], t["greedy"][:rows])
        else:
            tokens, logprobs = self._sample(logits, st, u)
        self.generated_t.add_(act.sum())
        col = torch.where(act, gen, self.L - 1)
        t["tokens"][at, col] = tokens
        t["logprobs"][at, col] = logprobs
        t["versions"][at, col] = self.version_t
        t["last"][:rows].copy_(torch.where(act, tokens, t["last"][:rows]))
        t["lens"][:rows].add_(act)
        gen.add_(act)
        stopped = (tokens.unsqueeze(1) == t["stops"][:rows]).any(dim=1)
        finished = act & (stopped | (gen >= t["limit"][:rows]))
        t["stopped"][:rows].logical_or_(stopped & finished)
        t["finished"][:rows].logical_or_(finished)
        act.logical_and_(~finished)

    def _sample(self, logits: Tensor, st: SamplingTensors, u: Tensor | None) -> tuple[Tensor, Tensor]:
        """The torch sampler (rows with filters), its log-probs the invariant kernel's where asked."""
        tokens, logprobs = sample(logits, st, u)
        if self.invariant_logprobs is not None:
            logprobs = self.invariant_logprobs(logits, torch.arange(len(tokens), device=self.device), tokens)
        return tokens, logprobs

    def _first_tokens(self, rows: list[int], logits: Tensor) -> None:
        """The first token of each row whose prefill just ended; the rows start decoding."""
        t, dev = self.t, self.device
        idx = torch.tensor(rows, device=dev)
        s = self._sampling(rows)
        u = None if s.all_greedy else t["uniforms"][idx, 0]
        if self.fused_sampling is not None and not s.needs_filter:  # one kernel, reading the rows where they are
            tokens, logprobs = self.fused_sampling(
                logits, torch.arange(len(rows), device=dev), u, s.inv_temperature, s.greedy
            )
        else:
            tokens, logprobs = self._sample(logits, s, u)
        t["tokens"][idx, 0] = tokens
        t["logprobs"][idx, 0] = logprobs
        t["versions"][idx, 0] = self.version_t
        t["last"][idx] = tokens
        t["gen"][idx] = 1
        stopped = (tokens.unsqueeze(1) == t["stops"][idx]).any(dim=1)
        finished = stopped | (t["limit"][idx] <= 1)
        t["stopped"][idx], t["finished"][idx], t["active"][idx] = stopped, finished, ~finished
        for s in rows:
            self.status[s] = DECODE
        self._dec = None
        self.stats["generated_tokens"] += len(rows)

    def _read_back(self, top: int, version: int) -> list:
        """The host's one look at the device per step: which of slots ``[0, top)`` finished (their
        groups are emitted) and how many tokens the decode steps generated."""
        t = self.t
        flags = torch.cat([t["finished"][:top].long(), self.generated_t.view(1)]).tolist()
        self.generated_t.zero_()
        self.stats["generated_tokens"] += flags[-1]
        self.stats["read_backs"] += 1
        hit = [s for s in range(top) if flags[s]]
        if not hit:
            return []
        stopped = t["stopped"][torch.tensor(hit, device=self.device)].tolist()
        reasons = [FinishReason.STOP if x else FinishReason.LENGTH for x in stopped]
        completed = self._emit(hit, reasons, version)
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
        shared = None if self.prefixes is None else self.prefixes.shared(rows)
        out = self.runner.forward_slots(
            t["last"][:rows].unsqueeze(1),
            lens.unsqueeze(1),
            [k[:rows] for k in self.keys],
            [v[:rows] for v in self.values],
            end,
            mask,
            cols=cols,
            shared=shared,
        )
        if self.recording:  # where each row wrote its key
            t["routes"][torch.arange(rows, device=self.device), cols] = self.runner.last_routes[:, 0].to(torch.int16)
        return out

    def _emit(self, slots: list[int], reasons: list[FinishReason], version: int | None) -> list:
        """Results of ``slots`` (tokens so far); their slots are retained (``version`` given) or freed."""
        t, completed = self.t, []
        idx = torch.tensor(slots, dtype=torch.long, device=self.device)
        t["active"][idx] = t["finished"][idx] = t["stopped"][idx] = False
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
        for name in ("active", "finished", "stopped") if self.t else ():
            self.t[name].zero_()
        self.generated_t.zero_()
        self.status = [FREE] * self.cap
        self.slot_group = [None] * self.cap
        self._dec = None
