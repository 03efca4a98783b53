"""Finding the processes a test started, wherever they ended up (jailed, re-parented, daemonised)."""

from __future__ import annotations

import os
import time

TAG_VARIABLE = "LOONGSAGE_TEST_TAG"


def survivors(tag: str) -> list[int]:
    """Processes on this machine whose environment carries ``LOONGSAGE_TEST_TAG=tag``."""
    needle, found = f"{TAG_VARIABLE}={tag}".encode(), []
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(name))
        except (OSError, ValueError):
            continue
    return found


def lasting(tag: str, within: float = 30.0) -> list[int]:
    """The tagged processes still alive once ``within`` seconds have passed or none is left: what a
    run leaves behind (a run's processes end with it, but Ray reaps its workers a moment later)."""
    deadline = time.monotonic() + within
    while (left := survivors(tag)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def process_name(pid: int) -> str | None:
    """The first word of a process's command line (Ray names an actor's ``ray::Class``); None once gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return None


def sandbox_processes() -> int:
    """Processes on this machine running under a sandbox uid (the local backend's, from ``UID_BASE``)."""
    from loongsage.sandbox.store import UID_BASE

    count = 0
    for name in os.listdir("/proc"):
        try:
            if name.isdigit() and os.stat(f"/proc/{name}").st_uid >= UID_BASE:
                count += 1
        except OSError:
            continue
    return count
