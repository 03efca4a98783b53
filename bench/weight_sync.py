"""End-to-end weight update on one GPU, colocated: the ``ipc`` transport against the raw CUDA IPC
hand-off of the same bytes, in one run.

* ``ours``: a trainer-side actor holding a Qwen3-1.7B-shaped model in bf16 on the GPU pushes its
  HF-named tensors with :class:`~loongsage.sync.ipc.IpcTransport` into a real engine worker (the
  native engine serving the same shape on the same GPU), all committed at once and the engine
  serving the new version. Two ways: ``in place`` (the engine copies straight from the trainer's
  tensors, shared once; the default) and ``packed`` per bucket size (buckets packed, handles
  sent, views staged). Each way keeps one transport across its pushes, as a trainer does. Then the
  engine's weights are checked against the trainer's, a checksum per tensor (bit for bit).
* ``raw``: the ceiling. One flat buffer of the same total size on the trainer's side, its CUDA IPC
  handle sent to a receiver actor on the same GPU, which opens it and copies it into a buffer of its
  own (no bucketing, no staging, no commit).

Both are warmed the same way, then repeated ``--repeats`` times per way (``--buckets`` MiB: the
packed sizes).
Reported: seconds and GB/s per update, and ours/raw. Absolute figures hold on the GPU machine.

    python bench/weight_sync.py [--buckets 64 256 512 1024] [--repeats 3] [--out-dir bench/results]

Needs one CUDA GPU, Ray, and the loongsage packages (entry points or PYTHONPATH). Writes
``<out-dir>/weight_sync.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
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

PLUGINS = "plugins=[loongsage.algos.plugin,loongsage.sync.plugin]"


class Trainer:
    """The sender: the model's weights on the GPU, as a trainer rank 0 holds them."""

    def __init__(self, model_path: str):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).cuda()
        self.flat = None
        self.transports = {}  # one per way, kept across pushes

    def bytes(self) -> int:
        """What a push moves: every tensor once (a tied output layer is its embedding, sent once)."""
        from loongsage.core.buckets import without_aliases
        from loongsage.core.model_math.state import state_tensors

        return sum(t.numel() * t.element_size() for _, t in without_aliases(state_tensors(self.model)))

    def push(self, engine, bucket_mb: float | None) -> dict:
        """``bucket_mb`` None: in place; else packed in buckets of that size."""
        from loongsage.core.model_math.state import state_tensors
        from loongsage.sync.ipc import IpcTransport

        transport = self.transports.setdefault(
            bucket_mb, IpcTransport(bucket_mb=bucket_mb or 512, in_place=bucket_mb is None)
        )
        torch.cuda.synchronize()
        start = time.perf_counter()
        stats = transport.push(state_tensors(self.model), [engine])  # listed as the torch trainer exports
        stats["wall_s"] = time.perf_counter() - start
        return stats

    def checksums(self) -> dict:
        from loongsage.core.buckets import checksums

        return checksums(self.model.state_dict().items())

    def raw(self, receiver, nbytes: int) -> float:
        import ray
        from torch.multiprocessing.reductions import reduce_tensor

        if self.flat is None or self.flat.numel() != nbytes:
            self.flat = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        start = time.perf_counter()
        ray.get(receiver.copy.remote(reduce_tensor(self.flat)))
        return time.perf_counter() - start


class RawReceiver:
    def __init__(self):
        self.out = None

    def copy(self, handle) -> int:
        rebuild, args = handle
        flat = rebuild(*args)
        if self.out is None or self.out.numel() != flat.numel():
            self.out = torch.empty_like(flat)
        self.out.copy_(flat)
        torch.cuda.synchronize()
        del flat
        return int(self.out.numel())


def way_name(bucket_mb: float | None) -> str:
    return "in place" if bucket_mb is None else f"packed {bucket_mb:g} MiB"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--buckets", type=float, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out-dir", default=str(BENCH / "results"))
    args = ap.parse_args()
    source = source_state()  # the commit measured, first
    import ray

    from loongsage.core.config import load_config
    from loongsage.core.workers import EngineWorker

    ray.init(num_gpus=1, include_dashboard=False, log_to_driver=False)
    with tempfile.TemporaryDirectory(prefix="bench-weight-sync-") as tmp:
        path = Path(tmp) / "model"
        del_model = build(path)
        del del_model
        torch.cuda.empty_cache()
        cfg, _ = load_config(
            "tiny/grpo_arith_cpu",
            [
                PLUGINS,
                "model.dtype=bfloat16",
                "rollout.transport={name: ipc}",
                "rollout.engine={name: native, params: {device: cuda, max_model_len: 512, max_batch_size: 8, "
                "cuda_graphs: false}}",
            ],
        )
        gpu = {"num_gpus": 0.3, "num_cpus": 0}
        engine = ray.remote(EngineWorker).options(**gpu, max_concurrency=8).remote(cfg, str(path), 0, 1)
        trainer = ray.remote(Trainer).options(**gpu).remote(str(path))
        receiver = ray.remote(RawReceiver).options(**gpu).remote()
        nbytes = ray.get(trainer.bytes.remote())
        ray.get(engine.version.remote())
        rows = []
        ways = [None, *args.buckets]
        # each way in a block (an engine holds the share of one in-place sender), warmed the same on
        # both sides: one push and one raw hand-off, then the repeats
        for mb in ways:
            ray.get(trainer.push.remote(engine, mb))
            ray.get(trainer.raw.remote(receiver, nbytes))
            for repeat in range(args.repeats):
                stats = ray.get(trainer.push.remote(engine, mb))
                raw_s = ray.get(trainer.raw.remote(receiver, nbytes))
                rows.append(
                    {
                        "repeat": repeat,
                        "way": way_name(mb),
                        "ours_s": stats["wall_s"],
                        "raw_s": raw_s,
                        "buckets": stats["sync/buckets"],
                        "version": stats["sync/version"],
                    }
                )
                print(
                    f"repeat {repeat} {way_name(mb):>16}: ours {stats['wall_s'] * 1e3:7.1f} ms "
                    f"({nbytes / stats['wall_s'] / 1e9:6.1f} GB/s), raw {raw_s * 1e3:6.1f} ms "
                    f"({nbytes / raw_s / 1e9:6.1f} GB/s)",
                    flush=True,
                )
        equal = ray.get(engine.weight_checksums.remote())
        expected = ray.get(trainer.checksums.remote())
        bit_equal = all(equal.get(n) == v for n, v in expected.items())
    summary = {}
    for way in map(way_name, ways):
        mine = [r for r in rows if r["way"] == way]
        ours, raw = statistics.median(r["ours_s"] for r in mine), statistics.median(r["raw_s"] for r in mine)
        summary[way] = {
            "ours_s": ours,
            "raw_s": raw,
            "ours_gb_per_s": nbytes / ours / 1e9,
            "raw_gb_per_s": nbytes / raw / 1e9,
            "ours_over_raw_throughput": raw / ours,
            "buckets": mine[0]["buckets"],
            "ours_s_all": [r["ours_s"] for r in mine],
            "raw_s_all": [r["raw_s"] for r in mine],
        }
    result = {
        "source": source,
        "settings": vars(args),
        "bytes": nbytes,
        "bit_equal_after_updates": bit_equal,
        "device": torch.cuda.get_device_name(0),
        "summary": summary,
        "rows": rows,
    }
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "weight_sync.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [
        f"commit `{source['commit'][:10]}`; {result['device']}; Qwen3-1.7B shape, bf16, {nbytes / 1e9:.2f} GB; "
        f"ipc transport into the native engine (colocated, one GPU) vs the raw CUDA IPC hand-off + copy of the "
        f"same bytes; median of {args.repeats} after a warm-up; engine weights bit-equal to the trainer's: "
        f"{bit_equal}",
        "",
        "| way | messages | ours ms | ours GB/s | raw ms | raw GB/s | ours / raw (throughput) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for way, s in summary.items():
        lines.append(
            f"| {way} | {s['buckets']:.0f} | {s['ours_s'] * 1e3:.1f} | {s['ours_gb_per_s']:.1f} | "
            f"{s['raw_s'] * 1e3:.1f} | {s['raw_gb_per_s']:.1f} | {s['ours_over_raw_throughput']:.2f} |"
        )
    (out / "weight_sync.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    ray.shutdown()
    return 0 if bit_equal else 1


if __name__ == "__main__":
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    sys.exit(main())
