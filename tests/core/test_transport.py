"""The CPU weight transport's bucketing: bytes in == bytes out, buckets bounded."""

from __future__ import annotations

import numpy as np
import torch

from loongsage.core.embedded.transport import pack_buckets, unpack_bucket


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
    buckets = list(pack_buckets(tensors, bucket_bytes))
    assert len(buckets) >= 3
    for metas, buffer in buckets:
        assert buffer.dtype == np.uint8
        assert buffer.nbytes <= bucket_bytes or len(metas) == 1
    out = {}
    for metas, buffer in buckets:
        view = buffer.copy()
        view.setflags(write=False)  # receivers see a read-only shared-memory view
        out.update(unpack_bucket(metas, view))
    assert list(out) == [n for n, _ in tensors]
    for name, t in tensors:
        assert out[name].dtype == t.dtype and out[name].shape == t.shape
        assert torch.equal(out[name], t)
