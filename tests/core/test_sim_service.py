"""The rollout service at scale, in simulated time: two sources with their own quotas and sampling
over 1,000 simulated engines with long-tailed lengths, under every scheduler, through the real
``RolloutService``, router, mixer, agents, reward worker, engine recovery and checkpoint writer
(:mod:`loongsage.core.sim`); engines killed and silenced during the run, and a checkpoint taken in
the middle of that and resumed over fresh engines."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from loongsage.core.config import load_config
from loongsage.core.rollout.seeds import request_seed
from loongsage.core.sim.engine import LatencyModel, LengthModel
from loongsage.core.sim.faults import random_faults
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
  engine_health_timeout_s: 10
  max_engine_restarts: 100
algorithm:
  advantage: {name: grpo}
placement: {colocate: false}
"""
STEPS, TRAIN_S, ENGINES = 6, 4.0, 1000
QUOTAS = {"arith": 150, "sort": 50}
BUDGETS = {"arith": 4096, "sort": 2048}
LENGTHS = LengthModel(median=256, p99=2560)
SYNC, FIFO = "{name: sync}", "{name: windowed_fifo, params: {max_staleness: 2}}"
HEALTH_TIMEOUT_S = 10.0  # the recipe's rollout.engine_health_timeout_s


def _config(scheduler: str, tmp_path):
    folder = scaffold_model(tmp_path / "model")
    (tmp_path / "sim.yaml").write_text(RECIPE.replace("TOKENIZER", folder).replace("SCHEDULER", scheduler))
    cfg, registry = load_config("sim", config_dir=str(tmp_path))
    return cfg, registry, folder


def _simulate(scheduler: str, tmp_path, **options) -> SimulatedRun:
    cfg, registry, folder = _config(scheduler, tmp_path)
    options.setdefault("steps", STEPS)
    return simulate_steps(cfg, registry, folder, engines=ENGINES, train_s=TRAIN_S, lengths=LENGTHS, **options)


@pytest.fixture(scope="module")
def simulated(tmp_path_factory):
    """One simulated run per scheduler for the module's tests (each takes seconds of CPU)."""
    runs: dict[str, SimulatedRun] = {}

    def run(scheduler: str) -> SimulatedRun:
        if scheduler not in runs:
            folder = tmp_path_factory.mktemp("run")
            with pytest.MonkeyPatch.context() as patch:
                patch.chdir(folder)
                runs[scheduler] = _simulate(scheduler, folder)
        return runs[scheduler]

    return run


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
def test_two_sources_over_a_thousand_engines_keep_their_exact_quotas(scheduler, simulated):
    run = simulated(scheduler)
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


def test_the_asynchronous_rollout_hides_the_long_tail(simulated):
    sync_s = simulated("{name: sync}").seconds
    async_s = simulated("{name: no_window, params: {max_staleness: 1}}").seconds
    # synchronous: every step waits for its longest sample, then trains; asynchronous: the next
    # batch generates while the trainer trains, and a long sample no longer holds its step
    assert sync_s > STEPS * TRAIN_S and async_s < sync_s / 2, (sync_s, async_s)


# ---------------------------------------------------------------- engines failing, and a resume
FAULT_STEPS, CHECKPOINT_AT = 5, 2
WITHIN_S = 3.0  # faults strike in a step's first seconds: within its rollout, and before its update


@pytest.fixture(scope="module")
def faulty(tmp_path_factory):
    """Per scheduler: the fault plan, a run of 5 steps with 5% of the engines killed or silenced at
    random steps and a checkpoint after step 2, and the run resumed from that checkpoint over fresh
    engines, the same faults striking in its steps."""
    runs: dict[str, tuple] = {}

    def run(scheduler: str) -> tuple:
        if scheduler not in runs:
            folder = tmp_path_factory.mktemp("faults")
            faults = random_faults(ENGINES, 0.05, range(FAULT_STEPS), within_s=WITHIN_S, seed=3)
            with pytest.MonkeyPatch.context() as patch:
                patch.chdir(folder)
                cfg, registry, model = _config(scheduler, folder)
                options = dict(
                    engines=ENGINES, steps=FAULT_STEPS, train_s=TRAIN_S, lengths=LENGTHS, faults=faults, run_dir="run"
                )
                whole = simulate_steps(cfg, registry, model, checkpoint_at=CHECKPOINT_AT, **options)
                resumed = simulate_steps(cfg, registry, model, resume=True, **options)
            runs[scheduler] = (faults, whole, resumed)
        return runs[scheduler]

    return run


def _drawn_length(group_id: int, sample: int, source: str) -> int:
    """The length a sample's seed draws: what any engine samples for it (the run's seed is 1)."""
    return LENGTHS.draw(random.Random(request_seed(1, group_id) * 1_000_003 + sample), BUDGETS[source])


def _prompts(batch) -> list[tuple[int, str, int]]:
    return sorted((g[0].group_id, g[0].source, g[0].metadata["record_index"]) for g in batch[0])


def _samples(batch) -> list[tuple]:
    return sorted(
        (t.group_id, t.sample_index, t.response_ids, t.versions, t.status, t.reward) for g in batch[0] for t in g
    )


@pytest.mark.parametrize("scheduler", [SYNC, FIFO])
def test_engines_killed_and_silenced_during_the_run_lose_no_group(scheduler, faulty):
    faults, run, _ = faulty(scheduler)
    # 5% of the engines struck at random steps, killed or silenced while they held requests
    assert len(run.struck) == len(faults) == ENGINES // 20
    assert {kind for *_, kind in run.struck} == {"kill", "silence"}
    assert len({step for step, *_ in run.struck}) == FAULT_STEPS
    trained: Counter = Counter()
    for groups, _ in run.batches:
        assert Counter(g[0].source for g in groups) == QUOTAS
        assert all(len(g) == 8 and len({t.group_id for t in g}) == 1 for g in groups)
        trained.update(g[0].group_id for g in groups)
    # no group trained twice, none lost: the batches hold the first groups of the run, in order
    assert sorted(trained) == list(range(FAULT_STEPS * sum(QUOTAS.values())))
    # every engine struck was replaced, and its requests sent again; the replacements generated (those
    # of the last step's engines too, synchronously: a replacement is routed to as soon as it is loaded)
    router = run.router
    assert router.engine_restarts == len(run.replacements) == len(run.struck) and not router.down
    assert router.requests_redispatched >= len(run.struck)
    assert router.requests_hedged == 0  # equal engines, failing or not: no straggler to copy from
    routed_in_time = [s for s, *_ in run.struck if scheduler == SYNC or s < FAULT_STEPS - 1]
    assert sum(h.calls > 0 for h in run.replacements) >= len(routed_in_time)
    # no stall: a struck request waits at most its strike, one health timeout of silence and one
    # unanswered probe, then generates again from its prompt (at most the longest sample)
    longest = max(len(t.response_ids) for groups, _ in run.batches for g in groups for t in g)
    bound = WITHIN_S + 2 * HEALTH_TIMEOUT_S + longest * LatencyModel().step_s(8) + 0.1
    assert max(run.step_seconds) <= bound, (run.step_seconds, bound)
    # a weight update waits for a silent engine's abort (one timeout), then its probe (one more)
    assert max(run.update_seconds) <= 2 * HEALTH_TIMEOUT_S + 1e-6, run.update_seconds
    if scheduler == SYNC:
        # every sample has exactly the tokens its seed draws, whichever engine (or engines) it ran on
        for version, (groups, _) in enumerate(run.batches):
            for t in (t for g in groups for t in g):
                assert len(t.response_ids) == _drawn_length(t.group_id, t.sample_index, t.source)
                assert t.versions == [version] * len(t.response_ids)


@pytest.mark.parametrize("scheduler", [SYNC, FIFO])
def test_a_run_resumed_amid_the_faults_trains_what_the_uninterrupted_one_does(scheduler, faulty):
    """What is exact across a resume: the prompts and group ids of every batch (synchronous, and
    windowed by dispatch order), the groups the checkpoint held (the first batch), every token
    generated before the checkpoint; synchronously, every token. What is not, asynchronously: a sample
    still generating after the resume is cut by the next update wherever it has got to then, and a
    continuation's seed depends on that point; and a group may start under another version."""
    _, whole, resumed = faulty(scheduler)
    assert resumed.first_step == CHECKPOINT_AT and len(resumed.batches) == FAULT_STEPS - CHECKPOINT_AT
    after = whole.batches[CHECKPOINT_AT:]
    assert [_prompts(a) for a in after] == [_prompts(b) for b in resumed.batches]
    assert _samples(after[0]) == _samples(resumed.batches[0])
    if scheduler == SYNC:
        assert [_samples(a) for a in after] == [_samples(b) for b in resumed.batches]
        return
    for a, b in zip(after, resumed.batches):
        for x, y in zip(_samples(a), _samples(b)):
            before = [(tok, v) for tok, v in zip(x[2], x[3]) if v < CHECKPOINT_AT]
            assert before == [(tok, v) for tok, v in zip(y[2], y[3]) if v < CHECKPOINT_AT]


def test_a_slow_engine_holds_only_the_synchronous_step_that_finds_it(tmp_path, monkeypatch):
    """One engine of 64 ten times slower, one request of 8 samples per engine and step: the slow
    engine's first answer shows its pace, and from the next step on each request routed to it is
    also sent to an idle engine at once. Those steps take what they take with every engine fast."""
    monkeypatch.chdir(tmp_path)
    recipe = RECIPE.replace("prompts_per_step: 150", "prompts_per_step: 24").replace(
        "prompts_per_step: 50", "prompts_per_step: 8"
    )
    folder = scaffold_model(tmp_path / "model")
    (tmp_path / "sim.yaml").write_text(recipe.replace("TOKENIZER", folder).replace("SCHEDULER", SYNC))
    cfg, registry = load_config("sim", config_dir=str(tmp_path))
    options = dict(engines=64, steps=4, train_s=TRAIN_S, lengths=LENGTHS)
    fast = simulate_steps(cfg, registry, folder, **options)
    slow = simulate_steps(cfg, registry, folder, slowdown={0: 10.0}, **options)
    for version, (groups, _) in enumerate(slow.batches):
        assert Counter(g[0].source for g in groups) == {"arith": 24, "sort": 8}
        assert sorted(g[0].group_id for g in groups) == list(range(32 * version, 32 * (version + 1)))
        for t in (t for g in groups for t in g):  # the tokens its seed draws, whichever engine answered
            assert len(t.response_ids) == _drawn_length(t.group_id, t.sample_index, t.source)
    assert slow.step_seconds[0] > 1.25 * fast.step_seconds[0]  # not known yet: its request holds the step
    assert all(s <= 1.25 * f for s, f in zip(slow.step_seconds[1:], fast.step_seconds[1:])), (
        slow.step_seconds,
        fast.step_seconds,
    )
    assert slow.router.requests_hedged == len(slow.batches) - 1


def test_a_simulated_trainer_takes_the_time_of_the_tokens_it_trains(tmp_path):
    """A :class:`SimulatedTrainer` step lasts 6 x params x the batch's tokens at its MFU, plus the
    seams: long-tailed responses make it vary from step to step, and the run's simulated time is the
    sum of its phases (a synchronous run: nothing overlaps)."""
    from loongsage.core.sim.trainer import SimulatedTrainer

    cfg, registry, folder = _config(SYNC, tmp_path)
    trainer = SimulatedTrainer(matmul_params=1.72e9)
    run = simulate_steps(cfg, registry, folder, engines=64, steps=3, train_s=trainer, lengths=LENGTHS)
    for (groups, _), seconds in zip(run.batches, run.train_seconds, strict=True):
        tokens = sum(len(t.prompt_ids) + len(t.response_ids) for group in groups for t in group)
        assert tokens > 200 * 8 * 100  # every trajectory's prompt and response
        expected = 6 * 1.72e9 * tokens / (trainer.peak_flops * trainer.mfu) + trainer.seams_s
        assert seconds == pytest.approx(expected, rel=1e-12)
    assert len(set(run.train_seconds)) == 3  # the batches' tokens differ
    phases = sum(run.step_seconds) + sum(run.train_seconds) + sum(run.update_seconds)
    assert run.seconds == pytest.approx(phases, rel=1e-6, abs=1e-6)
    with pytest.raises(ValueError, match="need positive figures"):
        SimulatedTrainer(matmul_params=1e9, mfu=1.5)
