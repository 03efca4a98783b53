"""The embedded tiny task: tokenizer, tiny Qwen3, arithmetic data source, scoring, warm-start cache."""

from __future__ import annotations

import random

import pytest
import torch

from loongsage.core.tinytask.arith import (
    ArithmeticTask,
    extract_answer,
    format_answer,
    in_test_split,
    score,
    teacher_answer,
)
from loongsage.core.tinytask.tokenizer import IM_END, IM_START, PAD_TOKEN, build_tokenizer
from loongsage.core.types import DataRecord, DataSource


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    build_tokenizer(path)
    return path


def test_tokenizer_loads_and_splits_digits(tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert 256 < len(tok) <= 512
    assert (tok.pad_token, tok.eos_token) == (PAD_TOKEN, IM_END)
    assert tok.convert_tokens_to_ids(IM_START) is not None
    ids = tok("12345+67=80412 and 2024", add_special_tokens=False)["input_ids"]
    pieces = [tok.decode([i]) for i in ids]
    numbers = [p.strip() for p in pieces if p.strip().isdigit()]
    assert numbers == list("12345") + list("67") + list("80412") + list("2024")
    assert tok.decode(ids) == "12345+67=80412 and 2024"


def test_chat_template_is_chatml(tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    text = tok.apply_chat_template([{"role": "user", "content": "3+4="}], tokenize=False, add_generation_prompt=True)
    assert text == f"{IM_START}user\n3+4={IM_END}\n{IM_START}assistant\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids.count(tok.convert_tokens_to_ids(IM_START)) == 2  # special tokens stay single tokens
    assert tok.eos_token_id in ids


def test_tokenizer_is_deterministic():
    assert build_tokenizer().backend_tokenizer.to_str() == build_tokenizer().backend_tokenizer.to_str()


def test_tiny_model_round_trips(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from loongsage.core.tinytask.tiny_model import build_tiny_qwen3

    model, tok = build_tiny_qwen3(
        tmp_path, hidden_size=32, num_layers=1, heads=2, kv_heads=1, intermediate_size=64, seed=7
    )
    again, _ = build_tiny_qwen3(None, hidden_size=32, num_layers=1, heads=2, kv_heads=1, intermediate_size=64, seed=7)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded).__name__ == "Qwen3ForCausalLM"
    assert AutoTokenizer.from_pretrained(tmp_path).get_vocab() == tok.get_vocab()
    assert (tmp_path / "model.safetensors").is_file()
    ids = torch.tensor([tok("12+34=", add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        expected = model(ids).logits
        assert torch.equal(again(ids).logits, expected)  # same seed, same weights
        assert torch.allclose(loaded(ids).logits, expected)


def test_task_is_a_data_source_with_correct_labels():
    task = ArithmeticTask(digits=2, operations="+-", split="train", size=500, answer_format="plain")
    assert isinstance(task, DataSource)
    for i in range(len(task)):
        record = task[i]
        assert isinstance(record, DataRecord) and record.index == i and record.source == "arith"
        m = record.metadata
        assert record.label == str(m["a"] + m["b"] if m["op"] == "+" else m["a"] - m["b"])
        assert record.prompt == [{"role": "user", "content": f"{m['a']}{m['op']}{m['b']}="}]


def test_reversed_answers_and_text_prompts():
    record = ArithmeticTask(split="test", size=10, prompt_format="text")[3]
    assert isinstance(record.prompt, str) and record.prompt.endswith("=")
    assert record.label == str(record.metadata["value"])[::-1]
    assert format_answer(132, "reversed") == "231" and format_answer(-40, "reversed") == "-04"


@pytest.mark.parametrize("digits", [2, 4])  # enumerated and sampled operand spaces
def test_splits_are_disjoint_and_deterministic(digits):
    def problems(split, seed):
        task = ArithmeticTask(digits=digits, operations="+-", split=split, size=400, seed=seed)
        return [task.problem(i) for i in range(len(task))]

    train, test = set(problems("train", 0)) | set(problems("train", 1)), set(problems("test", 0))
    assert train and test and not train & test
    assert problems("test", 0) == problems("test", 0)
    assert problems("train", 0) != problems("train", 1)  # the seed changes the order, not the split
    assert all(in_test_split(a, op, b, 0.1) for a, op, b in test)


def test_test_split_is_distinct_when_enumerated():
    task = ArithmeticTask(digits=2, split="test", size=256)
    assert task.num_distinct() > 256
    assert len({task.problem(i) for i in range(256)}) == 256


def test_scoring_is_strict_exact_match():
    assert extract_answer("231") == "231"
    assert extract_answer(" 231<|im_end|>") == "231"
    assert extract_answer("-04\n") == "-04"
    assert extract_answer("23 1") is None and extract_answer("231 or 232") is None and extract_answer("") is None
    assert score("231<|im_end|>", "231") == 1.0
    assert score("232", "231") == 0.0
    assert score("0231", "231") == 0.0


def test_teacher_forgets_carries_only_where_there_is_one():
    rng = random.Random(0)
    assert {teacher_answer(12, "+", 34, drop_prob=0.9, rng=rng) for _ in range(50)} == {46}  # no carry
    assert {teacher_answer(47, "+", 85, drop_prob=0.5, rng=rng) for _ in range(200)} == {132, 122, 32, 22}
    assert {teacher_answer(52, "-", 48, drop_prob=0.5, rng=rng) for _ in range(200)} == {4, 14}
    assert all(teacher_answer(a, "+", b) == a + b for a in range(0, 1000, 37) for b in range(0, 1000, 41))


@pytest.fixture
def counted_builds(monkeypatch):
    """A tiny warm start's params and the list of builds run (one entry per build)."""
    from loongsage.core.tinytask import warmstart

    params = warmstart.WarmStartParams(
        hidden_size=16, num_layers=1, heads=2, kv_heads=1, intermediate_size=32, steps=2, batch_size=4, warmup_steps=1
    )
    calls = []
    real_build = warmstart.build_warm_start
    monkeypatch.setattr(warmstart, "build_warm_start", lambda *a, **k: calls.append(1) or real_build(*a, **k))
    return params, calls


def test_cached_warm_start_builds_once(tmp_path, counted_builds):
    from loongsage.core.tinytask import warmstart
    from loongsage.core.tinytask.builds import INFO_FILE

    params, calls = counted_builds
    first = warmstart.cached_warm_start(params, tmp_path)
    second = warmstart.cached_warm_start(params, tmp_path)
    assert first == second == tmp_path / "models" / params.cache_key() and len(calls) == 1
    assert (first / INFO_FILE).is_file() and (first / "model.safetensors").is_file()
    # no temp folder left (the builders' lock file stays, empty)
    assert [p.name for p in (tmp_path / "models").iterdir() if not p.name.endswith(".lock")] == [first.name]
    other = warmstart.WarmStartParams(**{**params.__dict__, "seed": 1})
    assert other.cache_key() != params.cache_key()
    # the device enters the key only when named (every key from before it existed stays)
    assert "device" not in params.key_params()
    on_gpu = warmstart.WarmStartParams(**{**params.__dict__, "device": "cuda"})
    assert on_gpu.key_params()["device"] == "cuda" and on_gpu.cache_key() != params.cache_key()


def test_concurrent_builders_of_one_warm_start_build_it_once(tmp_path, counted_builds):
    from concurrent.futures import ThreadPoolExecutor

    from loongsage.core.tinytask import warmstart

    params, calls = counted_builds
    with ThreadPoolExecutor(3) as pool:  # each opens the lock file on its own, as processes do
        paths = list(pool.map(lambda _: warmstart.cached_warm_start(params, tmp_path), range(3)))
    assert len(set(paths)) == 1 and len(calls) == 1
