"""The batch-invariant GEMM against cuBLAS on one CUDA GPU, at the Qwen3-1.7B shape's projections.

For each projection (merged q/k/v, o, merged gate/up, down, the FP32 LM head) and each row count
``M`` (a decode step's live rows, a trainer micro-batch's tokens) it times three sides on the same
inputs:

* ``cublas``: ``F.linear`` (the fast path's GEMM; the head as a bf16 GEMM with float32 output);
* ``invariant``: :func:`~loongsage.core.engine.fused.matmul.invariant_matmul` as the engine and the
  trainer run it (128 x 256 tiles read by TMA for a trainer's rows on a Hopper GPU; 64 x 128 or
  64 x 64 tiles for a decode step's, with a chunk of K per program when they are few);
* ``one_program_a_tile``: the same kernel kept to 64 x 64 tiles, a tile per program, at every shape:
  what a fixed-tile GEMM without the chunked layout costs (the kernel before the chunks).

Each side is warmed, then 20 calls are captured in a CUDA graph (the engine's decode step is a
graph; 3 for trainer-sized row counts, whose outputs are large) and the graph's replay is timed
with CUDA events, 3 times; the table gives the median per call. The last table adds the GEMMs of one
decode step of the 28-layer model (four per layer, the head once) per side: the engine's decode
floor on each. Writes ``--out`` (JSON, the commit first) and a markdown table beside it.

    python bench/invariant_gemm_gpu.py [--rows 64 128 256 8192] [--out bench/results/invariant_gemm_gpu.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F
from _source import source_state
from engine_profile_gpu import replay_times

RESULTS = Path(__file__).resolve().parent / "results" / "invariant_gemm_gpu.json"
LAYERS = 28
# name -> (N, K, float32 output, calls per decode step)
SHAPES = {
    "qkv": (4096, 2048, False, LAYERS),
    "o": (2048, 2048, False, LAYERS),
    "gate_up": (12288, 2048, False, LAYERS),
    "down": (2048, 6144, False, LAYERS),
    "head": (151936, 2048, True, 1),
}
SIDES = ("cublas", "invariant", "one_program_a_tile")


def time_ms(fn, calls: int = 20, repeats: int = 3) -> list[float]:
    """Milliseconds per call, ``repeats`` times: ``calls`` calls captured in one CUDA graph (as the
    engine's decode step runs them: no host launch cost, which would dwarf a decode-sized GEMM),
    after three eager warm-up calls (compilation, autotuning, allocator)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # one more call on the capture stream, as CUDA graphs ask
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()  # warm the replay
    return [ms / calls for ms in replay_times(graph, repeats)]


def sides(x: torch.Tensor, w: torch.Tensor, fp32_out: bool) -> dict:
    from loongsage.core.engine.fused import matmul

    out = torch.float32 if fp32_out else None

    def one_program_a_tile():
        saved = matmul._layout
        matmul._layout = lambda m, n, k, device, wide_out: (matmul.SMALL_TILES, "tile")
        try:
            return matmul.invariant_matmul(x, w, out_dtype=out)
        finally:
            matmul._layout = saved

    cublas = (lambda: torch.mm(x, w.T, out_dtype=torch.float32)) if fp32_out else (lambda: F.linear(x, w))
    return {
        "cublas": cublas,
        "invariant": lambda: matmul.invariant_matmul(x, w, out_dtype=out),
        "one_program_a_tile": one_program_a_tile,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 128, 256, 8192])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    source = source_state()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    rows_out, step = [], {m: dict.fromkeys(SIDES, 0.0) for m in args.rows}
    for name, (n, k, fp32_out, per_step) in SHAPES.items():
        w = torch.randn(n, k, dtype=torch.bfloat16, device=dev) * 0.02
        for m in args.rows:
            x = torch.randn(m, k, dtype=torch.bfloat16, device=dev)
            row = {"projection": name, "n": n, "k": k, "rows": m}
            for side, fn in sides(x, w, fp32_out).items():
                # a trainer-sized call's output is large (the head's at 8192 rows is 5 GB): fewer in the graph
                runs = time_ms(fn, calls=20 if m <= 1024 else 3)
                row[side] = {"ms": statistics.median(runs), "runs": runs}
                step[m][side] += per_step * row[side]["ms"]
            row["invariant_vs_cublas"] = row["invariant"]["ms"] / row["cublas"]["ms"]
            # the weight read once at the card's bytes/s is the floor at decode sizes
            row["weight_gb_s"] = n * k * 2 / (row["invariant"]["ms"] * 1e-3) / 1e9
            rows_out.append(row)
            print(f"{name:8} M={m:5}  " + "  ".join(f"{s} {row[s]['ms']:.4f} ms" for s in SIDES), flush=True)
            del x
        del w
        torch.cuda.empty_cache()
    result = {
        "source": source,
        "device": torch.cuda.get_device_name(),
        "workload": "Qwen3-1.7B shape projections, random bf16; 20 calls in one CUDA graph, 3 replays (their median)",
        "rows": rows_out,
        "decode_step_gemm_ms": {str(m): v for m, v in step.items() if m <= 1024},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    lines = [
        f"commit `{source['commit'][:10]}`; {result['device']}; {result['workload']}",
        "",
        "| projection | N x K | M | cuBLAS ms | invariant ms | one program a tile ms | invariant / cuBLAS | "
        "invariant weight GB/s |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows_out:
        lines.append(
            f"| {r['projection']} | {r['n']} x {r['k']} | {r['rows']} | {r['cublas']['ms']:.4f} | "
            f"{r['invariant']['ms']:.4f} | {r['one_program_a_tile']['ms']:.4f} | {r['invariant_vs_cublas']:.2f}x | "
            f"{r['weight_gb_s']:.0f} |"
        )
    lines += [
        "",
        f"GEMMs of one decode step ({LAYERS} layers x 4, the head once), ms:",
        "",
        "| M | cuBLAS | invariant | one program a tile | invariant / cuBLAS |",
        "|---:|---:|---:|---:|---:|",
    ]
    for m, v in step.items():
        if m > 1024:  # a trainer's micro-batch, not a decode step
            continue
        lines.append(
            f"| {m} | {v['cublas']:.2f} | {v['invariant']:.2f} | {v['one_program_a_tile']:.2f} | "
            f"{v['invariant'] / v['cublas']:.2f}x |"
        )
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
