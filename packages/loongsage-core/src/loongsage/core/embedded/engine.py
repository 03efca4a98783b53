"""The embedded rollout engine (``native``): token-in, token-out generation with a batched KV cache.

Shape of the engine:

* ``generate(request)`` is per request and async. It validates the request (a bad one raises a
  one-line ``ValueError`` in its own caller only), queues it and awaits its future.
* One scheduler task per event loop (:meth:`NativeEngine._serve`) takes queued requests FIFO up to
  ``max_batch_size`` sample rows and runs them as one :class:`_Batch`: a single left-padded prefill
  of the distinct prompts, the prompt cache copied to the ``n`` sample rows of each request (never
  re-prefilled), then decode steps that advance all rows by one token. Requests that arrive while a
  batch runs wait for the next batch; admission is the one place that changes when rows may join a
  running batch (which needs the block-paged cache).
* Between two steps the scheduler yields to the event loop, then applies aborts, drops requests
  whose caller went away and honours ``pause()``. A step (forward + sampling + bookkeeping) holds
  ``self._lock``, as does ``update_weights``, so weights only change between steps, even when called
  from another thread.

Results: the sampled stop token (a request's ``stop_token_ids`` plus the model's eos) is kept in
``output_ids`` with its log-prob, as vLLM and SGLang return it (``STOP``); ``LENGTH`` means
``max_new_tokens`` or ``max_model_len`` was reached; ``ABORT`` returns the tokens so far. Every
token records the weight version of the step that produced it. Log-probs are the raw policy's
``log_softmax`` in float32 — temperature, top-k/p and min-p are *not* folded in, so they equal the
trainer's log-probs of the same tokens (see :mod:`loongsage.core.embedded.sampling`).
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Iterable

import torch
from torch import Tensor

from loongsage.core.embedded.kv_cache import DecoderRunner, StaticKVCache
from loongsage.core.embedded.sampling import SamplingTensors, draw_uniforms, sample
from loongsage.core.types import FinishReason, GenerationRequest, GenerationResult

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class _Group:
    """One request in flight: ``n`` sample rows that share its prompt's prefill."""

    __slots__ = ("request", "future", "results", "pending", "stops", "running")

    def __init__(self, request: GenerationRequest, future: asyncio.Future | None, eos: set[int]):
        self.request, self.future, self.running = request, future, False
        self.results: list[GenerationResult | None] = [None] * request.sampling.n
        self.pending = request.sampling.n
        self.stops = sorted(set(request.sampling.stop_token_ids) | eos)

    @property
    def n(self) -> int:
        return self.request.sampling.n

    def put(self, sample: int, result: GenerationResult) -> bool:
        """Record one sample's result; True when the request is complete."""
        self.results[sample] = result
        self.pending -= 1
        return self.pending == 0

    def aborted(self) -> list[GenerationResult]:
        """Results of a request aborted before it ran: no tokens."""
        rid = self.request.request_id
        return [GenerationResult(rid, [], [], [], FinishReason.ABORT) for _ in range(self.n)]


class _Batch:
    """Sample rows generated together: one prefill, then one decode column per step.

    Row state lives in tensors (last token, position, limits, stop ids, sampling settings, random
    numbers, the tokens and log-probs so far) so that a step is a fixed number of tensor ops; a row
    that finishes is compacted away at once so it costs nothing afterwards.
    """

    def __init__(self, engine: "NativeEngine", groups: list[_Group]):
        self.engine, self.runner, dev = engine, engine._runner, engine.device
        self.groups = groups
        counts = [g.n for g in groups]
        limits = [min(g.request.sampling.max_new_tokens, engine.max_model_len - len(g.request.input_ids))
                  for g in groups]
        self.steps_max = max(limits)
        self.row_group = [g for g in groups for _ in range(g.n)]
        self.row_sample = [j for g in groups for j in range(g.n)]
        rows = len(self.row_group)
        self.limit = torch.tensor(limits, device=dev).repeat_interleave(torch.tensor(counts, device=dev))
        width = max(len(g.stops) for g in groups)
        self.stop_ids: Tensor | None = None
        if width:
            stops = [g.stops + [-1] * (width - len(g.stops)) for g in groups for _ in range(g.n)]
            self.stop_ids = torch.tensor(stops, dtype=torch.long, device=dev)
        params = [g.request.sampling for g in self.row_group]
        self.st = SamplingTensors.build(params, self.runner.vocab_size, dev)
        self.uniforms: Tensor | None = None
        if not self.st.all_greedy:
            self.uniforms = draw_uniforms(counts, [g.request.sampling.seed for g in groups], self.steps_max,
                                          engine._generator, dev)
        self.tokens = torch.empty(rows, self.steps_max, dtype=torch.long, device=dev)
        self.logprobs = torch.empty(rows, self.steps_max, dtype=torch.float32, device=dev)
        self.versions: list[int] = []
        self.t = 0  # tokens generated so far by every live row
        self.cache: StaticKVCache | None = None
        self.last: Tensor | None = None
        self.positions: Tensor | None = None

    @property
    def done(self) -> bool:
        return not self.row_group

    def live_groups(self) -> list[_Group]:
        return list(dict.fromkeys(self.row_group))

    def _prefill(self) -> Tensor:
        prompts = [g.request.input_ids for g in self.groups]
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.bool)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = True
        dev = self.engine.device
        ids, mask = ids.to(dev), mask.to(dev)
        positions = (mask.long().cumsum(-1) - 1).clamp_min(0)
        cache = self.runner.allocate(len(prompts), width + self.steps_max)
        cache.key_mask[:, :width] = mask
        cache.key_mask[:, width:] = True  # generated tokens are real for every row
        logits = self.runner.forward(ids, positions, cache)
        lengths = torch.tensor([len(p) for p in prompts], device=dev)
        if any(g.n > 1 for g in self.groups):
            # n samples share one prefill: copy the prompt's cache rows instead of recomputing them.
            rows = torch.arange(len(prompts), device=dev).repeat_interleave(
                torch.tensor([g.n for g in self.groups], device=dev))
            cache, logits, lengths = cache.select(rows), logits[rows], lengths[rows]
        stats = self.engine._stats
        stats["prefill_rows"] += len(prompts)
        stats["prefill_tokens"] += sum(len(p) for p in prompts)
        self.cache, self.positions = cache, lengths
        return logits

    def step(self, version: int) -> list[_Group]:
        """Advance every live row by one token; return the requests completed by this step."""
        if self.t == 0:
            logits = self._prefill()
        else:
            logits = self.runner.forward(self.last.unsqueeze(1), self.positions.unsqueeze(1), self.cache)
            self.positions += 1
        u = None if self.uniforms is None else self.uniforms[:, self.t]
        tokens, logprobs = sample(logits, self.st, u)
        self.tokens[:, self.t] = tokens
        self.logprobs[:, self.t] = logprobs
        self.versions.append(version)
        self.t += 1
        self.last = tokens
        self.engine._stats["steps"] += 1
        self.engine._stats["generated_tokens"] += len(self.row_group)
        finished = self.limit <= self.t
        stopped = None
        if self.stop_ids is not None:
            stopped = (tokens.unsqueeze(1) == self.stop_ids).any(dim=1)
            finished |= stopped
        if not bool(finished.any()):
            return []
        rows = finished.nonzero().flatten()
        reasons = stopped[rows].tolist() if stopped is not None else [False] * rows.numel()
        reasons = [FinishReason.STOP if s else FinishReason.LENGTH for s in reasons]
        completed = self._emit(rows, reasons)
        self._keep((~finished).nonzero().flatten())
        return completed

    def _emit(self, rows: Tensor, reasons: list[FinishReason]) -> list[_Group]:
        t = self.t
        tokens = self.tokens[rows, :t].tolist()
        logprobs = self.logprobs[rows, :t].tolist()
        completed = []
        for k, r in enumerate(rows.tolist()):
            group = self.row_group[r]
            result = GenerationResult(group.request.request_id, tokens[k], logprobs[k], self.versions[:t], reasons[k])
            if group.put(self.row_sample[r], result):
                completed.append(group)
        return completed

    def _keep(self, rows: Tensor) -> None:
        """Compact the batch to ``rows`` (finished or aborted rows leave the computation)."""
        kept = rows.tolist()
        self.row_group = [self.row_group[r] for r in kept]
        self.row_sample = [self.row_sample[r] for r in kept]
        if not kept:
            self.cache = None
            return
        self.limit, self.tokens, self.logprobs = self.limit[rows], self.tokens[rows], self.logprobs[rows]
        if self.stop_ids is not None:
            self.stop_ids = self.stop_ids[rows]
        if self.uniforms is not None:
            self.uniforms = self.uniforms[rows]
        self.st = self.st.select(rows, self.runner.vocab_size)
        if self.t > 0:
            self.cache, self.last, self.positions = self.cache.select(rows), self.last[rows], self.positions[rows]
        else:  # not prefilled yet: drop whole requests before the prefill sees them
            alive = set(self.row_group)
            self.groups = [g for g in self.groups if g in alive]

    def abort(self, groups: set[_Group]) -> list[_Group]:
        """End the rows of ``groups`` with ``ABORT`` (tokens so far); return those groups completed."""
        hit = [i for i, g in enumerate(self.row_group) if g in groups]
        if not hit:
            return []
        dev = self.tokens.device
        keep = [i for i, g in enumerate(self.row_group) if g not in groups]
        with torch.inference_mode():
            completed = self._emit(torch.tensor(hit, device=dev), [FinishReason.ABORT] * len(hit))
            self._keep(torch.tensor(keep, dtype=torch.long, device=dev))
        return completed


class NativeEngine:
    """Embedded generation engine over an HF Llama-family checkpoint (CPU first, any torch device).

    ``eos_token_ids`` overrides the stop ids read from the model's config and generation config
    (``[]`` disables them, for benchmarks that must run to ``max_new_tokens``). ``generate`` and
    ``abort`` must be awaited on one event loop at a time; ``generate_batch`` is synchronous, runs
    its requests to completion and does not observe ``pause``/``abort``; for it a bad request raises
    before anything runs.
    """

    kind = "engine"

    def __init__(self, model_path: str, *, dtype: str | torch.dtype = "float32", device: str = "cpu",
                 max_batch_size: int = 256, max_model_len: int = 512, fp32_lm_head: bool = True, seed: int = 0,
                 eos_token_ids: Iterable[int] | None = None):
        from transformers import AutoModelForCausalLM

        torch_dtype = _DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
        if not isinstance(torch_dtype, torch.dtype):
            raise ValueError(f"native engine: dtype={dtype!r}: must be one of {sorted(_DTYPES)}")
        if max_batch_size < 1 or max_model_len < 2:
            raise ValueError(f"native engine: max_batch_size={max_batch_size} must be >= 1 and "
                             f"max_model_len={max_model_len} >= 2")
        self.model_path, self.dtype, self.device = str(model_path), torch_dtype, torch.device(device)
        self.max_batch_size, self.max_model_len = int(max_batch_size), int(max_model_len)
        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch_dtype)
        self.model = model.to(self.device).eval().requires_grad_(False)
        self._runner = DecoderRunner(self.model, fp32_lm_head=fp32_lm_head)
        self.eos_token_ids = set(_model_eos(self.model) if eos_token_ids is None else eos_token_ids)
        # Every name a trainer may export, tied aliases included (lm_head.weight of a tied model).
        self._weights = dict(self.model.named_parameters(remove_duplicate=False))
        self._weights.update(self.model.named_buffers(remove_duplicate=False))
        self._generator = torch.Generator().manual_seed(int(seed))
        self._version = 0
        self._lock = threading.Lock()
        self._paused = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._serve_task: asyncio.Task | None = None
        self._wake_event: asyncio.Event | None = None
        self._waiting: deque[_Group] = deque()
        self._entries: dict[str, _Group] = {}  # request id -> request waiting or running
        self._aborts: list[tuple[list[_Group], asyncio.Future]] = []
        self._running: _Batch | None = None
        self._last_error: str | None = None
        self._stats = dict.fromkeys(("batches", "steps", "generated_tokens", "prefill_rows", "prefill_tokens"), 0)

    # ----------------------------------------------------------------------------- public API

    @property
    def version(self) -> int:
        return self._version

    def set_version(self, version: int) -> None:
        """Continue a resumed run's version numbering."""
        with self._lock:
            self._version = int(version)

    async def generate(self, request: GenerationRequest) -> list[GenerationResult]:
        """The ``n`` samples of one prompt, in sample order."""
        self._validate(request)
        loop = self._bind_loop()
        rid = request.request_id
        if rid in self._entries:
            raise ValueError(f"request {rid!r}: a request with this id is already in flight")
        group = _Group(request, loop.create_future(), self.eos_token_ids)
        self._entries[rid] = group
        self._waiting.append(group)
        self._wake()
        try:
            return await group.future
        except asyncio.CancelledError:
            # The caller went away: a waiting request leaves now, a running one at the next step.
            if not group.running and group in self._waiting:
                self._waiting.remove(group)
                self._entries.pop(rid, None)
            raise

    def generate_batch(self, requests: list[GenerationRequest]) -> list[list[GenerationResult]]:
        """Synchronous convenience: run all requests (in batches of ``max_batch_size`` rows)."""
        seen: set[str] = set()
        for request in requests:
            self._validate(request)
            if request.request_id in seen:
                raise ValueError(f"request {request.request_id!r}: duplicate request id in the batch")
            seen.add(request.request_id)
        groups = [_Group(r, None, self.eos_token_ids) for r in requests]
        pending = deque(groups)
        while pending:
            batch = _Batch(self, self._take(pending))
            self._stats["batches"] += 1
            while not batch.done:
                self._step(batch)
        return [g.results for g in groups]

    async def abort(self, request_ids: list[str] | None = None) -> list[GenerationResult]:
        """Abort requests (``None``: all in flight); returns their results with what was generated.

        Samples of an aborted request that had already finished keep their own finish reason.
        """
        loop = self._bind_loop()
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        ids = list(self._entries) if request_ids is None else list(dict.fromkeys(request_ids))
        unknown = [rid for rid in ids if rid not in self._entries]
        if unknown:
            raise ValueError(f"abort: unknown request id(s) {unknown}: not waiting or running")
        results, running = [], []
        for rid in ids:
            group = self._entries[rid]
            if group.running:
                running.append(group)
                continue
            self._waiting.remove(group)
            del self._entries[rid]
            group.results = group.aborted()
            _resolve(group)
            results.extend(group.results)
        if running:
            future = loop.create_future()
            self._aborts.append((running, future))
            self._wake()
            results.extend(await future)
        return results

    def pause(self) -> None:
        """Stop before the next decode step (caches kept); queued requests wait too."""
        self._paused = True

    def resume(self) -> None:
        self._paused = False
        self._wake()

    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> int:
        """Copy HF-named tensors into the model in place, between decode steps; returns the new version.

        Names and shapes are all checked before any tensor is copied, so a bad update changes nothing.
        """
        items = list(named_tensors)
        for name, tensor in items:
            target = self._weights.get(name)
            if target is None:
                raise ValueError(f"update_weights: unknown tensor {name!r} for {type(self.model).__name__}")
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(f"update_weights: {name!r} has shape {tuple(tensor.shape)}, "
                                 f"the model expects {tuple(target.shape)}")
        with self._lock, torch.no_grad():
            for name, tensor in items:
                self._weights[name].copy_(tensor)
            self._runner.refresh_head()
            self._version += 1
            return self._version

    def health(self) -> dict:
        running = self._running
        return {
            "status": "paused" if self._paused else "ok",
            "version": self._version,
            "waiting_requests": len(self._waiting),
            "running_requests": len(running.live_groups()) if running is not None else 0,
            "running_rows": len(running.row_group) if running is not None else 0,
            "max_batch_size": self.max_batch_size,
            "max_model_len": self.max_model_len,
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "model_path": self.model_path,
            "last_error": self._last_error,
            **self._stats,
        }

    # ----------------------------------------------------------------------------- internals

    def _validate(self, request: GenerationRequest) -> None:
        prefix = f"request {request.request_id!r}: "
        try:
            request.sampling.validate()
        except ValueError as exc:
            raise ValueError(prefix + str(exc)) from None
        ids = request.input_ids
        if len(ids) == 0:
            raise ValueError(prefix + "input_ids is empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(prefix + f"prompt of {len(ids)} tokens is too long for max_model_len="
                             f"{self.max_model_len} (at most {self.max_model_len - 1}, to leave room for one new token)")
        vocab = self._runner.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(prefix + f"input_ids must lie in [0, {vocab}), got values in [{min(ids)}, {max(ids)}]")
        if request.sampling.n > self.max_batch_size:
            raise ValueError(prefix + f"sampling.n={request.sampling.n} exceeds max_batch_size={self.max_batch_size}")

    def _take(self, queue: deque[_Group]) -> list[_Group]:
        """Admit queued requests FIFO while their rows fit ``max_batch_size``."""
        groups, rows = [], 0
        while queue:
            group = queue[0]
            if group.future is not None and group.future.done():  # cancelled while waiting
                queue.popleft()
                self._entries.pop(group.request.request_id, None)
                continue
            if groups and rows + group.n > self.max_batch_size:
                break
            queue.popleft()
            group.running = True
            groups.append(group)
            rows += group.n
        return groups

    def _step(self, batch: _Batch) -> list[_Group]:
        with self._lock, torch.inference_mode():
            return batch.step(self._version)

    def _bind_loop(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            if self._loop is not None and self._loop.is_running():
                raise RuntimeError("native engine: already serving another running event loop")
            # A previous loop is gone together with its futures: start clean on this one.
            self._loop, self._wake_event, self._serve_task = loop, asyncio.Event(), None
            self._waiting.clear()
            self._entries.clear()
            self._aborts.clear()
            self._running = None
        if self._serve_task is None or self._serve_task.done():
            self._serve_task = loop.create_task(self._serve())
        return loop

    def _wake(self) -> None:
        loop, event = self._loop, self._wake_event
        if loop is None or event is None or loop.is_closed():
            return
        try:
            same = asyncio.get_running_loop() is loop
        except RuntimeError:
            same = False
        if same:
            event.set()
        else:  # pause/resume/update from another thread
            loop.call_soon_threadsafe(event.set)

    async def _serve(self) -> None:
        while True:
            self._wake_event.clear()
            self._apply_aborts(None)
            groups = self._take(self._waiting) if not self._paused else []
            if not groups:
                await self._wake_event.wait()
                continue
            batch = self._running = _Batch(self, groups)
            self._stats["batches"] += 1
            try:
                while not batch.done:
                    await self._between_steps(batch)
                    if batch.done:
                        break
                    for group in self._step(batch):
                        self._finish(group)
            except Exception as exc:  # a failing batch fails its own requests; the engine keeps serving
                self._last_error = f"{type(exc).__name__}: {exc}"
                for group in batch.live_groups():
                    self._entries.pop(group.request.request_id, None)
                    if not group.future.done():
                        group.future.set_exception(exc)
            finally:
                self._running = None

    async def _between_steps(self, batch: _Batch) -> None:
        await asyncio.sleep(0)  # let new requests, aborts and weight updates in
        while True:
            self._wake_event.clear()
            self._apply_aborts(batch)
            gone = {g for g in batch.live_groups() if g.future.done()}
            if gone:
                batch.abort(gone)
                for group in gone:
                    self._entries.pop(group.request.request_id, None)
            if not self._paused or batch.done:
                return
            await self._wake_event.wait()

    def _apply_aborts(self, batch: _Batch | None) -> None:
        """Answer pending ``abort`` calls for running requests (at a step boundary)."""
        aborts, self._aborts = self._aborts, []
        for groups, future in aborts:
            live = {g for g in groups if g.pending}
            if batch is not None and live:
                for group in batch.abort(live):
                    self._finish(group)
            # A request that completed before this boundary answers with its final results.
            results = [r for g in groups for r in g.results if r is not None]
            if not future.done():
                future.set_result(results)

    def _finish(self, group: _Group) -> None:
        self._entries.pop(group.request.request_id, None)
        _resolve(group)


def _resolve(group: _Group) -> None:
    if group.future is not None and not group.future.done():
        group.future.set_result(group.results)


def _model_eos(model) -> list[int]:
    """Stop ids the model declares: ``eos_token_id`` of its config and of its generation config."""
    ids: list[int] = []
    for source in (model.config, getattr(model, "generation_config", None)):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if value is not None:
            ids.extend([value] if isinstance(value, int) else value)
    return ids
