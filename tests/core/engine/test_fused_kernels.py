"""The fused Triton decode kernels on the CPU: ``_fused_interpreted.py`` in Triton's interpreter.

The interpreter must be switched on before Triton is first imported, which in this process has
long happened (torch imports it), so the kernel tests run in a pytest process of their own.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


def test_fused_kernels_in_the_triton_interpreter():
    pytest.importorskip("triton", reason="Triton is not installed")
    command = [sys.executable, "-m", "pytest", str(HERE / "_fused_interpreted.py"), "-q", "-p", "no:cacheprovider"]
    command += ["-o", "addopts=--import-mode=importlib", "-o", "python_files=_fused_interpreted.py"]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    # about 5 minutes on a 2-core machine beside the rest of the suite; the interpreter runs every
    # kernel program one by one
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1200, cwd=HERE.parents[2])
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-2000:]
