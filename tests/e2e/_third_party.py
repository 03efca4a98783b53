"""Install the throwaway third-party plugin distribution (tests/fixtures/third_party_plugin).

``install_third_party_plugin(target)`` installs it into ``target`` (not into the environment), so a
process only sees it with ``PYTHONPATH=<target>``; the entry point in the group ``loongsage`` is
then found like any installed plugin's.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "third_party_plugin"
DISTRIBUTION = "loongsage-centered-reward"
MODULE = "loongsage_centered_reward"


def install_third_party_plugin(target_dir: str | os.PathLike) -> Path:
    """Build and install the fixture into ``target_dir``; return that directory (for PYTHONPATH)."""
    target = Path(target_dir).resolve()
    target.mkdir(parents=True, exist_ok=True)
    uv = os.environ.get("UV") or shutil.which("uv")
    if uv:
        cmd = [
            uv,
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--target",
            str(target),
            "--python",
            sys.executable,
            str(FIXTURE),
        ]
    else:
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target), str(FIXTURE)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"installing {FIXTURE} failed ({' '.join(cmd)}):\n{proc.stdout}\n{proc.stderr}")
    if not (target / f"{MODULE}.py").is_file():
        raise RuntimeError(f"installing {FIXTURE} left no {MODULE}.py in {target}")
    return target


def env_with(target: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) with ``target`` first on PYTHONPATH."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(target), env.get("PYTHONPATH", "")) if p)
    return env
