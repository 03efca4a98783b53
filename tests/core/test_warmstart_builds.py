"""Warm-start builds in the model cache, through real processes: what a build says while it runs,
what a process waiting for another's build says, and what a killed build leaves behind."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests._procs import TAG_VARIABLE

KEY = "stub-model-0123456789abcdef"

# A build whose body the test controls (the cache's lock, temporary folder and rename are the real
# ones): it writes a file into its folder, says so, then waits for the file `go` beside the cache.
STUB = textwrap.dedent(
    f"""
    import sys, time
    from pathlib import Path
    from loongsage.core.tinytask.builds import INFO_FILE, cached_build

    cache = Path(sys.argv[1])

    def build(folder):
        (folder / "weights.bin").write_bytes(b"x" * 1000)
        print("BUILDING", folder, file=sys.stderr, flush=True)
        while not (cache / "go").exists():
            time.sleep(0.05)
        (folder / INFO_FILE).write_text("{{}}")

    print("PATH", cached_build({KEY!r}, build, cache), flush=True)
    """
)


def _start(code: str, *args: str, tag: str, progress: str = "30") -> subprocess.Popen:
    env = dict(os.environ, LOONGSAGE_PROGRESS_SECONDS=progress, **{TAG_VARIABLE: tag})
    return subprocess.Popen(
        [sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


def _read_until(stream, pattern: str, lines: list[str], timeout: float = 300) -> str:
    """Lines of ``stream`` (appended to ``lines``) up to the first that matches ``pattern``."""
    deadline = time.monotonic() + timeout
    for line in stream:
        lines.append(line)
        if re.search(pattern, line):
            return line
        assert time.monotonic() < deadline, f"no line matching {pattern!r} in time: {lines}"
    raise AssertionError(f"the stream ended before a line matching {pattern!r}: {lines}")


def _temporary(models: Path) -> list[str]:
    return sorted(p.name for p in models.iterdir() if p.is_dir() and p.name.startswith("."))


def test_a_build_reports_progress_and_a_sigterm_removes_its_folder(tmp_path, tag) -> None:
    """The real arithmetic warm start: it says what it builds, then its SFT steps with the time left;
    SIGTERM ends it as SIGTERM does, and the half-built folder is gone."""
    code = textwrap.dedent(
        """
        import sys
        from loongsage.core.tinytask.warmstart import WarmStartParams, cached_warm_start

        params = WarmStartParams(hidden_size=16, num_layers=1, heads=2, kv_heads=1, intermediate_size=32,
                                 steps=100000, batch_size=4)
        cached_warm_start(params, sys.argv[1])
        """
    )
    proc = _start(code, str(tmp_path), tag=tag, progress="0.5")
    lines: list[str] = []
    try:
        header = _read_until(proc.stderr, r"building tiny-qwen3-arith-", lines)
        models = tmp_path / "models"
        assert re.fullmatch(
            rf"\[loongsage\] building tiny-qwen3-arith-[0-9a-f]{{16}} into {re.escape(str(models))} "
            r"\(once; later runs find it there\): 100000 SFT steps of 4 examples on 2 threads\n",
            header,
        ), header
        key = header.split()[2]
        steps = [_read_until(proc.stderr, r"SFT: step [1-9]", lines) for _ in range(2)]
        for line in steps:
            assert re.fullmatch(
                r"\[loongsage\] tiny-qwen3-arith SFT: step \d+/100000, \d+ (s|min \d\d s) elapsed, "
                r"about .+ left\n",
                line,
            ), line
        assert [
            name.startswith(f".{key}.building-{socket.gethostname()}-{proc.pid}-") for name in _temporary(models)
        ] == [True]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == -signal.SIGTERM
    finally:
        proc.kill()
        proc.communicate()
    assert _temporary(models) == [] and not (models / key).exists()


def test_a_process_waiting_for_a_build_says_for_whom_then_uses_it(tmp_path, tag) -> None:
    first = _start(STUB, str(tmp_path), tag=tag)
    second = None
    try:
        _read_until(first.stderr, "^BUILDING", [])
        second = _start(STUB, str(tmp_path), tag=tag)
        lines: list[str] = []
        waiting = _read_until(second.stderr, "waiting for", lines)
        assert waiting == (
            f"[loongsage] waiting for {KEY}: another process is building it (pid {first.pid} on "
            f"{socket.gethostname()}, building since {waiting.split('building since ')[1][:8]}); "
            "this one uses it once built\n"
        )
        (tmp_path / "go").touch()
        out, err = second.communicate(timeout=120)
        assert second.returncode == 0, err
        assert out == f"PATH {tmp_path / 'models' / KEY}\n"
        assert re.search(rf"waited \d+ s for {KEY}", err) and "BUILDING" not in err  # found, not built again
        assert first.wait(timeout=60) == 0
    finally:
        for proc in (first, second):
            if proc is not None:
                proc.kill()
                proc.communicate()


def test_the_folder_of_a_killed_build_is_removed_by_the_next_one(tmp_path, tag) -> None:
    """SIGKILL leaves no chance to clean up: the next build finds the folder's lock free (its builder
    is gone) and removes it; a build in progress keeps its own."""
    killed = _start(STUB, str(tmp_path), tag=tag)
    try:
        _read_until(killed.stderr, "^BUILDING", [])
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=60)
    finally:
        killed.kill()
        killed.communicate()
    models = tmp_path / "models"
    left = _temporary(models)
    assert len(left) == 1 and left[0].startswith(f".{KEY}.building-")
    (tmp_path / "go").touch()
    again = _start(STUB, str(tmp_path), tag=tag)
    out, err = again.communicate(timeout=120)
    assert again.returncode == 0, err
    assert f"removing {left[0]}, left by a build that did not finish" in err
    assert _temporary(models) == [] and (models / KEY / "weights.bin").is_file()


def test_a_build_in_progress_keeps_its_folder(tmp_path, tag) -> None:
    from loongsage.core.tinytask.builds import remove_abandoned

    building = _start(STUB, str(tmp_path), tag=tag)
    try:
        _read_until(building.stderr, "^BUILDING", [])
        models = tmp_path / "models"
        before = _temporary(models)
        remove_abandoned(models)
        assert _temporary(models) == before and len(before) == 1
    finally:
        building.kill()
        building.communicate()


@pytest.mark.parametrize(("seconds", "text"), [(0.4, "0 s"), (42, "42 s"), (185, "3 min 05 s"), (3725, "1 h 02 min")])
def test_durations_read_as_a_person_would_say_them(seconds, text) -> None:
    from loongsage.core.tinytask.builds import duration

    assert duration(seconds) == text
