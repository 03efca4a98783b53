"""Shared pieces of the GPU tests."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _bench import bench_module  # noqa: E402


@pytest.fixture(scope="session")
def qwen3_1024_dir(tmp_path_factory) -> str:
    """The consistency bench's Qwen3-shaped model (hidden 1024, 8 layers, random bf16), built once."""
    consistency = bench_module("consistency_gpu")
    path = str(tmp_path_factory.mktemp("qwen3_1024") / "m")
    consistency.build_model(path, **consistency.MODEL)
    return path
