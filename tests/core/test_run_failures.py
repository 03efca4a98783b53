"""How a run that stops is told, and what is refused before it starts, without starting Ray.

What a failure becomes (``failures.explain``): one line naming what happened and what to do,
from real exceptions (a write to a full device, torch's own short-write error, Ray's task error
around an actor's exception). What ``resume=true`` checks in the latest checkpoint before Ray
starts, what a placement may ask of this machine, the group size a group-relative estimator needs,
the evaluation readers' ``on_bad_row``, and a run folder that already holds a run. The end-to-end
counterparts (signals, a dead actor, a full disk, through the launcher) are in
tests/e2e/test_run_failures.py.
"""

from __future__ import annotations

import asyncio
import errno
import gc
import json
import os
import signal
import sys
from pathlib import Path

import pytest
import torch

from loongsage.core import cli
from loongsage.core.checkpoint import check_resumable
from loongsage.core.config import load_config
from loongsage.core.failures import (
    RunError,
    Stopped,
    explain,
    install_stop_handlers,
    quiet_stopped_tasks,
    restore_previous_handlers,
)
from loongsage.core.types import BadRecordError, ConfigError
from loongsage.core.validation import check_machine

RECIPE = "tiny/grpo_arith_cpu"


# ----------------------------------------------------------------------------- explain
def _raised(fn) -> BaseException:
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - the exception is the test's subject
        return exc
    raise AssertionError("did not raise")


def _ray_task_error(function_name: str, cause: BaseException) -> BaseException:
    """What ``ray.get`` raises for an exception in an actor method: Ray's own class, built as Ray builds it."""
    from ray.exceptions import RayTaskError

    return RayTaskError(
        function_name, "Traceback (most recent call last):\n  ...", cause, proctitle=f"ray::{function_name}"
    ).as_instanceof_cause()


def _checkpoint(run_dir: Path, step: int, sources=("arith",), *, trainer: bytes | None = None) -> Path:
    path = run_dir / "checkpoints" / f"step_{step:06d}"
    path.mkdir(parents=True)
    (path / "controller.json").write_text(
        json.dumps(
            {
                "step": step,
                "version": step,
                "next_group_id": 0,
                "mixer": {s: {"epoch": 0, "offset": 0} for s in sources},
            }
        )
    )
    torch.save({"model": {"w": torch.zeros(64)}, "steps": step}, path / "trainer.pt")
    torch.save({"rng": torch.zeros(4)}, path / "rng_rank0.pt")
    if trainer is not None:
        (path / "trainer.pt").write_bytes(trainer)
    return path


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux)")
def test_a_full_disk_is_named_from_an_oserror_or_torchs_short_write_anywhere_in_the_chain(tmp_path) -> None:
    run_dir = tmp_path / "runs" / "r"
    _checkpoint(run_dir, 4)
    enospc = _raised(lambda: open("/dev/full", "w").write("x" * 100_000))
    assert isinstance(enospc, OSError) and enospc.errno == errno.ENOSPC

    def wrapped():
        try:
            open("/dev/full", "w").write("x" * 100_000)
        except OSError as exc:
            raise RuntimeError("writing the metrics failed") from exc

    # torch reports ENOSPC as "unexpected pos N vs M", the errno lost; raised in an actor, Ray wraps it
    short = _raised(lambda: torch.save({"x": torch.zeros(100_000)}, "/dev/full"))
    assert "unexpected pos" in str(short) and not isinstance(short, OSError)
    for exc in (enospc, _raised(wrapped), _ray_task_error("TrainerWorker.save", short)):
        out = explain(exc, run_dir=run_dir, step=5, total_steps=10)
        assert out.code == 1
        assert out.message.startswith("no space left on device while writing "), out.message
        assert "free some space there" in out.message and "after 5 of 10 steps" in out.message
        assert out.message.endswith(f"continue from {run_dir}/checkpoints/step_000004") and "\n" not in out.message


def test_a_path_that_cannot_be_written_is_named(tmp_path) -> None:
    for code in (errno.EROFS, errno.EACCES):
        exc = OSError(code, os.strerror(code), str(tmp_path / "runs/r/metrics.jsonl"))
        out = explain(exc, run_dir=tmp_path / "runs/r", step=2, total_steps=3)
        assert out.message.startswith(
            f"cannot write {tmp_path}/runs/r/metrics.jsonl: {os.strerror(code)} after 2 of 3 "
            f"steps; make {tmp_path}/runs/r writable again"
        ), out.message
        assert "resume=true to start it again (no checkpoint was written yet)" in out.message


def test_an_actors_exception_names_its_type_message_and_actor(tmp_path) -> None:
    cause = _raised(lambda: 1 / 0)
    out = explain(_ray_task_error("RewardWorker.score", cause), run_dir=tmp_path, step=3, total_steps=10)
    assert out.code == 1
    assert out.message.startswith(
        "the run failed after 3 of 10 steps: ZeroDivisionError: division by zero (in the "
        "reward actor, RewardWorker.score); fix the cause, then run the same command with "
        "resume=true"
    ), out.message


def test_a_gpu_out_of_memory_names_the_knobs_that_make_room(tmp_path) -> None:
    # torch's own message (its class; a CUDA allocation is not to be had on this machine)
    oom = torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 2.32 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
        "1.07 GiB is free. Including non-PyTorch memory, this process has 78.11 GiB memory in use. Of the "
        "allocated memory 61.20 GiB is allocated by PyTorch, and 14.30 GiB is reserved by PyTorch but "
        "unallocated. If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=..."
    )
    out = explain(_ray_task_error("TrainerWorker.train_step", oom), run_dir=tmp_path, step=1, total_steps=8)
    assert out.code == 1 and "\n" not in out.message
    assert out.message.startswith(
        "a GPU ran out of memory after 1 of 8 steps (in the trainer actor, TrainerWorker.train_step): CUDA out "
        "of memory. Tried to allocate 2.32 GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.07 GiB is "
        "free. Including non-PyTorch memory, this process has 78.11 GiB memory in use; lower "
        "trainer.micro_batch_tokens"
    ), out.message
    assert "placement.release_engine_memory=true" in out.message and "PYTORCH_CUDA_ALLOC_CONF" not in out.message
    assert out.message.endswith("resume=true to start it again (no checkpoint was written yet)")


def test_signals_and_refusals_keep_their_exit_codes(tmp_path, monkeypatch) -> None:
    _checkpoint(tmp_path, 2)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    out = explain(KeyboardInterrupt(), run_dir=tmp_path, step=2, total_steps=9)
    assert (out.code, out.message) == (
        130,
        "stopped by SIGINT after 2 of 9 steps; Ray was shut down; run the same "
        f"command with resume=true to continue from {tmp_path}/checkpoints/step_000002",
    )
    assert explain(Stopped(signal.SIGTERM), run_dir=tmp_path).code == 143
    monkeypatch.setenv("RAY_ADDRESS", "head-node:6379")  # a joined cluster is not shut down, only left
    assert explain(Stopped(signal.SIGTERM), run_dir=tmp_path, step=2, total_steps=9).message.startswith(
        "stopped by SIGTERM after 2 of 9 steps; its actors on the Ray cluster at head-node:6379 were stopped; run "
    )
    monkeypatch.delenv("RAY_ADDRESS")
    # a refusal raised in an actor is still the refusal, in its own words
    out = explain(_ray_task_error("RewardWorker.score", BadRecordError("data.jsonl row 3: missing key 'prompt'")))
    assert (out.code, out.message) == (2, "data.jsonl row 3: missing key 'prompt'")
    out = explain(RunError("wandb tracker: wandb.init failed"), run_dir=tmp_path / "none")
    assert out.message == (
        "wandb tracker: wandb.init failed; then run the same command with resume=true to start it "
        "again (no checkpoint was written yet)"
    )


@pytest.mark.parametrize("quiet", [False, True])
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_that_lands_in_another_task_stops_the_run_and_is_not_reported_again(signum, quiet, caplog) -> None:
    """The handler raises in whatever task runs: the stop must leave that task and end the run (a
    plain BaseException would stay in it), and the task, which keeps it as its exception too, must
    not be logged as never retrieved once collected, after the launcher's one line."""

    async def run() -> None:
        if quiet:
            asyncio.get_running_loop().set_exception_handler(quiet_stopped_tasks)

        async def flush() -> None:
            os.kill(os.getpid(), signum)  # handled at the next bytecode: in this task
            await asyncio.sleep(5)

        asyncio.get_running_loop().create_task(flush())
        await asyncio.sleep(5)

    install_stop_handlers()
    try:
        with pytest.raises(Stopped if signum == signal.SIGTERM else KeyboardInterrupt):
            asyncio.run(run())
    finally:
        restore_previous_handlers()
    gc.collect()
    reported = [r for r in caplog.records if "never retrieved" in r.getMessage()]
    assert len(reported) == (0 if quiet else 1), reported  # the control: asyncio reports it by default


def test_a_ray_cluster_that_is_not_there_is_one_line(monkeypatch) -> None:
    import ray

    from loongsage.core.ray_runtime import start_ray

    was_up = ray.is_initialized()  # an earlier test's Ray in this process: the probe comes before ray.init
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")  # a cluster that is not there
    with pytest.raises(RunError) as exc:
        start_ray(num_cpus=1)
    assert str(exc.value) == (
        "could not join the Ray cluster at RAY_ADDRESS=127.0.0.1:1: nothing answers at 127.0.0.1:1 (Connection "
        "refused); start it first (`ray start --head` on the head node, `ray start --address=HEAD:6379` on the "
        "others) or unset RAY_ADDRESS so that the run starts a Ray of its own"
    )
    assert ray.is_initialized() == was_up


# ----------------------------------------------------------------------------- resume checks
def test_resume_checks_the_latest_checkpoint_before_ray_starts(tmp_path) -> None:
    run_dir = tmp_path / "runs" / "r"
    assert check_resumable(run_dir, ["arith"], 10) is None  # nothing to resume: starts at 0
    _checkpoint(run_dir, 2)
    latest = _checkpoint(run_dir, 4)
    assert check_resumable(run_dir, ["arith"], 10) == latest

    with pytest.raises(ConfigError) as exc:
        check_resumable(run_dir, ["arith", "sort"], 10)
    assert str(exc.value) == (
        f"resume: checkpoint {latest} was written by a run of the data sources [arith] and the "
        "config has [arith, sort] (not in the checkpoint: sort); resume with the checkpoint's "
        "data_sources, or start a new run (another run.name)"
    )
    with pytest.raises(ConfigError, match=r"\(not in the config: arith; not in the checkpoint: other\)"):
        check_resumable(run_dir, ["other"], 10)
    for total in (4, 3):
        with pytest.raises(ConfigError) as exc:
            check_resumable(run_dir, ["arith"], total)
        assert str(exc.value) == (
            f"resume: checkpoint {latest} is at step 4 and run.total_steps={total}, so there is "
            "nothing left to train; set run.total_steps above 4 to train further"
        )


def test_resume_refuses_a_checkpoint_cut_short_and_names_the_one_before(tmp_path) -> None:
    run_dir = tmp_path / "runs" / "r"
    _checkpoint(run_dir, 2)
    whole = (_checkpoint(run_dir, 3) / "trainer.pt").read_bytes()
    cut = _checkpoint(run_dir, 4, trainer=whole[: len(whole) // 2])
    with pytest.raises(ConfigError) as exc:
        check_resumable(run_dir, ["arith"], 10)
    message = str(exc.value)
    assert message.startswith(f"resume: checkpoint {cut} is damaged (trainer.pt: cut short (")
    assert message.endswith(f"delete {cut} to resume from step_000003, the checkpoint before it")

    (cut / "trainer.pt").write_bytes(whole)
    (cut / "rng_rank0.pt").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"\(rng_rank0\.pt: empty\)"):
        check_resumable(run_dir, ["arith"], 10)

    only = tmp_path / "runs" / "only"
    lone = _checkpoint(only, 1)
    (lone / "controller.json").write_text('{"step": 1,')
    with pytest.raises(ConfigError) as exc:
        check_resumable(only, ["arith"], 10)
    assert str(exc.value).startswith(f"resume: checkpoint {lone} is damaged (controller.json: JSONDecodeError: ")
    assert str(exc.value).endswith(
        f"it is the only checkpoint: delete {lone} to start over from step 0 (resume=true), or use a new run.name"
    )


# ----------------------------------------------------------------------------- config refusals
def test_a_placement_larger_than_the_machine_is_refused() -> None:
    def check(*overrides: str, cores: int) -> None:
        check_machine(load_config(RECIPE, list(overrides))[0], cores=cores)

    with pytest.raises(ConfigError) as exc:
        check("placement.cpus_per_actor=64", cores=2)
    assert str(exc.value) == (
        "placement.cpus_per_actor=64: this machine has 2 CPU cores, so one actor cannot have "
        "more; set placement.cpus_per_actor <= 2 (it starts Ray itself here; on a Ray cluster, "
        "start Ray there first)"
    )
    with pytest.raises(ConfigError) as exc:
        check("placement.num_cpus=512", cores=2)
    assert str(exc.value) == (
        "placement.num_cpus=512: this machine has 2 CPU cores and the placement needs 1; set "
        "placement.num_cpus <= 2, or leave it null (every core)"
    )
    check("placement.cpus_per_actor=2", cores=2)
    check("colocate=false", "placement.num_cpus=2", cores=1)  # two one-CPU bundles on one core: needed, allowed
    with pytest.raises(
        ConfigError,
        match=r"^placement\.num_cpus=3: this machine has 1 CPU core and the placement "
        r"needs 2; set placement\.num_cpus <= 2",
    ):
        check("colocate=false", "placement.num_cpus=3", cores=1)


def test_the_launcher_refuses_an_actor_larger_than_the_machine(tmp_path) -> None:
    """The machine check runs where the launcher starts Ray itself: through the real launcher."""
    import subprocess

    cores = len(os.sched_getaffinity(0))
    script = Path(sys.executable).parent / "loongsage"
    launcher = [str(script)] if script.is_file() else [sys.executable, "-m", "loongsage.core.cli"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(
        [
            *launcher,
            "train",
            RECIPE,
            f"placement.cpus_per_actor={cores + 1}",
            f"run.output_dir={tmp_path}/runs",
            f"run.log_dir={tmp_path}/log",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (proc.returncode, proc.stdout) == (2, ""), proc.stderr
    assert proc.stderr == (
        f"loongsage: error: placement.cpus_per_actor={cores + 1}: this machine has {cores} CPU "
        f"core{'' if cores == 1 else 's'}, so one actor cannot have more; set "
        f"placement.cpus_per_actor <= {cores} (it starts Ray itself here; on a Ray cluster, start "
        "Ray there first)\n"
    )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("advantage", ["{name: grpo}", "{name: rloo}", "{name: grpo, params: {std_normalize: false}}"])
def test_a_group_relative_estimator_needs_two_samples_per_prompt(advantage) -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(RECIPE, [f"algorithm.advantage={advantage}", "data_sources.0.samples_per_prompt=1"])
    name = "rloo" if "rloo" in advantage else "grpo"
    assert str(exc.value) == (
        f"data_sources[0].samples_per_prompt=1: advantage {name!r} compares the samples of a "
        "prompt with each other, so it needs >= 2 (with fewer every advantage is 0 and the run "
        "trains nothing); raise samples_per_prompt, or use an estimator with a batch baseline "
        "(e.g. reinforce_pp)"
    )


@pytest.mark.parametrize(
    "overrides",
    [
        ["algorithm.advantage={name: grpo, params: {scope: batch}}", "data_sources.0.samples_per_prompt=1"],
        ["algorithm.advantage={name: reinforce_pp}", "data_sources.0.samples_per_prompt=1"],
        ["data_sources.0.samples_per_prompt=2"],
    ],
)
def test_one_sample_per_prompt_is_fine_where_the_baseline_is_not_the_group(overrides) -> None:
    load_config(RECIPE, overrides)


def test_sft_trains_one_sample_per_record() -> None:
    cfg, _ = load_config("tiny/sft_chat_cpu")  # nll ignores advantages
    assert cfg.data_sources[0].samples_per_prompt == 1


# ----------------------------------------------------------------------------- evaluation rows
def test_evaluation_honours_on_bad_row(tmp_path) -> None:
    from loongsage.core.evaluation import Evaluator

    rows = [
        {"prompt": "1+1=", "label": "2"},
        {"label": "3"},
        "not an object",
        {"prompt": "2+2=", "label": "4"},
        {"prompt": "3+3=", "label": "6"},
        {"prompt": "4+4=", "label": "8"},
    ]
    path = tmp_path / "eval.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n{broken\n")
    eval_reader = f"data_sources.0.eval_reader={{name: file, params: {{path: {path}}}}}"
    cfg, registry = load_config(RECIPE, [eval_reader, "evaluation.max_prompts=3"])
    records = Evaluator(cfg, registry).records["arith"]
    # the bad rows are skipped, as in training, and the next good ones fill their places
    assert [(r.index, r.prompt) for r in records] == [(0, "1+1="), (3, "2+2="), (4, "3+3=")]

    cfg, registry = load_config(RECIPE, [eval_reader, "data_sources.0.on_bad_row=error"])
    with pytest.raises(BadRecordError) as exc:
        Evaluator(cfg, registry)
    assert str(exc.value) == (
        f"data source 'arith' (eval_reader): {path} row 1: missing key 'prompt'; present: label; "
        "fix the row, or set on_bad_row: skip"
    )

    path.write_text('{"label": "1"}\n[]\n')
    cfg, registry = load_config(RECIPE, [eval_reader])
    with pytest.raises(
        BadRecordError,
        match=r"^data source 'arith' \(eval_reader\): no valid evaluation row \(all 2 "
        r"bad\); fix the file, or drop eval_reader$",
    ):
        Evaluator(cfg, registry)


# ----------------------------------------------------------------------------- a folder holding a run
@pytest.fixture
def never_runs(monkeypatch):
    """A refusal comes before the run: if it does not, the test fails at once instead of training."""
    from loongsage.core.controller import Controller

    def started(self):
        raise AssertionError("the run started")

    monkeypatch.setattr(Controller, "run", started)


@pytest.mark.parametrize(
    ("files", "what"),
    [
        (
            ["config.yaml", "metrics.jsonl", "final/config.json", "checkpoints/step_000100/controller.json"],
            "a finished run; train it further with resume=true and a larger run.total_steps",
        ),
        (
            ["config.yaml", "metrics.jsonl", "checkpoints/step_000100/controller.json"],  # checkpoint.export_hf=false
            "a finished run; train it further with resume=true and a larger run.total_steps",
        ),
        (
            ["config.yaml", "metrics.jsonl", "checkpoints/step_000004/controller.json"],
            "a run stopped after its checkpoint step_000004; continue it with resume=true",
        ),
        (
            ["config.yaml", "metrics.jsonl"],
            "a run that stopped before its first checkpoint; start it again there with resume=true",
        ),
    ],
)
def test_a_folder_that_holds_a_run_is_refused_unless_resuming(
    tmp_path, monkeypatch, capsys, never_runs, files, what
) -> None:
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "runs" / "grpo_arith_cpu"
    for name in files:
        (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / name).write_text("{}")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert cli.main(["train", RECIPE, f"run.output_dir={tmp_path}/runs", f"run.log_dir={tmp_path}/log"]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"loongsage: error: run.name=grpo_arith_cpu: {run_dir} already holds {what}, give this run its own "
        "folder (another run.name=... or run.output_dir=...), or remove that folder\n"
    )
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing written


def test_a_folder_without_a_step_or_checkpoint_holds_no_run(tmp_path, monkeypatch, capsys, never_runs) -> None:
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "runs" / "grpo_arith_cpu"
    (run_dir / "served").mkdir(parents=True)  # `loongsage serve`'s records
    for name in ("config.yaml", "run.log", "metrics.jsonl"):  # a run that failed before its first step's metrics
        (run_dir / name).write_text("")
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    assert cli.main(["train", RECIPE, f"run.output_dir={tmp_path}/runs", f"run.log_dir={tmp_path}/log"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("loongsage: error: the run failed: AssertionError: the run started; fix the cause, then ")
    assert all(line.startswith("[loongsage] ") for line in err[:-1]), err
    # the traceback went to the run's log; the launcher put back the signal handlers it installed for the run
    assert err[-1].endswith(f"; the traceback is in {tmp_path}/runs/grpo_arith_cpu/run.log")
    assert "Traceback" in (tmp_path / "runs" / "grpo_arith_cpu" / "run.log").read_text()
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers


# ----------------------------------------------------------------------------- a tracker that cannot start
def test_wandb_without_an_account_is_one_line_before_ray(model_cache, tmp_path, monkeypatch, capsys) -> None:
    """Online W&B with no API key anywhere (none in the environment, no ``wandb login`` in this HOME)."""
    wandb = pytest.importorskip("wandb")
    import ray

    for key in ("WANDB_API_KEY", "WANDB_DIR", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_BASE_URL"):
        monkeypatch.delenv(key, raising=False)
    for key, value in (
        ("WANDB_MODE", "online"),
        ("WANDB_SILENT", "true"),
        ("WANDB_ERROR_REPORTING", "false"),
        ("HOME", str(tmp_path / "home")),
        ("WANDB_CONFIG_DIR", str(tmp_path / "home" / "config")),
        ("NETRC", str(tmp_path / "home" / ".netrc")),
    ):
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)
    ray_before = ray.is_initialized()
    try:
        rc = cli.main(
            [
                "train",
                RECIPE,
                "tracking.backends=[jsonl,wandb]",
                "tracking.progress=false",
                f"run.output_dir={tmp_path}/runs",
                f"run.log_dir={tmp_path}/log",
            ]
        )
    finally:
        wandb.teardown()
    err = capsys.readouterr().err.splitlines()
    assert rc == 1, err
    assert err[-1].startswith("loongsage: error: wandb tracker: wandb.init failed: "), err
    assert (
        "(log in with `wandb login` or set WANDB_API_KEY; to log without an account or network, use mode offline: "
        "WANDB_MODE=offline); then run the same command with resume=true to start it again" in err[-1]
    )
    assert err[-1].endswith(f"; the traceback is in {tmp_path}/runs/grpo_arith_cpu/run.log")
    assert all(line.startswith("[loongsage] ") for line in err[:-1]), err
    assert ray.is_initialized() == ray_before  # it stopped before Ray
