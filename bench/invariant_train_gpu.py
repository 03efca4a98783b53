"""The batch-invariant trainer's forward + backward against the plain HF one on one CUDA GPU.

A Qwen3-1.7B-shaped model (random bf16 weights) runs one micro-batch of ``--rows`` sequences of
``--width`` tokens through its decoder body and back (the loss: the sum of the final hidden states),
three ways, in this process, on the same weights and tokens:

* ``hf``: the plain HF forward and backward (eager, SDPA attention): the fast path's trainer
  uncompiled, the peer;
* ``hf_compiled``: the same with every decoder layer compiled as ``compile_layers`` does it (a copy
  of the model's modules over the same parameters): the fast path's trainer as the GPU step runs it;
* ``invariant``: :class:`~loongsage.core.trainer.invariant.InvariantForward` as the trainer runs it
  now: one forward on the batch-invariant kernels (the engine's numbers bit for bit), differentiated
  through the same kernels (:mod:`loongsage.core.engine.fused.differentiable`);
* ``invariant_two_forwards``: what the mode cost before: the invariant forward without gradient,
  then the plain HF forward and backward for the gradient (timed as the sum of the two).

Each side is warmed once, then ``--repeats`` (at least 3) timed runs are interleaved; medians and
min-max. Also recorded: the peak memory of each side's run, whether the trainer's hidden states are
the engine path's bits (:meth:`~loongsage.core.engine.fused.decoder.FusedDecoder.hidden` with
``invariant``), and the relative error of the invariant gradient against HF's on a few weights.

    python bench/invariant_train_gpu.py [--rows 32] [--width 384] [--repeats 3] [--out PATH]

Writes ``bench/results/invariant_train_gpu.json`` (the commit first) and a markdown table beside it.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
from pathlib import Path

import torch
from _source import source_state
from engine_gpu import qwen3_1_7b_config, timed

RESULTS = Path(__file__).resolve().parent / "results" / "invariant_train_gpu.json"


def kernel_profile(fn, top: int = 15) -> dict:
    """The GPU time of everything ``fn`` runs on the device (kernels, copies, fills), summed
    (``total_ms``), and the ``top`` kernels it spends most in, ``(kernel name, total ms, calls)``
    each (``costliest``): the total, not the top kernels' sum, is the side's kernel time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type.name == "CUDA":
            entry = totals.setdefault(event.name[:90], [0.0, 0])
            entry[0] += event.device_time_total / 1e3
            entry[1] += 1
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "total_ms": round(sum(ms for ms, _ in totals.values()), 3),
        "costliest": [(name, round(ms, 3), int(calls)) for name, (ms, calls) in ranked],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--profile", action="store_true", help="also each side's kernel time and its 15 costliest GPU kernels"
    )
    args = parser.parse_args()
    if args.repeats < 3:
        parser.error(f"--repeats={args.repeats}: at least 3 timed runs per side")
    source = source_state()  # the commit measured, first
    from transformers import Qwen3ForCausalLM

    from loongsage.core.trainer.compiling import compile_like_eager
    from loongsage.core.trainer.invariant import InvariantForward

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(qwen3_1_7b_config()).to(torch.bfloat16)
    rows, width = args.rows, args.width
    ids = torch.randint(0, 151_000, (rows, width), device="cuda")
    invariant = InvariantForward(model, fp32_lm_head=True)
    n, r = rows * width, invariant.runner
    positions = torch.arange(width, device="cuda").repeat(rows).view(n, 1)
    sequences = torch.arange(rows, device="cuda").repeat_interleave(width)

    @torch.no_grad()
    def engine_path() -> torch.Tensor:
        keys = torch.empty(rows, r.kv_heads, width, r.head_dim, dtype=torch.bfloat16, device="cuda")
        values = torch.empty_like(keys)
        layers = len(r.layers)
        return invariant.decoder.hidden(
            ids.reshape(n, 1),
            positions,
            [keys] * layers,
            [values] * layers,
            positions[:, 0],
            width,
            cache_rows=sequences,
            invariant=True,
        )

    def hf() -> None:
        model.model(input_ids=ids, use_cache=False).last_hidden_state.float().sum().backward()

    compiled = copy.deepcopy(model, {id(p): p for p in model.parameters()})  # the same weights, no copy
    for layer in compiled.model.layers:
        compile_like_eager(layer)

    def hf_compiled() -> None:
        compiled.model(input_ids=ids, use_cache=False).last_hidden_state.float().sum().backward()

    def ours() -> None:
        invariant.hidden(ids).float().sum().backward()

    sides = {"hf": [hf], "hf_compiled": [hf_compiled], "invariant": [ours], "invariant_two_forwards": [engine_path, hf]}
    with torch.no_grad():
        same_bits = bool(torch.equal(engine_path(), invariant.hidden(ids).view(n, -1)))

    def run(name: str) -> float:
        model.zero_grad(set_to_none=True)
        compiled.zero_grad(set_to_none=True)
        return sum(timed(part) for part in sides[name])

    peaks = {}
    for name in sides:  # warm-up, and each side's peak memory
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        run(name)
        peaks[name] = torch.cuda.max_memory_allocated() / 1e9
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(args.repeats):
        for name in sides:
            times[name].append(run(name))
    probes = {
        "layers.0.self_attn.q_proj": model.model.layers[0].self_attn.q_proj.weight,
        "layers.13.mlp.down_proj": model.model.layers[13].mlp.down_proj.weight,
        "layers.27.self_attn.k_norm": model.model.layers[27].self_attn.k_norm.weight,
        "norm": model.model.norm.weight,
    }

    def gradients(fn) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        fn()
        return [w.grad.float().clone() for w in probes.values()]

    grad_error = {name: float((a - b).norm() / b.norm()) for name, a, b in zip(probes, gradients(ours), gradients(hf))}
    stats = {
        name: {"median": statistics.median(v), "min": min(v), "max": max(v), "peak_gb": peaks[name]}
        for name, v in times.items()
    }
    result = {
        "source": source,
        "device": torch.cuda.get_device_name(),
        "rows": rows,
        "width": width,
        "repeats": args.repeats,
        "sides": stats,
        "repeats_s": times,
        "invariant_equals_engine_path_bits": same_bits,
        "gradient_relative_error_vs_hf": grad_error,
        "kernels_ms": {name: kernel_profile(lambda n=name: run(n)) for name in sides} if args.profile else None,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    hf_s = stats["hf"]["median"]
    lines = [
        f"commit `{source['commit'][:10]}`; {result['device']}; Qwen3-1.7B shape, random bf16; one micro-batch of "
        f"{rows} x {width} tokens, the decoder body's forward + backward; medians of {args.repeats} interleaved runs "
        f"after one warm-up each; the invariant hidden states equal the engine path's bit for bit: {same_bits}",
        "",
        "| side | seconds (min-max) | vs HF | peak memory |",
        "|---|---|---|---|",
    ]
    for name, s in stats.items():
        lines.append(
            f"| {name} | {s['median']:.3f} ({s['min']:.3f}-{s['max']:.3f}) | {s['median'] / hf_s:.2f}x | "
            f"{s['peak_gb']:.1f} GB |"
        )
    lines += [
        "",
        "Gradient of the invariant path against HF's, relative error: "
        + ", ".join(f"{k} {v:.3f}" for k, v in grad_error.items()),
    ]
    table = "\n".join(lines) + "\n"
    args.out.with_suffix(".md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
