"""The rollout service at scale, in simulated time: two sources with their own quotas and sampling
over 1,000 simulated engines with long-tailed lengths, under every scheduler, through the real
``RolloutService``, router, mixer, agents and reward worker (:mod:`loongsage.core.sim`)."""

from __future__ import annotations

from collections import Counter

import pytest

from loongsage.core.config import load_config
from loongsage.core.sim.engine import LengthModel
from loongsage.core.sim.rollout import SimulatedRun, scaffold_model, simulate_steps

RECIPE = """
run: {name: sim_service, seed: 1, total_steps: 6}
model: {path: TOKENIZER}
data_sources:
  - name: arith
    reader: {name: arith, params: {split: train, size: 100000}}
    prompts_per_step: 150
    samples_per_prompt: 8
    agent: {name: single_turn, params: {prompt_template: chat}}
    reward: {name: exact_match}
    sampling: {temperature: 1.0, max_new_tokens: 4096}
  - name: sort
    reader: {name: digit_sort, params: {split: train, size: 100000}}
    prompts_per_step: 50
    samples_per_prompt: 8
    agent: {name: single_turn, params: {prompt_template: chat}}
    reward: {name: digit_sort}
    sampling: {temperature: 0.8, top_p: 0.95, max_new_tokens: 2048}
rollout:
  engine: {name: native}
  scheduler: SCHEDULER
algorithm:
  advantage: {name: grpo}
placement: {colocate: false}
"""
STEPS, TRAIN_S, ENGINES = 6, 4.0, 1000
QUOTAS = {"arith": 150, "sort": 50}


def _simulate(scheduler: str, tmp_path) -> SimulatedRun:
    folder = scaffold_model(tmp_path / "model")
    (tmp_path / "sim.yaml").write_text(RECIPE.replace("TOKENIZER", folder).replace("SCHEDULER", scheduler))
    cfg, registry = load_config("sim", config_dir=str(tmp_path))
    lengths = LengthModel(median=256, p99=2560)
    return simulate_steps(cfg, registry, folder, engines=ENGINES, steps=STEPS, train_s=TRAIN_S, lengths=lengths)


@pytest.mark.parametrize(
    "scheduler",
    [
        "{name: sync}",
        "{name: one_step_off}",
        "{name: no_window, params: {max_staleness: 1}}",
        "{name: window_gated, params: {max_staleness: 2}}",
        "{name: windowed_fifo, params: {max_staleness: 2}}",
    ],
)
def test_two_sources_over_a_thousand_engines_keep_their_exact_quotas(scheduler, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = _simulate(scheduler, tmp_path)
    sched = run.scheduler
    seen: Counter = Counter()
    for version, (groups, metrics) in enumerate(run.batches):
        # every batch holds each source's exact quota of whole groups of 8
        assert Counter(g[0].source for g in groups) == QUOTAS
        assert all(len(g) == 8 and len({t.group_id for t in g}) == 1 for g in groups)
        seen.update(g[0].group_id for g in groups)
        # no sample is staler than the scheduler allows
        staleness = max(version - min(t.versions) for g in groups for t in g)
        assert staleness <= sched.max_staleness, (version, staleness)
        assert metrics.get("rollout/staleness_max", 0) <= sched.max_staleness
    assert all(count == 1 for count in seen.values()), "a group trained twice"
    # the buffer holds at most the groups the scheduler lets run ahead: its window of batches
    assert run.buffer_high_water <= (sched.max_staleness + 1) * sum(QUOTAS.values())


def test_the_asynchronous_rollout_hides_the_long_tail(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sync").mkdir()
    (tmp_path / "async").mkdir()
    sync_s = _simulate("{name: sync}", tmp_path / "sync").seconds
    async_s = _simulate("{name: no_window, params: {max_staleness: 1}}", tmp_path / "async").seconds
    # synchronous: every step waits for its longest sample, then trains; asynchronous: the next
    # batch generates while the trainer trains, and a long sample no longer holds its step
    assert sync_s > STEPS * TRAIN_S and async_s < sync_s / 2, (sync_s, async_s)
