"""End to end through the real launcher and Ray: a shortened tiny/mopd_two_teachers_cpu (MOPD)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import yaml

from loongsage.core.cli import main
from loongsage.core.tinytask.warmstart import WarmStartParams, cached_warm_start

sys.path.insert(0, str(Path(__file__).parent))
from test_grpo_tiny import _metrics, _model_path, _short_run, _trained  # noqa: E402

MOPD = "tiny/mopd_two_teachers_cpu"
SECOND_SOURCE = ["data_sources.1.prompts_per_step=4", "data_sources.1.samples_per_prompt=4"]
# CI-sized models: the student and both teachers fine-tuned for 20 steps each from the default warm
# start instead of the recipe's 300 / 150 / 300 (cached by these params, so built once)
CHEAP_MODELS = [
    "model.builder.params.steps=20",
    *(f"data_sources.{i}.teacher.params.builder.params.steps=20" for i in (0, 1)),
]


def _divergence(name: str, **params) -> list[str]:
    """Overrides that replace the recipe's divergence (Hydra would merge a new mapping into the old params)."""
    return [
        f"algorithm.distill.divergence.name={name}",
        "~algorithm.distill.divergence.params",
        *(f"++algorithm.distill.divergence.params.{k}={v}" for k, v in params.items()),
    ]


def _two_teachers(name: str, *extra: str) -> list[str]:
    return _short_run(MOPD, name, 2, *SECOND_SOURCE, *extra, *CHEAP_MODELS, "evaluation.every_steps=2")


# the top-k path with teacher workers is also taken by test_self_distillation_starts_at_zero, and
# with held teachers by test_held_teachers_under_two_sharded_trainer_ranks_resume
@pytest.mark.parametrize("divergence", ["jsd", pytest.param("topk_kl", marks=pytest.mark.slow)])
def test_two_teachers_score_their_own_sources(launched, divergence):
    """Each source's teacher scores its rows; the PG and GKD branches both run; evaluation per source."""
    args = _two_teachers(f"mopd_{divergence}")
    if divergence == "topk_kl":  # the top-k path: teacher ids and log-probs shipped, the student gathered on them
        args += _divergence("topk_kl", k=4)
    where = launched(args)
    run_dir = where / "runs" / f"mopd_{divergence}"
    rows = _metrics(run_dir)
    trained = _trained(rows)
    assert [r["step"] for r in trained] == [1, 2]
    log = next((where / "log").glob("trainer_*.log")).read_text()
    teachers = {}
    for source, op in (("add", "+"), ("sub", "-")):
        line = next(x for x in log.splitlines() if f"teacher for {source}:" in x)
        teachers[source] = Path(line.split(f"teacher for {source}: ")[1].strip())
        info = json.loads((teachers[source] / "loongsage_warmstart.json").read_text())["params"]
        assert (info["operations"], info["drop_prob"], info["steps"], info["init_from"]) == (op, 0.0, 20, {})
    assert teachers["add"] != teachers["sub"] != _model_path(run_dir)
    student = json.loads((_model_path(run_dir) / "loongsage_warmstart.json").read_text())["params"]
    assert (student["operations"], student["drop_prob"], student["steps"]) == ("+-", 0.6, 20)
    for r in trained:
        assert r["rollout/trajectories"] == 32  # 4 prompts x 4 samples from each source
        for source in ("add", "sub"):
            kl, lp = r[f"train_per_ds/{source}/mopd_kl"], r[f"train_per_ds/{source}/mopd_teacher_logprob"]
            assert math.isfinite(kl) and lp < 0  # teacher log-probs of the student's tokens
            assert r[f"train_per_ds/{source}/gkd"] > 0  # a different model: the divergence is positive
        # the step-level values are the token-weighted mix of the two sources'
        assert (
            min(r["train_per_ds/add/gkd"], r["train_per_ds/sub/gkd"])
            <= r["train/gkd"]
            <= max(r["train_per_ds/add/gkd"], r["train_per_ds/sub/gkd"])
        )
        assert r["train/grad_norm"] > 0
    for key in ("eval/add/accuracy", "eval/sub/accuracy"):
        assert key in rows[0] and key in rows[-1]


def test_self_distillation_starts_at_zero(ray_session, in_tmp, model_cache):
    """The student as its own teacher (one actor shared by both sources): before the first update the
    teacher scores exactly the engine's policy, so the sampled-token KL and the divergence are 0."""
    student = cached_warm_start(WarmStartParams(), model_cache)  # the default warm start, shared with other tests
    args = _short_run(
        MOPD, "self", 2, *SECOND_SOURCE, "model.builder=null", f"model.path={student}", *_divergence("topk_kl", k=8)
    )
    for i in (0, 1):
        args += [f"~data_sources.{i}.teacher.params.builder", f"++data_sources.{i}.teacher.params.path={student}"]
    assert main(args) == 0
    first, second = _trained(_metrics(in_tmp / "runs" / "self"))
    log = next((in_tmp / "log").glob("trainer_*.log")).read_text()
    assert f"teacher for add, sub: {student}" in log  # one teacher actor for the two identical specs
    for source in ("add", "sub"):
        assert first[f"train_per_ds/{source}/mopd_kl"] == pytest.approx(0.0, abs=1e-4)
        assert first[f"train_per_ds/{source}/gkd"] == pytest.approx(0.0, abs=1e-5)
    # after one update the student has moved away from its frozen copy
    assert second["train/gkd"] > 1e-7 and abs(second["train/mopd_kl"]) > 1e-5


def _hydra(value) -> str:
    """A value in Hydra's override syntax."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_hydra(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)


def _held_teachers() -> list[str]:
    """Both sources' teachers held by the trainer's ranks (``name: trainer``), built as in the recipe (a
    new name replaces a spec's params, so the builder is given again)."""
    recipe = yaml.safe_load((Path(__file__).parents[2] / "recipes" / f"{MOPD}.yaml").read_text())
    return [
        f"data_sources.{i}.teacher={_hydra({'name': 'trainer', 'params': src['teacher']['params']})}"
        for i, src in enumerate(recipe["data_sources"])
    ]


HELD = _held_teachers()


def test_teachers_held_by_the_trainer_score_as_teacher_workers(launched):
    """``teacher: {name: trainer}``: the trainer ranks hold the teachers and compute their full-vocabulary
    distribution inside the train step. Same seed, same rollouts: the first step's teacher log-probs,
    divergences, loss and gradient norm equal those of the run with teacher workers (the jsd run of
    test_two_teachers_score_their_own_sources)."""
    steps = {}
    for name, extra in (("jsd", []), ("held", HELD)):
        steps[name] = _trained(_metrics(launched(_two_teachers(f"mopd_{name}", *extra)) / "runs" / f"mopd_{name}"))[0]
    workers, held = steps["jsd"], steps["held"]
    assert workers["rollout/trajectories"] == held["rollout/trajectories"] == 32
    for key in (
        "train_per_ds/add/mopd_teacher_logprob",
        "train_per_ds/sub/mopd_teacher_logprob",
        "train_per_ds/add/gkd",
        "train_per_ds/sub/gkd",
        "train/loss",
        "train/grad_norm",
    ):
        assert held[key] == pytest.approx(workers[key], rel=1e-5, abs=1e-7), key
    assert held["train_per_ds/sub/gkd"] > 0


def test_held_teachers_under_two_sharded_trainer_ranks_resume(ray_session, in_tmp):
    """MOPD with DP 2 under FSDP2 (each rank gets both sources' rows), the teachers held by the trainer
    ranks and sharded as the policy is, the top-k divergence, and a resume: teachers hold no state, so
    the resumed run just goes on scoring with the same teachers."""
    args = _short_run(
        MOPD,
        "mopd_dp2",
        2,
        *SECOND_SOURCE,
        *HELD,
        *CHEAP_MODELS,
        *_divergence("topk_kl", k=4),
        "trainer.world_size=2",
        "checkpoint.every_steps=2",
    )
    assert main(args) == 0
    assert main([*args, "run.total_steps=3", "resume=true"]) == 0
    trained = _trained(_metrics(in_tmp / "runs" / "mopd_dp2"))
    assert [r["step"] for r in trained] == [1, 2, 3]
    for r in trained:
        assert r["rollout/trajectories"] == 32 and r["train/grad_norm"] > 0
        for source in ("add", "sub"):
            assert math.isfinite(r[f"train_per_ds/{source}/mopd_kl"]) and r[f"train_per_ds/{source}/gkd"] > 0
