"""MOPD configuration: the recipe validates; every refusal is one line naming the key and what is
allowed; teacher models built by the warm-start machinery are keyed by their parameters."""

from __future__ import annotations

from pathlib import Path

import pytest

from loongsage.core.config import load_config
from loongsage.core.distill import check_same_vocabulary, split_teacher_spec
from loongsage.core.tinytask.warmstart import WarmStartParams
from loongsage.core.types import ConfigError

REPO = Path(__file__).resolve().parents[2]
MOPD = "tiny/mopd_two_teachers_cpu"


@pytest.fixture(autouse=True)
def at_repo(monkeypatch):
    monkeypatch.chdir(REPO)


def config_error(overrides: list[str], recipe: str = MOPD) -> str:
    with pytest.raises(ConfigError) as exc:
        load_config(recipe, overrides)
    text = str(exc.value)
    assert "\n" not in text, f"error spans several lines: {text!r}"
    return text


def test_mopd_recipe_validates() -> None:
    cfg, registry = load_config(MOPD)
    assert [s.name for s in cfg.data_sources] == ["add", "sub"]
    distill = cfg.algorithm.distill
    assert distill.pg_coef > 0 and 0 < distill.gkd_coef <= 1 and distill.divergence["name"] in registry.names("kl")
    for src, op in zip(cfg.data_sources, "+-", strict=True):
        source, backend = split_teacher_spec(src.teacher)
        assert backend["name"] == "embedded" and "builder" not in backend["params"]
        params = source["builder"]["params"]
        assert params["operations"] == op and params["drop_prob"] == 0.0 and params["init_from"] == {}
        assert src.reader["params"]["operations"] == op == src.eval_reader["params"]["operations"]
    assert registry.entry("teacher", "embedded").factory.kind == "teacher"


def test_distill_without_a_teacher_on_every_source_is_refused() -> None:
    text = config_error(["data_sources.1.teacher=null"])
    assert text.startswith("data_sources[1].teacher: algorithm.distill is set, so every data source needs a teacher")
    assert "'sub' has none" in text


def test_a_teacher_without_distill_is_refused() -> None:
    text = config_error(["algorithm.distill=null"])
    assert text.startswith("data_sources[0].teacher is set but algorithm.distill is null")
    assert "drop the teacher" in text


def test_unknown_divergence_lists_the_known_ones() -> None:
    text = config_error(["algorithm.distill.divergence={name: reverse_kl}"])
    assert text.startswith("algorithm.distill.divergence.name: unknown kl 'reverse_kl'; known:")
    for name in ("full_vocab_kl", "jsd", "k2", "k3", "topk_jsd", "topk_kl"):
        assert name in text


@pytest.mark.parametrize(
    "overrides,expected",
    [
        (["algorithm.distill.gkd_coef=1.5"], "algorithm.distill.gkd_coef=1.5: must be in [0, 1]"),
        (["algorithm.distill.pg_coef=-1"], "algorithm.distill.pg_coef=-1.0: must be >= 0"),
        (
            ["algorithm.distill.pg_coef=0", "algorithm.distill.gkd_coef=0", "algorithm.distill.divergence=null"],
            "pg_coef=0 and gkd_coef=0: distillation would do nothing",
        ),
        (
            ["algorithm.distill.gkd_coef=0.5", "algorithm.distill.divergence=null"],
            "algorithm.distill.divergence=null: gkd_coef=0.5 needs one",
        ),
        (["algorithm.distill.gkd_coef=0"], "divergence: set but gkd_coef=0"),
        (
            [
                "algorithm.distill.divergence.name=topk_kl",
                "~algorithm.distill.divergence.params.beta",
                "++algorithm.distill.divergence.params.k=0",
            ],
            "algorithm.distill.divergence.params.k=0: must be >= 1",
        ),
        (
            ["algorithm.distill.divergence={name: jsd, params: {beta: 1.0}}"],
            "algorithm.distill.divergence.params.beta=1.0: must be in (0, 1)",
        ),
        (["algorithm.kl={name: topk_kl}", "algorithm.kl_coef=0.1"], "algorithm.kl.name='topk_kl' consumes 'topk'"),
    ],
)
def test_bad_distill_values(overrides, expected) -> None:
    assert expected in config_error(overrides)


@pytest.mark.parametrize(
    "overrides,expected",
    [
        (["data_sources.0.teacher.name=nope"], "data_sources[0].teacher.name: unknown teacher 'nope'; known: embedded"),
        (["++data_sources.0.teacher.params.path=/models/t"], "set exactly one of path (an HF folder) or builder"),
        (["data_sources.0.teacher.params.builder=null"], "got neither"),
        (
            ["~data_sources.0.teacher.params.builder", "++data_sources.0.teacher.params.path=/nonexistent"],
            "data_sources[0].teacher.params.path='/nonexistent': not an HF model folder",
        ),
        (
            ["++data_sources.0.teacher.params.lr=0.1"],
            "data_sources[0].teacher.params.lr: unknown key; allowed: device, dtype",
        ),
        (["++data_sources.0.teacher.params.model_path=/x"], "data_sources[0].teacher.params.model_path: unknown key"),
        (
            ["data_sources.1.teacher.params.builder.params.init_from={hidden_size: 32}"],
            "hidden_size=64: must equal the init_from model's (32)",
        ),
        (["data_sources.1.teacher.params.builder.params.init_from={depth: 3}"], "init_from.depth: unknown key"),
        (
            ["data_sources.0.teacher={name: trainer, params: {builder: {name: tiny_arith}, dtype: float32}}"],
            "data_sources[0].teacher.params.dtype: a teacher held by the trainer is built like the policy",
        ),
        (
            ["data_sources.0.teacher={name: trainer, params: {builder: {name: tiny_arith}}}"],
            "data_sources: some teachers are held by the trainer (name: trainer) and some run in teacher workers",
        ),
    ],
)
def test_bad_teacher_specs(overrides, expected) -> None:
    assert expected in config_error(overrides)


def test_teacher_vocabulary_must_match_the_students(tmp_path) -> None:
    from loongsage.core.tinytask.tiny_model import build_tiny_qwen3

    small = dict(hidden_size=16, num_layers=1, heads=2, kv_heads=1, intermediate_size=32)
    build_tiny_qwen3(tmp_path / "a", vocab_size=300, **small)
    build_tiny_qwen3(tmp_path / "b", vocab_size=300, seed=1, **small)
    build_tiny_qwen3(tmp_path / "c", vocab_size=320, **small)
    check_same_vocabulary(str(tmp_path / "a"), str(tmp_path / "b"), "data_sources[0].teacher")  # same tokenizer
    with pytest.raises(ConfigError, match=r"^data_sources\[1\]\.teacher: the teacher at .* has another vocabulary"):
        check_same_vocabulary(str(tmp_path / "a"), str(tmp_path / "c"), "data_sources[1].teacher")


def test_warm_start_keys_with_init_from() -> None:
    # the field's default leaves every existing key unchanged (no cache invalidated)
    assert WarmStartParams().cache_key() == "tiny-qwen3-arith-588138b29ec65304"
    teacher = WarmStartParams(name="t", operations="-", drop_prob=0.0, steps=10, init_from={})
    spelled = WarmStartParams(
        name="t", operations="-", drop_prob=0.0, steps=10, init_from={"name": "tiny-qwen3-arith", "steps": 1000}
    )
    assert teacher.cache_key() == spelled.cache_key()  # {} and the spelled-out defaults: one base
    other_base = WarmStartParams(name="t", operations="-", drop_prob=0.0, steps=10, init_from={"steps": 999})
    assert other_base.cache_key() != teacher.cache_key()
    with pytest.raises(ValueError, match="one level only"):
        WarmStartParams(init_from={"init_from": {}})
