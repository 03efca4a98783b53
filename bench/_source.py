"""The commit a benchmark measured, recorded first in every result file.

``LOONGSAGE_COMMIT``, when set, names it: a machine that got a copy of the working tree (a GPU
machine) may carry no history, or a stale one.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def source_state() -> dict[str, Any]:
    """``{"commit": sha, "uncommitted_files": n}`` (n is None when git cannot tell)."""

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    if os.environ.get("LOONGSAGE_COMMIT"):
        return {"commit": os.environ["LOONGSAGE_COMMIT"], "uncommitted_files": None}
    commit = git("rev-parse", "HEAD")
    if commit is None:
        return {"commit": "unknown", "uncommitted_files": None}
    return {"commit": commit, "uncommitted_files": len((git("status", "--porcelain") or "").splitlines())}
