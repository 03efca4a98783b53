"""Weight transports end to end on CPU, under a real Ray: trainer-side senders pushing to real engine
workers (the native engine on a tiny model). After every update each engine's weights equal the
pushed ones bit for bit (a checksum per tensor); the ``broadcast`` path (gloo here, NCCL on GPUs)
splits into many buckets, forms its private group again when the engines change, and a bad update
or a receiver that dies mid-transfer is a clear error while every engine keeps its previous
version and keeps serving. The ``ipc`` path needs one GPU: tests/gpu."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import pytest
import torch

from loongsage.core.buckets import checksums
from loongsage.core.config import load_config
from loongsage.core.rollout import EngineRouter
from loongsage.core.types import SamplingParams
from loongsage.core.workers import EngineWorker

sys.path.insert(0, str(Path(__file__).parents[1] / "core" / "engine"))
from _engine_helpers import build_engine_test_model, prompts  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def engines(ray, model: str, transport: str, count: int = 2):
    cfg, _ = load_config(
        "tiny/grpo_arith_cpu",
        ["rollout.engine={name: native, params: {max_model_len: 256}}", f"rollout.transport={transport}"],
    )
    return [
        ray.remote(EngineWorker).options(num_cpus=0, max_concurrency=16).remote(cfg, model, i, 1) for i in range(count)
    ]


def weights_like(model: str, seed: int) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    g = torch.Generator().manual_seed(seed)
    policy = AutoModelForCausalLM.from_pretrained(model)
    with torch.no_grad():
        for p in policy.parameters():  # tied weights (embeddings and head) move together, as in training
            p.add_(0.01 * torch.randn(p.shape, generator=g))
    return dict(policy.state_dict())


def serves(ray, engine) -> bool:
    results = asyncio.run(EngineRouter([engine]).generate(prompts(1, seed=5)[0], SamplingParams(max_new_tokens=4)))
    return len(results[0].output_ids) == 4


@pytest.mark.parametrize(
    "spec",
    [
        "{name: cpu, params: {bucket_mb: 0.01}}",
        "{name: broadcast, params: {backend: gloo, bucket_mb: 0.01, timeout_s: 20}}",
    ],
)
def test_every_update_arrives_bit_for_bit(ray_module, tmp_path, spec):
    ray = ray_module
    model = build_engine_test_model(tmp_path / "m")
    workers = engines(ray, model, spec)
    cfg, _ = load_config("tiny/grpo_arith_cpu", [f"rollout.transport={spec}"])
    from loongsage.core.plugins import load_registry

    sender = load_registry(cfg.plugins).create("transport", cfg.rollout.transport, "rollout.transport")
    try:
        for version, seed in ((1, 1), (2, 2)):
            weights = weights_like(model, seed)
            stats = sender.push(weights.items(), workers)
            assert stats["sync/version"] == version and stats["sync/buckets"] > 5, stats  # many small buckets
            expected = checksums(weights.items())
            for w in workers:
                got = ray.get(w.weight_checksums.remote())
                assert {n: got[n] for n in expected} == expected
        assert all(serves(ray, w) for w in workers)
        # the engines change (one replaced after a failure, say): only it gets the next push
        fresh = engines(ray, model, spec, count=1)[0]
        weights = weights_like(model, 3)
        assert sender.push(weights.items(), [fresh])["sync/version"] == 1
        assert {n: v for n, v in ray.get(fresh.weight_checksums.remote()).items() if n in weights} == checksums(
            weights.items()
        )
        assert sender.push(weights.items(), [*workers, fresh])["sync/version"] == 3  # max over the engines
    finally:
        for w in workers:
            ray.kill(w)


def test_a_bad_update_changes_nothing_and_the_next_one_lands(ray_module, tmp_path):
    ray = ray_module
    model = build_engine_test_model(tmp_path / "m")
    spec = "{name: broadcast, params: {backend: gloo, bucket_mb: 0.01, timeout_s: 20}}"
    workers = engines(ray, model, spec)
    from loongsage.sync.broadcast import BroadcastTransport

    sender = BroadcastTransport(backend="gloo", bucket_mb=0.01, timeout_s=20)
    good = weights_like(model, 1)
    assert sender.push(good.items(), workers)["sync/version"] == 1
    before = [ray.get(w.weight_checksums.remote()) for w in workers]
    for bad, why in (
        ({**good, "model.layers.0.unknown.weight": torch.zeros(3)}, "unknown tensor"),
        ({**good, "model.norm.weight": torch.zeros(7)}, "has shape"),
        ({n: t.to(torch.float64) for n, t in good.items()}, "is float64"),
    ):
        with pytest.raises(Exception, match=why):
            sender.push(bad.items(), workers)
        for w, was in zip(workers, before):
            assert ray.get(w.version.remote()) == 1 and ray.get(w.weight_checksums.remote()) == was
            assert serves(ray, w)
    assert sender.push(weights_like(model, 2).items(), workers)["sync/version"] == 2
    for w in workers:
        ray.kill(w)


def test_a_receiver_that_dies_mid_transfer_is_an_error_and_the_others_keep_serving(ray_module, tmp_path):
    ray = ray_module
    model = build_engine_test_model(tmp_path / "m")
    spec = "{name: broadcast, params: {backend: gloo, bucket_mb: 0.01, timeout_s: 5}}"
    survivor, doomed = engines(ray, model, spec)
    from loongsage.sync.broadcast import BroadcastTransport

    sender = BroadcastTransport(backend="gloo", bucket_mb=0.01, timeout_s=5)
    assert sender.push(weights_like(model, 1).items(), [survivor, doomed])["sync/version"] == 1
    before = ray.get(survivor.weight_checksums.remote())

    def dying():  # the receiver's process is killed once a few buckets went through
        for k, item in enumerate(weights_like(model, 2).items()):
            if k == 6:
                ray.kill(doomed)
                time.sleep(0.5)
            yield item

    started = time.monotonic()
    with pytest.raises(Exception):  # noqa: B017 - Ray's error or the collective's, whichever comes first
        sender.push(dying(), [survivor, doomed])
    assert time.monotonic() - started < 60
    assert ray.get(survivor.version.remote()) == 1 and ray.get(survivor.weight_checksums.remote()) == before
    assert serves(ray, survivor)
    # the next push (the dead engine dropped, as the controller does after replacing it) lands
    fresh = BroadcastTransport(backend="gloo", bucket_mb=0.01, timeout_s=20)
    weights = weights_like(model, 3)
    assert fresh.push(weights.items(), [survivor])["sync/version"] == 2
    ray.kill(survivor)


def test_ipc_messages_an_engine_cannot_serve_are_refused_in_one_line():
    """An engine asked for "the same tensors as share n" that does not hold share n (a replaced
    engine, a share it never took) refuses, and commits nothing; the in-place flag is checked."""
    from loongsage.sync.ipc import IpcReceiver, IpcTransport

    receiver = IpcReceiver()
    with pytest.raises(RuntimeError, match=r"^ipc: the sender refers to its share 3, this engine holds none; nothing"):
        receiver.receive("same", 3)
    with pytest.raises(ValueError, match="unknown message 'views'; allowed: bucket, share, same"):
        receiver.receive("views", 1)
    with pytest.raises(ValueError, match=r"ipc.in_place='yes': must be true or false"):
        IpcTransport(in_place="yes")
