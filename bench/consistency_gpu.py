"""Engine vs trainer log-probs of the same sampled tokens on one CUDA GPU (bf16, FP32 LM head).

A Qwen3-shaped model (hidden 1024, 8 layers, random bf16 weights) samples ``--batch`` prompts of
``--prompt`` tokens for ``--new-tokens`` tokens each; the torch trainer then scores the same tokens.
The figure of merit is the k3 KL between the two log-probs (what ``train/is_approx_k3_kl`` reports
in a run) against the goal of 1e-5, for:

* the engine's fast path (batched bf16 decode on its fused kernels) against the trainer's batched
  forward, and the same with the engine's torch decode path (``kernels="torch"``);
* the engine's deterministic mode against a trainer that runs one sequence per micro-batch (the
  setting in which both are the same computation, so the KL is exactly 0);
* the batch-invariant mode: engine and trainer both with ``batch_invariant`` (the same kernels, each
  token computed the same way whatever the batch: exactly 0 without a second forward);
* the engine's decode GEMMs on FP8 weights (``quantization="fp8"``) against the bf16 trainer, and
  the bf16 engine against the trainer's decoder GEMMs in FP8 (``fp8: hybrid``, FP8 training);
* for scale, the fast path with a bf16 LM head in the engine (what the FP32 head is there to avoid);
* the fast path against the trainer with its layers compiled (``compile_layers``, as the GPU
  recipes run it), and compiled with Inductor's default rounding (what ``compile_layers`` was);
* the fast path with cuBLAS's bf16 split-K reductions off on both sides (``fp32_reductions``);
* the fast path with only its decode attention replaced by the torch decode path's
  (``scaled_dot_product_attention`` over each row's columns, the query heads of a kv head as its
  rows), every other fused kernel kept: what the fused attention kernel alone adds to k3;
* the batch-invariant mode with the decoder layers' GEMMs on cuBLAS on both sides (attention,
  norms, rotary, SwiGLU and the head still batch-invariant): what the GEMMs alone add to k3.

With ``--sglang``, also the ``sglang`` engine (:class:`loongsage.sglang.engine.SGLangEngine`, one
SGLang server at a time) under the server settings of :data:`SGLANG_SETTINGS` (the default six of
:data:`SGLANG_DEFAULT`): the same model folder (its end-of-sequence token dropped, so every sample
runs to its budget), prompts and sampling, its log-probs scored by the same trainer path as the fast
path (goal for SGLang: k3 <= 1e-4), and its throughput: sampled tokens per second of one
``generate`` of the whole workload, the median of 3 after one warm-up of the same shape (other
prompts), the prefix cache flushed before each. A setting whose server does not start (or fails) is
recorded with its error; the next one starts after the server has ended and its memory is back.

    python bench/consistency_gpu.py [--out PATH] [--sglang] [--sides NAME ...] [--merge]
        [--time-budget-s S] [--model qwen3_1024|qwen3_1p7b]

Each native side also records the engine's sampled tokens/s and the trainer's scoring forward in
seconds, each the median of 3 timed runs after a warm-up one: what a mode costs.

``--sides`` picks what runs: native sides (``fast``, ``fast_torch_kernels``, ``deterministic``,
``batch_invariant``, ``fp8_engine``, ``fp8_trainer``, ``engine_bf16_head``, ``fast_compiled_trainer``,
``fast_compiled_trainer_inductor_rounding``, ``fast_fp32_reductions``, ``fast_torch_attention``,
``batch_invariant_cublas_gemms``), SGLang
settings as ``sglang:<name>``, or the groups ``native``, ``sglang`` (the default six) and ``sglang:all``.
``--merge`` keeps what ``--out`` already holds for the sides not run now (to fill one file over
several calls).
``--time-budget-s`` starts no SGLang server once less than a start-up's worth of the budget is left,
and bounds each server's start-up to what is left. The JSON (and a markdown table beside it) is
rewritten after every side, so a run cut short keeps what it measured.

Writes ``bench/results/consistency_gpu.json`` and ``.md`` (or ``--out``);
``tests/gpu/test_consistency_gpu.py`` asserts the bounds that hold today with the same
:func:`measure` and :func:`measure_sglang`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results" / "consistency_gpu.json"
GOAL_K3 = 1e-5
REPEATS = 3  # timed runs of each native side's generate and scoring forward (their medians)
SGLANG_GOAL_K3 = 1e-4
MODELS = {
    "qwen3_1024": {"hidden": 1024, "layers": 8, "vocab": 32000},
    # Qwen3-1.7B's shape (sglang_overhead's model; intermediate 3 x hidden, 16 heads of 128, 8 KV heads)
    "qwen3_1p7b": {"hidden": 2048, "layers": 28, "vocab": 151936},
}
MODEL = MODELS["qwen3_1024"]
NATIVE_SIDES: dict[str, dict[str, Any]] = {
    "fast": {},
    "fast_torch_kernels": {"kernels": "torch"},
    "deterministic": {"deterministic": True},
    # engine and trainer on the fused kernels' batch-invariant path (fixed-tile GEMMs, attention in
    # one program a token, fixed vocabulary chunks): bit for bit, no second forward
    "batch_invariant": {"batch_invariant": True},
    # the engine's decode GEMMs on FP8 weights against the bf16 trainer: what FP8 rollouts cost in k3
    "fp8_engine": {"quantization": "fp8"},
    # the bf16 engine against the trainer with its decoder GEMMs in FP8 (fp8: hybrid, rowwise
    # scales): what FP8 training costs in k3 (its forward is what the loss's ratio reads)
    "fp8_trainer": {"trainer_fp8": "hybrid"},
    "engine_bf16_head": {"engine_fp32_head": False},
    # the fast path against the trainer as the GPU recipes run it (each decoder layer compiled,
    # rounding where eager rounds: trainer/compiling.py), and compiled with Inductor's default
    # rounding, which leaves out the roundings of the eager ops that the engine's kernels reproduce
    "fast_compiled_trainer": {"trainer_compile": True},
    "fast_compiled_trainer_inductor_rounding": {"trainer_compile": True, "inductor_rounding": True},
    # the fast path with cuBLAS kept from reducing split-K partial sums in bf16 on either side
    # (torch's allow_bf16_reduced_precision_reduction, on by default): its GEMMs then round once
    "fast_fp32_reductions": {"fp32_reductions": True},
    # the fused decode step with the torch decode path's attention: the fused attention's share of k3
    "fast_torch_attention": {"torch_attention": True},
    # the batch-invariant mode with its decoder GEMMs on cuBLAS, on both sides: the GEMMs' share of k3
    "batch_invariant_cublas_gemms": {"batch_invariant": True, "cublas_gemms": True},
}
# SGLang settings: SGLangEngine params over the bench's own (FP32 head, torch sampling, CUDA
# graphs, no memory release, the workload's sizing), as SGLang 0.5.16 spells its options
SGLANG_SETTINGS: dict[str, dict[str, Any]] = {
    # the engine as a run starts it today; SGLang picks the attention backend (fa3 on an H200)
    "default": {},
    "bf16_head": {"fp32_lm_head": False},
    # --enable-deterministic-inference: batch-invariant mm/addmm/bmm/log_softmax/mean (DeepGEMM or
    # Triton), fixed attention splits (fa3 by default on Hopper), seeded Gumbel sampling
    "deterministic": {"deterministic": True},
    # --rl-on-policy-target fsdp (deterministic too): HF-style norms with float32 weights, a float32
    # residual stream and embedding, rotary and SiLU in torch; with each deterministic attention backend
    "on_policy_fa3": {"rl_on_policy_target": "fsdp", "attention_backend": "fa3"},
    "on_policy_flashinfer": {"rl_on_policy_target": "fsdp", "attention_backend": "flashinfer"},
    "on_policy_triton": {"rl_on_policy_target": "fsdp", "attention_backend": "triton"},
    # not run by default (--sides sglang:<name>, or sglang:all)
    "deterministic_flashinfer": {"deterministic": True, "attention_backend": "flashinfer"},
    "deterministic_triton": {"deterministic": True, "attention_backend": "triton"},
    "flashinfer": {"attention_backend": "flashinfer"},
    "triton": {"attention_backend": "triton"},
    # torch's scaled_dot_product_attention per request, as the trainer's HF attention (SGLang then
    # turns its CUDA graphs off; not a deterministic backend)
    "torch_native_attention": {"attention_backend": "torch_native"},
    "no_cuda_graphs": {"cuda_graphs": False},
}
SGLANG_DEFAULT = ("default", "bf16_head", "deterministic", "on_policy_fa3", "on_policy_flashinfer", "on_policy_triton")
# what a setting's server resolved its options to (GET /server_info), recorded beside the figures
RESOLVED_KEYS = (
    "attention_backend",
    "prefill_attention_backend",
    "decode_attention_backend",
    "sampling_backend",
    "enable_deterministic_inference",
    "rl_on_policy_target",
    "enable_fp32_lm_head",
    "disable_radix_cache",
    "disable_cuda_graph",
    "version",
)
STARTUP_RESERVE_S = 90.0  # with --time-budget-s: no server starts with less than this left


def build_model(path: str, *, hidden: int = 1024, layers: int = 8, vocab: int = 32000) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=hidden // 16,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(path)


def workload_prompts(batch: int, prompt_len: int, seed: int = 1) -> list[list[int]]:
    """The workload's prompts: ``seed`` 1 is what every side samples from (others: warm-ups)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 32000, (prompt_len,), generator=g).tolist() for _ in range(batch)]


def measure(
    path: str,
    batch: int = 32,
    prompt_len: int = 64,
    new_tokens: int = 64,
    *,
    fp32_reductions: bool = False,
    torch_attention: bool = False,
    cublas_gemms: bool = False,
    **options: Any,
) -> dict[str, float]:
    """k3 KL and |delta log-prob| between the engine's and the trainer's log-probs of the same tokens,
    and what each side's pass took, the median of :data:`REPEATS` timed runs: the engine's generate
    (after one warm-up generate of the same shape on other prompts; the prefix cache flushed before
    each) in sampled tokens/s, and the trainer's scoring forward (after a warm-up one) in seconds.

    ``options`` are :func:`_measure`'s keywords. ``engine_fp32_head=False`` gives the engine a bf16
    LM head against the trainer's FP32 one: the size of the error a broken head would cause, to size
    the tests' bounds against.
    ``batch_invariant`` runs both sides on the batch-invariant path. ``trainer_compile``: the
    trainer's layers compiled (``compile_layers``); ``inductor_rounding``: compiled with Inductor's
    default rounding instead of the eager ops' (``emulate_precision_casts`` off). ``trainer_fp8``:
    the trainer's decoder GEMMs in FP8 (its ``fp8``), against the bf16 engine.
    ``fp32_reductions``: both sides with ``allow_bf16_reduced_precision_reduction`` off.
    ``torch_attention``: the engine's fused decode step with the torch decode path's attention.
    ``cublas_gemms``: the batch-invariant path's decoder GEMMs by cuBLAS (:func:`cublas_layer_gemms`).
    """
    if cublas_gemms and not (options.get("batch_invariant") and options.get("engine_fp32_head", True)):
        raise ValueError(
            "cublas_gemms: replaces the batch-invariant path's layer GEMMs; needs batch_invariant=True "
            "and the engine's FP32 head (which it keeps invariant)"
        )
    matmul = torch.backends.cuda.matmul
    reduced = matmul.allow_bf16_reduced_precision_reduction
    matmul.allow_bf16_reduced_precision_reduction = reduced and not fp32_reductions
    try:
        with contextlib.ExitStack() as patches:
            if torch_attention:
                patches.enter_context(torch_decode_attention())
            if cublas_gemms:
                patches.enter_context(cublas_layer_gemms())
            return _measure(path, batch, prompt_len, new_tokens, **options)
    finally:
        matmul.allow_bf16_reduced_precision_reduction = reduced


@contextlib.contextmanager
def torch_decode_attention() -> Iterator[None]:
    """The fused decoder's decode attention replaced by the torch decode path's
    (:func:`~loongsage.core.engine.kv_cache.grouped_decode_attention`) over the step's columns under
    each row's key mask. Prefill and the batch-invariant path keep the kernel."""
    from loongsage.core.engine.fused import decoder
    from loongsage.core.engine.kv_cache import grouped_decode_attention

    fused = decoder.decode_attention

    def sdpa(q, k_cache, v_cache, lengths, scale, columns, *, cache_rows=None, splits=None, shared=None):
        if cache_rows is not None or splits == 1 or shared is not None:
            return fused(
                q, k_cache, v_cache, lengths, scale, columns, cache_rows=cache_rows, splits=splits, shared=shared
            )
        rows = q.shape[0]
        keep = torch.arange(columns, device=q.device)[None, :] < lengths[:, None]
        keys, values = k_cache[:rows, :, :columns], v_cache[:rows, :, :columns]
        return grouped_decode_attention(q, keys, values, keep[:, None, None, :], scale)

    decoder.decode_attention = sdpa
    try:
        yield
    finally:
        decoder.decode_attention = fused


@contextlib.contextmanager
def cublas_layer_gemms() -> Iterator[None]:
    """The batch-invariant path's decoder-layer GEMMs (merged or not, engine and trainer) by
    cuBLAS (``F.linear``), its attention, norms, rotary, SwiGLU and FP32 head kept: the decoder
    runs each layer's projections through these two names (no gradient is taken here); the
    trainer's head imports its GEMM where it runs, so it stays invariant."""
    import torch.nn.functional as F

    from loongsage.core.engine.fused import decoder

    kept = decoder.invariant_linear, decoder.invariant_linears

    def linear(x, weight, bias=None, out_dtype=None):
        if out_dtype is not None:  # the engine's FP32 head (measure() refuses a bf16 one here)
            return kept[0](x, weight, bias, out_dtype)
        return F.linear(x, weight, bias)

    def linears(x, weights, biases):
        return torch.cat([F.linear(x, w, b) for w, b in zip(weights, biases)], -1)

    decoder.invariant_linear, decoder.invariant_linears = linear, linears
    try:
        yield
    finally:
        decoder.invariant_linear, decoder.invariant_linears = kept


def _measure(
    path: str,
    batch: int,
    prompt_len: int,
    new_tokens: int,
    *,
    deterministic: bool = False,
    engine_fp32_head: bool = True,
    kernels: str = "auto",
    batch_invariant: bool = False,
    quantization: str | None = None,
    trainer_compile: bool = False,
    inductor_rounding: bool = False,
    trainer_fp8: str | None = None,
) -> dict[str, float]:
    import time

    import torch._dynamo

    from loongsage.core.engine.native import NativeEngine
    from loongsage.core.trainer import compiling
    from loongsage.core.trainer.torch_trainer import TorchTrainer
    from loongsage.core.types import GenerationRequest, SamplingParams, TrainBatch

    engine = NativeEngine(
        path,
        dtype="bfloat16",
        device="cuda",
        fp32_lm_head=engine_fp32_head,
        eos_token_ids=[],
        max_model_len=prompt_len + new_tokens + 8,
        deterministic=deterministic,
        kernels=kernels,
        batch_invariant=batch_invariant,
        quantization=quantization,
    )

    def requests_of(prompts: list[list[int]], tag: str) -> list:
        sampling = [SamplingParams(temperature=1.0, max_new_tokens=new_tokens, seed=i) for i in range(len(prompts))]
        return [GenerationRequest(f"{tag}{i}", p, s) for i, (p, s) in enumerate(zip(prompts, sampling))]

    engine.generate_batch(requests_of(workload_prompts(batch, prompt_len, seed=2), "warm"))
    prompts = workload_prompts(batch, prompt_len)
    engine_runs, results = [], None
    for repeat in range(REPEATS):  # the same requests (their seeds too): the first run's tokens are scored
        engine.flush_cache()  # every run prefills its prompts anew
        torch.cuda.synchronize()
        start = time.perf_counter()
        answers = [r[0] for r in engine.generate_batch(requests_of(prompts, f"r{repeat}-"))]
        engine_runs.append(time.perf_counter() - start)
        results = results or answers
    del engine
    torch.cuda.empty_cache()

    torch._dynamo.reset()  # a graph compiled for another side is not reused
    rounding = compiling.EAGER_ROUNDING
    if inductor_rounding:  # read when the layers are handed to torch.compile, in the constructor
        compiling.EAGER_ROUNDING = {"emulate_precision_casts": False}
    try:
        trainer = TorchTrainer(
            path,
            dtype="bfloat16",
            device="cuda",
            fp32_lm_head=True,
            batch_invariant=batch_invariant,
            compile_layers=trainer_compile,
            fp8=trainer_fp8,
        )
    finally:
        compiling.EAGER_ROUNDING = rounding
    T = prompt_len + new_tokens
    ids = torch.tensor([p + r.output_ids for p, r in zip(prompts, results)])
    mask = torch.zeros(batch, T)
    mask[:, prompt_len:] = 1
    tb = TrainBatch(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        response_mask=mask,
        rollout_logprobs=torch.zeros(batch, T),
        advantages=torch.zeros(batch, T),
        rewards=torch.zeros(batch),
        group_ids=torch.arange(batch),
    )
    budget = 1 if deterministic else batch * T
    trainer.logprobs(tb, token_budget=budget)  # warm (and compiled)
    trainer_runs = []
    for _ in range(REPEATS):
        torch.cuda.synchronize()
        start = time.perf_counter()
        trainer_lp, _ = trainer.logprobs(tb, token_budget=budget)
        torch.cuda.synchronize()
        trainer_runs.append(time.perf_counter() - start)
    engine_lp = torch.tensor([r.logprobs for r in results])
    delta = (trainer_lp[:, prompt_len:] - engine_lp).double()
    k3 = (torch.exp(delta) - delta - 1).mean().item()
    return {
        "k3_kl": k3,
        "max_abs_logprob_diff": delta.abs().max().item(),
        "mean_abs_logprob_diff": delta.abs().mean().item(),
        "tokens": float(delta.numel()),
        "engine_tok_s": delta.numel() / statistics.median(engine_runs),
        "engine_tok_s_runs": [delta.numel() / t for t in engine_runs],
        "trainer_forward_s": statistics.median(trainer_runs),
        "trainer_forward_s_runs": trainer_runs,
    }


# ----------------------------------------------------------------------------- SGLang
def served_copy(path: str, into: Path) -> str:
    """The model folder as SGLang serves it here: the same weights (linked), no end-of-sequence
    token, so every sample runs to its budget as on the native sides (which pass no EOS)."""
    into.mkdir(parents=True, exist_ok=True)
    for item in Path(path).iterdir():
        target = into / item.name
        if item.name in ("config.json", "generation_config.json"):
            data = json.loads(item.read_text())
            data["eos_token_id"] = None
            target.write_text(json.dumps(data))
        elif not target.exists():
            target.symlink_to(item.resolve())
    return str(into)


def score(trainer: Any, prompts: list[list[int]], results: list[Any]) -> dict[str, float]:
    """k3 KL and |delta| between the log-probs of ``results`` (their sampled tokens) and the
    trainer's, on the fast path's trainer call (one micro-batch of the whole workload). Samples of
    unequal length (a stop the workload should not have) are right-padded and masked."""
    from loongsage.core.types import TrainBatch

    n, p = len(prompts), len(prompts[0])
    lengths = [len(r.output_ids) for r in results]
    T = p + max(lengths)
    ids = torch.zeros(n, T, dtype=torch.long)
    attention = torch.zeros(n, T, dtype=torch.long)
    mask = torch.zeros(n, T)
    engine_lp = torch.zeros(n, T)
    for i, (prompt, r) in enumerate(zip(prompts, results)):
        end = p + len(r.output_ids)
        ids[i, :end] = torch.tensor(prompt + list(r.output_ids))
        attention[i, :end] = 1
        mask[i, p:end] = 1
        engine_lp[i, p:end] = torch.tensor(r.logprobs, dtype=torch.float32)
    tb = TrainBatch(
        input_ids=ids,
        attention_mask=attention,
        response_mask=mask,
        rollout_logprobs=torch.zeros(n, T),
        advantages=torch.zeros(n, T),
        rewards=torch.zeros(n),
        group_ids=torch.arange(n),
    )
    trainer_lp, _ = trainer.logprobs(tb, token_budget=n * T)
    delta = (trainer_lp - engine_lp).double()[mask.bool()]
    figures = {
        "k3_kl": (torch.exp(delta) - delta - 1).mean().item(),
        "max_abs_logprob_diff": delta.abs().max().item(),
        "mean_abs_logprob_diff": delta.abs().mean().item(),
        "tokens": float(delta.numel()),
    }
    if len(set(lengths)) > 1:
        figures["ragged"] = float(min(lengths))  # the shortest sample: a stop that should not happen
    return figures


def _generate(engine: Any, loop: asyncio.AbstractEventLoop, prompts: list[list[int]], new_tokens: int, tag: str):
    """One generate of the whole workload, as a run sends it (a request per prompt, all at once:
    the engine batches them); returns (seconds, results)."""
    from loongsage.core.types import GenerationRequest, SamplingParams

    requests = [
        GenerationRequest(
            f"{tag}-{i}", p, SamplingParams(temperature=1.0, max_new_tokens=new_tokens, seed=i, stop_token_ids=[])
        )
        for i, p in enumerate(prompts)
    ]

    async def run():
        return await asyncio.gather(*(engine.generate(r) for r in requests))

    start = time.perf_counter()
    answers = loop.run_until_complete(run())
    return time.perf_counter() - start, [a[0] for a in answers]


def _resolved(url: str) -> dict[str, Any]:
    """The options the server resolved (``GET /server_info``), best effort."""
    import httpx

    try:
        info = httpx.get(url + "/server_info", timeout=60, trust_env=False).json()
    except Exception as exc:  # noqa: BLE001 - a record, not a check
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {k: info[k] for k in RESOLVED_KEYS if k in info}


def _wait_for_memory(free_before: int, timeout_s: float = 60.0) -> float:
    """Wait until the card's free memory is back to within 1 GiB of ``free_before`` (an ended
    server's processes give theirs back a moment after they exit); returns the seconds waited."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        free, _ = torch.cuda.mem_get_info()
        if free >= free_before - (1 << 30):
            break
        time.sleep(0.5)
    return time.monotonic() - start


def _close_loop(loop: asyncio.AbstractEventLoop, timeout_s: float = 10.0) -> None:
    """End the loop a setting's generates ran on. A streamed batch's task reads its stream to the
    end after the last sample was answered: let those finish (then cancel what is left) before the
    loop's async generators are closed."""
    try:
        pending = asyncio.all_tasks(loop)
        if pending:
            loop.run_until_complete(asyncio.wait(pending, timeout=timeout_s))
        left = asyncio.all_tasks(loop)
        for task in left:
            task.cancel()
        if left:
            loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
    finally:
        loop.close()


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def measure_sglang(
    path: str,
    settings: list[str] | tuple[str, ...] = SGLANG_DEFAULT,
    batch: int = 32,
    prompt_len: int = 64,
    new_tokens: int = 64,
    *,
    repeats: int = 3,
    deadline: float | None = None,
    startup_timeout_s: float = 600.0,
) -> dict[str, dict[str, Any]]:
    """Each SGLang setting's figures (or its error), by name: see :func:`sglang_sides`."""
    return dict(
        sglang_sides(
            path,
            settings,
            batch,
            prompt_len,
            new_tokens,
            repeats=repeats,
            deadline=deadline,
            startup_timeout_s=startup_timeout_s,
        )
    )


def sglang_sides(
    path: str,
    settings: list[str] | tuple[str, ...],
    batch: int,
    prompt_len: int,
    new_tokens: int,
    *,
    repeats: int = 3,
    deadline: float | None = None,
    startup_timeout_s: float = 600.0,
) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(name, figures)`` per setting, as each finishes: one server at a time, ended (and its
    memory back) before the next starts. ``deadline`` (``time.monotonic()``): no server starts
    with less than :data:`STARTUP_RESERVE_S` left, and start-up may take at most what is left."""
    unknown = [s for s in settings if s not in SGLANG_SETTINGS]
    if unknown:
        raise ValueError(f"unknown SGLang setting(s) {unknown}; known: {', '.join(SGLANG_SETTINGS)}")
    if importlib.util.find_spec("sglang") is None or importlib.util.find_spec("loongsage.sglang") is None:
        for name in settings:
            yield name, {"params": SGLANG_SETTINGS[name], "error": "sglang (or loongsage-sglang) is not installed"}
        return
    from loongsage.core.trainer.torch_trainer import TorchTrainer
    from loongsage.sglang.engine import SGLangEngine
    from loongsage.sglang.server import SGLANG_LAUNCH

    prompts = workload_prompts(batch, prompt_len)
    warm_prompts = workload_prompts(batch, prompt_len, seed=2)  # the same shape, other prompts
    trainer = TorchTrainer(path, dtype="bfloat16", device="cuda", fp32_lm_head=True)
    with tempfile.TemporaryDirectory(prefix="consistency-sglang-") as tmp:
        served = served_copy(path, Path(tmp) / "served")
        for name in settings:
            params = SGLANG_SETTINGS[name]
            row: dict[str, Any] = {"params": params}
            timeout = float(startup_timeout_s)
            if deadline is not None:
                left = deadline - time.monotonic()
                if left < STARTUP_RESERVE_S:
                    yield name, {**row, "error": f"skipped: {max(left, 0):.0f} s of the time budget left"}
                    continue
                timeout = min(timeout, left - 30.0)
            torch.cuda.empty_cache()
            free_before, _ = torch.cuda.mem_get_info()
            started = time.perf_counter()
            engine = None
            loop = asyncio.new_event_loop()
            try:
                engine = SGLangEngine(
                    served,
                    **{
                        "dtype": "bfloat16",
                        "fp32_lm_head": True,
                        "seed": 0,
                        "max_model_len": prompt_len + new_tokens + 8,
                        "max_batch_size": batch,
                        "release_tags": [],
                        "startup_timeout_s": timeout,
                        **params,
                    },
                )
                row["server_flags"] = engine.server.command[len(SGLANG_LAUNCH) :]
                row["startup_s"] = engine.startup_s
                row["resolved"] = _resolved(engine.url)
                _generate(engine, loop, warm_prompts, new_tokens, f"{name}-warm")
                runs, scored = [], None
                for repeat in range(repeats):
                    engine.flush_cache()  # every repeat prefills its prompts anew
                    seconds, results = _generate(engine, loop, prompts, new_tokens, f"{name}-{repeat}")
                    runs.append(sum(len(r.output_ids) for r in results) / seconds)
                    scored = scored or results
                row["tok_s"] = statistics.median(runs)
                row["tok_s_runs"] = runs
                row.update(score(trainer, prompts, scored))
                row["meets_goal"] = row["k3_kl"] <= GOAL_K3
                row["meets_sglang_goal"] = row["k3_kl"] <= SGLANG_GOAL_K3
            except Exception as exc:  # noqa: BLE001 - one setting's failure is that setting's result
                row["error"] = _error(exc)
            finally:
                _close_loop(loop)  # while the server still answers: its last streams end as they should
                if engine is not None:
                    engine.close()
                torch.cuda.empty_cache()
                row["memory_wait_s"] = _wait_for_memory(free_before)
                row["seconds"] = time.perf_counter() - started
            yield name, row
    del trainer
    torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- the run
def select(sides: list[str] | None, sglang: bool) -> tuple[list[str], list[str]]:
    """(native sides, SGLang settings) to run: ``--sides`` if given, else every native side and,
    with ``--sglang``, the default SGLang settings."""
    if not sides:
        return list(NATIVE_SIDES), list(SGLANG_DEFAULT) if sglang else []
    native: list[str] = []
    settings: list[str] = []
    for side in sides:
        if side == "native":
            native += list(NATIVE_SIDES)
        elif side == "sglang":
            settings += list(SGLANG_DEFAULT)
        elif side == "sglang:all":
            settings += list(SGLANG_SETTINGS)
        elif side.startswith("sglang:") and side[len("sglang:") :] in SGLANG_SETTINGS:
            settings.append(side[len("sglang:") :])
        elif side in NATIVE_SIDES:
            native.append(side)
        else:
            raise SystemExit(
                f"--sides {side!r}: one of {', '.join(NATIVE_SIDES)}, "
                f"{', '.join('sglang:' + s for s in SGLANG_SETTINGS)}, native, sglang, sglang:all"
            )
    return list(dict.fromkeys(native)), list(dict.fromkeys(settings))


def _relative_speeds(section: dict[str, Any]) -> None:
    base = section["settings"].get("default", {}).get("tok_s")
    for row in section["settings"].values():
        if "tok_s" in row:
            row["vs_default_tok_s"] = row["tok_s"] / base if base else None


def _gist(error: str) -> str:
    """An error in one table cell: its first line and, for a server's, the last line of its log."""
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()] or ["?"]
    text = lines[0][:160] + (f" ... {lines[-1][:200]}" if len(lines) > 1 else "")
    return text.replace("|", "/")


def _measured_at(row: dict[str, Any], figures: dict[str, Any]) -> str:
    """The commit a row was measured at (a merged file holds rows of several); rows written before
    rows recorded theirs are older than every commit the file was merged at."""
    if row.get("commit"):
        return f"`{str(row['commit'])[:10]}`"
    earlier = [m.get("commit") for m in figures.get("merged_from", []) if isinstance(m, dict)]
    if not earlier:  # never merged: every row is of the file's own run
        return f"`{str(figures.get('source', {}).get('commit', '?'))[:10]}`"
    return f"`{str(earlier[-1])[:10]}` or earlier"


def markdown(figures: dict[str, Any]) -> str:
    source = figures.get("source", {})
    lines = [
        f"commit `{str(source.get('commit', '?'))[:10]}`; {figures.get('device', '?')}; {figures.get('model', '?')}; "
        f"{figures.get('workload', '?')}",
        "",
    ]
    native = [n for n in NATIVE_SIDES if n in figures]
    if native:
        lines += [
            "| path | k3 KL | mean abs diff | max abs diff | goal 1e-5 | engine tok/s | trainer forward s | commit |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name in native:
            f = figures[name]
            tok_s, fwd = f.get("engine_tok_s"), f.get("trainer_forward_s")
            lines.append(
                f"| {name} | {f['k3_kl']:.2e} | {f['mean_abs_logprob_diff']:.2e} | {f['max_abs_logprob_diff']:.2e} | "
                f"{'met' if f['meets_goal'] else 'not met'} | {f'{tok_s:,.0f}' if tok_s else '-'} | "
                f"{f'{fwd:.3f}' if fwd else '-'} | {_measured_at(f, figures)} |"
            )
        lines.append("")
    section = figures.get("sglang")
    if section and section.get("settings"):
        lines += [
            f"SGLang {section.get('version', '?')} through the `sglang` engine: {section.get('throughput', '')}",
            "",
            "| setting | k3 | mean abs diff | tok/s | vs default tok/s | max abs diff | k3 <= 1e-4 | attention | "
            "start-up s | commit |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name, row in section["settings"].items():
            if "error" in row:
                error = _gist(str(row["error"]))
                lines.append(f"| {name} | error: {error} | | | | | | | | {_measured_at(row, figures)} |")
                continue
            vs = row.get("vs_default_tok_s")
            resolved = row.get("resolved", {})
            lines.append(
                f"| {name} | {row['k3_kl']:.2e} | {row['mean_abs_logprob_diff']:.2e} | {row['tok_s']:.0f} | "
                f"{f'{vs:.2f}x' if vs else '-'} | {row['max_abs_logprob_diff']:.2e} | "
                f"{'met' if row['meets_sglang_goal'] else 'not met'} | {resolved.get('attention_backend', '?')} | "
                f"{row['startup_s']:.0f} | {_measured_at(row, figures)} |"
            )
    return "\n".join(lines) + "\n"


def write(out: Path, figures: dict[str, Any]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(figures, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(figures))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="the JSON (the .md beside it); default bench/results")
    parser.add_argument("--model", choices=list(MODELS), default="qwen3_1024")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--sglang", action="store_true", help="also the sglang engine's default settings")
    parser.add_argument("--sides", nargs="+", default=None, metavar="SIDE", help="what runs (see the docstring)")
    parser.add_argument("--merge", action="store_true", help="keep what --out holds for the sides not run now")
    parser.add_argument("--repeats", type=int, default=3, help="timed SGLang generates per setting (median)")
    parser.add_argument("--time-budget-s", type=float, default=0.0, help="0: none")
    parser.add_argument("--startup-timeout-s", type=float, default=600.0, help="one SGLang server's start-up")
    args = parser.parse_args()
    deadline = time.monotonic() + args.time_budget_s if args.time_budget_s > 0 else None
    from _source import source_state

    source = source_state()  # the commit measured, first
    native, settings = select(args.sides, args.sglang)
    out = args.out or (
        RESULTS if args.model == "qwen3_1024" else RESULTS.with_name(f"consistency_gpu.{args.model}.json")
    )
    figures: dict[str, Any] = {}
    if args.merge and out.is_file():
        figures = json.loads(out.read_text())
        if figures.get("device") != torch.cuda.get_device_name():
            sys.exit(
                f"--merge: {out} holds figures of the {figures.get('device')}, this card is the "
                f"{torch.cuda.get_device_name()}: write this card's to another --out"
            )
        if figures.get("source") != source:
            figures["merged_from"] = [*figures.get("merged_from", []), figures.get("source")]
    shape = MODELS[args.model]
    figures.update(
        {
            "source": source,
            "device": torch.cuda.get_device_name(),
            "model": f"Qwen3-shaped, hidden {shape['hidden']}, {shape['layers']} layers, random bf16",
            "workload": f"{args.batch} prompts x {args.prompt} tokens, {args.new_tokens} sampled tokens each, "
            "FP32 LM head",
            "goal_k3_kl": GOAL_K3,
        }
    )
    size = (args.batch, args.prompt, args.new_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        build_model(f"{tmp}/m", **shape)
        for name in native:
            f = measure(f"{tmp}/m", *size, **NATIVE_SIDES[name])
            figures[name] = {**f, "meets_goal": f["k3_kl"] <= GOAL_K3, "commit": source["commit"]}
            write(out, figures)
            print(f"{name}: k3 {f['k3_kl']:.2e}", flush=True)
        if settings:
            try:
                version = importlib.metadata.version("sglang")
            except importlib.metadata.PackageNotFoundError:
                version = None
            section = figures.get("sglang") if args.merge else None
            section = {
                "version": version,
                "goal_k3_kl": SGLANG_GOAL_K3,
                "throughput": f"sampled tokens/s of one generate of the workload, median of {args.repeats} after "
                "one warm-up generate of the same shape (other prompts), prefix cache flushed before each",
                "settings": dict((section or {}).get("settings", {})),
            }
            figures["sglang"] = section
            for name, row in sglang_sides(
                f"{tmp}/m",
                settings,
                *size,
                repeats=args.repeats,
                deadline=deadline,
                startup_timeout_s=args.startup_timeout_s,
            ):
                section["settings"][name] = {**row, "commit": source["commit"]}
                _relative_speeds(section)
                write(out, figures)
                print(
                    f"sglang {name}: "
                    + (
                        f"error {_gist(str(row['error']))}"
                        if "error" in row
                        else f"k3 {row['k3_kl']:.2e}, {row['tok_s']:.0f} tok/s, start-up {row['startup_s']:.0f} s"
                    ),
                    flush=True,
                )
    write(out, figures)
    print(markdown(figures))


if __name__ == "__main__":
    main()
