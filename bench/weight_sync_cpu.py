"""End-to-end weight update on CPU: the ``cpu`` transport (Ray's shared-memory object store) and the
``broadcast`` transport over gloo against a plain ``torch.distributed`` gloo broadcast of the same
bytes, in one run.

* ``ours_cpu``: a sender actor holding a Qwen3-shaped model's HF-named tensors (built offline by
  :func:`~loongsage.core.tinytask.tiny_model.build_tiny_qwen3`, another seed than the engine's) pushes
  them with :class:`~loongsage.core.transport.CpuTransport` into a real engine worker (the
  native engine on CPU serving the same shape): buckets packed, put once into the object store,
  mapped and copied out, staged, all committed at once, the engine at the new version.
* ``ours_broadcast_gloo``: the same push with :class:`~loongsage.sync.broadcast.BroadcastTransport`
  (gloo) into an engine worker of its own; its group is formed once, in the warm-up.
* ``raw_broadcast``: the ceiling. Two plain actors in a gloo group (``tcp://127.0.0.1``, a free
  port); rank 0 broadcasts one flat ``uint8`` tensor of the pushed byte count into rank 1's
  preallocated one. Timed on rank 0 from a barrier (both ready) through the broadcast and a final
  barrier (rank 1 has it); no bucketing, staging or commit.

Every side is warmed once per bucket size (untimed), then the sides take turns ``--repeats`` times
per bucket size (``--buckets`` MiB). Reported: ms and GB/s per update (medians) and ours/raw in
throughput. Afterwards both engines' weights are checked against the sender's, a checksum per tensor
(bit for bit), and rank 1's buffer against rank 0's. Loopback only, no downloads, a few minutes.

    python bench/weight_sync_cpu.py [--buckets 16 64 256] [--repeats 3] [--hidden 768] [--layers 5]
                                    [--dtype float32] [--out-dir bench/results]

Writes ``<out-dir>/weight_sync_cpu.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
from _source import source_state  # noqa: E402

from loongsage.core.placement import free_port  # noqa: E402

SIDES = ("ours_cpu", "ours_broadcast_gloo", "raw_broadcast")


class Sender:
    """The trainer's side: HF-named tensors of the model's shape, pushed by a transport."""

    def __init__(self, shape: dict, dtype: str):
        from loongsage.core.tinytask.tiny_model import build_tiny_qwen3

        model, _ = build_tiny_qwen3(seed=1, **shape)  # the engine serves seed 0: every push changes it
        self.weights = list(model.to(getattr(torch, dtype)).state_dict().items())
        self.broadcast = None  # one transport, so the engine's group stays the one it joined

    def info(self) -> dict:
        """The bytes a push moves (an alias such as a tied head is sent once) and this actor's threads."""
        from loongsage.core.buckets import plan_buckets

        return {
            "bytes": sum(t.numel() * t.element_size() for b in plan_buckets(self.weights, 1 << 40) for _, t in b),
            "tensors": len(self.weights),
            "torch_threads": torch.get_num_threads(),
        }

    def push(self, engine, side: str, bucket_mb: float) -> dict:
        from loongsage.core.buckets import bucket_bytes
        from loongsage.core.transport import CpuTransport
        from loongsage.sync.broadcast import BroadcastTransport

        if side == "ours_cpu":
            transport = CpuTransport(bucket_mb=bucket_mb)
        else:
            self.broadcast = self.broadcast or BroadcastTransport(backend="gloo", timeout_s=120)
            transport = self.broadcast
            transport.bucket_mb, transport.bucket_bytes = bucket_mb, bucket_bytes("broadcast", bucket_mb)
        start = time.perf_counter()
        stats = transport.push(self.weights, [engine])
        return {**stats, "wall_s": time.perf_counter() - start}

    def checksums(self) -> dict:
        from loongsage.core.buckets import checksums

        return checksums(self.weights)


class RawRank:
    """One rank of the plain gloo broadcast."""

    def __init__(self, rank: int, nbytes: int):
        self.rank = rank
        self.buf = (
            torch.randint(0, 256, (nbytes,), dtype=torch.uint8) if rank == 0 else torch.empty(nbytes, dtype=torch.uint8)
        )

    def join(self, port: int) -> None:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=self.rank,
            world_size=2,
            timeout=datetime.timedelta(seconds=120),
        )

    def broadcast(self) -> float:
        dist.barrier()  # both ready: the clock starts with the transfer, not with a late peer
        start = time.perf_counter()
        dist.broadcast(self.buf, src=0)
        dist.barrier()  # on rank 0: returns once rank 1 holds every byte
        return time.perf_counter() - start

    def digest(self) -> str:
        return hashlib.sha256(self.buf.numpy()).hexdigest()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--buckets", type=float, nargs="+", default=[16, 64, 256])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--out-dir", default=str(BENCH / "results"))
    args = ap.parse_args()
    source = source_state()  # the commit measured, first
    load_before = os.getloadavg()[0]
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    import ray

    from loongsage.core.config import load_config
    from loongsage.core.tinytask.tiny_model import build_tiny_qwen3
    from loongsage.core.workers import EngineWorker

    shape = {
        "hidden_size": args.hidden,
        "num_layers": args.layers,
        "heads": args.hidden // 64,
        "kv_heads": 4,
        "head_dim": 64,
        "intermediate_size": args.hidden * 8 // 3 // 64 * 64,
    }
    ray.init(
        num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": {"GLOO_SOCKET_IFNAME": "lo"}}
    )  # gloo on loopback on every side
    with tempfile.TemporaryDirectory(prefix="bench-weight-sync-cpu-") as tmp:
        build_tiny_qwen3(Path(tmp) / "model", seed=0, **shape)
        engines = {}
        for side, name in (("ours_cpu", "cpu"), ("ours_broadcast_gloo", "broadcast")):
            cfg, _ = load_config(
                "tiny/grpo_arith_cpu",
                [
                    f"model.dtype={args.dtype}",
                    f"rollout.transport={{name: {name}}}",
                    "rollout.engine={name: native, params: {max_model_len: 256}}",
                ],
            )
            engines[side] = (
                ray.remote(EngineWorker)
                .options(num_cpus=0, max_concurrency=4)
                .remote(cfg, str(Path(tmp) / "model"), 0, 1)
            )
        sender = ray.remote(Sender).options(num_cpus=0).remote(shape, args.dtype)
        info = ray.get(sender.info.remote())
        nbytes = info["bytes"]
        ranks = [ray.remote(RawRank).options(num_cpus=0).remote(r, nbytes) for r in (0, 1)]
        port = free_port()
        ray.get([r.join.remote(port) for r in ranks] + [e.version.remote() for e in engines.values()])

        def once(side: str, mb: float) -> dict:
            if side == "raw_broadcast":
                rank0_s, rank1_s = ray.get([r.broadcast.remote() for r in ranks])
                return {"wall_s": rank0_s, "rank1_s": rank1_s}
            return ray.get(sender.push.remote(engines[side], side, mb))

        for mb in args.buckets:  # warm-up, the same on every side: one untimed round per bucket size
            for side in SIDES:
                once(side, mb)
        rows = []
        for repeat in range(args.repeats):
            for mb in args.buckets:
                for side in SIDES:
                    r = once(side, mb)
                    rows.append(
                        {
                            "repeat": repeat,
                            "bucket_mb": mb,
                            "side": side,
                            "s": r["wall_s"],
                            **{k.removeprefix("sync/"): v for k, v in r.items() if k != "wall_s"},
                        }
                    )
                    print(
                        f"repeat {repeat} bucket {mb:5.0f} MiB {side:20s} {r['wall_s'] * 1e3:8.1f} ms "
                        f"({nbytes / r['wall_s'] / 1e9:5.2f} GB/s)",
                        flush=True,
                    )
        expected = ray.get(sender.checksums.remote())
        bit_equal = {}
        for side, engine in engines.items():
            got = ray.get(engine.weight_checksums.remote())
            bit_equal[side] = all(got.get(n) == v for n, v in expected.items())
        bit_equal["raw_broadcast"] = len(set(ray.get([r.digest.remote() for r in ranks]))) == 1
    summary = {}
    for mb in args.buckets:
        mine = {side: [r for r in rows if r["bucket_mb"] == mb and r["side"] == side] for side in SIDES}
        s = {side: statistics.median(r["s"] for r in mine[side]) for side in SIDES}
        summary[f"{mb:g}"] = {
            "buckets": mine["ours_cpu"][0]["buckets"],
            **{f"{side}_s": s[side] for side in SIDES},
            **{f"{side}_gb_per_s": nbytes / s[side] / 1e9 for side in SIDES},
            **{f"{side}_over_raw_throughput": s["raw_broadcast"] / s[side] for side in SIDES[:2]},
            **{f"{side}_s_all": [r["s"] for r in mine[side]] for side in SIDES},
        }
    result = {
        "source": source,
        "settings": {**vars(args), "shape": shape, "sender": info},
        "bytes": nbytes,
        "bit_equal": bit_equal,
        "cpu": cpu_name(),
        "cores": len(os.sched_getaffinity(0)),
        "load_1min": {"before": load_before, "after": os.getloadavg()[0]},
        "summary": summary,
        "rows": rows,
    }
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "weight_sync_cpu.json").write_text(json.dumps(result, indent=1) + "\n")
    load = result["load_1min"]
    lines = [
        f"commit `{source['commit'][:10]}`; {result['cores']} shared CPU cores ({result['cpu']}, 1-min load "
        f"{load['before']:.1f} before, {load['after']:.1f} after); ratios hold, absolute times are noisy; "
        f"Qwen3-shaped tiny model (hidden {args.hidden}, {args.layers} layers), {args.dtype}, "
        f"{nbytes / 1e6:.1f} MB; "
        f"the `cpu` and `broadcast` (gloo) transports into the native engine (staged, committed) vs a plain gloo "
        f"broadcast of the same bytes between two processes; median of {args.repeats} after a warm-up; "
        "bit-equal after the updates: " + ", ".join(f"{k} {v}" for k, v in bit_equal.items()),
        "",
        "| bucket MiB | buckets | ours_cpu ms | GB/s | ours_broadcast_gloo ms | GB/s | raw_broadcast ms | GB/s "
        "| cpu / raw | broadcast / raw |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mb, s in summary.items():
        cells = [f"{s[f'{side}_s'] * 1e3:.1f} | {s[f'{side}_gb_per_s']:.2f}" for side in SIDES]
        lines.append(
            f"| {float(mb):.0f} | {s['buckets']:.0f} | "
            + " | ".join(cells)
            + " | "
            + " | ".join(f"{s[f'{side}_over_raw_throughput']:.2f}" for side in SIDES[:2])
            + " |"
        )
    (out / "weight_sync_cpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    ray.shutdown()
    return 0 if all(bit_equal.values()) else 1


def cpu_name() -> str:
    names = [
        ln.split(":", 1)[1].strip()
        for ln in Path("/proc/cpuinfo").read_text().splitlines()
        if ln.startswith("model name")
    ]
    return names[0] if names else "unknown CPU"


if __name__ == "__main__":
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    sys.exit(main())
