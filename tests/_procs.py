"""Finding the processes a test started, wherever they ended up (jailed, re-parented, daemonised)."""

from __future__ import annotations

import os

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
