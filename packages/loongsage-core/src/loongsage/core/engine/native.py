"""The embedded rollout engine (``native``): token-in, token-out generation with a batched KV cache.

Shape of the engine:

* ``generate(request)`` is per request and async. It validates the request (a bad one raises a
  one-line ``ValueError`` in its own caller only), queues it and awaits its future.
* One scheduler task per event loop (:meth:`NativeEngine._serve`) runs *continuous batching* over
  one :class:`~loongsage.core.engine.continuous.SlotBatch` (a slot-based KV cache of at most
  ``max_batch_size`` rows x ``max_model_len``): at every step boundary it admits queued requests
  FIFO into free slots, then runs one step (at most ``prefill_chunk_tokens`` prompt tokens of
  prefill, plus one decode token for every decoding row). The ``n`` sample rows of a request share
  one prefill; finished rows free their slot at once, so new requests join while others decode.
* Prefix reuse (``prefix_cache``): a finished row's cache stays in its slot until the slot is needed
  (LRU); a request whose ``input_ids`` extend those tokens (the next turn of a session) prefills
  only the new suffix. Only caches computed by the current weight version are reused.
* Between two steps the scheduler yields to the event loop until the loop has nothing else ready
  to run (at most ``_MAX_YIELDS`` rounds), then applies aborts, drops requests whose caller went
  away and honours ``pause()``. A caller on the same loop (an HTTP gateway, say) needs several
  loop rounds to turn a finished answer into its next request; yielding once would let a step run
  in each of them, every one without that request. Waiting on nothing but ready work adds no
  latency: with nothing ready the next step starts at once. A step (forward + sampling +
  bookkeeping) holds ``self._lock``, as does ``update_weights``, so weights only change between
  steps, even when called from another thread.

Lifecycle: ``release_memory()`` frees the KV cache (and, on an accelerator, moves the weights to
host memory) so a colocated trainer can use the device; ``resume_memory()`` brings both back.
Weight updates are accepted while released.

Deterministic mode (``deterministic=True``): when a sample completes, its log-probs are recomputed
by the trainer's own forward (:func:`loongsage.core.model_math.logprobs.policy_logits`) over prompt +
output, one sequence at a time, so they equal the trainer's log-probs of the same tokens bit for
bit when the trainer also runs one sequence per micro-batch (``trainer.micro_batch_tokens: 1``) on
the same device and dtype. Sampling still uses the batched decode logits; only the reported
log-probs change. Slower (one extra forward per sample); meant for consistency checks and
debugging. A sample whose tokens span a weight update gets the log-probs of the weights at
completion for its new tokens (a resumed sample keeps its earlier tokens' log-probs).

Results: the sampled stop token (a request's ``stop_token_ids`` plus the model's eos) is kept in
``output_ids`` with its log-prob, as vLLM and SGLang return it (``STOP``); ``LENGTH`` means
``max_new_tokens`` or ``max_model_len`` was reached; ``ABORT`` returns the tokens so far. Every
token records the weight version of the step that produced it. Log-probs are the raw policy's
``log_softmax`` in float32 — temperature, top-k/p and min-p are *not* folded in, so they equal the
trainer's log-probs of the same tokens (see :mod:`loongsage.core.engine.sampling`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections import deque
from collections.abc import Iterable

import torch
from torch import Tensor

from loongsage.core.engine.continuous import SlotBatch
from loongsage.core.engine.kv_cache import DecoderRunner
from loongsage.core.engine.options import check_options, engine_dtype, resolve_steps_per_sync
from loongsage.core.model_math.logprobs import logprobs_and_entropy, policy_logits
from loongsage.core.types import FinishReason, GenerationRequest, GenerationResult, abort_targets, check_request

# Loop rounds the scheduler yields at most between two steps while other callbacks are ready: enough
# for a request's hops through an HTTP stack, few enough that a busy loop cannot stall generation.
_MAX_YIELDS = 32


class _Group:
    """One request in flight: ``n`` sample rows that share its prompt's prefill."""

    __slots__ = ("request", "future", "results", "pending", "stops", "running", "prompt", "prior", "max_new")

    def __init__(self, request: GenerationRequest, future: asyncio.Future | None, eos: set[int]):
        self.request, self.future, self.running = request, future, False
        self.results: list[GenerationResult | None] = [None] * request.sampling.n
        self.pending = request.sampling.n
        self.stops = sorted(set(request.sampling.stop_token_ids) | eos)
        # A resumed sample prefills its earlier tokens as prompt and keeps them in its result.
        self.prior = request.resume_from
        done = self.prior.output_ids if self.prior is not None else []
        self.prompt = list(request.input_ids) + list(done)
        self.max_new = request.sampling.max_new_tokens - len(done)

    @property
    def n(self) -> int:
        return self.request.sampling.n

    def put(self, sample: int, result: GenerationResult) -> bool:
        """Record one sample's result; True when the request is complete."""
        if self.prior is not None:
            p = self.prior
            # the routes cover the whole input of this run: the prompt with the prior tokens in it
            result = GenerationResult(
                result.request_id,
                p.output_ids + result.output_ids,
                p.logprobs + result.logprobs,
                p.versions + result.versions,
                result.finish_reason,
                p.routed_experts if result.routed_experts is None else result.routed_experts,
            )
        self.results[sample] = result
        self.pending -= 1
        return self.pending == 0

    def aborted(self) -> list[GenerationResult]:
        """Results of a request aborted before it ran: no new tokens (a resumed one keeps its old ones)."""
        rid = self.request.request_id
        self.results, self.pending = [None] * self.n, self.n
        for sample in range(self.n):
            self.put(sample, GenerationResult(rid, [], [], [], FinishReason.ABORT))
        return self.results


class NativeEngine:
    """Embedded generation engine over an HF Llama-family checkpoint (CPU first, any torch device).

    ``eos_token_ids`` overrides the stop ids read from the model's config and generation config
    (``[]`` disables them, for benchmarks that must run to ``max_new_tokens``). ``max_batch_size``
    bounds the live sample rows (KV slots); ``prefill_chunk_tokens`` the prompt tokens prefilled per
    step; ``prefix_cache`` turns prefix reuse across requests on or off; ``cuda_graphs`` replays the
    decode step from captured CUDA graphs on a CUDA device (see :mod:`loongsage.core.engine.cuda_graphs`).
    ``return_routed_experts`` (a mixture-of-experts model) records the experts every MoE layer chose
    for every token and returns them with each sample (R3 routing replay; decode then runs without
    CUDA graphs). ``kernels`` picks the decode step's kernels: ``"auto"`` runs fused Triton kernels
    where they apply (a CUDA device, Triton installed, a dense Llama-family decoder; see
    :mod:`loongsage.core.engine.fused`), ``"triton"`` requires them, ``"torch"`` keeps the torch ops.
    ``steps_per_sync`` decode steps run back to back before the host reads back which rows finished
    (see :mod:`loongsage.core.engine.continuous`); by default 8 where the steps replay as CUDA
    graphs, 1 elsewhere. ``batch_invariant`` runs prefill, decode and the sampled tokens' log-probs
    on the fused kernels' batch-invariant path, which the trainer's ``batch_invariant`` forward also
    runs (:mod:`loongsage.core.trainer.invariant`): their log-probs agree bit for bit, without the
    deterministic mode's second forward, at the cost of slower GEMMs and decode attention whose
    columns are never split over programs.
    ``quantization="fp8"`` runs the decode GEMMs on float8 copies of the projections (a bf16 model on
    an Ada or Hopper GPU; :mod:`loongsage.core.engine.fused.fp8`), quantized again after each update.
    ``shared_prefix_decode`` lets decode attention read the prompt of a request's ``n`` samples once
    per tile of up to ``16 // group`` of them instead of once per sample (the fused kernels, the
    batch-invariant mode included; :mod:`loongsage.core.engine.fused.attention`).
    ``generate`` and
    ``abort`` must be awaited on one event loop at a time; ``generate_batch`` is synchronous, runs
    its requests to completion and does not observe ``pause``/``abort``; for it a bad request raises
    before anything runs.
    """

    kind = "engine"

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str | torch.dtype = "float32",
        device: str = "cpu",
        max_batch_size: int = 256,
        max_model_len: int = 512,
        fp32_lm_head: bool = True,
        seed: int = 0,
        eos_token_ids: Iterable[int] | None = None,
        prefill_chunk_tokens: int = 2048,
        prefix_cache: bool = True,
        deterministic: bool = False,
        cuda_graphs: bool = True,
        return_routed_experts: bool = False,
        kernels: str = "auto",
        steps_per_sync: int | None = None,  # decode steps per host read-back (None: 8 under CUDA graphs, else 1)
        # prefill, decode and log-probs computed as the trainer's batch-invariant forward computes them
        # (bf16/fp16 on CUDA, the fused kernels; see docs/engine.md)
        batch_invariant: bool = False,
        # decode GEMMs on float8 weights ("fp8", Ada/Hopper, bf16 models; fused/fp8.py); null: the model's
        quantization: str | None = None,
        # decode attention reads a request's prompt once for up to 16 // group of its samples (fused kernels)
        shared_prefix_decode: bool = True,
    ):
        from transformers import AutoModelForCausalLM

        torch_dtype = engine_dtype(dtype)
        check_options(
            max_batch_size=max_batch_size,
            max_model_len=max_model_len,
            batch_invariant=batch_invariant,
            deterministic=deterministic,
            quantization=quantization,
            steps_per_sync=steps_per_sync,
        )
        self.model_path, self.dtype, self.device = str(model_path), torch_dtype, torch.device(device)
        self.max_batch_size, self.max_model_len = int(max_batch_size), int(max_model_len)
        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch_dtype)
        self.model = model.to(self.device).eval().requires_grad_(False)
        self._runner = DecoderRunner(
            self.model,
            fp32_lm_head=fp32_lm_head,
            kernels=kernels,
            batch_invariant=bool(batch_invariant),
            quantization=quantization,
        )
        if return_routed_experts:
            self._runner.record_routes()
        self.eos_token_ids = set(_model_eos(self.model) if eos_token_ids is None else eos_token_ids)
        self.deterministic = bool(deterministic)
        self._released = False
        self._bind_weights()
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
        self._last_error: str | None = None
        self._stats = dict.fromkeys(
            (
                "batches",
                "steps",
                "read_backs",
                "generated_tokens",
                "prefill_rows",
                "prefill_tokens",
                "prefix_hit_tokens",
                "prefill_forwards",
                "kv_slots",
                "kv_cache_bytes",
            ),
            0,
        )
        self._batch_args = {
            "max_slots": self.max_batch_size,
            "max_model_len": self.max_model_len,
            "generator": self._generator,
            "stats": self._stats,
            "prefill_chunk_tokens": int(prefill_chunk_tokens),
            "prefix_cache": bool(prefix_cache),
            "cuda_graphs": bool(cuda_graphs),
            "steps_per_sync": resolve_steps_per_sync(
                steps_per_sync, cuda_graphs=cuda_graphs, device=self.device, routes=return_routed_experts
            ),
            "shared_prefix_decode": bool(shared_prefix_decode),
        }
        self._batch = SlotBatch(self._runner, **self._batch_args)

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
        # The serving batch when idle (its retained prefixes are reused), else a batch of its own.
        batch = self._batch if not self._batch.live_rows() else SlotBatch(self._runner, **self._batch_args)
        self._stats["batches"] += 1
        try:
            while pending or not batch.done:
                self._admit(batch, pending)
                self._step(batch)
        except BaseException:
            batch.reset()
            raise
        finally:
            if batch is not self._batch:  # its cache goes; report the serving batch's size again
                self._batch.record_size()
        return [g.results for g in groups]

    async def abort(self, request_ids: list[str] | None = None) -> list[GenerationResult]:
        """Abort requests (``None``: all in flight); returns their results with what was generated.

        Samples of an aborted request that had already finished keep their own finish reason.
        """
        loop = self._bind_loop()
        ids = abort_targets(request_ids, self._entries)
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

    def flush_cache(self) -> int:
        """Forget the retained prefixes (requests in flight keep theirs); returns how many.

        What runs next then computes exactly what it would on a fresh engine: evaluation flushes
        after itself, so that training after it does not reuse its prefixes (a resumed run, whose
        engine never saw that evaluation, must draw the same numbers).
        """
        with self._lock:
            return self._batch.drop_retained()

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
                raise ValueError(
                    f"update_weights: {name!r} has shape {tuple(tensor.shape)}, the model expects {tuple(target.shape)}"
                )
            if tensor.dtype != target.dtype:
                raise ValueError(
                    f"update_weights: {name!r} is {str(tensor.dtype).removeprefix('torch.')}, "
                    f"the model holds {str(target.dtype).removeprefix('torch.')}"
                )
        with self._lock, torch.no_grad():
            if items:
                torch._foreach_copy_([self._weights[name] for name, _ in items], [t for _, t in items])
                if self.device.type == "cuda":  # copied before the version says so (and the sources may go)
                    torch.cuda.current_stream(self.device).synchronize()
            self._runner.weights_changed()
            self._version += 1
            return self._version

    def named_weights(self) -> list[tuple[str, Tensor]]:
        """The engine's HF-named tensors as they are now (checks that an update arrived bit for bit),
        listed under the lock: never between the copies of an update."""
        with self._lock:
            return [(name, t.detach()) for name, t in self._weights.items()]

    def release_memory(self) -> None:
        """Free the KV cache and, on an accelerator, move the weights to host memory.

        Refused while requests wait or run (pause and abort them first). ``generate`` raises until
        :meth:`resume_memory`; ``update_weights`` still works (the copy lands in host memory).
        """
        with self._lock:
            if self._entries or self._batch.live_rows():
                raise RuntimeError(
                    f"release_memory: {len(self._entries)} request(s) still waiting or running; "
                    "abort them (or let them finish) first"
                )
            if self._released:
                return
            self._batch.release()
            if self.device.type != "cpu":
                self._move_weights(torch.device("cpu"))
                getattr(torch, self.device.type).empty_cache()
            self._released = True

    def resume_memory(self) -> None:
        """Undo :meth:`release_memory`: weights back on the device, an empty KV cache."""
        with self._lock:
            if not self._released:
                return
            if self.device.type != "cpu":
                self._move_weights(self.device)
            self._batch.reallocate()
            self._released = False

    def health(self) -> dict:
        batch = self._batch
        return {
            "status": "released" if self._released else "paused" if self._paused else "ok",
            "version": self._version,
            "waiting_requests": len(self._waiting),
            "running_requests": len(batch.live_groups()),
            "running_rows": batch.live_rows(),
            "max_batch_size": self.max_batch_size,
            "max_model_len": self.max_model_len,
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "decode_kernels": ("triton, batch-invariant" if self._runner.invariant else "triton")
            + (", fp8 weights" if self._runner.fused is not None and self._runner.fused.fp8 else "")
            + (", shared prefixes" if self._batch.prefixes is not None else "")
            if self._runner.fused is not None
            else f"torch ({self._runner.fused_off_because})",
            "model_path": self.model_path,
            "last_error": self._last_error,
            **self._stats,
        }

    # ----------------------------------------------------------------------------- internals

    def _bind_weights(self) -> None:
        # Every name a trainer may export, tied aliases included (lm_head.weight of a tied model).
        # Rebuilt after a device move: ``Module.to`` keeps parameter objects but replaces buffers.
        self._weights = dict(self.model.named_parameters(remove_duplicate=False))
        self._weights.update(self.model.named_buffers(remove_duplicate=False))

    def _move_weights(self, device: torch.device) -> None:
        self.model.to(device)
        self._runner.moved()
        self._bind_weights()

    def _validate(self, request: GenerationRequest) -> None:
        prefix = f"request {request.request_id!r}: "
        ids = check_request(request, released=self._released)
        if len(ids) >= self.max_model_len:
            raise ValueError(
                prefix + f"prompt of {len(ids)} tokens is too long for max_model_len="
                f"{self.max_model_len} (at most {self.max_model_len - 1}, "
                "to leave room for one new token)"
            )
        vocab = self._runner.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(prefix + f"input_ids must lie in [0, {vocab}), got values in [{min(ids)}, {max(ids)}]")
        if request.sampling.n > self.max_batch_size:
            raise ValueError(prefix + f"sampling.n={request.sampling.n} exceeds max_batch_size={self.max_batch_size}")

    def _admit(self, batch: SlotBatch, queue: deque[_Group]) -> None:
        """Admit queued requests FIFO while their rows fit the batch's free slots."""
        while queue:
            group = queue[0]
            if group.future is not None and group.future.done():  # cancelled while waiting
                queue.popleft()
                self._entries.pop(group.request.request_id, None)
                continue
            if batch.available() < group.n:
                return
            queue.popleft()
            group.running = True
            batch.admit(group, self._version)

    def _step(self, batch: SlotBatch) -> list[_Group]:
        with self._lock, torch.inference_mode():
            return self._completed(batch.step(self._version))

    def _completed(self, groups: list[_Group]) -> list[_Group]:
        """Deterministic mode: the completed samples' log-probs from the trainer's forward."""
        if not self.deterministic:
            return groups
        with torch.inference_mode():
            for group in groups:
                prompt, kept = group.request.input_ids, len(group.prompt)
                for sample, result in enumerate(group.results):
                    if result is None or len(prompt) + len(result.output_ids) <= kept:
                        continue
                    ids = torch.tensor([list(prompt) + result.output_ids], device=self.device)
                    logits = policy_logits(
                        self.model, ids, torch.ones_like(ids), len(prompt), fp32_lm_head=self._runner.fp32_lm_head
                    )
                    lp = logprobs_and_entropy(logits, ids, len(prompt), with_entropy=False)[0][0, kept:]
                    logprobs = result.logprobs[: kept - len(prompt)] + lp.tolist()
                    group.results[sample] = dataclasses.replace(result, logprobs=logprobs)
        return groups

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
            self._batch.reset()
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
        batch, busy = self._batch, False
        while True:
            self._wake_event.clear()
            self._apply_aborts(batch)
            gone = {g for g in batch.live_groups() if g.future is not None and g.future.done()}
            if gone:  # the caller went away
                batch.abort(gone)
                for group in gone:
                    self._entries.pop(group.request.request_id, None)
            if not self._paused:
                self._admit(batch, self._waiting)
            if self._paused or batch.done:
                busy = False
                await self._wake_event.wait()
                continue
            if not busy:
                busy = True
                self._stats["batches"] += 1
            try:
                for group in self._step(batch):
                    self._finish(group)
            except Exception as exc:  # a failing step fails its own requests; the engine keeps serving
                self._last_error = f"{type(exc).__name__}: {exc}"
                for group in batch.live_groups():
                    self._entries.pop(group.request.request_id, None)
                    if not group.future.done():
                        group.future.set_exception(exc)
                batch.reset()
            await _yield_while_busy(self._loop)  # let new requests, aborts and weight updates in

    def _apply_aborts(self, batch: SlotBatch) -> None:
        """Answer pending ``abort`` calls for running requests (at a step boundary)."""
        aborts, self._aborts = self._aborts, []
        for groups, future in aborts:
            live = {g for g in groups if g.pending}
            if live:
                with self._lock:
                    completed = self._completed(batch.abort(live))
                for group in completed:
                    self._finish(group)
            # A request that completed before this boundary answers with its final results.
            results = [r for g in groups for r in g.results if r is not None]
            if not future.done():
                future.set_result(results)

    def _finish(self, group: _Group) -> None:
        self._entries.pop(group.request.request_id, None)
        _resolve(group)


async def _yield_while_busy(loop: asyncio.AbstractEventLoop) -> None:
    """Yield to ``loop`` once, then again while other callbacks are ready (``_MAX_YIELDS`` at most).

    Reads asyncio's ready queue (``_ready``, a private attribute of the standard loops); a loop
    without one gets a single yield.
    """
    await asyncio.sleep(0)
    ready = getattr(loop, "_ready", None)
    for _ in range(_MAX_YIELDS - 1):
        if not ready:
            return
        await asyncio.sleep(0)


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
