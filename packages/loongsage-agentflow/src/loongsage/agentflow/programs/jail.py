"""The loopback-only network jail of agent programs: bubblewrap, and a relay to the gateway.

``bwrap --unshare-net`` starts the program in a new network namespace that holds nothing but its
own loopback interface: no route, so a connection to any other address fails at once with
"network is unreachable" and nothing leaves the machine. That loopback is not the host's, so the
gateway is carried in::

    program --TCP--> 127.0.0.1:<gateway port>   (the namespace's loopback)
            supervisor's relay (inside, see supervise.py)
            --Unix socket (a file under the episode's control directory: files cross namespaces)-->
            HostRelay (the runner's event loop, host side) --TCP--> the gateway

The program keeps the gateway's URL unchanged. No root daemon is needed: bubblewrap creates the
namespaces itself (as root, or through an unprivileged user namespace). The jail also unshares the
PID namespace (``--unshare-pid``, with a fresh ``/proc``): when the supervisor ends, the kernel
kills every process left in it, and ``--die-with-parent`` ends it with the runner. Files are not
isolated: the program sees the host's file system as the runner does, but for the paths an agent
hides (the run's data and labels, say), which it sees empty, and the driver's interpreter and
import folders, which it cannot change.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import shutil
import subprocess
import sys

PACKAGE_HINT = "install the 'bubblewrap' package (apt-get install -y bubblewrap)"
_JAIL_FLAGS = ["--unshare-net", "--unshare-pid", "--die-with-parent", "--dev-bind", "/", "/", "--proc", "/proc"]


@functools.lru_cache(maxsize=1)
def bwrap_problem() -> str | None:
    """Why the jail cannot be used here (None: it can): bwrap missing, or unable to make namespaces."""
    path = shutil.which("bwrap")
    if path is None:
        return f"bwrap (bubblewrap) is not on PATH: {PACKAGE_HINT}"
    try:
        probe = subprocess.run([path, *_JAIL_FLAGS, "--", "true"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bwrap could not run: {exc}"
    if probe.returncode != 0:
        reason = (probe.stderr.strip().splitlines() or [f"exit code {probe.returncode}"])[-1]
        return f"bwrap cannot create network and PID namespaces here ({reason})"
    return None


@functools.lru_cache(maxsize=1)
def code_paths() -> tuple[str, ...]:
    """The driver's interpreter and every folder it imports from (the framework, its rewards, their
    dependencies): read-only inside the jail, so a program (or a model with a shell tool) cannot
    change the code a reward or a grader's next child process runs."""
    found = [sys.prefix, sys.base_prefix, sys.exec_prefix, *(p for p in sys.path if p)]
    return tuple(dict.fromkeys(os.path.realpath(p) for p in found if os.path.isdir(p)))


def jail_argv(
    argv: list[str],
    control_dir: str,
    workdir: str | None = None,
    hidden: tuple[str, ...] = (),
    read_only: tuple[str, ...] = (),
) -> list[str]:
    """``argv`` run inside the jail; ``control_dir`` (the relay's socket) is bound at the same path.
    ``read_only``: folders the program reads but cannot change (:func:`code_paths`). ``hidden``:
    absolute paths the program does not see: a folder is an empty one there, a file an empty file
    (the run's data and its labels, say). The working directory and the control directory are
    bound after them, so hiding a folder that holds them hides neither."""
    masks: list[str] = [arg for path in read_only for arg in ("--ro-bind", path, path)]
    if hidden:  # a file is hidden behind an empty one (a bound /dev/null is a device node, not readable there)
        empty = os.path.join(control_dir, "empty")
        open(empty, "w").close()
        for path in hidden:
            masks += ["--tmpfs", path] if os.path.isdir(path) else ["--ro-bind", empty, path]
    bound = ["--bind", workdir, workdir] if workdir is not None else []
    binds = [*masks, *bound, "--bind", control_dir, control_dir]
    return [shutil.which("bwrap") or "bwrap", *_JAIL_FLAGS, *binds, "--", *argv]


# Connections one jailed program keeps open to the gateway at once: agents hold a few (a client's
# pool, parallel requests); each costs the runner's process three descriptors (this end, the TCP
# connection, the gateway's), so one program holding thousands would leave none to the others.
MAX_CONNECTIONS = 64


class HostRelay:
    """The host end: a Unix socket whose every connection is carried to the gateway over TCP, at
    most ``max_connections`` at once (one more is closed as soon as it is accepted)."""

    def __init__(self, path: str, host: str, port: int, max_connections: int = MAX_CONNECTIONS):
        self.path, self.host, self.port, self.max_connections = path, host, port, max_connections
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._accept, path=self.path)

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._tasks) >= self.max_connections:
            writer.close()
            return
        task = asyncio.ensure_future(self._bridge(reader, writer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _bridge(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(self.host, self.port)
        except OSError:
            writer.close()
            return
        try:
            await asyncio.gather(_copy(reader, up_writer), _copy(up_reader, writer))
        finally:
            for w in (writer, up_writer):
                w.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await task


async def _copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()  # half-close: the other direction may still be answering
    except OSError:
        pass
