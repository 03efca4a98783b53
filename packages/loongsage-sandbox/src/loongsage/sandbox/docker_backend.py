"""``docker``: every sandbox a container of a Docker Engine API, through the official ``docker``
Python client (``pip install 'loongsage-sandbox[docker]'``). Any engine that serves the API works:
Docker, or Podman's compatible service (``podman system service``), which the tests run.

A container per sandbox, created from ``image`` and kept alive by its PID 1 (:data:`INIT`); every
``exec`` is a process of it. What it may do:

* network: ``network_mode: none`` (its own namespace, loopback only);
* files: a read-only root file system, a size-capped tmpfs at ``/work`` (the work directory,
  owned by the sandbox's uid) and at ``/tmp``. The default image is a skeleton built here (a few
  empty directories, the links of a merged ``/usr``, ``passwd``/``group``/``hosts``;
  :mod:`loongsage.sandbox.docker_image`) with the host's ``/usr`` and the loader's files bound
  read-only, the same view as the ``local`` jail; a ``image`` of your own (``python:3.12-slim``,
  a task's repository image) is used as it is;
* identity: commands run without capabilities and with ``no-new-privileges``, under **a uid of the
  sandbox's own**, claimed machine-wide from the range the ``local`` backend claims from
  (:class:`~loongsage.sandbox.store.UidClaim`): ``RLIMIT_NPROC`` counts the processes of a uid on the
  whole host, so under one shared uid a sandbox holding its processes would fail a peer's forks
  (the claims are this machine's: clients on two machines sharing one engine may pick one uid). A
  rootless engine maps too few uids for that: there, or with ``uid`` given, every sandbox runs as
  that one uid (1000 by default on a rootless engine). The container keeps only ``KILL``, for the
  root process that ends the others (the sweeper), which a sandbox's uid never holds;
* limits: **the container's** memory (``memory_mb``, a cgroup: all its processes together, no swap),
  CPU share (``cpus``) and processes (``processes``, the pids cgroup), and per process the CPU
  seconds, file size and open files of :class:`~loongsage.sandbox.limits.Limits`.

``exec`` runs ``/bin/sh -c cmd`` in ``/work``. A container has one PID namespace, where the ``local``
backend gives each command its own, so what ends a command's processes is a *sweep*: every process
of the sandbox but PID 1 is killed, by the sweeper that PID 1 keeps (the container's root; see
:data:`INIT`), which answers once none is left. A command's processes are swept when it returns, once
no other command of the sandbox runs (what a command left in the background dies then; a command
started meanwhile waits for the sweep), and at its timeout (or when it is cancelled, or its output
stream broke), concurrent commands of the same sandbox included. The sweeper runs on shell builtins
alone and is asked through the container's stdin, so a fork bomb that holds every slot of the pids
cgroup cannot stop it, where an exec (which needs new processes in the container) could not even
start. A command's output arrives whole, or the result says it did not (``error``, no exit code; see
:mod:`loongsage.sandbox.docker_stream`).

``put``/``get`` go through the engine's archive API. A path follows the same rules as in ``local``
(relative, no ``..``); the engine resolves it inside the container, so a symlink the sandbox planted
redirects a ``put`` at most elsewhere inside the sandbox, never outside it, and ``get`` refuses a
symlink or anything but a regular file.

Every container carries labels (owner, deadline, and the creating process as host, pid and start
time): :meth:`DockerSandbox.reap_orphans` removes those whose creator on this host is gone, and
those of any host more than an hour past their deadline.
"""

from __future__ import annotations

import asyncio
import functools
import io
import logging
import os
import secrets
import socket
import tarfile
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from loongsage.core.contracts import ExecResult, Sandbox, SandboxOwner
from loongsage.core.types import Check
from loongsage.sandbox import paths
from loongsage.sandbox.docker_image import (
    SANDBOX_UID,
    base_image,
    docker_problem,
    engine_client,
    host_mounts,
    mount_roots,
    rootless,
)
from loongsage.sandbox.docker_stream import ExecStream, StreamBroken, SweepChannel
from loongsage.sandbox.jail import WORK, jail_env
from loongsage.sandbox.limits import MIB, Limits
from loongsage.sandbox.local import Capture, check_exec, check_owner, exec_result
from loongsage.sandbox.store import UidClaim, process_start

log = logging.getLogger(__name__)
LABEL = "loongsage.sandbox"
_SYMLINK, _DIR = 1 << 27, 1 << 31  # Go's os.ModeSymlink and os.ModeDir in the archive API's stat
_ORPHAN_GRACE_S = 3600.0  # a container of another host is an orphan this long after its deadline
_DRAIN_S = 5.0
_SWEEP_S = 20.0  # how long a sweep may take before the backend falls back on a root exec
_SWEEP_TRIES = 10000  # kills of one sweep request before the sweeper answers "left" (about 50 ms)

# PID 1 of every container (root, with CAP_KILL only). It keeps one child, the sweeper, and waits
# on it, which collects every orphan meanwhile: a killed process holds its slot of the pids cgroup
# until it is collected. The sweeper reads a number per line on the container's stdin (written only
# by the backend, through the engine's attach), kills every process but PID 1 and itself again and
# again until the kernel finds none left to signal (zombies count until PID 1 collects them), and
# answers ``swept N`` on stdout, or ``left N`` after _SWEEP_TRIES kills (the backend asks again).
# kill(-1) is atomic against fork (a process cannot fork once SIGKILL is pending), and read, kill,
# test and echo are builtins: nothing here forks, so a full pids cgroup cannot stop a sweep. A
# sweeper killed is started again; one whose stdin closed (Podman closes it when the backend's
# attach ends) is not, and PID 1 only waits (the backend's sweeps fall back on a root exec).
INIT = (
    "trap 'exit 0' TERM; exec 3<&0 </dev/null; "
    "while (while read -r n; do i=0; "
    f"while kill -9 -1 2>/dev/null && [ $((i += 1)) -lt {_SWEEP_TRIES} ]; do :; done; "
    f'if [ $i -lt {_SWEEP_TRIES} ]; then echo "swept $n"; else echo "left $n"; fi; '
    "done) <&3 & wait $!; [ $? -gt 128 ]; do :; done; "
    "while :; do sleep 3600 & wait $!; done"
)


def _names(path: str) -> list[str]:
    """The components of ``path`` (the rules of :func:`~loongsage.sandbox.paths.split`), each valid
    UTF-8: the engine's API carries paths as text."""
    parts = paths.split(path)
    try:
        return [p.decode("utf-8") for p in parts]
    except UnicodeDecodeError:
        raise ValueError(
            f"sandbox path {path!r}: not valid UTF-8; the docker backend's file API carries "
            f"UTF-8 names only (a command inside may still create any name)"
        ) from None


def _claim_uid() -> UidClaim:
    """A uid of the sandbox range, held until released: machine-wide where this process may write
    the claims of :data:`UID_LOCKS` (root), else among this user's processes."""
    try:
        return UidClaim()
    except PermissionError:
        return UidClaim(locks=Path(tempfile.gettempdir()) / f"loongsage-sandbox-uids-{os.geteuid()}")


class DockerSandbox(Sandbox):
    """The ``docker`` sandbox backend (see the module docstring)."""

    reusable = False

    @staticmethod
    def doctor() -> list[Check]:
        """A Docker Engine API answering at the default address (Docker, or Podman's service)."""
        problem = docker_problem()
        fix = "start Docker, or Podman's API service (podman system service), or set DOCKER_HOST"
        return [Check("Docker Engine API", problem is None, problem or "answers", "" if problem is None else fix)]

    def __init__(
        self,
        limits: Limits = Limits(),
        base_url: str | None = None,
        image: str | None = None,
        cpus: float = 1.0,
        runtime: str | None = None,
        api_timeout_s: float = 120.0,
        uid: int | None = None,
    ):
        if isinstance(cpus, bool) or not isinstance(cpus, (int, float)) or not 0 < cpus <= 1024:
            raise ValueError(f"docker sandbox cpus={cpus!r}: must be a positive number of CPUs")
        if uid is not None and (isinstance(uid, bool) or not isinstance(uid, int) or not 0 < uid < 2**31):
            raise ValueError(
                f"docker sandbox uid={uid!r}: must be a uid from 1 to 2**31 - 1 (or null: a uid of its own per sandbox)"
            )
        self.limits, self.cpus, self.runtime = limits, float(cpus), runtime
        self.client = engine_client(base_url, api_timeout_s)
        if uid is None and rootless(self.client):
            log.warning(
                "sandbox 'docker': the engine is rootless and maps too few uids for a uid per sandbox; "
                "every sandbox runs as uid %d, whose process limit (processes) counts them all together",
                SANDBOX_UID,
            )
            uid = SANDBOX_UID
        self.uid = uid  # every sandbox's (None: each its own, claimed)
        self._claims: dict[str, UidClaim] = {}  # sandbox id -> the claim on its uid (uid None)
        self.image = image or base_image(self.client)
        self._mounts = host_mounts() if image is None else {}
        self._boxes: dict[str, str | None] = {}  # sandbox id (the container's name) -> None, or why it is closing
        self._channels: dict[str, SweepChannel] = {}  # sandbox id -> the way to its sweeper
        self._running: dict[str, int] = {}  # sandbox id -> its commands under way (none: absent)
        self._sweeps: dict[str, set[asyncio.Task]] = {}  # sandbox id -> its sweeps under way
        self._threads = ThreadPoolExecutor(max_workers=64, thread_name_prefix="docker-sandbox")
        self._background: set[asyncio.Task] = set()
        self._host = socket.gethostname()
        self._creator = f"{self._host}:{os.getpid()}:{process_start(os.getpid()) or 0}"

    # ------------------------------------------------------------------------------- lifecycle
    async def create(self, owner: SandboxOwner, deadline: float) -> str:
        check_owner(owner, deadline)
        task = self._spawn(self._make(owner, deadline))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:  # made anyway: removed once it exists
            self._spawn(self._discard(task))
            raise

    async def _make(self, owner: SandboxOwner, deadline: float) -> str:
        name = f"lsg-{secrets.token_hex(6)}"
        if self.uid is None:
            self._claims[name] = _claim_uid()
        try:
            return await self._start(name, owner, deadline)
        except BaseException:
            self._forget(name)
            raise

    async def _start(self, name: str, owner: SandboxOwner, deadline: float) -> str:
        from docker.types import Ulimit

        lim, uid = self.limits, self._uid(name)
        labels = {
            LABEL: "1",
            f"{LABEL}.run": owner.run,
            f"{LABEL}.trajectory": owner.trajectory,
            f"{LABEL}.attempt": str(owner.attempt),
            f"{LABEL}.deadline": repr(float(deadline)),
            f"{LABEL}.creator": self._creator,
        }
        options = dict(
            command=["/bin/sh", "-c", INIT],
            stdin_open=True,  # the sweeper's requests
            detach=True,  # else the client asks the engine to close the stdin when an attach ends
            name=name,
            labels=labels,
            network_mode="none",
            read_only=True,
            user="0:0",
            working_dir=WORK,
            cap_drop=["ALL"],
            cap_add=["KILL"],
            security_opt=["no-new-privileges"],
            mem_limit=lim.memory_mb * MIB,
            memswap_limit=lim.memory_mb * MIB,
            pids_limit=lim.processes,
            nano_cpus=int(self.cpus * 1e9),
            volumes=self._mounts,
            environment=jail_env(),
            tmpfs={WORK: f"size={lim.work_mb}m", "/tmp": f"size={lim.tmp_mb}m"},
            ulimits=[
                Ulimit(name="cpu", soft=lim.cpu_s, hard=lim.cpu_s),
                Ulimit(name="core", soft=0, hard=0),
                Ulimit(name="fsize", soft=lim.file_size_mb * MIB, hard=lim.file_size_mb * MIB),
                Ulimit(name="nofile", soft=lim.open_files, hard=lim.open_files),
                # a uid's processes on the whole host: the sandbox's own where its uid is (see above)
                Ulimit(name="nproc", soft=lim.processes, hard=lim.processes),
            ],
        )
        if self.runtime:
            options["runtime"] = self.runtime
        container = await self._call(self.client.containers.create, self.image, **options)
        self._boxes[name] = None  # from here on a delete removes it
        self._channels[name] = SweepChannel(self.client.api, name)
        try:
            await self._call(container.start)
            # the tmpfs roots' owner and mode, set by the engine from an archive of two directory entries
            await self._call(self.client.api.put_archive, name, "/", mount_roots(uid))
        except BaseException:
            await self.delete(name)
            raise
        return name

    async def _discard(self, task: asyncio.Task) -> None:
        try:
            name = await task
        except BaseException:  # noqa: BLE001 - it removed itself
            return
        await self.delete(name)

    async def delete(self, sandbox_id: str) -> None:
        if sandbox_id not in self._boxes:
            return
        self._boxes[sandbox_id] = "deleted"
        await asyncio.shield(self._spawn(self._remove(sandbox_id)))

    async def _remove(self, sandbox_id: str) -> None:
        import docker

        channel = self._channels.pop(sandbox_id, None)
        if channel is not None:
            await self._call(channel.close)
        try:
            await self._call(self.client.api.remove_container, sandbox_id, force=True, v=True)
        except docker.errors.NotFound:
            pass
        self._boxes.pop(sandbox_id, None)
        self._forget(sandbox_id)  # its uid's processes went with the container

    def _uid(self, sandbox_id: str) -> int:
        claim = self._claims.get(sandbox_id)
        return claim.uid if claim is not None else self.uid

    def _forget(self, sandbox_id: str) -> None:
        claim = self._claims.pop(sandbox_id, None)
        if claim is not None:
            claim.release()

    async def reap_orphans(self) -> int:
        """Remove this engine's sandbox containers whose creating process (on this host) is gone,
        or of any host, an hour past their deadline; how many."""
        containers = await self._call(self.client.containers.list, all=True, filters={"label": LABEL})
        count = 0
        for container in containers:
            labels = container.labels
            host, _, rest = labels.get(f"{LABEL}.creator", "").partition(":")
            pid, _, start = rest.partition(":")
            try:
                dead = host == self._host and process_start(int(pid)) != int(start)
                expired = float(labels.get(f"{LABEL}.deadline", "inf")) + _ORPHAN_GRACE_S < time.time()
            except ValueError:
                dead, expired = False, False
            if (dead or expired) and container.name not in self._boxes:
                self._boxes[container.name] = "reaped"
                await self._remove(container.name)
                count += 1
        return count

    async def close(self) -> None:
        """Remove every container of this backend and wait for background work."""
        for sandbox_id in list(self._boxes):
            await self.delete(sandbox_id)
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

    def sandbox_ids(self) -> list[str]:
        return [s for s, closing in self._boxes.items() if closing is None]

    # ------------------------------------------------------------------------------------ exec
    async def exec(self, sandbox_id: str, cmd: str, timeout: float) -> ExecResult:
        check_exec(cmd, timeout)
        self._open(sandbox_id)
        await self._swept(sandbox_id)  # a sweep under way would kill this command's processes too
        self._open(sandbox_id)
        self._running[sandbox_id] = self._running.get(sandbox_id, 0) + 1
        try:
            result = await self._run(sandbox_id, cmd, float(timeout))
        finally:
            self._running[sandbox_id] -= 1
            if not self._running[sandbox_id]:
                # the last command of the sandbox: whatever it or another left behind ends now
                del self._running[sandbox_id]
                self._sweep(sandbox_id)
        if sweeps := self._sweeps.get(sandbox_id):  # returned once the next command finds nothing left over
            await asyncio.wait(set(sweeps))
        return result

    async def _run(self, sandbox_id: str, cmd: str, timeout: float) -> ExecResult:
        import docker

        out, err = Capture(self.limits.output_bytes), Capture(self.limits.output_bytes)
        start = time.monotonic()
        try:
            exec_id = (
                await self._call(
                    self.client.api.exec_create,
                    sandbox_id,
                    ["/bin/sh", "-c", cmd],
                    workdir=WORK,
                    user=f"{self._uid(sandbox_id)}:{self._uid(sandbox_id)}",
                    environment=jail_env(),
                )
            )["Id"]
        except docker.errors.NotFound:
            raise LookupError(f"sandbox {sandbox_id!r}: its container is gone") from None
        except docker.errors.APIError as exc:
            return ExecResult(
                None, None, "", "", False, False, time.monotonic() - start, f"could not start: {exc.explanation or exc}"
            )
        stream = ExecStream(self.client.api, exec_id)
        reader = asyncio.ensure_future(self._call(stream.pump, out, err))
        timed_out = False
        try:
            if not (await asyncio.wait({reader}, timeout=timeout))[0]:
                timed_out = True
                await self._kill_all(sandbox_id)
        except BaseException:  # cancelled: the command is abandoned, so is every process of the sandbox
            self._spawn(self._abandon(sandbox_id, reader, stream))
            raise
        wall = time.monotonic() - start
        if not (await asyncio.wait({reader}, timeout=_DRAIN_S))[0]:
            stream.abort()  # the engine never ended the stream: its thread must not wait forever
            await asyncio.wait({reader})
        closing = self._boxes.get(sandbox_id, "deleted")
        problem = reader.exception()
        if closing is not None or timed_out:  # its processes were killed: the stream ended with them
            return exec_result(None, timed_out, wall, out, err, closing)
        if isinstance(problem, docker.errors.NotFound):
            raise LookupError(f"sandbox {sandbox_id!r}: its container is gone") from None
        if isinstance(problem, docker.errors.APIError):
            return ExecResult(
                None, None, "", "", False, False, wall, f"could not start: {problem.explanation or problem}"
            )
        if problem is None:
            code, problem = await self._exit_code(exec_id)
            if problem is None:
                return exec_result(code, False, wall, out, err, None)
        else:
            problem = f"the command's output stream broke: {problem}"
        # never an empty or short output passed off as the command's own; a command that may still
        # run is ended, as at a timeout (nobody reads its output any more)
        await self._kill_all(sandbox_id)
        return _lost(out, err, wall, problem)

    async def _exit_code(self, exec_id: str) -> tuple[int | None, str | None]:
        """The exec's exit code once the engine saw it end (some engines record the end a moment
        after the stream's), or why there is none: a clean end of a stream whose command still
        runs ``_DRAIN_S`` later was a cut connection, not the command's end."""
        import docker

        end, pause = time.monotonic() + _DRAIN_S, 0.005
        while True:
            try:
                state = await self._call(self.client.api.exec_inspect, exec_id)
            except docker.errors.APIError as exc:
                return None, f"the engine lost the command's exit status: {exc.explanation or exc}"
            if not state.get("Running"):
                return state.get("ExitCode"), None
            if time.monotonic() > end:
                return None, "the command's output stream ended while the command still ran"
            await asyncio.sleep(pause)
            pause = min(2 * pause, 0.2)

    async def _kill_all(self, sandbox_id: str) -> None:
        """Every process of the sandbox but its PID 1 ends (a sweep, which a cancelled caller leaves running)."""
        await asyncio.shield(self._sweep(sandbox_id))

    def _sweep(self, sandbox_id: str) -> asyncio.Task:
        """A sweep of the sandbox, under way until it ends; a command waits for every such (``_swept``)."""
        task = self._spawn(self._sweep_now(sandbox_id))
        self._sweeps.setdefault(sandbox_id, set()).add(task)
        task.add_done_callback(functools.partial(self._sweep_done, sandbox_id))
        return task

    def _sweep_done(self, sandbox_id: str, task: asyncio.Task) -> None:
        sweeps = self._sweeps.get(sandbox_id, set())
        sweeps.discard(task)
        if not sweeps:
            self._sweeps.pop(sandbox_id, None)

    async def _swept(self, sandbox_id: str) -> None:
        """Until no sweep of the sandbox is under way (one may start while another is awaited)."""
        while sweeps := self._sweeps.get(sandbox_id):
            await asyncio.wait(set(sweeps))

    async def _sweep_now(self, sandbox_id: str) -> None:
        import docker

        channel = self._channels.get(sandbox_id)
        if channel is None or self._boxes.get(sandbox_id) is not None:
            return  # being deleted: its container goes with every process
        try:
            await self._call(channel.sweep, _SWEEP_S)
            return
        except (StreamBroken, OSError):  # the sweeper is out of reach: a root exec, where one can start
            if self._boxes.get(sandbox_id) is not None:
                return
        try:
            exec_id = (
                await self._call(self.client.api.exec_create, sandbox_id, ["/bin/sh", "-c", "kill -9 -1"], user="0:0")
            )["Id"]
            await self._call(self.client.api.exec_start, exec_id)
        except docker.errors.APIError:
            pass  # the container is gone already, and its processes with it

    async def _abandon(self, sandbox_id: str, reader: asyncio.Future, stream: ExecStream) -> None:
        await self._kill_all(sandbox_id)
        if not (await asyncio.wait({reader}, timeout=_DRAIN_S))[0]:
            stream.abort()
        await asyncio.wait({reader})
        reader.exception()  # retrieved: an abandoned command's broken stream is no one's news

    # ----------------------------------------------------------------------------------- files
    async def put(self, sandbox_id: str, path: str, data: bytes) -> None:
        import docker

        parts = _names(path)
        if len(data) > self.limits.get_bytes:
            raise ValueError(f"sandbox put {path!r}: {len(data)} bytes is over the limit of {self.limits.get_bytes}")
        self._open(sandbox_id)
        uid = self._uid(sandbox_id)
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for i in range(1, len(parts)):
                info = tarfile.TarInfo("/".join(parts[:i]))
                info.type, info.mode, info.uid, info.gid = tarfile.DIRTYPE, paths.DIR_MODE, uid, uid
                tar.addfile(info)
            info = tarfile.TarInfo("/".join(parts))
            info.size, info.mode, info.uid, info.gid = len(data), paths.FILE_MODE, uid, uid
            info.mtime = int(time.time())
            tar.addfile(info, io.BytesIO(data))
        try:
            await self._call(self.client.api.put_archive, sandbox_id, WORK, buf.getvalue())
        except docker.errors.NotFound:
            raise LookupError(f"sandbox {sandbox_id!r}: its container is gone") from None
        except docker.errors.APIError as exc:
            raise ValueError(f"sandbox put {path!r}: refused by the engine: {exc.explanation or exc}") from None

    async def get(self, sandbox_id: str, path: str) -> bytes:
        parts = _names(path)
        self._open(sandbox_id)
        return await self._call(self._read, sandbox_id, path, f"{WORK}/{'/'.join(parts)}")

    def _read(self, sandbox_id: str, path: str, where: str) -> bytes:
        import docker

        limit = self.limits.get_bytes
        try:
            stream, stat = self.client.api.get_archive(sandbox_id, where)
        except docker.errors.NotFound:
            if sandbox_id not in self._boxes or self._boxes[sandbox_id] is not None:
                raise LookupError(f"sandbox {sandbox_id!r}: deleted during the file transfer") from None
            raise FileNotFoundError(f"sandbox path {path!r}: no such file in the work directory") from None
        if stat.get("mode", 0) & _SYMLINK:
            raise ValueError(f"sandbox path {path!r}: is a symlink; symlinks are not followed")
        if stat.get("mode", 0) & _DIR:
            raise ValueError(f"sandbox path {path!r}: not a regular file; only regular files are read")
        if stat.get("size", 0) > limit:
            raise ValueError(f"sandbox get {path!r}: {stat['size']} bytes is over the limit of {limit}")
        raw = bytearray()
        for chunk in stream:
            raw += chunk
            if len(raw) > limit + (1 << 20):  # the tar's headers and padding, at most
                raise ValueError(f"sandbox get {path!r}: over the limit of {limit} bytes")
        with tarfile.open(fileobj=io.BytesIO(bytes(raw)), mode="r:") as tar:
            member = tar.next()
            if member is None or not member.isreg():
                raise ValueError(f"sandbox path {path!r}: not a regular file; only regular files are read")
            data = tar.extractfile(member).read(limit + 1)
        if len(data) > limit:
            raise ValueError(f"sandbox get {path!r}: over the limit of {limit} bytes")
        return data

    # ------------------------------------------------------------------------------- internals
    def _open(self, sandbox_id: str) -> None:
        if sandbox_id not in self._boxes:
            raise LookupError(f"sandbox {sandbox_id!r}: no such sandbox here (deleted, or never created)")
        if self._boxes[sandbox_id] is not None:
            raise LookupError(f"sandbox {sandbox_id!r}: being {self._boxes[sandbox_id]}; no new commands")

    async def _call(self, fn, *args, **kwargs) -> Any:
        """A blocking client call in this backend's threads (the default pool is a handful)."""
        return await asyncio.get_running_loop().run_in_executor(self._threads, functools.partial(fn, *args, **kwargs))

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return task


def _lost(out: Capture, err: Capture, wall: float, why: str) -> ExecResult:
    """A command whose output did not arrive whole: what did arrive, no exit code, and why."""
    return ExecResult(None, None, out.text(), err.text(), out.truncated or err.truncated, False, wall, why)
