"""Native engine vs HF ``generate`` on one CUDA GPU: a Qwen3-1.7B-shaped model with random bf16 weights.

Workload: ``--batch`` prompts of ``--prompt`` random tokens, each sampled (temperature 1, no filter,
no stop ids) for exactly ``--new-tokens`` tokens. Both sides run in this process on the same
weights; the time covers prefill and decode. Sides:

* HF ``generate`` (``do_sample``, static batch, its default dynamic cache);
* the native engine with CUDA graphs over its fused Triton decode kernels (the default on CUDA);
* the native engine with CUDA graphs over the torch decode path (``kernels="torch"``), to show what
  the fused kernels buy;
* with ``--eager``, the torch path without graphs (``cuda_graphs=False``), to show what graphs buy;
* with ``--fp8`` / ``--batch-invariant``, the fused path on FP8 weights (``quantization="fp8"``) / in
  the batch-invariant mode, to show what each gains or costs;
* with ``--samples-per-prompt N``, the fused engine on the RL step's shape: ``batch / N`` prompts of
  ``N`` samples each (``n=N``: one prefill a prompt, its cache copied to the samples' rows), the same
  number of sampled tokens. With ``--batches 128`` alone the engine also holds at most 128 rows, as
  the RL step's does: the two differences between this bench and the step's rollout, apart;
  with ``--shared-prefix`` as well, that workload on an engine whose decode attention reads each
  prompt once per tile of its samples (``shared_prefix_decode=True``);
* with ``--sglang``, SGLang (0.5.16 verified) serving the same folder on the same card in its own
  process, driven over its own HTTP ``/generate`` with the same prompts and sampling (log-probs
  returned, no end-of-sequence token, its CUDA graphs up to the largest batch, FP32 LM head, the
  ``--sglang-sampling-backend``), as ``bench/sglang_overhead.py`` drives it.

Every side first runs the full workload once untimed (kernels, allocator, graph capture), then
``--repeats`` (at least 3) timed runs of the sides are interleaved; medians and min-max are reported.

Reference lines, not measured here: the weights-only bandwidth roofline of this workload on an H200
and SGLang 0.5.16 on the same workload and card. Measured here: the bandwidth roofline of the decode
steps (every step reads the weights once and each row's cached keys and values once) at the
device-to-device copy bandwidth of this card, measured first.

    python bench/engine_gpu.py [--batches 64 128 256] [--eager] [--fp8] [--batch-invariant] [--sglang] [--prompt 128]
                               [--new-tokens 256] [--samples-per-prompt 8 [--shared-prefix]] [--repeats 3] [--out PATH]

Writes ``bench/results/engine_gpu.json`` (or ``--out``) and a markdown table next to it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from _source import source_state

RESULTS = Path(__file__).resolve().parent / "results" / "engine_gpu.json"
# SGLang 0.5.16 on one H200, same model shape and workload (tokens/s), by batch size, from an earlier
# run whose settings were not recorded; `--sglang` measures it in the same run (12,544 / 24,317 at
# commit d8485dc, with log-probs).
SGLANG_REFERENCE = {64: 18_933, 256: 36_470}
# The weights-only bandwidth roofline of this workload on an H200, as the engine's goals state it.
ROOFLINE_REFERENCE = {64: 39_000, 256: 156_000}


def qwen3_1_7b_config():
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=151_936,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40_960,
        rope_theta=1_000_000.0,
        tie_word_embeddings=True,
        eos_token_id=151_645,
        pad_token_id=151_643,
    )


def build(path: Path) -> torch.nn.Module:
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(qwen3_1_7b_config()).to(torch.bfloat16)
    model.generation_config.eos_token_id = None  # run every row to max_new_tokens
    model.save_pretrained(str(path))
    return model.eval()


def timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def hf_side(model, prompts: torch.Tensor, new_tokens: int) -> float:
    def run():
        with torch.inference_mode():
            out = model.generate(
                prompts,
                attention_mask=torch.ones_like(prompts),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                pad_token_id=0,
            )
        assert out.shape[1] == prompts.shape[1] + new_tokens

    return timed(run)


def engine_settings(longest: int, prompt: int, new_tokens: int) -> dict:
    """The native engine's settings for this workload (batches up to ``longest``)."""
    return {
        "dtype": "bfloat16",
        "device": "cuda",
        "max_batch_size": longest,
        "eos_token_ids": [],
        "max_model_len": prompt + new_tokens,
        "prefill_chunk_tokens": longest * prompt,
        # Repeats send the same prompts: a prefix cache would skip their prefill, which HF
        # cannot, so it is off (this is a static-batch workload, not sessions).
        "prefix_cache": False,
    }


def copy_bandwidth() -> float:
    """Bytes per second of a large device-to-device copy (read plus write), median of 10."""
    src = torch.randn(1 << 29, device="cuda")  # 2 GiB
    dst = torch.empty_like(src)
    times = [timed(lambda: dst.copy_(src)) for _ in range(12)]
    return 2 * src.numel() * src.element_size() / statistics.median(times[2:])


def decode_roofline(batch: int, prompt: int, new_tokens: int, weight_bytes: int, kv_bytes_per_token: int, bw: float):
    """Tokens/s if every decode step only read the weights and each row's cached keys/values once."""
    seconds = sum(weight_bytes + batch * (prompt + t) * kv_bytes_per_token for t in range(new_tokens)) / bw
    return batch * new_tokens / seconds


def engine_side(engine, prompts: torch.Tensor, new_tokens: int, samples: int = 1) -> float:
    """Seconds for the engine to sample ``new_tokens`` for each row of ``prompts``; with ``samples``
    > 1, every ``samples``-th prompt is sent with ``n=samples`` (the same rows, one prefill each)."""
    from loongsage.core.types import GenerationRequest, SamplingParams

    sampling = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, n=samples)
    rows = prompts[::samples].tolist()
    requests = [GenerationRequest(f"r{i}", row, sampling) for i, row in enumerate(rows)]

    def run():
        results = engine.generate_batch(requests)
        assert all(len(group) == samples for group in results)
        assert all(len(r.output_ids) == new_tokens for group in results for r in group)

    return timed(run)


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--eager", action="store_true", help="also time the torch path without CUDA graphs")
    parser.add_argument("--fp8", action="store_true", help="also time the fused path on FP8 weights")
    parser.add_argument(
        "--batch-invariant", action="store_true", help="also time the fused path in the batch-invariant mode"
    )
    parser.add_argument("--sglang", action="store_true", help="also time SGLang on the same card, same run")
    parser.add_argument("--sglang-mem-fraction", type=float, default=0.35)
    parser.add_argument("--sglang-sampling-backend", default="pytorch", choices=["pytorch", "flashinfer"])
    parser.add_argument(
        "--sglang-attention-backend", default=None, help="SGLang's attention backend (default: its own choice)"
    )
    parser.add_argument(
        "--samples-per-prompt", type=int, default=0, help="also time the fused engine with N samples a prompt"
    )
    parser.add_argument(
        "--shared-prefix",
        action="store_true",
        help="with --samples-per-prompt, also time it with shared_prefix_decode",
    )
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.repeats < 3:
        parser.error(f"--repeats={args.repeats}: at least 3 timed runs per side")
    if args.samples_per_prompt and any(b % args.samples_per_prompt for b in args.batches):
        parser.error(f"--samples-per-prompt={args.samples_per_prompt} must divide every batch in {args.batches}")
    if args.shared_prefix and args.samples_per_prompt < 2:
        parser.error("--shared-prefix times the --samples-per-prompt workload: give --samples-per-prompt N >= 2")
    source = source_state()  # the commit measured, taken before anything runs
    from loongsage.core.engine.native import NativeEngine

    tmp = Path(tempfile.mkdtemp(prefix="qwen3-1.7b-random-"))
    model = build(tmp)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    on_h200 = "H200" in torch.cuda.get_device_name()
    longest = max(args.batches)
    common = engine_settings(longest, args.prompt, args.new_tokens)
    cfg = model.config
    kv_bytes_per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 2
    bandwidth = copy_bandwidth()
    # shared prefixes off: the grouped workload's side without them (they change nothing for one
    # sample a prompt); `--shared-prefix` adds the engine as it runs by default
    fused = NativeEngine(str(tmp), kernels="triton", shared_prefix_decode=False, **common)
    graphed = NativeEngine(str(tmp), kernels="torch", **common)
    sides = {
        "hf": lambda prompts: hf_side(model, prompts, args.new_tokens),
        "fused": lambda prompts: engine_side(fused, prompts, args.new_tokens),
        "graphs": lambda prompts: engine_side(graphed, prompts, args.new_tokens),
    }
    if args.eager:
        eager = NativeEngine(str(tmp), kernels="torch", cuda_graphs=False, **common)
        sides["eager"] = lambda prompts: engine_side(eager, prompts, args.new_tokens)
    if args.fp8:
        fp8 = NativeEngine(str(tmp), kernels="triton", quantization="fp8", **common)
        sides["fp8"] = lambda prompts: engine_side(fp8, prompts, args.new_tokens)
    if args.batch_invariant:
        invariant = NativeEngine(str(tmp), kernels="triton", batch_invariant=True, **common)
        sides["batch_invariant"] = lambda prompts: engine_side(invariant, prompts, args.new_tokens)
    if args.samples_per_prompt > 1:
        n = args.samples_per_prompt
        sides["grouped"] = lambda prompts: engine_side(fused, prompts, args.new_tokens, samples=n)
    if args.shared_prefix:
        shared = NativeEngine(str(tmp), kernels="triton", shared_prefix_decode=True, **common)
        sides["grouped_shared"] = lambda prompts: engine_side(shared, prompts, args.new_tokens, samples=n)
    server = None
    if args.sglang:
        from sglang_overhead import raw_rollout, without_eos

        from loongsage.sglang.engine import SGLangEngine

        without_eos(tmp)  # the native engines were told eos_token_ids=[]; SGLang reads the config
        server = SGLangEngine(
            str(tmp),
            dtype="bfloat16",
            fp32_lm_head=True,
            seed=1,
            mem_fraction_static=args.sglang_mem_fraction,
            release_tags=[],
            sampling_backend=args.sglang_sampling_backend,
            attention_backend=args.sglang_attention_backend,
            server_args={"cuda_graph_max_bs": longest},
        )
        url = server.url
        sides["sglang"] = lambda prompts: raw_rollout(url, prompts.tolist(), args.new_tokens)
    gen = torch.Generator().manual_seed(1)
    rows = []
    for batch in args.batches:
        prompts = torch.randint(3, 151_000, (batch, args.prompt), generator=gen).cuda()
        tokens = batch * args.new_tokens
        # Every side is warmed on the full workload, once (kernels, allocator, autotuning, graphs);
        # the timed runs are then interleaved so that a drift of the host hits every side alike.
        warm = {name: tokens / run(prompts) for name, run in sides.items()}
        timed_runs: dict[str, list[float]] = {name: [] for name in sides}
        for _ in range(args.repeats):
            for name, run in sides.items():
                timed_runs[name].append(tokens / run(prompts))
        stats = {name: spread(values) for name, values in timed_runs.items()}
        row = {
            "batch": batch,
            "prompt": args.prompt,
            "new_tokens": args.new_tokens,
            "hf_generate_tok_s": stats["hf"],
            "engine_fused_tok_s": stats["fused"],
            "engine_torch_graphs_tok_s": stats["graphs"],
            "engine_eager_tok_s": stats.get("eager"),
            "engine_fp8_tok_s": stats.get("fp8"),
            "engine_batch_invariant_tok_s": stats.get("batch_invariant"),
            "engine_grouped_tok_s": stats.get("grouped"),
            "engine_grouped_shared_tok_s": stats.get("grouped_shared"),
            "samples_per_prompt": args.samples_per_prompt or None,
            # both references are an H200's: on another card they compare nothing
            "roofline_tok_s": ROOFLINE_REFERENCE.get(batch) if on_h200 else None,
            "decode_roofline_tok_s": decode_roofline(
                batch, args.prompt, args.new_tokens, weight_bytes, kv_bytes_per_token, bandwidth
            ),
            "sglang_reference_tok_s": SGLANG_REFERENCE.get(batch) if on_h200 else None,
            "sglang_tok_s": stats.get("sglang"),
            "warm_up_tok_s": warm,
            "repeats": timed_runs,
        }
        row["speedup_vs_hf"] = stats["fused"]["median"] / stats["hf"]["median"]
        # the least favourable pairing of our slowest run against HF's fastest, and the reverse
        row["speedup_vs_hf_range"] = [
            stats["fused"]["min"] / stats["hf"]["max"],
            stats["fused"]["max"] / stats["hf"]["min"],
        ]
        row["fused_vs_torch_kernels"] = stats["fused"]["median"] / stats["graphs"]["median"]
        row["fraction_of_decode_roofline"] = stats["fused"]["median"] / row["decode_roofline_tok_s"]
        if "sglang" in stats:  # measured in this run
            row["fraction_of_sglang"] = stats["fused"]["median"] / stats["sglang"]["median"]
            row["fraction_of_sglang_range"] = [
                stats["fused"]["min"] / stats["sglang"]["max"],
                stats["fused"]["max"] / stats["sglang"]["min"],
            ]
        elif row["sglang_reference_tok_s"]:
            row["fraction_of_sglang"] = stats["fused"]["median"] / row["sglang_reference_tok_s"]
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "repeats"}), flush=True)
    if server is not None:
        server.close()
    info = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "weights_gb": weight_bytes / 1e9,
        "graphs_captured": fused._batch.graphs.captures,
        "copy_bandwidth_tb_s": bandwidth / 1e12,
        "sglang": {
            "mem_fraction_static": args.sglang_mem_fraction,
            "sampling_backend": args.sglang_sampling_backend,
            "attention_backend": args.sglang_attention_backend or "default",
        }
        if server is not None
        else None,
        "peak_memory_gb": torch.cuda.max_memory_allocated() / 1e9,
        "repeats": args.repeats,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"source": source, "info": info, "rows": rows}, indent=1))
    table = [
        "| batch | HF generate tok/s | engine, torch kernels + graphs tok/s | engine, fused kernels + graphs "
        "tok/s | fused / torch | vs HF (range) | SGLang 0.5.16 | share of SGLang | decode roofline "
        "(share) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def cell(s: dict[str, float]) -> str:
        return f"{s['median']:,.0f} ({s['min']:,.0f}-{s['max']:,.0f})"

    for r in rows:
        if r["sglang_tok_s"]:
            sglang = cell(r["sglang_tok_s"])
        else:
            sglang = f"{r['sglang_reference_tok_s']:,} (earlier run)" if r["sglang_reference_tok_s"] else "-"
        share = f"{r['fraction_of_sglang']:.0%}" if r.get("fraction_of_sglang") else "-"
        lo, hi = r["speedup_vs_hf_range"]
        table.append(
            f"| {r['batch']} | {cell(r['hf_generate_tok_s'])} | {cell(r['engine_torch_graphs_tok_s'])} | "
            f"{cell(r['engine_fused_tok_s'])} | {r['fused_vs_torch_kernels']:.2f}x | "
            f"{r['speedup_vs_hf']:.2f}x ({lo:.2f}-{hi:.2f}) | {sglang} | {share} | "
            f"{r['decode_roofline_tok_s']:,.0f} ({r['fraction_of_decode_roofline']:.0%}) |"
        )
    labels = (
        ("fp8", "FP8 weights"),
        ("batch_invariant", "batch-invariant"),
        ("grouped", f"{args.samples_per_prompt} samples a prompt"),
        ("grouped_shared", f"{args.samples_per_prompt} samples a prompt, shared prefixes"),
    )
    extra = [(k, label) for k, label in labels if k in sides]
    if extra:
        table += ["", "| batch | fused | " + " | ".join(f"{label} tok/s (vs fused)" for _, label in extra) + " |"]
        table.append("|---|---|" + "---|" * len(extra))
        for r in rows:
            fused_median = r["engine_fused_tok_s"]["median"]
            cells = [
                f"{cell(r[f'engine_{k}_tok_s'])} ({r[f'engine_{k}_tok_s']['median'] / fused_median:.2f}x)"
                for k, _ in extra
            ]
            table.append(f"| {r['batch']} | {cell(r['engine_fused_tok_s'])} | " + " | ".join(cells) + " |")
    text = "\n".join(table)
    note = (
        f"Commit {source['commit'][:10]}; medians of {args.repeats} interleaved timed runs per side (min-max in "
        "brackets), each side warmed once on the full workload first."
    )
    args.out.with_suffix(".md").write_text(f"{info}\n\n{note}\n\n{text}\n")
    print(info)
    print(note)
    print(text)


if __name__ == "__main__":
    main()
