"""Shared fixtures: one Ray per session, a per-session model cache, temporary working directories."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import sys
import tempfile
from pathlib import Path

import pytest

from tests._procs import survivors

REPO = Path(__file__).resolve().parents[1]

# Ray reads this switch once, when ``ray`` is first imported, and test modules import it at
# collection, long before a fixture runs: set here, in the first module pytest imports. Left on,
# under `uv run pytest` Ray makes every worker a `uv run` of a copy of the checkout in the session's
# runtime_resources, where uv builds a second .venv (gigabytes per session). The workers must run in
# this very environment; subprocesses the tests start inherit the switch. Forced, not defaulted: a
# value from the shell would bring the copy back.
os.environ["RAY_ENABLE_UV_RUN_RUNTIME_ENV"] = "0"

# Bytecode: where PYTHONDONTWRITEBYTECODE is set (container images often set it), no process keeps the
# bytecode it compiles, so every process the suite starts (each Ray actor, launcher, worker script)
# compiles torch, transformers and the rest from source again: 5-10 s of CPU each, about half of an
# actor's start. The suite's processes keep it instead, in a folder of their own (PYTHONPYCACHEPREFIX,
# so the checkout and the environment stay as they are): each module is compiled once. Bytecode is
# checked against its source on every import, so an edited module is compiled again.
if sys.dont_write_bytecode or os.environ.get("PYTHONDONTWRITEBYTECODE"):
    sys.pycache_prefix = os.environ.setdefault(
        "PYTHONPYCACHEPREFIX", str(Path(tempfile.gettempdir()) / f"loongsage-tests-pycache-{os.getuid()}")
    )
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    sys.dont_write_bytecode = False


# The suite runs on two pytest-xdist workers (addopts) in units of work, each handed out whole. A run
# through the launcher keeps both cores busy with its actors (two at once slow each other down more
# than they gain), the unit tests one core each. So the launcher runs make two units: the first
# handed out goes along with the unit tests on the other worker, the second is handed out last, to
# whichever worker is free first. The first holds the end-to-end modules sharing launcher runs (the
# ``launched`` fixture, tests/e2e/_runs.py: each shared run made once), every test running
# sandboxes (their checks count every sandbox process on the machine) and the launcher tests of the
# backend packages; the second the end-to-end modules with runs of their own. The megatron worker
# scripts are one unit (one server process loads Megatron-Core for them); every other module is one.
SHARED_RUNS = tuple(
    f"e2e/test_{name}.py"
    for name in (
        "async_tiny",
        "engine_recovery",
        "gateway_tiny",
        "grpo_tiny",
        "kill_resume",
        "mixed_tiny",
        "mopd_tiny",
        "own_model_tiny",
        "resume_exact",
        "sync_regression",
    )
)
FIRST, LAST = "launcher runs", "launcher runs of their own"
BACKEND_LAUNCHERS = ("megatron/test_megatron_launcher.py", "sglang/test_sglang_launcher.py")


def work_unit(nodeid: str) -> str:
    """The unit of work a test belongs to, from its id."""
    module = nodeid.split("::")[0].removeprefix("tests/")
    if module in SHARED_RUNS or module in BACKEND_LAUNCHERS or "sandbox" in module:
        return FIRST
    if module.startswith("e2e/"):
        return LAST
    return "megatron workers" if module.startswith("megatron/") else module


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """The scheduler of ``--dist loadscope`` over the units above instead of modules, handing them
    out in the order collected (not ``xdist_group`` marks, which pytest 9.2's node ids lost)."""
    from xdist.scheduler import LoadScopeScheduling

    class ByUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    config.option.loadscopereorder = False  # it would order them by their number of tests
    return ByUnit(config, log)


def pytest_collection_modifyitems(config, items):
    shared = {f"tests/{module}" for module in SHARED_RUNS}
    strays = sorted({item.nodeid.split("::")[0] for item in items if "launched" in item.fixturenames} - shared)
    if strays:  # their shared runs would be made again on the other worker
        raise pytest.UsageError(f"{', '.join(strays)} use the launched fixture: add them to SHARED_RUNS")
    if os.environ.get("PYTEST_XDIST_WORKER"):  # the order units are handed out in (the sort is stable)
        items.sort(key=lambda item: {FIRST: 0, LAST: 2}.get(work_unit(item.nodeid), 1))
    if os.environ.get("LOONGSAGE_RUN_GPU") == "1":
        return
    skip_gpu = pytest.mark.skip(reason="GPU test: set LOONGSAGE_RUN_GPU=1 on a CUDA machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def model_cache() -> Path:
    """``LOONGSAGE_CACHE`` for the session: the user's own model cache unless LOONGSAGE_TEST_CACHE is set.

    The end-to-end tests train the recipe's own warm start (it must give a learning signal), so
    they share the cache the README's first command fills: on a fresh machine the first test that
    needs the model builds it once (about a minute on two idle cores).
    """
    from loongsage.core.tinytask.builds import default_cache_dir

    path = Path(os.environ.get("LOONGSAGE_TEST_CACHE") or default_cache_dir())
    os.environ["LOONGSAGE_CACHE"] = str(path)
    return path


@pytest.fixture(scope="session")
def ray_session(model_cache):
    """One local Ray for every in-process end-to-end test (Ray start-up costs seconds)."""
    from loongsage.core.ray_runtime import init_ray_environment

    init_ray_environment()
    import ray

    if not ray.is_initialized():
        ray.init(
            num_cpus=4,
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={"env_vars": {"LOONGSAGE_CACHE": str(model_cache)}},
        )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def ray_module(model_cache):
    """Ray for one module that runs before the tests checking that bad input never starts Ray
    (they assert it is not running): started here if needed, and then shut down after the module."""
    from loongsage.core.ray_runtime import init_ray_environment

    init_ray_environment()
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(
            num_cpus=4,
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={"env_vars": {"LOONGSAGE_CACHE": str(model_cache)}},
        )
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture
def in_tmp(tmp_path, monkeypatch) -> Path:
    """Run in a temporary directory that sees the repository's recipes (log/ and runs/ land there)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "recipes").symlink_to(REPO / "recipes")
    return tmp_path


@pytest.fixture(scope="session")
def opencode_dir(model_cache) -> Path:
    """The pinned OpenCode CLI (npm ``opencode-ai``), installed once per machine into the model cache
    (the set-up step ``python -m loongsage.agentflow.opencode_install``); skips where npm cannot."""
    from loongsage.agentflow import opencode_install

    try:
        return opencode_install.install(model_cache / "agents" / f"opencode-{opencode_install.VERSION}")
    except RuntimeError as exc:
        pytest.skip(f"OpenCode {opencode_install.VERSION} could not be installed from npm: {exc}")


@pytest.fixture(scope="session")
def mini_program() -> Path:
    """mini-swe-agent's ``mini`` of this environment, its bytecode and litellm's compiled first:
    compiling runs none of their code, and a cold import of litellm would otherwise compile
    thousands of modules inside the first episodes (tens of seconds)."""
    import importlib.util
    import subprocess
    import sys

    program = Path(sys.executable).parent / "mini"
    if not program.is_file():
        pytest.skip("mini-swe-agent is not installed here (`uv sync` installs it with the dev group)")
    folders = [
        p
        for name in ("litellm", "minisweagent")
        for p in (importlib.util.find_spec(name).submodule_search_locations or [])
    ]
    subprocess.run([sys.executable, "-m", "compileall", "-q", *folders], capture_output=True, timeout=600)
    return program


@pytest.fixture
def tag():
    """A mark for the environment of a test's programs (``LOONGSAGE_TEST_TAG``); whatever still
    carries it afterwards is killed, so a regression leaves no process behind (the tests assert
    first that none is left, with :func:`tests._procs.survivors`)."""
    value = secrets.token_hex(8)
    yield value
    for pid in survivors(value):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
