"""One agent program, start to end: spawn under its supervisor (in the jail or not), capture its
output within a size limit, wait, and make sure nothing it started is left running.

The supervisor (:mod:`loongsage.agentflow.programs.supervise`) owns the deadline and the cleanup of the
program's whole process tree; this side keeps two backstops for a supervisor that was itself
killed (the program runs as the same user and may do that): a SIGKILL of the supervisor's process
group at ``timeout + grace + margin``, and, outside the jail, a sweep of every process whose
environment carries the episode's marker (``LOONGSAGE_EPISODE``). Inside the jail the PID
namespace makes the sweep unnecessary: its processes die with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from loongsage.agentflow.programs import supervise
from loongsage.agentflow.programs.jail import HostRelay, code_paths, jail_argv

MARKER = "LOONGSAGE_EPISODE"
_MARGIN_S = 10.0  # the supervisor's own start-up and cleanup, beyond the program's timeout + grace
_DRAIN_S = 2.0  # after the exit, how long the output pipes may take to reach end of file


@dataclass
class Capture:
    """The last ``limit`` bytes of a stream, and how many it carried."""

    limit: int
    kept: bytearray = field(default_factory=bytearray)
    total: int = 0

    def add(self, data: bytes) -> None:
        self.total += len(data)
        self.kept += data
        if len(self.kept) > self.limit:
            del self.kept[: len(self.kept) - self.limit]  # bytearray drops a prefix cheaply

    def tail(self, chars: int) -> str:
        return bytes(self.kept[-4 * chars :]).decode("utf-8", "replace")[-chars:]


@dataclass
class Outcome:
    exit_code: int | None
    signal: int | None
    timed_out: bool
    wall_s: float
    stdout: Capture
    stderr: Capture
    leftover: int = 0  # processes alive when the program ended (the program too when it timed out)
    error: str | None = None  # the program never ran, or its supervisor was lost
    swept: int = 0  # processes the marker sweep had to kill (0 unless the supervisor was killed)


@dataclass
class Launch:
    argv: list[str]
    env: dict[str, str]
    cwd: str
    control_dir: str  # the supervisor's status file, the relay's socket (a short path: sockets need one)
    timeout_s: float
    grace_s: float
    max_output_bytes: int
    jail: bool
    gateway: tuple[str, int]  # where the host relay connects (jail only)
    hidden: tuple[str, ...] = ()  # absolute paths the jailed program sees empty (jail only)


async def run_program(launch: Launch) -> Outcome:
    status_path = os.path.join(launch.control_dir, "status.json")
    args = [
        sys.executable,
        "-I",
        "-S",
        supervise.__file__,
        "--status",
        status_path,
        "--timeout",
        str(launch.timeout_s),
        "--grace",
        str(launch.grace_s),
    ]
    relay = None
    if launch.jail:
        sock = os.path.join(launch.control_dir, "gateway.sock")
        relay = HostRelay(sock, *launch.gateway)
        args = jail_argv(
            [*args, "--relay", f"{launch.gateway[1]}={sock}", "--", *launch.argv],
            launch.control_dir,
            launch.cwd,
            launch.hidden,
            code_paths(),
        )
    else:
        args += ["--parent", str(os.getpid()), "--", *launch.argv]
    out, err = Capture(launch.max_output_bytes), Capture(launch.max_output_bytes)
    sinks: list[_Sink] = []
    backstop, swept, start = False, 0, time.monotonic()
    try:
        if relay is not None:
            await relay.start()
        writers = []
        for capture in (out, err):
            read_end, write_end = os.pipe()
            writers.append(write_end)
            sinks.append(await _Sink.open(read_end, capture))
        try:
            proc = await asyncio.create_subprocess_exec(
                *args,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=writers[0],
                stderr=writers[1],
                cwd=launch.cwd,
                env=launch.env,
                start_new_session=True,
            )
        except OSError as exc:
            return Outcome(None, None, False, 0.0, out, err, error=f"could not start: {exc}")
        except BaseException:
            # cancelled while starting: asyncio kills the supervisor alone, and a program it had
            # started already would outlive it (the jail's namespace dies with its bwrap instead)
            if not launch.jail:
                await asyncio.to_thread(sweep, launch.env[MARKER])
            raise
        finally:
            for fd in writers:
                os.close(fd)
        try:
            await asyncio.wait_for(proc.wait(), launch.timeout_s + launch.grace_s + _MARGIN_S)
        except TimeoutError:
            backstop = True
            _kill_group(proc.pid)
            await proc.wait()
        except BaseException:  # cancelled: the episode is abandoned, so is its program
            _kill_group(proc.pid)
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(proc.wait(), _DRAIN_S)
            raise
        finally:
            wall = time.monotonic() - start
            swept = 0 if launch.jail else await asyncio.to_thread(sweep, launch.env[MARKER])
    finally:
        # the pipes reach end of file once every process holding them is gone; the transports are
        # closed here in any case, so a survivor (none is expected) can hold no descriptor of ours
        if sinks:
            await asyncio.wait([s.closed for s in sinks], timeout=_DRAIN_S)
        for sink in sinks:
            sink.close()
        if relay is not None:
            await relay.close()
    return _outcome(status_path, proc.returncode, backstop, wall, out, err, swept)


class _Sink(asyncio.Protocol):
    """One output pipe read into a :class:`Capture` (its transport is ours to close, writers or not)."""

    def __init__(self, capture: Capture):
        self.capture, self.transport = capture, None
        self.closed = asyncio.get_running_loop().create_future()

    @classmethod
    async def open(cls, fd: int, capture: Capture) -> _Sink:
        sink = cls(capture)
        sink.transport, _ = await asyncio.get_running_loop().connect_read_pipe(lambda: sink, open(fd, "rb", 0))
        return sink

    def data_received(self, data: bytes) -> None:
        self.capture.add(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


def _outcome(
    status_path: str, returncode: int | None, backstop: bool, wall: float, out: Capture, err: Capture, swept: int
) -> Outcome:
    try:
        status = json.loads(Path(status_path).read_text())
        code, sig, leftover = status["exit_code"], status["signal"], int(status["leftover"])
        timed_out, spawn_error = bool(status["timed_out"]) or backstop, status["spawn_error"]
    except (OSError, ValueError, KeyError, TypeError):
        # the supervisor was killed before it wrote its outcome (or the file was tampered with):
        # only the runner's view is left
        reason = "timed out, killed by the runner's backstop" if backstop else f"supervisor ended with {returncode}"
        return Outcome(None, None, backstop, wall, out, err, error=f"supervisor lost: {reason}", swept=swept)
    error = f"could not start: {spawn_error}" if spawn_error else None
    return Outcome(code, sig, timed_out, wall, out, err, leftover=leftover, error=error, swept=swept)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def sweep(marker: str) -> int:
    """SIGKILL every process whose environment holds ``MARKER=marker``, until none is left."""
    needle = f"{MARKER}={marker}".encode()
    killed: set[int] = set()
    for _ in range(50):
        found = [pid for pid in _pids() if _has(pid, needle)]
        if not found:
            break
        for pid in found:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
            killed.add(pid)
        time.sleep(0.01)
    return len(killed)


def _pids() -> list[int]:
    me = os.getpid()
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != me]


def _has(pid: int, needle: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return needle in f.read().split(b"\0")
    except OSError:
        return False
