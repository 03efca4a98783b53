"""Fixtures of the native-engine tests: the tiny Qwen3 with peaked logits, as a folder and as an HF model.

Test modules here that need another model define their own ``model_dir``, which takes precedence.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _engine_helpers import build_engine_test_model  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_engine_test_model(tmp_path_factory.mktemp("tiny_qwen3"))


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir).eval()
