"""Run the Megatron tests' worker scripts in forks of one process that has Megatron-Core loaded.

Importing Megatron-Core, transformers' model code and the parts of torch they pull in (DTensor,
dynamo, sympy) costs about 8 s of CPU per process on a two-core machine, and the tests run about
twenty worker scripts. A script forked from this server starts with all of it loaded: the import is
paid once per pytest session. The script runs as ``python script args...`` would run it (its
``__main__`` block, ``sys.argv``, its folder first on ``sys.path``), in a session of its own (so a
timeout kills it with every rank it forked), its output in files handed back as text.

Forking is safe for the reason given in :mod:`_ranks`: the server keeps torch on one thread and
computes nothing. Run as a script, this file is the server: one JSON job per line on stdin, the
forked child's pid and then its exit status as JSON lines on stdout.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path


def _run_script(script: str, args: list[str], out: str, err: str) -> int:
    """In the forked child: ``script`` as ``__main__`` with ``args``; its exit code."""
    import runpy
    import traceback
    import warnings

    os.setsid()
    devnull = os.open(os.devnull, os.O_RDONLY)  # not the server's job pipe
    os.dup2(devnull, 0)
    os.close(devnull)
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115 - the child exits through os._exit
    sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
    os.environ["PYTHONWARNINGS"] = "ignore"
    warnings.simplefilter("ignore")
    sys.argv = [script, *args]
    sys.path.insert(0, str(Path(script).parent))
    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported as a script's traceback would be
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def serve() -> None:
    """The server's loop: fork a child per job line, answer its pid, then its exit status."""
    sys.path.insert(0, str(Path(__file__).parent))
    from _ranks import one_thread

    one_thread()
    import warnings

    warnings.simplefilter("ignore")
    # what the worker scripts and the ranks they fork import
    import megatron.core  # noqa: F401
    import torch.multiprocessing  # noqa: F401
    import transformers.models.qwen3.modeling_qwen3  # noqa: F401
    import transformers.models.qwen3_moe.modeling_qwen3_moe  # noqa: F401

    import loongsage.megatron.cpu  # noqa: F401
    import loongsage.megatron.trainer  # noqa: F401

    print(json.dumps({"ready": os.getpid()}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        pid = os.fork()
        if pid == 0:
            os._exit(_run_script(job["script"], job["args"], job["out"], job["err"]))
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), flush=True)


class WorkerServer:
    """The client: starts the server and runs scripts in it as ``subprocess.run`` would."""

    def __init__(self) -> None:
        self._log = tempfile.NamedTemporaryFile(prefix="megatron-server-", suffix=".err", delete=False)  # noqa: SIM115
        self._proc = subprocess.Popen(
            [sys.executable, __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )
        self._reply(600)  # {"ready": pid}

    def _reply(self, timeout: float) -> dict | None:
        """The server's next line, or None when ``timeout`` passes first."""
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout)
        if not ready:
            return None
        line = self._proc.stdout.readline()
        if not line:
            log = Path(self._log.name).read_text(errors="replace")[-4000:]
            raise RuntimeError(f"the Megatron worker server exited ({self._proc.wait()}):\n{log}")
        return json.loads(line)

    def run(self, script: Path | str, *args: str, timeout: float) -> subprocess.CompletedProcess:
        """``python script *args`` with its output captured as text; raises ``TimeoutExpired``
        (after killing the script and everything it forked) when it runs past ``timeout`` s."""
        with tempfile.TemporaryDirectory(prefix="megatron-job-") as tmp:
            out, err = Path(tmp) / "out", Path(tmp) / "err"
            job = {"script": str(script), "args": [str(a) for a in args], "out": str(out), "err": str(err)}
            self._proc.stdin.write(json.dumps(job) + "\n")
            self._proc.stdin.flush()
            pid = self._reply(60)["pid"]
            done = self._reply(timeout)
            if done is None:
                os.killpg(pid, signal.SIGKILL)
                self._reply(60)
                raise subprocess.TimeoutExpired([str(script), *job["args"]], timeout)
            read = lambda p: p.read_text(errors="replace") if p.exists() else ""  # noqa: E731
            return subprocess.CompletedProcess([str(script), *job["args"]], done["rc"], read(out), read(err))

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._log.close()
        Path(self._log.name).unlink(missing_ok=True)


_server: WorkerServer | None = None


def run_worker(script: Path | str, *args: str, timeout: float) -> subprocess.CompletedProcess:
    """Run a worker script in the session's server (started on first use, closed at exit)."""
    global _server
    if _server is None or _server._proc.poll() is not None:
        _server = WorkerServer()
        atexit.register(_server.close)
    return _server.run(script, *args, timeout=timeout)


if __name__ == "__main__":
    serve()
