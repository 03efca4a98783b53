"""The bucketing layer every transport shares: bytes in == bytes out, buckets bounded, offsets aligned."""

from __future__ import annotations

import torch

from loongsage.core.buckets import ALIGN, checksums, pack, plan_buckets, unpack
from loongsage.core.transport import CpuReceiver


def test_round_trip_across_buckets_and_dtypes():
    g = torch.Generator().manual_seed(0)
    tensors = [
        ("a.weight", torch.randn(64, 32, generator=g)),
        ("b.bias", torch.randn(7, generator=g).to(torch.bfloat16)),
        ("c.big", torch.randn(300, 300, generator=g)),  # larger than a bucket: a bucket of its own
        ("d.int", torch.arange(10, dtype=torch.int64)),
        ("e.scalar", torch.tensor(3.5)),
    ]
    bucket_bytes = 64 * 1024
    buckets = [pack(b) for b in plan_buckets(tensors, bucket_bytes)]
    assert len(buckets) >= 3
    for metas, flat in buckets:
        assert flat.dtype == torch.uint8
        assert flat.numel() <= bucket_bytes or len(metas) == 1
        assert all(m.offset % ALIGN == 0 for m in metas)
    out = {}
    receiver = CpuReceiver()
    for metas, flat in buckets:
        view = flat.numpy().copy()
        view.setflags(write=False)  # receivers see a read-only shared-memory view
        out.update(receiver.receive(metas, view))
    assert list(out) == [n for n, _ in tensors]
    for name, t in tensors:
        assert out[name].dtype == t.dtype and out[name].shape == t.shape
        assert torch.equal(out[name], t)
    assert checksums(out.items()) == checksums(tensors)
    # views share the buffer; copies do not
    metas, flat = buckets[0]
    view = dict(unpack(metas, flat, copy=False))["a.weight"]
    flat.zero_()
    assert float(view.abs().sum()) == 0.0


def test_checksums_see_one_flipped_bit():
    t = torch.randn(1000, dtype=torch.float32)
    flipped = t.clone()
    flipped.view(torch.int32)[123] ^= 1
    assert checksums([("t", t)]) != checksums([("t", flipped)])
    assert checksums([("t", t)]) == checksums([("t", t.clone())])


def test_an_alias_is_sent_once():
    embed = torch.randn(10, 4)
    tensors = [
        ("model.embed_tokens.weight", embed),
        ("model.norm.weight", torch.ones(4)),
        ("lm_head.weight", embed),
        ("copy.weight", embed.clone()),
    ]  # equal values in other memory: sent
    names = [n for bucket in plan_buckets(tensors, 1 << 20) for n, _ in bucket]
    assert names == ["model.embed_tokens.weight", "model.norm.weight", "copy.weight"]


def test_a_failed_bucket_poisons_the_commit_of_its_push(tmp_path):
    """A sender that does not wait for each bucket (ipc) learns of a failed one at the commit: the
    engine worker refuses it, keeps its version, and the next push starts clean."""
    import sys
    from pathlib import Path

    from loongsage.core.config import load_config
    from loongsage.core.workers import EngineWorker

    sys.path.insert(0, str(Path(__file__).parent / "engine"))
    from _engine_helpers import build_engine_test_model

    model = build_engine_test_model(tmp_path / "m")
    cfg, _ = load_config("tiny/grpo_arith_cpu", ["rollout.engine={name: native, params: {max_model_len: 256}}"])
    worker = EngineWorker(cfg, model, 0, 1)
    weights = [(n, t.clone()) for n, t in worker.engine.named_weights()]
    buckets = [pack(b) for b in plan_buckets(weights, 4096)]
    message = [(metas, flat.numpy()) for metas, flat in buckets]
    assert len(message) >= 3
    assert worker.receive_bucket(*message[0], first=True) == 0
    try:
        worker.receive_bucket(message[1][0], b"not a buffer")  # this bucket fails
    except Exception:
        pass
    else:
        raise AssertionError("a broken bucket was accepted")
    for metas, buffer in message[2:-1]:
        try:
            worker.receive_bucket(metas, buffer)
        except RuntimeError as exc:
            assert "an earlier bucket of this weight push failed" in str(exc)
    try:
        worker.receive_bucket(*message[-1], commit=True)
    except RuntimeError as exc:
        assert "nothing was committed, the engine keeps version 0" in str(exc)
    else:
        raise AssertionError("the commit of a push with a failed bucket went through")
    assert worker.engine.version == 0
    for k, (metas, buffer) in enumerate(message):  # the next push starts clean and lands
        version = worker.receive_bucket(metas, buffer, first=k == 0, commit=k == len(message) - 1)
    assert version == 1 and checksums(worker.engine.named_weights()) == checksums(weights)
