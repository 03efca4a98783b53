"""Every bad input to the launcher ends the same way: exit code 2 and one stderr line
``loongsage: error: ...`` naming what is wrong and what is allowed, before Ray starts or any model
is built -- never a traceback, a hang, or a second error that hides the first.

One table holds the cases. Each runs in-process through ``cli.main`` (Python start-up is the slow
part on a small machine); the ones marked ``SUBPROCESS`` also run through the installed
``loongsage`` launcher in a fresh interpreter, as a user would.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from loongsage.core import cli
from loongsage.core.config import load_config
from loongsage.core.types import ConfigError

REPO = Path(__file__).resolve().parents[2]
RECIPE = "tiny/grpo_arith_cpu"
OUT = ["run.output_dir={tmp}/runs", "run.log_dir={tmp}/log"]  # nothing lands in the repository, even on a slip


def train(*overrides: str) -> list[str]:
    return ["train", RECIPE, *overrides, *OUT]


# (id, argv, text the error line must contain); "{tmp}" is the test's temporary directory
CASES: list[tuple[str, list[str], str]] = [
    # recipe files and where they are looked for
    (
        "yaml_unclosed_by_path",
        ["train", "{tmp}/bad.yaml", *OUT],
        "{tmp}/bad.yaml: invalid YAML at line 2, column 1: expected ',' or '}', but got '<stream end>' "
        "(while parsing a flow mapping at line 1, column 6)",
    ),
    (
        "yaml_unclosed_in_config_dir",
        ["train", "broken", "--config-dir", "{tmp}/cfg", *OUT],
        "{tmp}/cfg/broken.yaml: invalid YAML at line 2, column 1",
    ),
    (
        "yaml_tab_indent",
        ["train", "tabs", "--config-dir", "{tmp}/cfg", *OUT],
        "{tmp}/cfg/tabs.yaml: invalid YAML at line 2, column 1: found character '\\t' that cannot start any token",
    ),
    (
        "recipe_is_a_list",
        ["train", "alist", "--config-dir", "{tmp}/cfg", *OUT],
        "{tmp}/cfg/alist.yaml: a recipe is a "
        "mapping of config sections (run, model, data_sources, ...); this file holds a list",
    ),
    (
        "recipe_without_sources",
        ["train", "empty", "--config-dir", "{tmp}/cfg", *OUT],
        "data_sources: at least one data source is required",
    ),
    (
        "recipe_missing_reader",
        ["train", "no_reader", "--config-dir", "{tmp}/cfg", *OUT],
        "config.data_sources[0].reader: missing required key",
    ),
    (
        "recipe_key_typo",
        ["train", "typo", "--config-dir", "{tmp}/cfg", *OUT],
        "config.trainers: unknown key; allowed: ",
    ),
    (
        "config_dir_missing",
        ["train", RECIPE, "--config-dir", "{tmp}/nope", *OUT],
        "--config-dir '{tmp}/nope': no such directory",
    ),
    ("config_dir_missing_for_recipes", ["recipes", "--config-dir", "{tmp}/nope"], "--config-dir '{tmp}/nope': no such"),
    ("recipe_not_found", ["train", "tiny/nope", *OUT], "recipe 'tiny/nope' not found; looked in: "),
    ("yaml_path_not_found", ["train", "{tmp}/nope.yaml", *OUT], "recipe '{tmp}/nope.yaml' not found"),
    # the command line itself
    ("train_without_recipe", ["train"], "train: no recipe given; usage: loongsage train <recipe> [key=value ...]"),
    (
        "override_in_place_of_recipe",
        ["train", "run.total_steps=5"],
        "train: the recipe comes first, got the override 'run.total_steps=5'",
    ),
    ("override_without_equals", train("trainer.world_size"), "override 'trainer.world_size': no '='; write key=value"),
    (
        "override_bad_syntax",
        train("trainer.micro_batch_tokens=[1,"),
        "override 'trainer.micro_batch_tokens=[1,': not valid override syntax",
    ),
    ("override_bad_interpolation", train("run.name=${nope}"), "override 'run.name=${nope}': Interpolation key 'nope'"),
    ("unknown_option", train("--bogus"), "train: unrecognized arguments: --bogus"),
    (
        "override_after_config_dir",
        ["train", RECIPE, "--config-dir", str(REPO / "recipes"), "run.total_steps=0", *OUT],
        "config.run.total_steps=0: must be >= 1",
    ),  # overrides on both sides of --config-dir all count
    ("override_adds_an_existing_key", train("+run.seed=3"), "override '+run.seed=3': Could not append to config"),
    (
        "config_dir_without_value",
        ["train", RECIPE, "--config-dir"],
        "train: argument --config-dir: expected one argument",
    ),
    ("no_command", [], "no command given; choose one of: train, plugins, reference, recipes, report, serve, doctor"),
    (
        "unknown_command",
        ["fly"],
        "unknown command 'fly'; choose one of: train, plugins, reference, recipes, report, serve, doctor",
    ),
    ("report_missing_dir", ["report", "{tmp}/nope"], "report: '{tmp}/nope': no such directory"),
    ("report_dir_without_metrics", ["report", "{tmp}/cfg"], "report: no metrics.jsonl in '{tmp}/cfg'"),
    ("report_bad_metrics", ["report", "{tmp}/badrun"], "report: {tmp}/badrun/metrics.jsonl is not a run's metrics"),
    (
        "plugins_missing_module",
        ["plugins", "--plugin", "no_such_module_xyz"],
        "plugins: module 'no_such_module_xyz' failed to import",
    ),
    # keys, types and ranges
    ("unknown_top_level_key", train("foo=1"), "config.foo: unknown key; allowed: algorithm, checkpoint, data_sources"),
    ("unknown_nested_key", train("trainer.optimizer.lrr=0.1"), "config.trainer.optimizer.lrr: unknown key; allowed: "),
    ("int_given_text", train("run.seed=abc"), "config.run.seed: got 'abc'; expected an integer"),
    (
        "int_given_float",
        train("data_sources.0.prompts_per_step=4.5"),
        "config.data_sources[0].prompts_per_step: got 4.5; expected an integer",
    ),
    ("bool_given_text", train("colocate=maybe"), "config.placement.colocate: got 'maybe'; expected true or false"),
    ("literal_not_allowed", train("model.dtype=fp8"), "config.model.dtype: got 'fp8'; allowed: 'float32'"),
    ("list_given_scalar", train("tracking.backends=jsonl"), "config.tracking.backends: got 'jsonl'; expected a list"),
    (
        "source_index_past_end",
        train("data_sources.5.prompts_per_step=4"),
        "data_sources.5: the recipe has 1 data source; only index 0 exists",
    ),
    (
        "source_index_not_a_number",
        train("data_sources.x.name=y"),
        "data_sources.x: data_sources is a list, indexed by number",
    ),
    (
        "negative_cpus_per_actor",
        train("placement.cpus_per_actor=-1"),
        "config.placement.cpus_per_actor=-1.0: must be > 0",
    ),
    (
        "num_cpus_too_small",
        train("colocate=false", "placement.num_cpus=1"),
        "placement.num_cpus=1: the placement needs "
        "2 CPUs, 2 bundles (disaggregated: trainer.world_size=1 + rollout.num_engines=1) x placement.cpus_per_actor=1",
    ),
    ("num_cpus_zero", train("placement.num_cpus=0"), "config.placement.num_cpus=0: must be >= 1"),
    (
        "negative_gpus_per_actor",
        train("placement.gpus_per_actor=-1"),
        "config.placement.gpus_per_actor=-1.0: must be >= 0",
    ),
    ("negative_torch_threads", train("placement.torch_threads=-1"), "config.placement.torch_threads=-1: must be >= 0"),
    (
        "negative_eval_every",
        train("evaluation.every_steps=-5"),
        "config.evaluation.every_steps=-5: must be >= 0 (0 = only at start and end)",
    ),
    (
        "negative_checkpoint_every",
        train("checkpoint.every_steps=-1"),
        "config.checkpoint.every_steps=-1: must be >= 0 (0 = only at the end)",
    ),
    ("negative_keep_last", train("checkpoint.keep_last=-1"), "config.checkpoint.keep_last=-1: must be >= 0"),
    ("negative_pass_k", train("evaluation.pass_k=-1"), "config.evaluation.pass_k=-1: must be >= 0"),
    ("zero_eval_prompts", train("evaluation.max_prompts=0"), "config.evaluation.max_prompts=0: must be >= 1"),
    ("zero_total_steps", train("run.total_steps=0"), "config.run.total_steps=0: must be >= 1"),
    ("negative_seed", train("run.seed=-1"), "config.run.seed=-1: must be >= 0"),
    ("empty_run_name", train("run.name="), "config.run.name='': must name a directory under run.output_dir"),
    ("zero_lr", train("trainer.optimizer.lr=0"), "config.trainer.optimizer.lr=0.0: must be > 0"),
    ("nan_lr", train("trainer.optimizer.lr=nan"), "config.trainer.optimizer.lr=nan: must be > 0"),
    (
        "beta_out_of_range",
        train("trainer.optimizer.betas=[0.9,1.5]"),
        "config.trainer.optimizer.betas[1]=1.5: must be in [0, 1)",
    ),
    (
        "negative_warmup",
        train("trainer.optimizer.warmup_steps=-1"),
        "config.trainer.optimizer.warmup_steps=-1: must be >= 0",
    ),
    ("zero_engines", train("rollout.num_engines=0"), "config.rollout.num_engines=0: must be >= 1"),
    (
        "refill_oversample_below_one",
        train("rollout.refill_oversample=0.5"),
        "config.rollout.refill_oversample=0.5: must be >= 1",
    ),
    (
        "negative_kl_coef",
        train("algorithm.kl={name: k3}", "algorithm.kl_coef=-1"),
        "config.algorithm.kl_coef=-1.0: must be >= 0",
    ),
    (
        "temperature_negative",
        train("data_sources.0.sampling.temperature=-1"),
        "data_sources[0].sampling.temperature=-1.0: must be >= 0",
    ),
    (
        "prompts_not_divisible",
        train("trainer.world_size=3"),
        "data_sources[0].prompts_per_step=8: must be divisible by "
        "trainer.world_size x trainer.mini_batches_per_step = 3",
    ),
    (
        "negative_staleness",
        train("colocate=false", "rollout.scheduler={name: no_window, params: {max_staleness: -1}}"),
        "max_staleness=-1: must be >= 0",
    ),
    (
        "async_colocated",
        train("rollout.scheduler.name=no_window"),
        "rollout.scheduler.name='no_window' generates while "
        "the trainer trains, so engines and trainers need separate resources: set placement.colocate=false",
    ),
    (
        "release_disaggregated",
        train("colocate=false", "placement.release_engine_memory=true"),
        "placement.release_engine_memory=true: engines give their memory to a trainer on the same device, which needs "
        "placement.colocate=true",
    ),
    (
        "offload_disaggregated",
        train("colocate=false", "placement.offload_trainer=true"),
        "placement.offload_trainer=true: the trainer gives its memory to engines on the same device, which needs "
        "placement.colocate=true",
    ),
    (
        "unknown_scheduler",
        train("rollout.scheduler.name=eager"),
        "rollout.scheduler.name: unknown rollout_scheduler 'eager'; known: ",
    ),
    # plugins and cross-field rules
    (
        "unknown_advantage",
        train("algorithm.advantage.name=nope"),
        "algorithm.advantage.name: unknown advantage 'nope'; known: ",
    ),
    (
        "unknown_plugin_param",
        train("algorithm.advantage.params.std_norm=true"),
        "algorithm.advantage.params.std_norm: unknown key; allowed: ",
    ),
    (
        "plugins_key_missing_module",
        train("plugins=[no_such_module_xyz]"),
        "plugins: module 'no_such_module_xyz' failed to import",
    ),
    (
        "model_path_not_hf",
        train("model.path=/nonexistent", "model.builder=null"),
        "model.path='/nonexistent': not an HF model folder",
    ),
    ("kl_coef_without_kl", train("algorithm.kl_coef=0.1"), "algorithm.kl_coef is set but algorithm.kl is null"),
    ("gae_without_critic", train("algorithm.advantage.name=gae"), "algorithm.advantage.name='gae' needs critic values"),
    ("aggregation_unknown", train("algorithm.aggregation=bogus"), "aggregation='bogus'; allowed: "),
    (
        "output_dir_is_a_file",
        ["train", RECIPE, "run.output_dir={tmp}/afile", "run.log_dir={tmp}/log"],
        "run.output_dir: cannot create the directory '{tmp}/afile/grpo_arith_cpu'",
    ),
]

# also run through the real launcher in a fresh interpreter (each costs a Python start-up)
SUBPROCESS = {
    "yaml_unclosed_by_path",
    "negative_cpus_per_actor",
    "num_cpus_too_small",
    "source_index_past_end",
    "train_without_recipe",
}

FIXTURES = {"bad.yaml", "cfg", "badrun", "afile", "cache"}  # what the test itself puts in {tmp}


def test_the_table_is_large_and_unique() -> None:
    ids = [case[0] for case in CASES]
    assert len(ids) == len(set(ids)) and len(ids) >= 34
    assert SUBPROCESS <= set(ids)


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch) -> Path:
    """A working directory with the broken files the cases point at; no model cache to build into."""
    (tmp_path / "bad.yaml").write_text("run: {name: x\n")
    cfg = tmp_path / "cfg"
    cfg.mkdir()
    shutil.copy(tmp_path / "bad.yaml", cfg / "broken.yaml")
    (cfg / "tabs.yaml").write_text("run:\n\tname: x\n")
    (cfg / "alist.yaml").write_text("- 1\n- 2\n")
    (cfg / "empty.yaml").write_text("")
    recipe = yaml.safe_load((REPO / "recipes" / "tiny" / "grpo_arith_cpu.yaml").read_text())
    no_reader = {**recipe, "data_sources": [{k: v for k, v in recipe["data_sources"][0].items() if k != "reader"}]}
    (cfg / "no_reader.yaml").write_text(yaml.safe_dump(no_reader))
    typo = {("trainers" if k == "trainer" else k): v for k, v in recipe.items()}
    (cfg / "typo.yaml").write_text(yaml.safe_dump(typo))
    (tmp_path / "badrun").mkdir()
    (tmp_path / "badrun" / "metrics.jsonl").write_text("this is not json\n")
    (tmp_path / "afile").write_text("")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LOONGSAGE_CACHE", str(tmp_path / "cache"))  # any model built would land here
    return tmp_path


def _argv(argv: list[str], tmp: Path) -> list[str]:
    return [a.replace("{tmp}", str(tmp)) for a in argv]


def _check(rc: int, out: str, err: str, expected: str, tmp: Path, seconds: float) -> None:
    assert rc == 2, (rc, out, err)
    assert err.endswith("\n") and err.count("\n") == 1, f"not one line:\n{err}"
    assert err.startswith("loongsage: error: ") and err.strip() != "loongsage: error:", err
    assert expected.replace("{tmp}", str(tmp)) in err, err
    assert out == "", out
    assert {p.name for p in tmp.iterdir()} <= FIXTURES, "something was written before the input was refused"
    assert seconds < 30, f"took {seconds:.1f} s"


@pytest.mark.parametrize(("argv", "expected"), [pytest.param(a, e, id=i) for i, a, e in CASES])
def test_bad_input_in_process(workdir, monkeypatch, capsys, argv, expected) -> None:
    from loongsage.core import controller, ray_runtime
    from loongsage.core.controller import Controller

    def started(self):  # a refused input never gets this far
        raise AssertionError("the input was accepted and the run started")

    # the one way to Ray, watched rather than ray.is_initialized() (an earlier test may have started one)
    rays: list[tuple] = []
    for module in (ray_runtime, controller):
        monkeypatch.setattr(module, "start_ray_for", lambda *args, **kwargs: rays.append(args) or False)
    monkeypatch.setattr(Controller, "run", started)
    t0 = time.perf_counter()
    rc = cli.main(_argv(argv, workdir))
    seconds = time.perf_counter() - t0
    captured = capsys.readouterr()
    _check(rc, captured.out, captured.err, expected, workdir, seconds)
    assert not rays, "Ray was started"


def _launcher() -> list[str]:
    script = Path(sys.executable).parent / "loongsage"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "loongsage.core.cli"]


@pytest.mark.parametrize(("argv", "expected"), [pytest.param(a, e, id=i) for i, a, e in CASES if i in SUBPROCESS])
def test_bad_input_through_the_launcher(workdir, argv, expected) -> None:
    env = {**os.environ, "LOONGSAGE_CACHE": str(workdir / "cache")}
    t0 = time.perf_counter()
    proc = subprocess.run(
        [*_launcher(), *_argv(argv, workdir)], cwd=workdir, env=env, capture_output=True, text=True, timeout=60
    )
    _check(proc.returncode, proc.stdout, proc.stderr, expected, workdir, time.perf_counter() - t0)


# ----------------------------------------------------------------------------- Ray started by someone else
def _placement_cfg(*overrides: str):
    cfg, _ = load_config(RECIPE, list(overrides))
    return cfg


@pytest.mark.parametrize(
    ("overrides", "total", "free", "expected"),
    [
        (
            ["colocate=false", "placement.cpus_per_actor=3"],
            {"CPU": 4.0},
            {"CPU": 4.0},
            "placement: the run needs 6 CPUs (2 bundles (disaggregated: trainer.world_size=1 + "
            "rollout.num_engines=1) x "
            "placement.cpus_per_actor=3) and this Ray cluster has 4 in all",
        ),
        (
            ["placement.gpus_per_actor=1"],
            {"CPU": 4.0},
            {"CPU": 4.0},
            "the run needs 1 GPU (1 bundle (colocated: max(trainer.world_size=1, rollout.num_engines=1)) x "
            "placement.gpus_per_actor=1) and this Ray cluster has 0 in all",
        ),
        (
            [],
            {"CPU": 4.0},
            {"CPU": 0.5},
            "the run needs 1 CPU (1 bundle (colocated: max(trainer.world_size=1, "
            "rollout.num_engines=1)) x placement.cpus_per_actor=1) and this Ray cluster has 0.5 free of 4",
        ),
    ],
)
def test_placement_checks_what_ray_has_before_reserving(monkeypatch, overrides, total, free, expected) -> None:
    """With Ray already running (a test session's, a notebook's), bundles that cannot fit are one
    ConfigError at once (free ones after a short grace), not Ray's silent wait."""
    import ray

    from loongsage.core.placement import Placement

    monkeypatch.setattr(ray, "cluster_resources", lambda: dict(total))
    monkeypatch.setattr(ray, "available_resources", lambda: dict(free))
    monkeypatch.setattr(Placement, "free_wait_s", 0.3)
    placement = Placement.__new__(Placement)
    t0 = time.perf_counter()
    with pytest.raises(ConfigError) as exc:
        placement._check_resources(_placement_cfg(*overrides))
    assert time.perf_counter() - t0 < 5
    assert expected in str(exc.value) and "\n" not in str(exc.value), str(exc.value)


def test_placement_accepts_bundles_that_fit(monkeypatch) -> None:
    import ray

    from loongsage.core.placement import Placement

    free = iter([{"CPU": 1.0}, {"CPU": 1.0}, {"CPU": 2.0}])  # a finished run's bundles come back
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    monkeypatch.setattr(ray, "available_resources", lambda: next(free))
    Placement.__new__(Placement)._check_resources(_placement_cfg("colocate=false"))


def test_a_failure_while_starting_actors_is_not_masked_by_the_cleanup(tmp_path, monkeypatch, caplog) -> None:
    """Actors half started: the cleanup releases what exists, and the original error is what propagates,
    even when a cleanup step fails too."""
    import ray
    import ray.util.placement_group  # noqa: F401 - the module, which ray.util's function of that name hides

    from loongsage.core import controller as ctl
    from loongsage.core.worker_group import WorkerGroup

    ray_pg = sys.modules["ray.util.placement_group"]

    released: list[str] = []

    def start_half(self, model_path, teacher_plans=()):
        self.placement = SimpleNamespace(pg="pg")
        # the trainer group started, the engines never: no engine group, no reward group
        self.groups.append(WorkerGroup("trainer", ["trainer0", "trainer1"]))
        raise ValueError("engine 0 failed to start")

    def kill(actor):
        released.append(f"kill {actor}")
        raise RuntimeError("actor already dead")

    monkeypatch.setattr(ctl, "resolve_model_path", lambda cfg, registry: str(tmp_path / "model"))
    monkeypatch.setattr(ctl.Controller, "_build_local", lambda self, model_path: None)
    monkeypatch.setattr(ctl.Controller, "_preflight", lambda self, model_path: None)
    monkeypatch.setattr(ctl.Controller, "_start_actors", start_half)
    monkeypatch.setattr(ray, "is_initialized", lambda: True)  # someone else's Ray: not started, not shut down
    monkeypatch.setattr(ray, "kill", kill)
    monkeypatch.setattr(ray, "shutdown", lambda: released.append("shutdown"))
    monkeypatch.setattr(ray_pg, "remove_placement_group", lambda pg: released.append(f"remove {pg}"))
    cfg, registry = load_config(RECIPE, [f"run.output_dir={tmp_path}"])
    logger = logging.getLogger("loongsage")
    logger.addHandler(caplog.handler)  # the launcher's logger may not propagate to the root
    try:
        with pytest.raises(ValueError, match="engine 0 failed"):
            ctl.Controller(cfg, registry).run()
    finally:
        logger.removeHandler(caplog.handler)
    assert released == ["kill trainer0", "kill trainer1", "remove pg"]  # one failed kill does not stop the next
    assert "could not kill the trainer actors: RuntimeError: actor already dead" in caplog.text
