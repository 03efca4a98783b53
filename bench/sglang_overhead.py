"""The ``sglang`` engine against the SGLang server it drives, on one CUDA GPU, in one run.

A Qwen3-1.7B-shaped model with random bf16 weights (no end-of-sequence token: every sample runs to
its budget) is served by one SGLang server that the engine starts. On that same server:

* **rollout**: ``--batch`` prompts of ``--prompt`` random tokens, exactly ``--new-tokens`` sampled
  tokens each (temperature 1, log-probs returned). Ours: the engine's ``generate``, one call per
  prompt, all concurrent (what the engine router does; the engine batches them). Raw: one batched
  ``POST /generate`` of the same prompts and parameters straight to the server. Tokens per second,
  ours / raw (goal >= 0.95).
* **weight update** of all 3.44 GB: ours, ``update_weights`` (names and shapes checked, packed into
  one buffer, ``/update_weights_from_tensor`` loaded by one batched copy into the parameters, the
  new version); raw, SGLang's own
  ``/update_weights_from_tensor`` with the same tensors pickled as they are (what SGLang's own
  ``Engine.update_weights_from_tensor`` sends, loaded by the model's ``load_weights``). Seconds,
  GB/s, and the fraction of the floor: one on-card copy of the same bytes (goal >= 0.5).
* **consistency**: the k3 KL between the log-probs the server returned and the torch trainer's of
  the same tokens (bf16, FP32 head on both sides; goal <= 1e-5).

Both sides of each measure are warmed the same way, then interleaved ``--repeats`` (>= 3) times.

    python bench/sglang_overhead.py [--batch 64] [--prompt 128] [--new-tokens 256] [--repeats 3]
        [--server-arg rl_on_policy_target=fsdp --name sglang_overhead_on_policy]

Needs one CUDA GPU and SGLang (0.5.16 for torch 2.11). Writes ``bench/results/sglang_overhead.json``
and ``.md`` (or under ``--out-dir``).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
from _source import source_state  # noqa: E402
from engine_gpu import build  # noqa: E402

GOALS = {"rollout_ratio": 0.95, "update_of_ceiling": 0.5, "k3_kl": 1e-5}


def without_eos(path: Path) -> None:
    """Every sample runs to its budget on both sides: the model declares no end-of-sequence token."""
    for name in ("config.json", "generation_config.json"):
        file = path / name
        if file.is_file():
            data = json.loads(file.read_text())
            data["eos_token_id"] = None
            file.write_text(json.dumps(data))


def ours_rollout(engine, prompts: list[list[int]], new_tokens: int) -> tuple[float, list]:
    from loongsage.core.types import GenerationRequest, SamplingParams

    async def run():
        return await asyncio.gather(
            *(
                engine.generate(
                    GenerationRequest(
                        f"b{time.monotonic_ns()}-{i}", p, SamplingParams(temperature=1.0, max_new_tokens=new_tokens)
                    )
                )
                for i, p in enumerate(prompts)
            )
        )

    start = time.perf_counter()
    results = asyncio.run(run())
    seconds = time.perf_counter() - start
    assert all(len(r[0].output_ids) == new_tokens for r in results), "a sample stopped early"
    return seconds, [r[0] for r in results]


def raw_rollout(url: str, prompts: list[list[int]], new_tokens: int) -> float:
    import httpx

    body = {
        "input_ids": prompts,
        "return_logprob": True,
        "logprob_start_len": -1,
        "sampling_params": [{"temperature": 1.0, "max_new_tokens": new_tokens} for _ in prompts],
    }
    start = time.perf_counter()
    answer = httpx.post(url + "/generate", json=body, timeout=None, trust_env=False)
    seconds = time.perf_counter() - start
    answer.raise_for_status()
    assert all(len(a["output_ids"]) == new_tokens for a in answer.json()), "a sample stopped early"
    return seconds


def raw_update(url: str, named: list[tuple[str, torch.Tensor]], version: str) -> float:
    from multiprocessing.reduction import ForkingPickler

    import httpx
    from torch import multiprocessing  # noqa: F401 - torch's reductions

    start = time.perf_counter()
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump(named)
    payload = base64.b64encode(buffer.getvalue()).decode()
    answer = httpx.post(
        url + "/update_weights_from_tensor",
        timeout=None,
        trust_env=False,
        json={"serialized_named_tensors": [payload], "weight_version": version, "flush_cache": True},
    )
    seconds = time.perf_counter() - start
    assert answer.json().get("success"), answer.text
    return seconds


def copy_ceiling(nbytes: int, repeats: int) -> float:
    """The floor of any update: one on-card copy of the same bytes (seconds, median; warmed)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    del src, dst
    torch.cuda.empty_cache()
    return statistics.median(times[1:])


def k3_against(trainer, prompts: list[list[int]], results: list) -> dict[str, float]:
    """The k3 KL (and |delta|) between the engine's log-probs of its samples and ``trainer``'s."""
    from loongsage.core.types import TrainBatch

    n, p = len(prompts), len(prompts[0])
    ids = torch.tensor([q + r.output_ids for q, r in zip(prompts, results)])
    mask = torch.zeros(ids.shape)
    mask[:, p:] = 1
    batch = TrainBatch(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        response_mask=mask,
        rollout_logprobs=torch.zeros(ids.shape),
        advantages=torch.zeros(ids.shape),
        rewards=torch.zeros(n),
        group_ids=torch.arange(n),
    )
    lp, _ = trainer.logprobs(batch, token_budget=16 * ids.shape[1])
    delta = (lp[:, p:] - torch.tensor([r.logprobs for r in results])).double()
    return {
        "k3_kl": (torch.exp(delta) - delta - 1).mean().item(),
        "mean_abs_logprob_diff": delta.abs().mean().item(),
        "max_abs_logprob_diff": delta.abs().max().item(),
        "tokens": float(delta.numel()),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--mem-fraction", type=float, default=0.5)
    ap.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an SGLang server flag for the run, e.g. rl_on_policy_target=fsdp (SGLang's kernels "
        "made to compute as an HF/FSDP trainer does: the KL line with it)",
    )
    ap.add_argument("--name", default="sglang_overhead", help="the results' file name")
    ap.add_argument("--out-dir", default=str(BENCH / "results"))
    args = ap.parse_args()
    server_args = {}
    for item in args.server_arg:
        key, sep, value = item.partition("=")
        if not sep or not key:
            ap.error(f"--server-arg {item!r}: expected KEY=VALUE")
        server_args[key] = value
    source = source_state()  # the commit measured, first
    from safetensors.torch import load_file

    from loongsage.sglang.engine import SGLangEngine

    with tempfile.TemporaryDirectory(prefix="bench-sglang-") as tmp:
        path = Path(tmp) / "model"
        del_model = build(path)
        del del_model
        torch.cuda.empty_cache()
        without_eos(path)
        engine = SGLangEngine(
            str(path),
            dtype="bfloat16",
            fp32_lm_head=True,
            seed=1,
            server_args=server_args,
            mem_fraction_static=args.mem_fraction,
            release_tags=[],
        )
        try:
            g = torch.Generator().manual_seed(0)
            prompts = [torch.randint(3, 150_000, (args.prompt,), generator=g).tolist() for _ in range(args.batch)]
            tokens = args.batch * args.new_tokens
            # warm-up, the same on both sides
            ours_rollout(engine, prompts, args.new_tokens)
            raw_rollout(engine.url, prompts, args.new_tokens)
            rows = []
            for repeat in range(args.repeats):
                ours_s, results = ours_rollout(engine, prompts, args.new_tokens)
                raw_s = raw_rollout(engine.url, prompts, args.new_tokens)
                rows.append({"repeat": repeat, "ours_s": ours_s, "raw_s": raw_s})
                print(
                    f"rollout {repeat}: ours {tokens / ours_s:8.0f} tok/s, raw {tokens / raw_s:8.0f} tok/s", flush=True
                )
            from loongsage.core.trainer.torch_trainer import TorchTrainer

            trainer = TorchTrainer(str(path), dtype="bfloat16", device="cuda", fp32_lm_head=True)
            consistency = k3_against(trainer, prompts[:32], results[:32])
            del trainer
            torch.cuda.empty_cache()
            named = [(n, t.cuda()) for p in sorted(path.glob("*.safetensors")) for n, t in load_file(str(p)).items()]
            nbytes = sum(t.numel() * t.element_size() for _, t in named)
            engine.update_weights(named)  # warm-up, the same on both sides
            raw_update(engine.url, named, "warm")
            updates = []
            for repeat in range(args.repeats):
                start = time.perf_counter()
                engine.update_weights(named)
                ours_s = time.perf_counter() - start
                raw_s = raw_update(engine.url, named, f"raw{repeat}")
                engine.set_version(engine.version)  # the server's version back to the engine's
                updates.append({"repeat": repeat, "ours_s": ours_s, "raw_s": raw_s})
                print(f"update {repeat}: ours {ours_s * 1e3:7.1f} ms, sglang's own {raw_s * 1e3:7.1f} ms", flush=True)
            ceiling_s = copy_ceiling(nbytes, args.repeats)
            startup_s = engine.startup_s
        finally:
            engine.close()
    med = {k: statistics.median(r[k] for r in rows) for k in ("ours_s", "raw_s")}
    umed = {k: statistics.median(r[k] for r in updates) for k in ("ours_s", "raw_s")}
    summary = {
        "rollout_ours_tok_s": tokens / med["ours_s"],
        "rollout_raw_tok_s": tokens / med["raw_s"],
        "rollout_ratio": med["raw_s"] / med["ours_s"],
        "update_ours_s": umed["ours_s"],
        "update_raw_s": umed["raw_s"],
        "update_ours_gb_s": nbytes / umed["ours_s"] / 1e9,
        "update_raw_gb_s": nbytes / umed["raw_s"] / 1e9,
        "copy_ceiling_s": ceiling_s,
        "update_of_ceiling": ceiling_s / umed["ours_s"],
        **consistency,
        "server_startup_s": startup_s,
    }
    result = {
        "source": source,
        "settings": vars(args),
        "device": torch.cuda.get_device_name(0),
        "bytes": nbytes,
        "goals": GOALS,
        "summary": summary,
        "rollout": rows,
        "updates": updates,
    }
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(result, indent=1) + "\n")
    s = summary
    lines = [
        f"commit `{source['commit'][:10]}`; {result['device']}; Qwen3-1.7B shape, random bf16 weights; one SGLang "
        f"server; {args.batch} prompts x {args.prompt} tokens, exactly {args.new_tokens} sampled; median of "
        f"{args.repeats} after a warm-up on each side" + (f"; server flags {server_args}" if server_args else ""),
        "",
        "| measure | ours (the `sglang` engine) | raw (the same server) | ratio | goal |",
        "|---|---:|---:|---:|---|",
        f"| rollout tokens/s | {s['rollout_ours_tok_s']:.0f} | {s['rollout_raw_tok_s']:.0f} | "
        f"{s['rollout_ratio']:.3f} | >= {GOALS['rollout_ratio']} |",
        f"| weight update of {nbytes / 1e9:.2f} GB | "
        f"{s['update_ours_s'] * 1e3:.1f} ms ({s['update_ours_gb_s']:.0f} GB/s) | "
        f"{s['update_raw_s'] * 1e3:.1f} ms (SGLang's own, {s['update_raw_gb_s']:.0f} GB/s) | "
        f"{s['update_raw_s'] / s['update_ours_s']:.2f} | |",
        f"| the update against one on-card copy of the same bytes ({s['copy_ceiling_s'] * 1e3:.2f} ms, the floor) | "
        f"{s['update_of_ceiling']:.2f} of it | {s['copy_ceiling_s'] / s['update_raw_s']:.2f} of it | | "
        f">= {GOALS['update_of_ceiling']} |",
        f"| k3 KL vs the trainer (bf16, FP32 head) | {s['k3_kl']:.2e} | | | <= {GOALS['k3_kl']:g} |",
    ]
    (out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
