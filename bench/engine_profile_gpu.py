"""Where the native engine's decode step spends its time on one CUDA GPU (Qwen3-1.7B shape, bf16).

For each ``--batches`` size it runs the ``engine_gpu`` workload (prompt + exactly ``--new-tokens``
sampled tokens) and splits a decode step into

* the captured decode step (forward, sampling and bookkeeping: replays of the widest graph, timed
  with CUDA events), and
* the rest (the host's read-backs between bursts of steps, prefill): the wall time per step minus that;

then profiles one eager run and lists the kernels by total GPU time, with the number of kernel
launches per decode step. Writes ``--out`` (JSON), a markdown table beside it and, per batch, a
Chrome trace of the graphed run (``engine_profile_gpu.b<batch>.trace.json.gz``).

    python bench/engine_profile_gpu.py [--batches 64 256] [--batch-invariant] [--samples-per-prompt 8]
        [--out bench/results/engine_profile_gpu.json]
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import statistics
import tempfile
from pathlib import Path

import torch
from _source import source_state
from engine_gpu import build, engine_settings, engine_side

RESULTS = Path(__file__).resolve().parent / "results" / "engine_profile_gpu.json"


def replay_ms(engine, batch: int, columns: int, repeats: int = 50) -> float:
    """Median milliseconds of one replay of the decode-step graph covering ``batch`` rows x ``columns``
    (after the run every row is finished: a replay writes only throw-away columns)."""
    graphs = engine._batch.graphs
    key = ("_decode_step", *graphs.bucket(batch, columns, engine._batch.cap))
    graph, _ = graphs._graphs[key]
    return statistics.median(replay_times(graph, repeats))


def replay_times(graph: torch.cuda.CUDAGraph, repeats: int) -> list[float]:
    """Milliseconds of each of ``repeats`` replays of ``graph``, timed with CUDA events."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def kernel_table(prof, steps: int, top: int = 25) -> tuple[list[dict], int]:
    rows, launches = [], 0
    for e in prof.key_averages():
        gpu_us = getattr(e, "device_time_total", 0.0)
        if e.device_type != torch.autograd.DeviceType.CUDA or gpu_us <= 0:
            continue
        launches += e.count
        rows.append({"kernel": e.key[:110], "calls": e.count, "gpu_ms_per_step": gpu_us / 1e3 / steps})
    rows.sort(key=lambda r: -r["gpu_ms_per_step"])
    return rows[:top], launches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--profile-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-invariant", action="store_true", help="the engine's batch-invariant mode")
    parser.add_argument("--samples-per-prompt", dest="samples", type=int, default=1, help="n of each request")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    source = source_state()
    from loongsage.core.engine.native import NativeEngine

    tmp = Path(tempfile.mkdtemp(prefix="qwen3-1.7b-random-"))
    build(tmp)
    torch.cuda.empty_cache()
    longest = max(args.batches)
    common = engine_settings(longest, args.prompt, args.new_tokens) | {"batch_invariant": args.batch_invariant}
    graphed = NativeEngine(str(tmp), **common)
    eager = NativeEngine(str(tmp), cuda_graphs=False, **common)
    gen = torch.Generator().manual_seed(1)
    out_dir = args.out.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    report = []
    for batch in args.batches:
        prompts = torch.randint(3, 151_000, (batch, args.prompt), generator=gen).cuda()
        run = (graphed, prompts, args.new_tokens, args.samples)
        engine_side(*run)  # warm: kernels, allocator, every graph bucket
        seconds = statistics.median(engine_side(*run) for _ in range(args.repeats))
        step_ms = seconds * 1e3 / args.new_tokens
        forward_ms = replay_ms(graphed, batch, args.prompt + args.new_tokens)
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            engine_side(*run)
        trace = out_dir / f"{args.out.stem}.b{batch}.trace.json"
        prof.export_chrome_trace(str(trace))
        with open(trace, "rb") as src, gzip.open(f"{trace}.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        trace.unlink()
        graphed_kernels, _ = kernel_table(prof, args.new_tokens)
        engine_side(eager, prompts, args.profile_tokens, args.samples)  # warm the eager side at this batch
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            engine_side(eager, prompts, args.profile_tokens, args.samples)
        eager_kernels, launches = kernel_table(prof, args.profile_tokens, top=40)
        row = {
            "batch": batch,
            "tok_s": batch * args.new_tokens / seconds,
            "step_ms": step_ms,
            "decode_step_graph_ms": forward_ms,
            "outside_graph_ms": step_ms - forward_ms,
            "eager_launches_per_step": launches / args.profile_tokens,
            "eager_kernels": eager_kernels,
            "graphed_kernels": graphed_kernels,
        }
        report.append(row)
        print(json.dumps({k: v for k, v in row.items() if not k.endswith("kernels")}), flush=True)
    info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "batch_invariant": args.batch_invariant}
    info["samples_per_prompt"] = args.samples
    args.out.write_text(json.dumps({"source": source, "info": info, "rows": report}, indent=1))
    lines = [
        "| batch | tok/s | step ms | decode step ms (graph replay) | outside the graph ms | eager launches / step |",
        "|---|---|---|---|---|---|",
    ]
    for r in report:
        lines.append(
            f"| {r['batch']} | {r['tok_s']:,.0f} | {r['step_ms']:.2f} | {r['decode_step_graph_ms']:.2f} | "
            f"{r['outside_graph_ms']:.2f} | {r['eager_launches_per_step']:.0f} |"
        )
    for r in report:
        lines += ["", f"Kernels of one graphed decode step at batch {r['batch']} (GPU ms per step):", ""]
        lines += [f"- {k['gpu_ms_per_step']:.3f} ms, {k['calls']} calls: `{k['kernel']}`" for k in r["graphed_kernels"]]
        lines += ["", f"Kernels of one eager decode step at batch {r['batch']} (GPU ms per step):", ""]
        lines += [f"- {k['gpu_ms_per_step']:.3f} ms, {k['calls']} calls: `{k['kernel']}`" for k in r["eager_kernels"]]
    text = "\n".join(lines)
    args.out.with_suffix(".md").write_text(f"commit {source['commit']}; {info}\n\n{text}\n")
    print(text)


if __name__ == "__main__":
    main()
