"""One SGLang server process: its command line, start-up, readiness, log and end.

The engine worker that owns the server starts it as a child in a session of its own, on loopback
at a free port; the child gets ``SIGKILL`` when its parent dies (``PR_SET_PDEATHSIG``), and
:meth:`ServerProcess.stop` ends the whole session (SGLang's scheduler and detokenizer are children
of the server). The server is ready when ``GET /health`` answers 200 (503 while it loads and warms
up); a server that exits or stays unready past the start-up timeout is an error naming the log and
quoting its last lines.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

SGLANG_LAUNCH = (sys.executable, "-m", "sglang.launch_server")

# SGLang 0.5.16's --attention-backend choices (server_args.ATTENTION_BACKEND_CHOICES), and those its
# deterministic inference (and so rl_on_policy_target) accepts (DETERMINISTIC_ATTENTION_BACKEND_CHOICES)
ATTENTION_BACKENDS = (
    "triton",
    "torch_native",
    "flex_attention",
    "dsa",
    "nsa",
    "dsv4",
    "compressed",
    "cutlass_mla",
    "fa3",
    "fa4",
    "flashinfer",
    "flashmla",
    "trtllm_mla",
    "cutedsl_mla",
    "tokenspeed_mla",
    "trtllm_mha",
    "dual_chunk_flash_attn",
    "aiter",
    "wave",
    "intel_amx",
    "ascend",
    "intel_xpu",
)
DETERMINISTIC_ATTENTION_BACKENDS = ("fa3", "fa4", "flashinfer", "triton", "ascend")
RL_ON_POLICY_TARGETS = ("fsdp",)  # SGLang 0.5.16's RL_ON_POLICY_TARGET_CHOICES


def check_numerics_options(attention_backend: str | None, rl_on_policy_target: str | None, verified: str) -> None:
    """One line naming an attention backend or an on-policy target that SGLang ``verified`` lacks."""
    if attention_backend is not None and attention_backend not in ATTENTION_BACKENDS:
        raise ValueError(
            f"sglang engine: attention_backend={attention_backend!r}: must be one of "
            f"{', '.join(ATTENTION_BACKENDS)} (SGLang {verified}), or null for SGLang's choice"
        )
    if rl_on_policy_target is not None and rl_on_policy_target not in RL_ON_POLICY_TARGETS:
        raise ValueError(
            f"sglang engine: rl_on_policy_target={rl_on_policy_target!r}: must be one of "
            f"{', '.join(RL_ON_POLICY_TARGETS)}, or null"
        )


def check_deterministic_backend(backend: str | None) -> None:
    """One line naming an attention backend a deterministic server refuses."""
    if backend is not None and backend not in DETERMINISTIC_ATTENTION_BACKENDS:
        raise ValueError(
            f"sglang engine: attention_backend={backend!r}: a deterministic server (deterministic or "
            f"rl_on_policy_target) takes only {', '.join(DETERMINISTIC_ATTENTION_BACKENDS)}"
        )


def server_flags(args: Mapping[str, Any]) -> list[str]:
    """``{"mem_fraction_static": 0.5, "skip_tokenizer_init": True}`` as SGLang's flags: a key is
    ``--key-with-dashes``, ``True`` a bare flag, ``False``/``None`` left out, a list its items."""
    out: list[str] = []
    for key, value in args.items():
        if value is None or value is False:
            continue
        flag = "--" + str(key).replace("_", "-")
        if value is True:
            out.append(flag)
        elif isinstance(value, (list, tuple)):
            out += [flag, *map(str, value)]
        else:
            out += [flag, str(value)]
    return out


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: the session is still ended by stop()
        pass


class ServerProcess:
    """A server started from ``launch + flags``, logging to a file of its own."""

    def __init__(
        self, launch: list[str], flags: list[str], *, env: Mapping[str, str] | None = None, name: str = "sglang"
    ):
        self.command = [*launch, *flags]
        self.env = {**os.environ, **(env or {})}
        fd, path = tempfile.mkstemp(prefix=f"loongsage-{name}-", suffix=".log")
        os.close(fd)
        self.log_path = Path(path)
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def exit_code(self, wait_s: float = 0.0) -> int | None:
        """None while it runs; ``wait_s``: how long to wait for an exit that may be under way."""
        if self.process is None:
            return None
        try:
            return self.process.wait(wait_s) if wait_s > 0 else self.process.poll()
        except subprocess.TimeoutExpired:
            return None

    def tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.rstrip().splitlines()[-lines:])

    def failure(self, what: str) -> RuntimeError:
        """An error for ``what`` went wrong, with the log's path and last lines."""
        return RuntimeError(f"sglang server (pid {self.pid}): {what}; log {self.log_path}, last lines:\n{self.tail()}")

    def wait_ready(self, url: str, timeout_s: float) -> float:
        """Poll ``GET {url}/health`` until 200; returns the seconds it took."""
        import httpx

        start = time.monotonic()
        with httpx.Client(timeout=5.0, trust_env=False) as client:
            while True:
                code = self.exit_code()
                if code is not None:
                    raise self.failure(f"exited with code {code} before it was ready")
                try:
                    if client.get(f"{url}/health").status_code == 200:
                        return time.monotonic() - start
                except httpx.HTTPError:
                    pass  # not listening yet
                if time.monotonic() - start > timeout_s:
                    self.stop()
                    raise self.failure(f"not ready within startup_timeout_s={timeout_s:g}")
                time.sleep(0.5)

    def stop(self, grace_s: float = 10.0) -> None:
        """End the server and every process of its session."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        try:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
        except ProcessLookupError:
            return
        try:  # whatever of the session is left (children that ignored the signal, a hung server)
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()
