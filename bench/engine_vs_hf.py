"""Native engine vs HF ``generate``: batched sampling throughput on the tiny Qwen3, CPU.

Both sides generate the same left-padded batch (default 64 prompts of 16-64 tokens) for exactly
``--new-tokens`` tokens (no stop ids on either side, so nobody stops early), in the same process,
interleaved repeat by repeat so that load from other processes hits both alike. The engine runs
twice: the synchronous ``generate_batch`` and the async path the framework uses (one ``generate``
per prompt, gathered). Reported: median tokens/s of each and the ratio of medians to HF.

    uv run python bench/engine_vs_hf.py [--batch 64] [--new-tokens 128] [--repeats 3] [--threads 1]
                                        [--device cpu] [--dtype float32] [--out PATH]

Writes ``bench/results/engine_vs_hf.json`` (or ``--out``) and prints a markdown table. Before timing it checks
that greedy decoding of the batch gives the same tokens on both sides.

Mixed workload (``--mixed-requests``, default 256; 0 skips it), where continuous batching matters:
requests with ``max_new_tokens`` drawn from 4..128 arrive in ``--waves`` waves; a wave arrives once
half of the previous wave has finished. Sides: the engine (async ``generate``, continuous batching),
HF ``generate`` over static batches (one per wave, run to its longest request; only requested tokens
count) and transformers' continuous batching (``init_continuous_batching`` manager, all requests
added by wave the same way) when the installed transformers has it. Reported: useful tokens/s.
Also writes ``engine_vs_hf.md`` next to the JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from loongsage.core.engine.native import NativeEngine
from loongsage.core.tinytask.tiny_model import build_tiny_qwen3
from loongsage.core.types import GenerationRequest, SamplingParams

RESULTS = Path(__file__).resolve().parent / "results" / "engine_vs_hf.json"

SCENARIOS = {
    "T=1.0": {"temperature": 1.0, "top_p": 1.0, "top_k": 0},
    "T=0.8, top-p 0.95, top-k 50": {"temperature": 0.8, "top_p": 0.95, "top_k": 50},
}


def make_prompts(batch: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(16, 65))] for _ in range(batch)]


def left_pad(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
    return ids, mask


def run_hf(model, ids, mask, new_tokens: int, sampling: dict, pad: int) -> tuple[float, int]:
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            do_sample=True,
            eos_token_id=None,
            pad_token_id=pad,
            **sampling,
        )
        out = out.cpu()  # waits for the device; the engine's results are host lists already
    return time.perf_counter() - start, (out.shape[1] - ids.shape[1]) * out.shape[0]


def requests(prompts, new_tokens: int, sampling: dict, tag: str) -> list[GenerationRequest]:
    return [
        GenerationRequest(f"{tag}{i}", p, SamplingParams(max_new_tokens=new_tokens, **sampling))
        for i, p in enumerate(prompts)
    ]


def run_engine_sync(engine, prompts, new_tokens: int, sampling: dict) -> tuple[float, int]:
    start = time.perf_counter()
    results = engine.generate_batch(requests(prompts, new_tokens, sampling, "s"))
    return time.perf_counter() - start, sum(len(r[0].output_ids) for r in results)


def run_engine_async(engine, prompts, new_tokens: int, sampling: dict) -> tuple[float, int]:
    async def main():
        return await asyncio.gather(*(engine.generate(r) for r in requests(prompts, new_tokens, sampling, "a")))

    start = time.perf_counter()
    results = asyncio.run(main())
    return time.perf_counter() - start, sum(len(r[0].output_ids) for r in results)


def greedy_agrees(model, engine, prompts, pad: int, new_tokens: int = 32) -> bool:
    ids, mask = (t.to(model.device) for t in left_pad(prompts, pad))
    with torch.inference_mode():
        hf = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=pad,
        )[:, ids.shape[1] :].tolist()
    ours = engine.generate_batch(requests(prompts, new_tokens, {"temperature": 0.0}, "g"))
    return all(r[0].output_ids == h for r, h in zip(ours, hf))


def mixed_workload(count: int, waves: int, vocab: int, seed: int = 1) -> list[list[tuple[list[int], int]]]:
    rng = random.Random(seed)
    items = [
        ([rng.randrange(3, vocab) for _ in range(rng.randrange(16, 65))], rng.randrange(4, 129)) for _ in range(count)
    ]
    size = -(-count // waves)
    return [items[k : k + size] for k in range(0, count, size)]


def mixed_engine(engine, waves, sampling: dict) -> tuple[float, int]:
    async def main():
        tasks = []
        for w, wave in enumerate(waves):
            if tasks:  # the next wave arrives once half of the previous one finished
                prev = tasks[-len(waves[w - 1]) :]
                while sum(t.done() for t in prev) < len(prev) // 2:
                    await asyncio.sleep(0.001)
            tasks += [
                asyncio.create_task(
                    engine.generate(GenerationRequest(f"m{w}_{i}", p, SamplingParams(max_new_tokens=k, **sampling)))
                )
                for i, (p, k) in enumerate(wave)
            ]
        return await asyncio.gather(*tasks)

    start = time.perf_counter()
    results = asyncio.run(main())
    return time.perf_counter() - start, sum(len(r[0].output_ids) for r in results)


def mixed_hf_static(model, waves, sampling: dict, pad: int) -> tuple[float, int]:
    start, useful = time.perf_counter(), 0
    for wave in waves:  # a static batch cannot take the next wave before it drained
        ids, mask = (t.to(model.device) for t in left_pad([p for p, _ in wave], pad))
        run_hf(model, ids, mask, max(k for _, k in wave), sampling, pad)
        useful += sum(k for _, k in wave)
    return time.perf_counter() - start, useful


def mixed_hf_continuous(model, waves, sampling: dict) -> tuple[float, int]:
    from transformers import GenerationConfig

    cfg = GenerationConfig(do_sample=True, eos_token_id=None, max_new_tokens=128, **sampling)
    manager = model.init_continuous_batching(generation_config=cfg)
    manager.start()
    try:
        start, useful, done = time.perf_counter(), 0, 0
        for w, wave in enumerate(waves):
            if w:
                target = sum(len(x) for x in waves[: w - 1]) + len(waves[w - 1]) // 2
                while done < target:
                    if (out := manager.get_result(timeout=60)) is None:
                        raise RuntimeError("transformers continuous batching: no result within 60 s")
                    done, useful = done + 1, useful + len(out.generated_tokens)
            for i, (p, k) in enumerate(wave):
                manager.add_request(p, request_id=f"c{w}_{i}", max_new_tokens=k)
        total = sum(map(len, waves))
        while done < total:
            if (out := manager.get_result(timeout=60)) is None:
                raise RuntimeError("transformers continuous batching: no result within 60 s")
            done, useful = done + 1, useful + len(out.generated_tokens)
        return time.perf_counter() - start, useful
    finally:
        manager.stop(block=True)


def run_mixed(model, engine, args, pad: int) -> dict:
    waves = mixed_workload(args.mixed_requests, args.waves, model.config.vocab_size)
    expected = sum(k for wave in waves for _, k in wave)
    sampling = SCENARIOS["T=1.0"]
    sides = {
        "hf_generate_static_batches": lambda: mixed_hf_static(model, waves, sampling, pad),
        "hf_continuous_batching": lambda: mixed_hf_continuous(model, waves, sampling),
        "engine_async_generate": lambda: mixed_engine(engine, waves, sampling),
    }
    times: dict[str, list[float]] = {}
    errors: dict[str, str] = {}
    warm = [waves[0][:8]]
    warmups = {
        "hf_generate_static_batches": lambda: mixed_hf_static(model, warm, sampling, pad),
        "hf_continuous_batching": lambda: mixed_hf_continuous(model, warm, sampling),
        "engine_async_generate": lambda: mixed_engine(engine, warm, sampling),
    }
    for side in sides:  # warm-up on a few requests; a side that cannot run is reported, not timed
        try:
            warmups[side]()
            times[side] = []
        except Exception as exc:  # noqa: BLE001 - e.g. no CB support for this model/device
            errors[side] = f"{type(exc).__name__}: {exc}"[:300]
    for _ in range(args.repeats):
        for side in times:
            seconds, tokens = sides[side]()
            if tokens != expected:
                raise RuntimeError(f"mixed {side} produced {tokens} tokens, expected {expected}")
            times[side].append(seconds)
    tps = {side: expected / statistics.median(t) for side, t in times.items()}
    return {
        "requests": args.mixed_requests,
        "waves": args.waves,
        "max_new_tokens": "4-128",
        "prompt_tokens": "16-64",
        "useful_tokens": expected,
        "sampling": sampling,
        "seconds": times,
        "tokens_per_s_median": tps,
        "unavailable": errors,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads for both sides")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--mixed-requests", type=int, default=256, help="mixed workload size (0: skip)")
    ap.add_argument("--waves", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        model, tokenizer = build_tiny_qwen3(tmp)
        model = model.to(device=args.device, dtype=getattr(torch, args.dtype)).eval()
        pad = tokenizer.pad_token_id
        engine = NativeEngine(
            tmp,
            max_batch_size=args.batch,
            max_model_len=64 + max(args.new_tokens, 128) + 1,
            eos_token_ids=[],
            device=args.device,
            dtype=args.dtype,
        )
        prompts = make_prompts(args.batch, model.config.vocab_size)
        ids, mask = (t.to(args.device) for t in left_pad(prompts, pad))
        agree = greedy_agrees(model, engine, prompts, pad, new_tokens=min(32, args.new_tokens))

        rows, raw = [], {}
        for name, sampling in SCENARIOS.items():
            sides = {
                "hf_generate": lambda s=sampling: run_hf(model, ids, mask, args.new_tokens, s, pad),
                "engine_generate_batch": lambda s=sampling: run_engine_sync(engine, prompts, args.new_tokens, s),
                "engine_async_generate": lambda s=sampling: run_engine_async(engine, prompts, args.new_tokens, s),
            }
            for run in sides.values():  # warm-up, not timed
                run()
            times: dict[str, list[float]] = {side: [] for side in sides}
            for _ in range(args.repeats):
                for side, run in sides.items():
                    seconds, tokens = run()
                    if tokens != args.batch * args.new_tokens:
                        raise RuntimeError(f"{side} produced {tokens} tokens, expected {args.batch * args.new_tokens}")
                    times[side].append(seconds)
            tps = {side: args.batch * args.new_tokens / statistics.median(t) for side, t in times.items()}
            raw[name] = {"sampling": sampling, "seconds": times, "tokens_per_s_median": tps}
            for side in sides:
                rows.append((name, side, tps[side], tps[side] / tps["hf_generate"]))
        mixed = run_mixed(model, engine, args, pad) if args.mixed_requests else None

    meta = {
        "batch": args.batch,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "threads": args.threads,
        "device": args.device,
        "dtype": args.dtype,
        "prompt_tokens": "16-64",
        "model": "tiny Qwen3 (build_tiny_qwen3 defaults)",
        "greedy_tokens_agree": agree,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "meta": meta,
                "scenarios": raw,
                "mixed": mixed,
                "table": [{"sampling": r[0], "side": r[1], "tokens_per_s": r[2], "ratio_vs_hf": r[3]} for r in rows],
            },
            indent=2,
        )
    )
    lines = [
        f"batch {args.batch} x {args.new_tokens} new tokens, {args.repeats} repeats (median), {args.device} "
        f"{args.dtype}, {args.threads} thread(s); greedy tokens agree with HF: {agree}",
        "",
        "| sampling | side | tokens/s | vs HF generate |",
        "|---|---|---:|---:|",
    ]
    lines += [f"| {name} | {side} | {value:,.0f} | {ratio:.2f}x |" for name, side, value, ratio in rows]
    if mixed is not None:
        tps = mixed["tokens_per_s_median"]
        base = tps.get("hf_generate_static_batches")
        lines += [
            "",
            f"Mixed workload: {mixed['requests']} requests, prompts 16-64 tokens, max_new_tokens 4-128, "
            f"{mixed['waves']} waves (each arrives when half of the previous finished), T=1.0; "
            f"{mixed['useful_tokens']} requested tokens.",
            "",
            "| side | useful tokens/s | vs HF static batches |",
            "|---|---:|---:|",
        ]
        lines += [
            f"| {side} | {v:,.0f} | {v / base:.2f}x |" if base else f"| {side} | {v:,.0f} | - |"
            for side, v in tps.items()
        ]
        lines += [f"| {side} | unavailable: {err} | - |" for side, err in mixed["unavailable"].items()]
    text = "\n".join(lines) + "\n"
    args.out.with_suffix(".md").write_text(text)
    print(text)
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
