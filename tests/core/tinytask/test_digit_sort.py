"""The digit-sorting task: data source and splits, imperfect teacher, reward, two-task warm start."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from loongsage.core.tinytask.digit_sort import (
    DigitSortReward,
    DigitSortTask,
    extract_answer,
    in_test_split,
    score,
    sort_digits,
    teacher_answer,
)
from loongsage.core.tinytask.tokenizer import build_tokenizer
from loongsage.core.types import ConfigError, DataRecord, DataSource, Trajectory


def _trajectory(text: str) -> Trajectory:
    return Trajectory(
        source="sort",
        group_id=0,
        sample_index=0,
        prompt_ids=[1],
        response_ids=[2],
        loss_mask=[1],
        rollout_logprobs=[0.0],
        versions=[0],
        response_text=text,
    )


def _record(label, digits: str = "") -> DataRecord:
    return DataRecord(source="sort", index=5, prompt=f"sort {digits}=", label=label)


# ------------------------------------------------------------------------------ data source


def test_task_is_a_data_source_with_sorted_labels():
    task = DigitSortTask(split="train", size=300)
    assert isinstance(task, DataSource)
    for i in range(len(task)):
        record = task[i]
        assert isinstance(record, DataRecord) and record.index == i and record.source == "digit_sort"
        digits = record.metadata["digits"]
        assert 3 <= len(digits) == record.metadata["length"] <= 20 and digits.isdigit()
        assert record.label == "".join(sorted(digits)) == sort_digits(digits)
        assert record.prompt == [{"role": "user", "content": f"sort {digits}="}]
    assert DigitSortTask(split="test", size=4, prompt_format="text")[2].prompt.startswith("sort ")


def test_lengths_are_spread_over_the_whole_range():
    task = DigitSortTask(min_len=3, max_len=20, split="train", size=2000)
    counts = Counter(len(task.problem(i)) for i in range(len(task)))
    assert set(counts) == set(range(3, 21))
    assert max(counts.values()) < 2 * min(counts.values())  # uniform lengths, roughly


@pytest.mark.parametrize("size", [400, 30_000])  # distinct (held-out sized) and per-index sampled splits
def test_splits_are_disjoint_and_deterministic(size):
    def lists(split, seed, n=400):
        task = DigitSortTask(min_len=2, max_len=6, split=split, size=size, seed=seed)
        return [task.problem(i) for i in range(n)]

    train, test = set(lists("train", 0)) | set(lists("train", 1)), set(lists("test", 0))
    assert train and test and not train & test
    assert lists("test", 0) == lists("test", 0)
    assert lists("train", 0) != lists("train", 1)  # the seed changes the draw, not the split
    assert all(in_test_split(d, 0.1) for d in test) and not any(in_test_split(d, 0.1) for d in train)


def test_every_short_list_lands_in_exactly_one_split():
    universe = {f"{n:03d}" for n in range(1000)}
    test = {d for d in universe if in_test_split(d, 0.1)}
    assert 60 < len(test) < 140  # about test_fraction of them
    train_task = DigitSortTask(min_len=3, max_len=3, split="train", size=5000)
    test_task = DigitSortTask(min_len=3, max_len=3, split="test", size=5000)
    assert {train_task.problem(i) for i in range(5000)} <= universe - test
    assert {test_task.problem(i) for i in range(5000)} == test  # the whole (small) split, then cycles


def test_held_out_split_is_distinct():
    task = DigitSortTask(split="test", size=256)
    assert task.num_distinct() == 256 and len({task.problem(i) for i in range(256)}) == 256
    assert DigitSortTask(split="train", size=50_000).num_distinct() is None


@pytest.mark.parametrize(
    "kwargs",
    [
        {"min_len": 0},
        {"min_len": 5, "max_len": 4},
        {"max_len": 65},
        {"split": "val"},
        {"test_fraction": 1.0},
        {"size": 0},
        {"prompt_format": "xml"},
    ],
)
def test_bad_params_are_refused(kwargs):
    with pytest.raises(ValueError):
        DigitSortTask(**kwargs)
    with pytest.raises(IndexError):
        DigitSortTask(size=3).problem(3)


def test_an_empty_split_is_an_error_not_a_hang():
    # 10 one-digit lists, about one in the test split at 0.1; at 0.001 almost surely none
    with pytest.raises(ValueError, match="no list"):
        DigitSortTask(min_len=1, max_len=1, split="test", size=5, test_fraction=0.001)


def test_tokenizer_encodes_prompts_and_answers_compactly():
    tok = build_tokenizer()
    task = DigitSortTask(split="test", size=64)
    for i in range(64):
        record = task[i]
        n = len(record.metadata["digits"])
        assert len(tok(record.prompt[0]["content"], add_special_tokens=False)["input_ids"]) == n + 5  # s|or|t|' '|=
        answer = tok(record.label + tok.eos_token, add_special_tokens=False)["input_ids"]
        assert len(answer) == n + 1 and tok.decode(answer[:-1]) == record.label  # one token per digit + eos
    lengths = [len(task[i].label) + 1 for i in range(64)]
    assert min(lengths) <= 6 and max(lengths) >= 19  # responses of about 4 to 21 tokens


# ------------------------------------------------------------------------------ teacher


def test_teacher_forgets_repeats_at_the_ends_only():
    rng = random.Random(0)
    assert {teacher_answer("90471", drop_prob=0.9, rng=rng) for _ in range(50)} == {"01479"}  # no repeats
    assert {teacher_answer("4155", drop_prob=0.9, rng=rng) for _ in range(50)} >= {"1455", "145"}
    assert {teacher_answer("4155", drop_prob=0.5, rng=rng) for _ in range(100)} == {"1455", "145"}
    assert {teacher_answer("3113", drop_prob=0.5, rng=rng) for _ in range(100)} == {"1133", "113", "133", "13"}
    assert {teacher_answer("52225", drop_prob=0.5, rng=rng) for _ in range(100)} == {"22255", "255", "2225", "25"}
    assert {teacher_answer("72227", drop_prob=0.9, rng=rng) for _ in range(50)} <= {"22277", "277", "2227", "27"}
    assert {teacher_answer("353", drop_prob=0.9, rng=rng) for _ in range(50)} == {"335", "35"}
    assert {teacher_answer("1511", drop_prob=0.9, rng=rng) for _ in range(50)} <= {"1115", "15"}
    assert {teacher_answer("5355", drop_prob=0.9, rng=rng) for _ in range(50)} <= {"3555", "35"}
    assert {teacher_answer("2552", drop_prob=0.9, rng=rng) for _ in range(50)} <= {"2255", "225", "255", "25"}
    assert {teacher_answer("777", drop_prob=0.5, rng=rng) for _ in range(50)} == {"777", "7"}  # one end
    assert {teacher_answer("9299", drop_prob=0.0, rng=rng) for _ in range(20)} == {"2999"}
    # the middle is never touched: "4" stays twice
    assert all(teacher_answer("14449", drop_prob=1.0, rng=rng) == "14449" for _ in range(20))
    assert teacher_answer("1144499", drop_prob=1.0, rng=rng) == "14449"
    task = DigitSortTask(split="train", size=500)
    assert all(teacher_answer(task.problem(i)) == task[i].label for i in range(500))
    with pytest.raises(ValueError):
        teacher_answer("12a")
    with pytest.raises(ValueError):
        teacher_answer("")
    with pytest.raises(ValueError):
        teacher_answer("١٢")  # other scripts' digits


def _repeated_ends(label: str) -> int:
    if len(set(label)) == 1:
        return int(len(label) > 1)
    return (label.count(label[0]) > 1) + (label.count(label[-1]) > 1)


def test_teacher_is_wrong_often_enough_for_rl_to_matter():
    task = DigitSortTask(split="train", size=4000)
    rng = random.Random(1)
    affected = wrong = 0
    for i in range(len(task)):
        digits, label = task.problem(i), task[i].label
        answer = teacher_answer(digits, drop_prob=0.6, rng=rng)
        if _repeated_ends(label):
            affected += 1
            wrong += answer != label
            assert sorted(set(answer)) == sorted(set(label)) and len(answer) < len(label) or answer == label
        else:
            assert answer == label
    assert 0.63 < affected / len(task) < 0.75  # an end digit repeats in about 69% of 3-20 digit lists
    assert 0.6 < wrong / affected < 0.8  # and the teacher drops those repeats with drop_prob at each end


# ------------------------------------------------------------------------------ reward


def test_reward_is_exact_match_after_normalisation():
    reward = DigitSortReward()
    for text in ("01479", " 01479\n", "01479<|im_end|>", "0 1 4 7 9", "0,1,4,7,9", "0, 1, 4, 7, 9"):
        assert reward(_trajectory(text), _record("01479")) == 1.0, text
    for text in (
        "0147",
        "014799",
        "01497",
        "1479",
        "",
        " ",
        "x01479",
        "01479.",
        "-01479",
        "01479\n01479",
        "sorted: 01479",
        "0\t1479",
        "0;1;4;7;9",
        "٠١٤٧٩",
        "０１４７９",
        "01479 " + "9" * 5000,
    ):
        assert reward(_trajectory(text), _record("01479")) == 0.0, text
    assert score("01479", "01479") == 1.0 and extract_answer("0 1 4") == "014" and extract_answer("a") is None


def test_reward_survives_hostile_outputs():
    reward = DigitSortReward(partial_credit=0.5)
    label = "0123456789"
    for text in (
        "\x00" * 100,
        "<|im_end|>" * 1000,
        "9" * 100_000,
        "🙂" * 50,
        "0" + "," * 10_000 + "1",
        "\ud800",
        "<|im_start|>assistant\n0123456789",
    ):
        value = reward(_trajectory(text), _record(label))
        assert 0.0 <= value < 1.0, text[:20]
    with pytest.raises(ValueError, match="no label"):
        DigitSortReward()(_trajectory("1"), _record(None))
    assert DigitSortReward()(_trajectory("0123"), _record(123)) == 0.0  # labels compare as strings
    assert DigitSortReward()(_trajectory("123"), _record(123)) == 1.0


def test_partial_credit_never_reaches_one_for_a_wrong_answer():
    assert score("0147", "01479", partial_credit=0.5) == pytest.approx(0.5 * 4 / 5)
    assert score("014799", "01479", partial_credit=0.5) == pytest.approx(0.5 * 5 / 6)
    assert score("97410", "01479", partial_credit=0.5) == pytest.approx(0.5 * 1 / 5)
    assert score("sorted", "01479", partial_credit=0.5) == 0.0  # unreadable: nothing
    assert score("01479", "01479", partial_credit=0.9) == 1.0
    rng = random.Random(0)
    for _ in range(500):
        label = sort_digits("".join(rng.choice("0123456789") for _ in range(rng.randint(1, 20))))
        text = "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 22)))
        value = score(text, label, partial_credit=0.99)
        assert value == 1.0 if text == label else 0.0 <= value < 1.0
    for bad in (-0.1, 1.0, 2.0):
        with pytest.raises(ValueError):
            DigitSortReward(partial_credit=bad)


def test_reward_and_data_source_are_registered():
    from loongsage.core.plugins import load_registry

    registry = load_registry()
    reward = registry.create("reward", {"name": "digit_sort", "params": {"partial_credit": 0.25}}, "r")
    assert isinstance(reward, DigitSortReward) and reward.partial_credit == 0.25
    with pytest.raises(ConfigError):
        registry.create("reward", {"name": "digit_sort", "params": {"partial_credit": 1.0}}, "r")
    source = registry.create("data_source", {"name": "digit_sort", "params": {"split": "test", "size": 8}}, "d")
    assert isinstance(source, DigitSortTask) and len(source) == 8


# ------------------------------------------------------------------------------ warm start


def test_existing_warm_start_cache_keys_are_unchanged():
    """The default warm start's key (and those of the MOPD recipe's fine-tuned models) must never
    move: users' caches and other tests depend on them."""
    from loongsage.core.tinytask.warmstart import BUILDER_VERSION, WarmStartParams

    assert BUILDER_VERSION == 1
    assert WarmStartParams().cache_key() == "tiny-qwen3-arith-588138b29ec65304"
    assert WarmStartParams(sort=None).cache_key() == "tiny-qwen3-arith-588138b29ec65304"
    student = WarmStartParams(
        name="tiny-arith-mopd-student",
        operations="+-",
        drop_prob=0.6,
        steps=300,
        batch_size=64,
        warmup_steps=10,
        init_from={},
    )
    assert student.cache_key() == "tiny-arith-mopd-student-a3dcd604ef5754a6"
    teacher = WarmStartParams(
        name="tiny-arith-teacher-add",
        operations="+",
        drop_prob=0.0,
        steps=150,
        batch_size=64,
        warmup_steps=10,
        init_from={},
    )
    assert teacher.cache_key() == "tiny-arith-teacher-add-5bf14114af861bfe"


def test_two_task_warm_start_params_have_keys_of_their_own():
    from loongsage.core.tinytask.warmstart import SortWarmStart, WarmStartParams

    mixed = WarmStartParams(sort={})
    assert mixed.cache_key() != WarmStartParams().cache_key()
    assert WarmStartParams(sort={"fraction": 0.5, "max_len": 20}).cache_key() == mixed.cache_key()
    assert WarmStartParams(sort={"drop_prob": 0.7}).cache_key() != mixed.cache_key()
    assert mixed.sort_params() == SortWarmStart()
    # a base that itself trains both tasks is keyed by its sort params too
    on_mixed = WarmStartParams(steps=10, init_from={"sort": {}})
    assert on_mixed.cache_key() != WarmStartParams(steps=10, init_from={}).cache_key()
    task = mixed.sort_task("test", 16)
    assert isinstance(task, DigitSortTask) and (task.min_len, task.max_len) == (3, 20)
    for bad in (
        {"fraction": 1.0},
        {"fraction": 0},
        {"drop_prob": 1.5},
        {"min_len": 0},
        {"max_len": 99},
        {"lenght": 3},
        [1],
    ):
        with pytest.raises(ValueError):
            WarmStartParams(sort=bad)
    with pytest.raises(ValueError, match="arithmetic only"):
        WarmStartParams().sort_params()


def test_two_task_warm_start_trains_on_both_tasks(tmp_path, monkeypatch):
    """Each SFT batch holds round(batch_size * fraction) sorting examples, the rest arithmetic; the
    model builds and is cached under its own key."""
    from loongsage.core.tinytask import warmstart

    seen = []
    real = warmstart.sft_tensors
    monkeypatch.setattr(warmstart, "sft_tensors", lambda tok, p, a: seen.append(list(p)) or real(tok, p, a))
    params = warmstart.WarmStartParams(
        hidden_size=16,
        num_layers=1,
        heads=2,
        kv_heads=1,
        intermediate_size=32,
        steps=2,
        batch_size=8,
        warmup_steps=1,
        sort={"fraction": 0.25},
    )
    path = warmstart.cached_warm_start(params, tmp_path)
    assert path.name == params.cache_key() and (path / "model.safetensors").is_file()
    assert len(seen) == 2
    for prompts in seen:
        assert sum("sort " in p for p in prompts) == 2 and sum("+" in p for p in prompts) == 6
