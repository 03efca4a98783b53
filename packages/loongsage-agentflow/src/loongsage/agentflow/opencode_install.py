"""OpenCode for the ``opencode`` agent: a pinned ``opencode-ai`` from npm, in a folder the project owns.

Set-up step (once per machine; about 250 MB from the npm registry)::

    python -m loongsage.agentflow.opencode_install [--dir DIR]

installs into ``DIR`` (default ``$LOONGSAGE_CACHE/agents/opencode-<version>``)::

    DIR/node_modules/opencode-ai, opencode-linux-x64, ...   the CLI and its platform binary
    DIR/config/{package.json, package-lock.json, node_modules/@opencode-ai/plugin, ...}

Why ``config/``: at start-up OpenCode makes sure that each of its configuration folders holds
``@opencode-ai/plugin`` and runs an npm install there when it does not; in the network jail that
install can only fail, after npm's retries (about 70 s). Each episode's configuration folder links
these ready ``node_modules`` and copies the manifest and lock, so OpenCode finds nothing to install.

npm runs with ``--ignore-scripts``: opencode-ai's postinstall only copies the platform binary (the
optional dependency npm installed) into place, and :func:`binary` finds that binary itself.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

VERSION = "1.18.33"
_NPM_FLAGS = ["--no-audit", "--no-fund", "--save-exact", "--ignore-scripts", "--loglevel=error"]
_NPM_TIMEOUT_S = 900


def default_dir(version: str = VERSION) -> Path:
    from loongsage.core.tinytask.builds import default_cache_dir

    return default_cache_dir() / "agents" / f"opencode-{version}"


def binary(install_dir: str | Path) -> Path | None:
    """The OpenCode executable of an install (the platform package npm chose), or None."""
    modules = Path(install_dir) / "node_modules"
    arch = {"x86_64": "x64", "amd64": "x64", "aarch64": "arm64", "arm64": "arm64"}.get(platform.machine().lower())
    if arch is None:
        return None
    names = [f"opencode-linux-{arch}"]
    if arch == "x64":  # the baseline build runs on CPUs without AVX2 as well
        names = names + [f"opencode-linux-{arch}-baseline"] if _avx2() else [f"{names[0]}-baseline", *names]
    if Path("/etc/alpine-release").exists():
        names = [f"{n}-musl" for n in names]
    for name in names:
        path = modules / name / "bin" / "opencode"
        if path.is_file() and os.access(path, os.X_OK):
            return path
    return None


def config_dependencies(install_dir: str | Path) -> Path | None:
    """The ready folder whose ``node_modules`` each episode's OpenCode configuration folder links."""
    path = Path(install_dir) / "config"
    return path if (path / "node_modules" / "@opencode-ai" / "plugin").is_dir() else None


def problem(install_dir: str | Path, version: str = VERSION) -> str | None:
    """Why the install in ``install_dir`` cannot be used (None: it can)."""
    hint = f"run: python -m loongsage.agentflow.opencode_install --dir {install_dir} --version {version}"
    if binary(install_dir) is None:
        return f"no OpenCode {version} binary under {install_dir}/node_modules ({hint})"
    if config_dependencies(install_dir) is None:
        return f"no @opencode-ai/plugin under {install_dir}/config ({hint})"
    return None


def install(install_dir: str | Path | None = None, version: str = VERSION) -> Path:
    """Install OpenCode ``version`` into ``install_dir`` unless it is there; returns the folder.

    Built in a temporary sibling and renamed into place, so a broken or concurrent install never
    leaves a half-filled folder that looks ready. Raises RuntimeError with npm's last words.
    """
    target = Path(install_dir) if install_dir else default_dir(version)
    if problem(target, version) is None:
        return target
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError("npm is not on PATH (install Node.js and npm)")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    staging.chmod(0o755)  # mkdtemp's 0700 would stay with the renamed folder
    try:
        (staging / "config").mkdir()
        _npm(npm, staging, f"opencode-ai@{version}")
        _npm(npm, staging / "config", f"@opencode-ai/plugin@{version}")
        if problem(staging, version) is not None:
            raise RuntimeError(f"npm installed opencode-ai@{version}, but {problem(staging, version)}")
        if target.exists():  # an incomplete earlier install, or a concurrent one that finished first
            if problem(target, version) is None:
                return target
            shutil.rmtree(target)
        try:
            staging.rename(target)
        except OSError:
            if problem(target, version) is not None:
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _npm(npm: str, prefix: Path, package: str) -> None:
    env = {**os.environ, "npm_config_update_notifier": "false"}
    try:
        done = subprocess.run(
            [npm, "install", "--prefix", str(prefix), *_NPM_FLAGS, package],
            cwd=prefix,
            env=env,
            capture_output=True,
            text=True,
            timeout=_NPM_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"npm install {package} took over {_NPM_TIMEOUT_S} s") from None
    if done.returncode != 0:
        tail = (done.stderr.strip() or done.stdout.strip())[-600:]
        raise RuntimeError(f"npm install {package} failed with exit code {done.returncode}: {tail}")


def _avx2() -> bool:
    try:
        return " avx2" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loongsage.agentflow.opencode_install",
        description="Install the pinned OpenCode CLI for the 'opencode' agent.",
    )
    parser.add_argument(
        "--dir", help="npm prefix to install into (default: $LOONGSAGE_CACHE/agents/opencode-<version>)"
    )
    parser.add_argument("--version", default=VERSION)
    opts = parser.parse_args(argv)
    try:
        path = install(opts.dir, opts.version)
    except RuntimeError as exc:
        print(f"opencode_install: {exc}", file=sys.stderr)
        return 1
    print(f"OpenCode {opts.version}: {binary(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
