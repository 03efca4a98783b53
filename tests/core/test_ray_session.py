"""The tests' Ray runs its workers in this very environment: no copy of the checkout, no `uv run`.

Under ``uv run pytest`` Ray's `uv run` hook (on unless ``RAY_ENABLE_UV_RUN_RUNTIME_ENV`` is false when
``ray`` is first imported) would make every worker a ``uv run`` of a copy of the working directory,
``.venv`` included (gigabytes per session, on disk and in start-up time). This module imports ``ray``
at collection on purpose, as several test modules do, so the switch must be set before any of them is
collected; the test fails whenever the hook is active in the session's Ray.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import ray


@ray.remote
def _worker_view() -> dict:
    return {
        "executable": sys.executable,
        "cwd": os.getcwd(),
        "runtime_env": dict(ray.get_runtime_context().runtime_env),
    }


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())


def test_workers_use_this_environment_and_nothing_is_copied(ray_session):
    from ray._private.ray_constants import RAY_ENABLE_UV_RUN_RUNTIME_ENV

    assert not RAY_ENABLE_UV_RUN_RUNTIME_ENV
    view = ray.get(_worker_view.remote())
    assert "working_dir" not in view["runtime_env"] and "py_executable" not in view["runtime_env"], view
    assert Path(view["executable"]).resolve() == Path(sys.executable).resolve(), view
    session = Path(ray._private.worker.global_worker.node.get_session_dir_path())
    resources = session / "runtime_resources"
    assert not resources.exists() or _size(resources) < 1 << 20, (resources, _size(resources))
    assert not view["cwd"].startswith(str(session)), view
