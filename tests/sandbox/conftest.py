"""A real ``local`` sandbox backend per test, under a root of its own, and the checks that nothing
of it is left afterwards (processes, mounts, directories)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from loongsage.core.contracts import SandboxOwner
from loongsage.sandbox.jail import jail_problem
from loongsage.sandbox.limits import Limits
from loongsage.sandbox.store import UID_BASE, UID_COUNT

PROBLEM = jail_problem()
needs_jail = pytest.mark.skipif(PROBLEM is not None, reason=f"local sandbox unavailable: {PROBLEM}")
SMALL = Limits(
    cpu_s=20,
    memory_mb=256,
    processes=48,
    file_size_mb=8,
    open_files=64,
    work_mb=16,
    tmp_mb=8,
    output_bytes=64 << 10,
    get_bytes=4 << 20,
)


def run(coro):
    return asyncio.run(coro)


def owner(trajectory: str = "t", attempt: int = 0) -> SandboxOwner:
    return SandboxOwner("run-test", trajectory, attempt)


def deadline(seconds: float = 120) -> float:
    return time.time() + seconds


def sandbox_processes() -> list[tuple[int, int]]:
    """``(pid, uid)`` of every live process on the machine running under a sandbox uid."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            uid = os.stat(f"/proc/{name}").st_uid
            with open(f"/proc/{name}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if UID_BASE <= uid < UID_BASE + UID_COUNT and state not in (b"Z", b"X"):
            found.append((int(name), uid))
    return found


def jail_processes() -> list[int]:
    """Live processes of this backend's jails on the machine: bubblewrap outside and as the
    namespace's init (both carry ``--args FD``, which no other bubblewrap user here passes), and
    ``setpriv``/``prlimit`` before the command replaced them."""
    found = []
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
            with open(f"/proc/{name}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except (OSError, IndexError):
            continue
        if state in (b"Z", b"X") or not argv[0].endswith((b"bwrap", b"setpriv", b"prlimit")):
            continue
        if b"--args" in argv or any(a.startswith(b"--reuid=30") for a in argv):
            found.append(int(name))
    return found


def mounts_under(root: Path) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [line for line in f if f" {root}/" in line or f" {root} " in line]


def leftovers(root: Path) -> dict[str, list]:
    """Everything a sandbox could leave behind; all lists empty when clean."""
    dirs = sorted(p.name for p in root.iterdir() if p.name.startswith("sbx-")) if root.exists() else []
    return {"processes": sandbox_processes(), "jails": jail_processes(), "mounts": mounts_under(root), "dirs": dirs}


def assert_clean(root: Path) -> None:
    end = time.monotonic() + 3  # a killed process may take a moment to be collected by the kernel
    while (left := leftovers(root)) and any(left.values()) and time.monotonic() < end:
        time.sleep(0.05)
    assert not any(left.values()), left


@pytest.fixture
def root(tmp_path) -> Path:
    path = tmp_path / "sandboxes"
    yield path
    assert_clean(path)
