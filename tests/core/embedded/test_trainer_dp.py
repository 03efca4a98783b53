"""Data parallelism changes nothing: DP 2 (FSDP2 and replicas, gloo) equals DP 1 on the same batch."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from loongsage.core.aggregation import AGGREGATION_MODES
from loongsage.core.embedded.tiny_model import build_tiny_qwen3

WORKER = Path(__file__).with_name("_dp_worker.py")
sys.path.insert(0, str(WORKER.parent))
from _dp_worker import step  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-dp")
    build_tiny_qwen3(path, hidden_size=32, num_layers=2, heads=2, kv_heads=1, intermediate_size=64, seed=4)
    return str(path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("dp_mode", ["fsdp2", "replicate"])
def test_dp2_equals_dp1_for_every_aggregation(model_dir, dp_mode, tmp_path):
    port, prefix = str(_free_port()), str(tmp_path / "rank0")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(WORKER.parent), os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(r), "2", port, model_dir, dp_mode, prefix],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    for p in procs:
        output, _ = p.communicate(timeout=300)
        assert p.returncode == 0, output[-3000:]
    for mode in AGGREGATION_MODES:
        ref = step(model_dir, dp_mode, mode, list(range(8)), budget=10_000)
        got = np.load(f"{prefix}-{mode}.npz")
        assert float(got["loss"][0]) == pytest.approx(float(ref["loss"][0]), abs=1e-6), mode
        assert float(got["grad_norm"][0]) == pytest.approx(float(ref["grad_norm"][0]), rel=1e-5), mode
        grads = [k for k in ref if k.startswith("grad/")]
        assert grads
        for key in grads:
            torch.testing.assert_close(torch.from_numpy(got[key]), torch.from_numpy(ref[key]), atol=1e-6, rtol=1e-4,
                                       msg=f"{mode} {key}")
