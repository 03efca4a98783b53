"""A stand-in for an SGLang 0.5.16 server, for the contract tests of the ``sglang`` engine on CPU.

It speaks the subset of SGLang's HTTP API that the engine uses, with SGLang's request and answer
shapes and its sharp edges, written from SGLang's server source (docs/sglang.md):

* the same command-line flags as ``python -m sglang.launch_server`` for what the engine passes
  (an unknown flag exits with code 2, as argparse does there);
* ``/health`` answers 503 until start-up is over (``--startup-delay``), then 200;
* ``/generate`` with ``input_ids``: unknown sampling keys are a 500 (msgspec's ``TypeError``), a
  prompt plus budget over ``--context-length`` a 400; one token every ``--token-delay`` seconds;
  ``output_ids`` include a matched stop token; ``meta_info`` carries ``finish_reason``
  (``stop``/``length``/``abort``), ``output_token_logprobs`` as ``[logprob, id, null]`` and the
  ``weight_version``; a request arriving while paused waits;
* a batch (lists of ``input_ids``, ``rid`` and ``sampling_params``) streamed: requests checked and
  started in turn, a bad one ending the stream with an error chunk and aborting the batch; a chunk
  with the request's ``index`` after its first token (a ``stream_interval`` past its budget) and
  one, cumulative, when it finishes;
* ``/abort_request`` for an id the server holds ends every live request whose id **starts with**
  it (SGLang's scheduler matches prefixes), each answering with the tokens it has; an abort for an
  id not seen yet is dropped;
* ``/health`` generates a token unless ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0``: then it
  kills a released server, answers 503 after ``--health-timeout`` when paused, and takes 1 s;
* ``/pause_generation`` (in place) and ``/continue_generation``;
* ``/flush_cache`` is plain text: 200 when idle, 400 otherwise;
* ``/update_weights_from_tensor`` unpickles with an allowlist (torch, builtins, collections,
  multiprocessing), waits for running requests unless paused, loads through the model's
  ``load_weights`` or a ``--custom-weight-loader`` named by ``load_format``, and, as SGLang's
  asserts do, **kills the server** when asked to flush a busy cache, given a tensor the model does
  not have, or when the loader raises;
* ``/release_memory_occupation`` kills the server unless idle; ``/update_weight_version``;
* with ``--enable-return-routed-experts``, a request asking ``return_routed_experts`` gets
  ``meta_info["routed_experts"]``: base64 of int32 ``[tokens, layers, top-k]`` for every token fed
  to the model (its input's and its output's but the last), as SGLang's capturer encodes them.

The "model" is a deterministic rule, not a network: the next token is
``(7 * last + k + s) % vocab`` with ``s`` derived from the weights' sum, so that a weight update
shows in the outputs; its log-prob is ``-0.5 - 0.001 * k``; token ``t``'s experts at layer ``l``
are ``(3 * t + l + j) % experts`` for ``j`` in ``0..top-k-1`` (:func:`routes_of`). ``GET /_contract/state`` shows the
server's weight checksum and counters to the tests.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import datetime
import importlib
import io
import json
import os
import pickle
import sys
import time
from pathlib import Path

import torch.multiprocessing  # noqa: F401 - torch's reductions, which the pickled tensors name
import uvicorn
from safetensors.torch import load_file
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

SAMPLING_KEYS = {
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "max_new_tokens",
    "stop_token_ids",
    "ignore_eos",
    "no_stop_trim",
    "n",
    "sampling_seed",
    "min_new_tokens",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "skip_special_tokens",
    "logit_bias",
    "custom_params",
    "stream_interval",
}
ALLOWED_MODULES = (
    "builtins",
    "collections",
    "torch",
    "multiprocessing.reduction",
    "multiprocessing.resource_sharer",
    "copyreg",
    "_codecs",
)


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--skip-tokenizer-init", action="store_true")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--random-seed", type=int)
    ap.add_argument("--weight-version", default="default")
    ap.add_argument("--enable-fp32-lm-head", action="store_true")
    ap.add_argument("--mem-fraction-static", type=float)
    ap.add_argument("--context-length", type=int, default=512)
    ap.add_argument("--max-running-requests", type=int)
    ap.add_argument("--max-total-tokens", type=int)
    ap.add_argument("--disable-cuda-graph", action="store_true")
    ap.add_argument("--enable-deterministic-inference", action="store_true")
    ap.add_argument("--enable-memory-saver", action="store_true")
    ap.add_argument("--enable-weights-cpu-backup", action="store_true")
    ap.add_argument("--custom-weight-loader", nargs="*")
    ap.add_argument("--sampling-backend", choices=("flashinfer", "pytorch", "ascend"))
    ap.add_argument("--cuda-graph-backend-prefill", choices=("full", "breakable", "tc_piecewise", "disabled"))
    ap.add_argument("--enable-return-routed-experts", action="store_true")
    ap.add_argument("--health-timeout", type=float, default=20.0)  # SGLANG_HEALTH_CHECK_TIMEOUT
    ap.add_argument("--record", default="")  # a JSON line per weight call, for tests that cannot reach the server
    # of the stand-in only
    ap.add_argument("--token-delay", type=float, default=0.002)
    ap.add_argument("--startup-delay", type=float, default=0.3)
    # a crash in the middle of a rollout: after this many /generate requests the server dies, once
    # (the file marks that a server of the run died; the replacement then lives)
    ap.add_argument("--die-after", type=int, default=0)
    ap.add_argument("--die-once-file", default="")
    return ap.parse_args(argv)


class SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if not any(module == m or module.startswith(m + ".") for m in ALLOWED_MODULES):
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed")
        return super().find_class(module, name)


def crash(reason: str) -> None:
    """What SGLang's scheduler does on a failed assert: the whole server goes."""
    print(f"Scheduler hit an exception: {reason}", flush=True)
    os._exit(1)


# SGLang's merged parameters of the Llama family (its models' stacked_params_mapping)
STACKED = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)


class Model:
    """The served model as far as weights go: the checkpoint held in SGLang's parameters (q/k/v and
    gate/up rows merged), loaded by ``load_weights`` as SGLang's Llama-family models load them. A
    server makes it a class named after the checkpoint's architecture, as SGLang's model is."""

    def __init__(self, model_path: str, vocab: int, eos: list[int], dtype: str):
        if dtype == "float32":  # SGLang's fused kernels take none: its first forward fails
            crash("rmsnorm: failed to dispatch data type Float")
        served = None if dtype == "auto" else getattr(torch, dtype)
        checkpoint = {
            n: t.to(served or t.dtype)
            for path in sorted(Path(model_path).glob("*.safetensors"))
            for n, t in load_file(str(path)).items()
        }
        self.params: dict[str, torch.Tensor] = {}
        self.shards: dict[tuple[str, object], tuple[int, int]] = {}  # (merged name, shard) -> (first row, rows)
        for name, tensor in checkpoint.items():
            merged = _merged(name)
            if merged is None:
                self.params[name] = tensor
            elif merged[0] not in self.params:  # the first part seen: all parts, in SGLang's order
                target = merged[0]
                parts = [
                    (shard, checkpoint[target.replace(f".{param}.", f".{part}.")])
                    for param, part, shard in STACKED
                    if f".{param}." in target
                ]
                self.params[target] = torch.cat([t for _, t in parts])
                start = 0
                for shard, t in parts:
                    self.shards[(target, shard)] = (start, t.shape[0])
                    start += t.shape[0]
        self.vocab, self.eos = vocab, set(eos)

    def named_parameters(self):
        return iter(self.params.items())

    def load_weights(self, named_tensors) -> None:
        for name, tensor in named_tensors:
            merged = _merged(name)
            if merged is not None:
                target, shard = merged
                if (target, shard) not in self.shards:
                    crash(f"load_weights: KeyError {target!r}")
                start, rows = self.shards[(target, shard)]
                dest = self.params[target].narrow(0, start, rows)
            else:
                dest = self.params.get(name)
            if dest is None or tuple(dest.shape) != tuple(tensor.shape):
                crash(f"load_weights: {name} {tuple(tensor.shape)}")
            dest.copy_(tensor)

    @property
    def shift(self) -> int:
        return int(abs(self.checksum()) * 1000) % 97

    def checksum(self) -> float:
        return float(sum(t.double().sum() for t in self.params.values()))

    def next_token(self, last: int, k: int) -> int:
        return (7 * last + k + self.shift) % self.vocab


def routes_of(tokens: list[int], layers: int, topk: int, experts: int) -> list[list[list[int]]]:
    """The stand-in's routing: each token's experts per layer, ``[tokens, layers, topk]``."""
    return [[[(3 * t + layer + j) % experts for j in range(topk)] for layer in range(layers)] for t in tokens]


def _merged(name: str) -> tuple[str, object] | None:
    """``(merged parameter, shard)`` for a checkpoint tensor that is part of one."""
    for param, part, shard in STACKED:
        if f".{part}." in name:
            return name.replace(f".{part}.", f".{param}."), shard
    return None


class Server:
    def __init__(self, args: argparse.Namespace):
        config = json.loads((Path(args.model_path) / "config.json").read_text())
        eos = config.get("eos_token_id")
        model_class = type(str(config.get("architectures", ["Model"])[0]), (Model,), {})
        self.model = model_class(
            args.model_path, int(config["vocab_size"]), eos if isinstance(eos, list) else [eos], args.dtype
        )
        self.args = args
        experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
        self.moe = (
            (int(config["num_hidden_layers"]), int(config.get("num_experts_per_tok") or 0), experts)
            if experts
            else None
        )
        self.version = args.weight_version
        self.started = time.monotonic()
        self.running: dict[str, dict] = {}  # rid -> {"abort": bool}
        self.waiting = 0  # requests held by a pause
        self.resumed = asyncio.Event()
        self.resumed.set()
        self.idle = asyncio.Event()  # no request running
        self.idle.set()
        self.released = False
        self.counters = {
            "generate": 0,
            "posts": 0,
            "aborted": 0,
            "flushes": 0,
            "updates": 0,
            "abort_calls": 0,
            "distributed_updates": 0,
            "custom_loads": 0,
        }
        self.groups: dict[str, object] = {}  # weight groups joined, by name

    # ---------------------------------------------------------------- endpoints
    async def health(self, request: Request) -> Response:
        if time.monotonic() - self.started < self.args.startup_delay:
            return Response(status_code=503)
        if os.environ.get("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "1").lower() in ("0", "false"):
            return Response(status_code=200)
        # SGLang's default: the check generates one token and looks again a second later
        if self.released:
            crash("write_cache_indices: Pointer argument cannot be accessed from Triton (cpu tensor?)")
        if not self.resumed.is_set():  # a paused scheduler answers nothing: 503 after the timeout
            await asyncio.sleep(self.args.health_timeout)
            return Response(status_code=503)
        await asyncio.sleep(1.0)
        return Response(status_code=200)

    async def model_info(self, request: Request) -> Response:
        return JSONResponse({"model_path": self.args.model_path, "weight_version": self.version, "is_generation": True})

    async def generate(self, request: Request) -> Response:
        body = await request.json()
        self.counters["posts"] += 1
        ids = body.get("input_ids")
        if not ids:
            return JSONResponse({"error": {"message": "input_ids cannot be empty."}}, status_code=400)
        if not isinstance(ids[0], list):  # one request
            params = dict(body.get("sampling_params") or {})
            problem = self.refusal(ids, params)
            if problem is not None:
                return problem
            rid = body.get("rid") or os.urandom(8).hex()
            return JSONResponse(await self.sample(rid, ids, params, self.asked(body)))
        # a batch: lists of prompts, ids and sampling params; the engine streams them
        rids, params = body.get("rid"), body.get("sampling_params")
        if not (isinstance(rids, list) and len(rids) == len(ids) and len(set(rids)) == len(rids)):
            return JSONResponse(
                {"error": {"message": "The rid should be a list of unique ids, one per request."}}, status_code=400
            )
        params = params if isinstance(params, list) else [dict(params or {}) for _ in ids]
        if not body.get("stream"):
            return JSONResponse({"error": {"message": "the stand-in serves batches streamed"}}, status_code=400)
        return StreamingResponse(self.stream(rids, ids, params, self.asked(body)), media_type="text/event-stream")

    def asked(self, body: dict) -> dict:
        """What a request asks to be returned beside the tokens (routes only from a server started
        to capture them, over an MoE model)."""
        return {
            "logprob": bool(body.get("return_logprob")),
            "routes": bool(body.get("return_routed_experts"))
            and self.args.enable_return_routed_experts
            and self.moe is not None,
        }

    def refusal(self, ids: list[int], params: dict) -> Response | None:
        unknown = set(params) - SAMPLING_KEYS
        if unknown:  # msgspec raises TypeError, which nothing catches
            return PlainTextResponse("Internal Server Error", status_code=500)
        if len(ids) + int(params.get("max_new_tokens", 128)) > self.args.context_length:
            message = (
                f"Requested token count exceeds the model's maximum context length of "
                f"{self.args.context_length} tokens."
            )
            return JSONResponse({"error": {"message": message}}, status_code=400)
        return None

    async def stream(self, rids: list[str], ids: list[list[int]], params: list[dict], logprob: dict):
        """SGLang's batched stream: the requests are checked and started in turn (a bad one ends the
        stream with an error chunk, and the batch is aborted); each sends a chunk after its first
        token when its ``stream_interval`` says so, and one when it finishes, with its ``index``."""
        chunks: asyncio.Queue = asyncio.Queue()
        tasks = []
        for index, (rid, prompt, p) in enumerate(zip(rids, ids, params)):
            problem = self.refusal(prompt, p)
            if problem is not None:
                message = json.loads(problem.body).get("error", {}).get("message", "refused")
                yield b"data: " + json.dumps({"error": {"message": message, "code": 400}}).encode() + b"\n\n"
                yield b"data: [DONE]\n\n"
                for started in rids[:index]:  # SGLang's background abort of the batch
                    if started in self.running:
                        self.running[started]["abort"] = True
                await asyncio.gather(*tasks, return_exceptions=True)
                return

            def first(partial: dict, index=index) -> None:
                chunks.put_nowait({**partial, "index": index})

            tasks.append(asyncio.ensure_future(self.sample(rid, prompt, p, logprob, first)))
            tasks[-1].add_done_callback(lambda t, index=index: chunks.put_nowait({**t.result(), "index": index}))
        finished = 0
        while finished < len(tasks):
            chunk = await chunks.get()
            finished += chunk["meta_info"]["finish_reason"] is not None
            yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"

    async def sample(self, rid: str, ids: list[int], params: dict, logprob: dict, first=None) -> dict:
        budget = int(params.get("max_new_tokens", 128))
        stops = set(self.model.eos) | set(params.get("stop_token_ids") or [])
        self.counters["generate"] += 1
        if self.args.die_after and self.counters["generate"] == self.args.die_after:
            marker = Path(self.args.die_once_file)
            if not marker.exists():
                marker.write_text(str(os.getpid()))
                asyncio.get_running_loop().call_later(0.05, os._exit, 1)  # with requests in flight
        if not self.resumed.is_set():  # paused: a new request waits
            self.waiting += 1
            await self.resumed.wait()
            self.waiting -= 1
        state = {"abort": False}
        self.running[rid] = state
        self.idle.clear()
        out, logprobs, reason = [], [], {"type": "length", "length": budget}
        try:
            last = ids[-1]
            for k in range(budget):
                await asyncio.sleep(self.args.token_delay)
                await self.resumed.wait()
                if state["abort"]:
                    reason = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
                    self.counters["aborted"] += 1
                    break
                last = self.model.next_token(last, k)
                out.append(last)
                logprobs.append([-0.5 - 0.001 * k, last, None])
                if last in stops:
                    reason = {"type": "stop", "matched": last}
                    break
                if first is not None and k == 0 and budget > 1:
                    first(self.answer(rid, ids, out, logprobs, None, logprob))
        finally:
            del self.running[rid]
            if not self.running:
                self.idle.set()
        return self.answer(rid, ids, out, logprobs, reason, logprob)

    def answer(
        self, rid: str, ids: list[int], out: list[int], logprobs: list, reason: dict | None, asked: dict
    ) -> dict:
        meta = {
            "id": rid,
            "finish_reason": reason,
            "prompt_tokens": len(ids),
            "weight_version": self.version,
            "completion_tokens": len(out),
            "cached_tokens": 0,
        }
        if asked["logprob"]:
            meta["output_token_logprobs"] = list(logprobs)
        if asked["routes"] and out:
            routes = torch.tensor(routes_of((list(ids) + list(out))[:-1], *self.moe), dtype=torch.int32)
            meta["routed_experts"] = base64.b64encode(routes.numpy().tobytes()).decode()
        return {"output_ids": list(out), "meta_info": meta}

    async def abort_request(self, request: Request) -> Response:
        body = await request.json()
        self.counters["abort_calls"] += 1
        named = body.get("rid") or ""
        if not body.get("abort_all") and named not in self.running:
            return Response(status_code=200)  # the front end drops an id it does not hold
        for rid, state in self.running.items():
            # SGLang's scheduler aborts every request whose id starts with the one named
            if body.get("abort_all") or rid.startswith(named):
                state["abort"] = True
        return Response(status_code=200)

    async def pause_generation(self, request: Request) -> Response:
        mode = (await request.json()).get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            return JSONResponse({"error": {"message": f"bad mode {mode}"}}, status_code=400)
        if mode == "abort":
            for state in self.running.values():
                state["abort"] = True
        self.resumed.clear()
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: Request) -> Response:
        self.resumed.set()
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    async def flush_cache(self, request: Request) -> Response:
        if self.running or self.waiting:
            return PlainTextResponse("Flush cache failed.\n", status_code=400)
        self.counters["flushes"] += 1
        return PlainTextResponse("Cache flushed.\n")

    async def update_weights_from_tensor(self, request: Request) -> Response:
        body = await request.json()
        if self.resumed.is_set():
            await self.idle.wait()  # the writer lock: running generations finish first
        try:
            raw = base64.b64decode(body["serialized_named_tensors"][0], validate=True)
        except (KeyError, IndexError, ValueError) as exc:
            return JSONResponse({"error": {"message": f"bad serialized_named_tensors: {exc}"}}, status_code=400)
        try:
            named = SafeUnpickler(io.BytesIO(raw)).load()
        except Exception as exc:  # noqa: BLE001 - deserialized in the TP worker, outside any try
            crash(f"deserialize: {exc}")
        load_format = body.get("load_format")
        if load_format is None:
            self.model.load_weights(named)
        elif load_format in (self.args.custom_weight_loader or []):  # "module.function", given the model
            module, _, function = load_format.rpartition(".")
            try:
                getattr(importlib.import_module(module), function)(self.model, named)
                self.counters["custom_loads"] += 1
            except Exception as exc:  # noqa: BLE001 - raised in the TP worker, outside any try
                crash(f"{load_format}: {type(exc).__name__}: {exc}")
        else:
            crash(f"NotImplementedError: Unknown load_format={load_format}")
        if body.get("flush_cache", True):
            if self.running or self.waiting:
                crash("assert flush_cache_success")
            self.counters["flushes"] += 1
        if body.get("weight_version") is not None:
            self.version = body["weight_version"]
        self.counters["updates"] += 1
        self.record("update_weights_from_tensor")
        return JSONResponse({"success": True, "message": "Success"})

    async def init_weights_update_group(self, request: Request) -> Response:
        """SGLang's ``init_custom_process_group``: a tcp rendezvous at the master's store, the store
        prefixed with the group's name, torch's group helper (blocks until every rank joined)."""
        body = await request.json()

        def join():
            from torch.distributed.distributed_c10d import (
                Backend,
                PrefixStore,
                _new_process_group_helper,
                _world,
                rendezvous,
            )

            timeout = datetime.timedelta(seconds=60)
            store, rank, world = next(
                rendezvous(
                    f"tcp://{body['master_address']}:{body['master_port']}",
                    int(body["rank_offset"]),
                    int(body["world_size"]),
                    timeout=timeout,
                )
            )
            store.set_timeout(timeout)
            name = body.get("group_name", "weight_update_group")
            group, _ = _new_process_group_helper(
                world,
                rank,
                [],
                Backend(body.get("backend", "nccl")),
                PrefixStore(name, store),
                group_name=name,
                backend_options=None,
                timeout=timeout,
            )
            _world.pg_group_ranks[group] = {i: i for i in range(world)}
            self.groups[name] = group

        try:
            await asyncio.to_thread(join)
        except Exception as exc:  # noqa: BLE001 - SGLang answers the failure
            return JSONResponse({"success": False, "message": f"Failed to initialize custom process group: {exc}."})
        return JSONResponse({"success": True, "message": "Succeeded to initialize custom process group."})

    async def update_weights_from_distributed(self, request: Request) -> Response:
        """A flattened bucket from rank 0 of the group: dense, the tensors back to back."""
        body = await request.json()
        group = self.groups.get(body.get("group_name", "weight_update_group"))
        if group is None:  # SGLang asserts it: the scheduler dies
            crash("assert group_name in self._model_update_group")
        if body.get("load_format") != "flattened_bucket":
            return JSONResponse({"error": {"message": "the stand-in takes flattened buckets"}}, status_code=400)
        if self.resumed.is_set():
            await self.idle.wait()  # the writer lock
        specs = [
            (n, getattr(torch, d), tuple(shape)) for n, d, shape in zip(body["names"], body["dtypes"], body["shapes"])
        ]
        sizes = [torch.Size(shape).numel() * torch.empty(0, dtype=d).element_size() for _, d, shape in specs]
        flat = torch.empty(sum(sizes), dtype=torch.uint8)
        await asyncio.to_thread(torch.distributed.broadcast, flat, 0, group)
        offset, received, named = 0, 0.0, []
        for (name, dtype, shape), size in zip(specs, sizes):
            tensor = flat[offset : offset + size].view(dtype).reshape(shape)
            received += float(tensor.double().sum())
            named.append((name, tensor))
            offset += size
        self.model.load_weights(named)
        if body.get("flush_cache", True) and (self.running or self.waiting):
            crash("assert flush_cache_success")
        if body.get("weight_version") is not None:
            self.version = body["weight_version"]
        self.counters["distributed_updates"] += 1
        self.record("update_weights_from_distributed", names=[n for n, _, _ in specs], received=received)
        return JSONResponse({"success": True, "message": "Succeeded to update parameter online."})

    async def release_memory(self, request: Request) -> Response:
        if self.running or self.waiting:
            crash("assert is_fully_idle()")
        self.released = True
        return JSONResponse(None)

    async def resume_memory(self, request: Request) -> Response:
        self.released = False
        return JSONResponse(None)

    async def update_weight_version(self, request: Request) -> Response:
        body = await request.json()
        self.version = body["new_version"]
        self.record("update_weight_version")
        return JSONResponse(
            {"success": True, "message": f"Weight version updated to {self.version}", "new_version": self.version}
        )

    def record(self, call: str, **details) -> None:
        if self.args.record:
            with open(self.args.record, "a") as f:
                f.write(
                    json.dumps({"call": call, "version": self.version, "checksum": self.model.checksum(), **details})
                    + "\n"
                )

    async def state(self, request: Request) -> Response:
        sizing = {k: getattr(self.args, k) for k in ("context_length", "max_running_requests", "max_total_tokens")}
        return JSONResponse(
            {
                "checksum": self.model.checksum(),
                "version": self.version,
                "released": self.released,
                "sizing": sizing,
                "running": len(self.running),
                "paused": not self.resumed.is_set(),
                **self.counters,
            }
        )

    def app(self) -> Starlette:
        post = ["POST"]
        return Starlette(
            routes=[
                Route("/health", self.health),
                Route("/model_info", self.model_info),
                Route("/generate", self.generate, methods=["POST", "PUT"]),
                Route("/abort_request", self.abort_request, methods=post),
                Route("/pause_generation", self.pause_generation, methods=post),
                Route("/continue_generation", self.continue_generation, methods=post),
                Route("/flush_cache", self.flush_cache, methods=["GET", "POST"]),
                Route("/update_weights_from_tensor", self.update_weights_from_tensor, methods=post),
                Route("/release_memory_occupation", self.release_memory, methods=["GET", "POST"]),
                Route("/resume_memory_occupation", self.resume_memory, methods=["GET", "POST"]),
                Route("/update_weight_version", self.update_weight_version, methods=post),
                Route("/init_weights_update_group", self.init_weights_update_group, methods=post),
                Route("/update_weights_from_distributed", self.update_weights_from_distributed, methods=post),
                Route("/_contract/state", self.state),
            ]
        )


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    server = Server(args)
    uvicorn.run(server.app(), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main(sys.argv[1:])
