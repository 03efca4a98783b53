"""The speed workloads: a random-weight model of a published shape, and prompts of an exact length."""

from __future__ import annotations

import json

import pytest
import torch

from loongsage.core.tinytask.shapes import PRESETS, RandomDigits, RandomInitModel
from loongsage.core.tinytask.tokenizer import build_tokenizer


def test_random_digits_are_exactly_length_tokens_and_reproducible():
    tokenizer = build_tokenizer()
    source = RandomDigits(length=128, size=50, seed=3)
    assert len(source) == 50
    for i in (0, 17, 49):
        record = source[i]
        assert record.source == "random_digits" and record.index == i and record.prompt.isdigit()
        assert len(tokenizer(record.prompt, add_special_tokens=False)["input_ids"]) == 128
        assert RandomDigits(length=128, size=50, seed=3)[i].prompt == record.prompt
    assert source[0].prompt != RandomDigits(length=128, size=50, seed=4)[0].prompt
    with pytest.raises(IndexError):
        source[50]


@pytest.mark.parametrize(
    "params, message",
    [
        ({"preset": "qwen9-1t"}, "preset='qwen9-1t': unknown; allowed: qwen3-0.6b"),
        ({"dtype": "int8"}, "dtype='int8': allowed: float32, bfloat16, float16"),
        ({"num_layers": 0}, "num_layers=0: a positive number of layers"),
    ],
)
def test_bad_builder_params_are_one_line_errors(params, message):
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        RandomInitModel(**params)


def test_the_cache_key_follows_every_param():
    base = RandomInitModel(device="cpu")
    keys = {
        base.cache_key(),
        RandomInitModel(device="cuda").cache_key(),
        RandomInitModel(device="cpu", seed=1).cache_key(),
        RandomInitModel(device="cpu", num_layers=2).cache_key(),
        RandomInitModel(device="cpu", preset="qwen3-4b").cache_key(),
    }
    assert len(keys) == 5 and base.cache_key() == RandomInitModel(device="cpu").cache_key()


def test_built_model_has_the_preset_shape_and_no_end_of_sequence(tmp_path, monkeypatch):
    from safetensors import safe_open
    from transformers import AutoConfig, AutoTokenizer

    monkeypatch.setenv("LOONGSAGE_CACHE", str(tmp_path))
    path = RandomInitModel(preset="qwen3-0.6b", num_layers=1, dtype="bfloat16", device="cpu").build()
    config = AutoConfig.from_pretrained(path)
    shape = PRESETS["qwen3-0.6b"]
    assert config.num_hidden_layers == 1 and config.hidden_size == shape["hidden_size"]
    assert config.vocab_size == shape["vocab_size"] and config.eos_token_id is None
    assert json.loads((path / "generation_config.json").read_text()).get("eos_token_id") is None
    assert AutoTokenizer.from_pretrained(path).pad_token == "<|endoftext|>"
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
    assert RandomInitModel(preset="qwen3-0.6b", num_layers=1, dtype="bfloat16", device="cpu").build() == path  # cached
