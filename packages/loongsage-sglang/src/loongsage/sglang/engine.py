"""``sglang``: an engine replica that is an SGLang server, driven over its HTTP API with token ids.

The engine worker starts the server (:mod:`.server`) with ``--skip-tokenizer-init`` (token ids in,
token ids out), its weight version at the framework's, the FP32 LM head when the run asks for it,
and ``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` so that the log-probs it returns are the raw policy's
(temperature and filters not folded in), as the engine contract asks. Then:

* ``generate``: each sample a request of its own (``n`` expanded here), with ``return_logprob``;
  the samples submitted in one turn of the event loop go to the server as one streamed batch
  (:mod:`.dispatch`: each answered as it finishes, a bad one failing alone). A resumed sample
  sends its prompt followed by the tokens it already has, for the budget that is left, and its
  result keeps them in front. Every token of an answer carries the
  server's weight version (a request never spans an update: partial rollout aborts first).
* ``abort``: ``POST /abort_request`` per sample (or ``abort_all``), sent again until each request
  has answered (an abort that reaches the server before its request is dropped there); the aborted
  requests answer with the tokens they have.
* ``pause``/``resume``: ``/pause_generation`` (``in_place``: the running batch and its cache are
  kept) and ``/continue_generation``.
* ``update_weights``: names, shapes and dtypes are checked against the checkpoint first, so a bad
  update changes nothing; the tensors are packed into one buffer the engine owns and sent with
  ``/update_weights_from_tensor`` (torch's multiprocessing pickling: a CUDA IPC handle on a GPU, a
  shared-memory file name on the CPU), with the new version, loaded by :mod:`.weight_loader` (one
  batched copy into the parameters) unless ``fast_weight_load=False``. While paused with requests held, the
  server's cache is not flushed (SGLang cannot flush a busy cache).
* ``release_memory``/``resume_memory``: ``/release_memory_occupation`` and
  ``/resume_memory_occupation`` with ``release_tags`` (the server runs with
  ``--enable-memory-saver``, and ``--enable-weights-cpu-backup`` when the weights are released, so
  they come back), refused while requests run (SGLang asserts an idle server).

The field names and behaviours follow SGLang 0.5.16's HTTP server (docs/sglang.md).
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor

from loongsage.core.contracts import Engine
from loongsage.core.placement import free_port
from loongsage.core.types import (
    Check,
    EngineUnavailable,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    abort_targets,
    check_request,
)
from loongsage.sglang.dispatch import Dispatcher, Sample, SGLangError, message, request_id_base
from loongsage.sglang.group_receiver import ServerJoinsTheGroup
from loongsage.sglang.server import (
    SGLANG_LAUNCH,
    ServerProcess,
    check_deterministic_backend,
    check_numerics_options,
    server_flags,
)
from loongsage.sglang.weight_loader import LOAD_FLAT, layout_name

_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}
_SERVED = ("bfloat16", "float16")  # SGLang's fused kernels (RMSNorm, ...) take no float32
_PREFILL_GRAPH_MIN_POSITIONS = 8192  # prefill CUDA-graph capture runs positions this far
_TAGS = ("kv_cache", "weights", "cuda_graph")
_EXIT_WAIT_S = 2.0  # a control call that lost the server waits this long for its exit code
_ABORT_RESEND_S = 0.5  # an abort that found no request is sent again this often until it answers


@dataclass
class _Flight:
    samples: list[Sample]  # one per sample asked for
    task: asyncio.Future  # their answers
    prior: GenerationResult | None  # what a resumed sample had


class SGLangEngine(Engine):
    """An SGLang server as one engine replica (see the module docstring)."""

    kind = "engine"
    named_weights: ClassVar[None] = None  # SGLang shows its weights only truncated
    VERIFIED = "0.5.16"  # the SGLang whose HTTP API this engine was written and tested against

    @staticmethod
    def doctor() -> list[Check]:
        """SGLang installed (its version against the verified one) and a CUDA GPU to serve on."""
        import importlib.metadata

        import torch

        try:
            found = importlib.metadata.version("sglang")
        except importlib.metadata.PackageNotFoundError:
            found = None
        fix = f"pip install 'sglang[all]=={SGLangEngine.VERIFIED}' (on a CUDA machine)"
        gpu = torch.cuda.is_available()
        return [
            Check("sglang", found is not None, found or "not installed", "" if found else fix),
            Check(
                f"sglang version verified ({SGLangEngine.VERIFIED})",
                found == SGLangEngine.VERIFIED,
                found or "-",
                "" if found == SGLangEngine.VERIFIED else f"other versions may differ in their HTTP API: {fix}",
                optional=True,
            ),
            Check("a CUDA GPU to serve on", gpu, "yes" if gpu else "none", "" if gpu else "SGLang serves on CUDA GPUs"),
        ]

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "bfloat16",
        fp32_lm_head: bool = True,
        seed: int = 0,
        mem_fraction_static: float | None = None,
        max_model_len: int | None = None,
        max_batch_size: int | None = None,
        cuda_graphs: bool = True,
        deterministic: bool = False,
        release_tags: list[str] | tuple[str, ...] = _TAGS,
        server_args: dict[str, Any] | None = None,
        launch: list[str] | None = None,
        startup_timeout_s: float = 900.0,
        control_timeout_s: float = 300.0,
        sampling_backend: str | None = "pytorch",
        device: str = "cuda",
        fast_weight_load: bool = True,
        return_routed_experts: bool = False,
        # SGLang's --attention-backend (fa3, flashinfer, triton, ...); null: SGLang's choice (fa3 on Hopper)
        attention_backend: str | None = None,
        # SGLang's --rl-on-policy-target: fsdp computes as an HF model with float32 weights under bf16
        # autocast (float32 residual stream and norms) and makes the server deterministic; null: off
        rl_on_policy_target: str | None = None,
    ):
        if device != "cuda":
            raise ValueError(
                f"sglang engine: device={device!r}: SGLang serves on CUDA GPUs only (use 'cuda', "
                "or the native engine on the CPU)"
            )
        if dtype not in (*_SERVED, "float32"):
            raise ValueError(f"sglang engine: dtype={dtype!r}: must be one of {', '.join((*_SERVED, 'float32'))}")
        bad = [t for t in release_tags if t not in _TAGS]
        if bad:
            raise ValueError(
                f"sglang engine: release_tags={list(release_tags)!r}: unknown {bad}; allowed: {', '.join(_TAGS)}"
            )
        check_numerics_options(attention_backend, rl_on_policy_target, SGLangEngine.VERIFIED)
        if mem_fraction_static is not None and not 0 < mem_fraction_static < 1:
            raise ValueError(f"sglang engine: mem_fraction_static={mem_fraction_static!r}: must be in (0, 1)")
        for name, value in (
            ("startup_timeout_s", startup_timeout_s),
            ("control_timeout_s", control_timeout_s),
            ("max_model_len", max_model_len or 1),
            ("max_batch_size", max_batch_size or 1),
        ):
            if not value > 0:
                raise ValueError(f"sglang engine: {name}={value!r}: must be > 0")
        # the native engine's sizing, in SGLang's terms: without a memory fraction the KV pool holds
        # max_batch_size full-length requests (SGLang's default fraction would take most of the card)
        pool = (
            max_batch_size * max_model_len if max_batch_size and max_model_len and mem_fraction_static is None else None
        )
        self.model_path, self.dtype, self.deterministic = str(model_path), dtype, bool(deterministic)
        # R3: SGLang records the experts every MoE layer chose for each token it fed the model
        self.route_shape = _route_shape(self.model_path) if return_routed_experts else None
        # a float32 policy is served in bfloat16 (its pushes are cast); its log-probs then differ by
        # bf16 rounding, which the run's IS correction weighs
        self.served_dtype = dtype if dtype in _SERVED else "bfloat16"
        self.release_tags = list(release_tags)
        self.control_timeout_s = float(control_timeout_s)
        # pushes load through weight_loader.load_flat (one batched copy into the parameters), not
        # the model's per-tensor load_weights
        self.load_format = LOAD_FLAT if fast_weight_load else None
        self.expected = checkpoint_tensors(self.model_path)  # name -> (shape, dtype) of the checkpoint
        self._version = 0
        self._paused = self._released = False
        self._flights: dict[str, _Flight] = {}
        self._per_loop: tuple[Any, Any, Dispatcher] | None = None  # (event loop, its async client, its dispatcher)
        self._background: set[asyncio.Task] = set()
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        flags = {
            "model_path": self.model_path,
            "host": "127.0.0.1",
            "port": port,
            "skip_tokenizer_init": True,
            "dtype": self.served_dtype,
            "random_seed": int(seed),
            "weight_version": "0",
            "enable_fp32_lm_head": bool(fp32_lm_head),
            "mem_fraction_static": mem_fraction_static,
            "context_length": max_model_len,
            "max_running_requests": max_batch_size,
            "max_total_tokens": pool,
            "disable_cuda_graph": not cuda_graphs,
            # SGLang captures prefill graphs at positions past a short model's rotary table (an illegal
            # memory access at start-up): such models keep the decode graphs only
            "cuda_graph_backend_prefill": "disabled"
            if cuda_graphs and _max_positions(self.model_path) < _PREFILL_GRAPH_MIN_POSITIONS
            else None,
            # rl_on_policy_target makes SGLang deterministic itself: said here, so the flags show it
            "enable_deterministic_inference": self.deterministic or rl_on_policy_target is not None,
            "rl_on_policy_target": rl_on_policy_target,
            "attention_backend": attention_backend,
            # torch sampling: flashinfer's sampling kernels are compiled at first use (minutes, and a
            # CUDA compiler on the host); None lets SGLang choose
            "sampling_backend": sampling_backend,
            "enable_memory_saver": bool(self.release_tags),
            "enable_weights_cpu_backup": "weights" in self.release_tags,
            "custom_weight_loader": [LOAD_FLAT] if fast_weight_load else None,
            "enable_return_routed_experts": self.route_shape is not None,
            **(server_args or {}),
        }
        # a deterministic server samples with a seed of its own per sample (42 when none is sent, so
        # the samples of one prompt would all be the same): the engine sends one whenever it is
        self.deterministic = bool(flags["enable_deterministic_inference"]) or flags["rl_on_policy_target"] is not None
        if self.deterministic:
            check_deterministic_backend(flags["attention_backend"])
        self.server = ServerProcess(
            list(launch or SGLANG_LAUNCH),
            server_flags(flags),
            env={
                "SGLANG_RETURN_ORIGINAL_LOGPROB": "1",
                # GET /health then answers without generating a token: a
                # generating check crashes a released server, waits 20 s
                # and fails on a paused one, and takes 1 s on an idle one
                "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0",
            },
        )
        self.server.start()
        self.startup_s = self.server.wait_ready(self.url, float(startup_timeout_s))

    # ------------------------------------------------------------------ generation
    async def generate(self, request: GenerationRequest) -> list[GenerationResult]:
        prefix = f"request {request.request_id!r}: "
        ids = check_request(request, released=self._released)
        rid = request.request_id
        if rid in self._flights:
            raise ValueError(prefix + "a request with this id is already in flight")
        prior = request.resume_from
        budget = request.sampling.max_new_tokens - (len(prior.output_ids) if prior else 0)
        samples = [
            Sample(request_id_base(rid, k), self._body(ids, request, budget, k), prefix)
            for k in range(request.sampling.n)
        ]
        task = asyncio.ensure_future(asyncio.gather(*(self._on_loop()[1].submit(s) for s in samples)))
        self._flights[rid] = _Flight(samples, task, prior)
        try:
            answers = await task
        except asyncio.CancelledError:  # its caller went away: so do its samples on the server
            self._abort_quietly([s.rid for s in samples if "rid" in s.body])
            raise
        finally:
            self._flights.pop(rid, None)
        return [self._result(rid, answer, prior) for answer in answers]

    def _body(self, ids: list[int], request: GenerationRequest, budget: int, k: int) -> dict[str, Any]:
        s = request.sampling
        params: dict[str, Any] = {
            "temperature": s.temperature,
            "top_p": s.top_p,
            "top_k": s.top_k or -1,
            "min_p": s.min_p,
            "max_new_tokens": budget,
        }
        if s.stop_token_ids:
            params["stop_token_ids"] = list(s.stop_token_ids)
        if self.deterministic and s.seed is not None:
            params["sampling_seed"] = int(s.seed) + k  # only deterministic servers take a seed
        body = {"input_ids": ids, "sampling_params": params, "return_logprob": True, "logprob_start_len": -1}
        if self.route_shape is not None:
            body["return_routed_experts"] = True
        return body

    def _result(self, rid: str, answer: dict[str, Any], prior: GenerationResult | None) -> GenerationResult:
        meta = answer.get("meta_info") or {}
        ids = [int(t) for t in answer.get("output_ids") or []]
        logprobs = [float(entry[0]) for entry in meta.get("output_token_logprobs") or []]
        if len(logprobs) != len(ids):
            raise SGLangError(f"request {rid!r}: sglang returned {len(ids)} tokens but {len(logprobs)} log-probs")
        reason = (meta.get("finish_reason") or {}).get("type")
        if reason not in _FINISH:
            raise SGLangError(f"request {rid!r}: unknown finish_reason {meta.get('finish_reason')!r}")
        version = _version(meta.get("weight_version"), self._version)
        routes = self._routes(rid, meta, len(ids))
        result = GenerationResult(rid, ids, logprobs, [version] * len(ids), _FINISH[reason], routes)
        if prior is not None:  # the routes cover this run's whole input: the prompt with the prior tokens in it
            result = GenerationResult(
                rid,
                list(prior.output_ids) + ids,
                list(prior.logprobs) + logprobs,
                list(prior.versions) + result.versions,
                result.finish_reason,
                prior.routed_experts if routes is None else routes,
            )
        return result

    def _routes(self, rid: str, meta: dict[str, Any], new_tokens: int) -> Tensor | None:
        """The routed experts SGLang returned (base64 of int32 ``[tokens, layers, top-k]``, for
        every token it fed the model: the input's and the output's but the last), or None when
        not asked for (or an abort before any token)."""
        if self.route_shape is None:
            return None
        encoded = meta.get("routed_experts")
        expected = int(meta.get("prompt_tokens") or 0) + new_tokens - 1
        if encoded is None:
            if new_tokens == 0:
                return None
            raise SGLangError(f"request {rid!r}: return_routed_experts is on but sglang returned no routed experts")
        flat = torch.frombuffer(bytearray(base64.b64decode(encoded)), dtype=torch.int32)
        layers, topk = self.route_shape
        if flat.numel() != expected * layers * topk:
            raise SGLangError(
                f"request {rid!r}: sglang returned {flat.numel()} routed experts; expected {expected} "
                f"tokens x {layers} layers x {topk}"
            )
        return flat.view(expected, layers, topk).long()

    async def abort(self, request_ids: list[str] | None = None) -> list[GenerationResult]:
        ids = abort_targets(request_ids, self._flights)
        flights = [self._flights[rid] for rid in ids]
        pending = {f.task for f in flights}
        while pending:
            # a request that reaches the server after its abort would run on: abort until it answered
            # (named anew each time: a sample sent again alone has a new id)
            rids = [s.rid for f in flights for s in f.samples if "rid" in s.body and not s.answer.done()]
            await asyncio.gather(*(self._post_async("/abort_request", {"rid": r}) for r in rids))
            _, pending = await asyncio.wait(pending, timeout=_ABORT_RESEND_S)
        results: list[GenerationResult] = []
        for rid, flight in zip(ids, flights):
            if flight.task.cancelled():  # its caller went away
                continue
            if flight.task.exception() is not None:
                raise flight.task.exception()
            results.extend(self._result(rid, answer, flight.prior) for answer in flight.task.result())
        return results

    def _on_loop(self) -> tuple[Any, Dispatcher]:
        """The running event loop's connection pool and dispatcher: a pool is bound to the loop
        that made it, and the dispatcher's batches are flushed by that loop."""
        import httpx

        loop = asyncio.get_running_loop()
        if self._per_loop is None or self._per_loop[0] is not loop:
            client = httpx.AsyncClient(
                base_url=self.url,
                timeout=None,
                trust_env=False,
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=512),
            )
            self._per_loop = (loop, client, Dispatcher(client, self._lost))
        return self._per_loop[1], self._per_loop[2]

    def _abort_quietly(self, rids: list[str]) -> None:
        async def abort() -> None:
            for rid in rids:
                try:
                    await self._post_async("/abort_request", {"rid": rid})
                except Exception:  # noqa: BLE001 - best effort: the server may be gone
                    return

        task = asyncio.ensure_future(abort())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _post_async(self, path: str, body: dict[str, Any]) -> None:
        import httpx

        try:
            response = await self._on_loop()[0].post(path, json=body, timeout=self.control_timeout_s)
        except httpx.HTTPError as exc:
            raise self._lost(f"POST {path} failed ({type(exc).__name__}: {exc})") from None
        if response.status_code != 200:
            raise SGLangError(f"sglang {path}: {response.status_code} {message(response)}")

    # ------------------------------------------------------------------ control
    def control(self, path: str, body: dict[str, Any] | None = None, timeout_s: float | None = None) -> Any:
        """A control call (``POST``); returns the parsed answer (JSON, or the text)."""
        import httpx

        try:
            response = httpx.post(
                self.url + path, json=body or {}, timeout=timeout_s or self.control_timeout_s, trust_env=False
            )
        except httpx.HTTPError as exc:
            raise self._lost(f"POST {path} failed ({type(exc).__name__}: {exc})", _EXIT_WAIT_S) from None
        if response.status_code != 200:
            raise SGLangError(f"sglang {path}: {response.status_code} {message(response)}")
        try:
            return response.json()
        except ValueError:
            return response.text

    def _lost(self, what: str, wait_s: float = 0.0) -> EngineUnavailable:
        """The server did not answer: the engine cannot serve (the run replaces the replica).
        ``wait_s``: how long to wait for its exit code (a refused connection is often a server
        dying); only callers off the event loop wait."""
        code = self.server.exit_code(wait_s=wait_s)
        failure = self.server.failure(f"{what}; the server exited with code {code}" if code is not None else what)
        return EngineUnavailable(str(failure))

    def pause(self) -> None:
        """Hold decoding; the running batch and its cache stay (``in_place``)."""
        self.control("/pause_generation", {"mode": "in_place"})
        self._paused = True

    def resume(self) -> None:
        self.control("/continue_generation", {"torch_empty_cache": False})
        self._paused = False

    def flush_cache(self) -> int:
        """Drop the server's prefix cache; 1 if it did, 0 if it was busy (SGLang flushes only when idle)."""
        import httpx

        response = httpx.post(self.url + "/flush_cache", timeout=self.control_timeout_s, trust_env=False)
        return 1 if response.status_code == 200 else 0

    def weight_receiver(self, transport: str) -> ServerJoinsTheGroup | None:
        """With ``broadcast`` the server joins the trainer's group and takes the weights itself."""
        return ServerJoinsTheGroup(self) if transport == "broadcast" else None

    def update_weights(self, named_tensors) -> int:
        items = list(named_tensors)
        self._check_weights(items)
        version = self._version + 1
        if not items:  # the server took this push's tensors itself (its weight group): the version moves
            self.set_version(version)
            if not (self._paused and self._flights):
                self.flush_cache()
            return version
        served = getattr(torch, self.served_dtype)
        payload, keep = serialize_named_tensors(
            [(n, t if t.dtype == served else t.to(served)) for n, t in items], flat=self.load_format is not None
        )
        answer = self.control(
            "/update_weights_from_tensor",
            {
                "serialized_named_tensors": [payload],
                "weight_version": str(version),
                "load_format": self.load_format,
                # a paused server may hold requests; SGLang flushes only an idle cache
                "flush_cache": not (self._paused and self._flights),
            },
        )
        del keep  # the server has copied the weights in
        if not (isinstance(answer, dict) and answer.get("success")):
            raise SGLangError(f"sglang refused the weight update: {answer!r}; the engine keeps version {self._version}")
        self._version = version
        return version

    def _check_weights(self, items: list[tuple[str, Tensor]]) -> None:
        """Every name, shape and dtype against the checkpoint, before anything is sent."""
        for name, tensor in items:
            if self.expected:
                want = self.expected.get(name)
                if want is None:
                    raise ValueError(f"update_weights: unknown tensor {name!r} for the checkpoint at {self.model_path}")
                if tuple(tensor.shape) != want[0]:
                    raise ValueError(
                        f"update_weights: {name!r} has shape {tuple(tensor.shape)}, the model expects {want[0]}"
                    )
            if str(tensor.dtype).removeprefix("torch.") not in (self.dtype, self.served_dtype):
                raise ValueError(
                    f"update_weights: {name!r} is {str(tensor.dtype).removeprefix('torch.')}, "
                    f"the engine takes {' or '.join(sorted({self.dtype, self.served_dtype}))}"
                )

    def release_memory(self) -> None:
        if self._flights:
            raise RuntimeError(
                f"release_memory: {len(self._flights)} request(s) still waiting or running; "
                "abort them (or let them finish) first"
            )
        self.control("/release_memory_occupation", {"tags": self.release_tags})
        self._released = True

    def resume_memory(self) -> None:
        self.control("/resume_memory_occupation", {"tags": self.release_tags})
        self._released = False

    @property
    def version(self) -> int:
        return self._version

    def set_version(self, version: int) -> None:
        self.control("/update_weight_version", {"new_version": str(int(version)), "abort_all_requests": False})
        self._version = int(version)

    def health(self) -> dict[str, Any]:
        import httpx

        code = self.server.exit_code()
        if code is not None:
            raise EngineUnavailable(str(self.server.failure(f"exited with code {code}")))
        try:
            status = httpx.get(self.url + "/health", timeout=self.control_timeout_s, trust_env=False).status_code
        except httpx.HTTPError as exc:
            raise self._lost(f"GET /health failed ({type(exc).__name__}: {exc})", _EXIT_WAIT_S) from None
        if status != 200:
            raise EngineUnavailable(str(self.server.failure(f"GET /health answered {status}")))
        return {
            "status": "released" if self._released else "paused" if self._paused else "ok",
            "version": self._version,
            "requests_in_flight": len(self._flights),
            "url": self.url,
            "pid": self.server.pid,
            "log": str(self.server.log_path),
            "startup_s": round(self.startup_s, 1),
        }

    def close(self) -> None:
        """End the server (an engine worker that dies ends it too: it is killed with its parent)."""
        self.server.stop()


def serialize_named_tensors(items: list[tuple[str, Tensor]], *, flat: bool = False) -> tuple[str, Any]:
    """``[(name, tensor)]`` as SGLang's ``MultiprocessingSerializer`` writes it (torch's
    ``ForkingPickler``, base64), and what must stay alive until the server has read it.

    The tensors are first packed into one buffer of this process: the server opens one CUDA IPC
    handle (or one shared-memory file) for all of them, and tensors this process opened from
    another one (an ``ipc`` push's views) cannot be shared again. ``flat``: the payload is that
    buffer as one entry named by its layout (:func:`.weight_loader.layout_name`), for
    :func:`.weight_loader.load_flat`; otherwise a view per tensor, for the model's ``load_weights``.
    """
    from multiprocessing.reduction import ForkingPickler

    from torch import multiprocessing as torch_mp  # registers torch's reductions with ForkingPickler

    from loongsage.core.buckets import pack, unpack

    if not items:
        return base64.b64encode(_pickled(ForkingPickler, [])).decode(), None
    device = items[0][1].device
    if device.type == "cpu":
        # a file name in shared memory, which any process can open (a descriptor could not be passed)
        torch_mp.set_sharing_strategy("file_system")
    metas, buffer = pack(items, device=device)
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()  # packed before the server reads it
    entries = [(layout_name(metas), buffer)] if flat else unpack(metas, buffer, copy=False)
    return base64.b64encode(_pickled(ForkingPickler, entries)).decode(), buffer


def _pickled(pickler: Any, obj: Any) -> bytes:
    buffer = io.BytesIO()
    pickler(buffer).dump(obj)
    return buffer.getvalue()


def checkpoint_tensors(model_path: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """``name -> (shape, dtype)`` from the safetensors headers of an HF folder (no tensor is read);
    empty when the folder holds none (SGLang's ``--load-format dummy``)."""
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for path in sorted(Path(model_path).glob("*.safetensors")):
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for name, info in header.items():
            if name != "__metadata__":
                out[name] = (tuple(info["shape"]), info["dtype"])
    return out


def _max_positions(model_path: str) -> int:
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return 1 << 30  # unknown: SGLang's default
    return int(config.get("max_position_embeddings") or 1 << 30)


def _route_shape(model_path: str) -> tuple[int, int]:
    """``(MoE layers, experts per token)`` of the served model, or one line saying it routes none."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    if not (config.get("num_experts") or config.get("num_local_experts")) or not config.get("num_experts_per_tok"):
        raise ValueError(
            f"sglang engine: return_routed_experts=true needs a mixture-of-experts model; {model_path} "
            f"({(config.get('architectures') or ['?'])[0]}) has no experts"
        )
    return int(config["num_hidden_layers"]), int(config["num_experts_per_tok"])


def _version(value: Any, default: int) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default
