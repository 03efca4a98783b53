"""``local``: every sandbox a work directory on this machine, every exec a fresh bubblewrap jail.

What is isolated and how is told in :mod:`loongsage.sandbox.jail` (the namespaces and the uid),
:mod:`loongsage.sandbox.limits` (the limits), :mod:`loongsage.sandbox.paths` (file transfer) and
:mod:`loongsage.sandbox.store` (the directories, their owners, orphans).

Cancellation: every method may be cancelled at any await. ``create`` has no await between making
the directory and recording it, so it either happened or not. A cancelled ``exec`` kills its jail
at once (synchronously) and leaves only the collection of the dead process to a background task.
``delete`` and ``reset`` run as tasks of their own that a cancelled caller does not stop
(``asyncio.shield``); :meth:`LocalSandbox.close` waits for any still running.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import math
import os
import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from loongsage.core.contracts import ExecResult, Sandbox, SandboxOwner
from loongsage.core.types import Check
from loongsage.sandbox import paths
from loongsage.sandbox.jail import PACKAGE_HINT, exec_options, jail_argv, jail_env, jail_options, jail_problem
from loongsage.sandbox.limits import Limits
from loongsage.sandbox.seccomp import keyring_filter
from loongsage.sandbox.store import SandboxStore, UidClaim, kill_uid

MAX_CMD_BYTES = 100_000  # below the kernel's limit on one argument (128 KiB)
_DRAIN_S = 5.0  # after the jail is gone, how long its output pipes may take to reach end of file


@dataclass
class Capture:
    """At most ``limit`` bytes of a stream: its head and its tail, and how many bytes it carried."""

    limit: int
    head: bytearray = field(default_factory=bytearray)
    tail: bytearray = field(default_factory=bytearray)
    total: int = 0

    def add(self, data: bytes) -> None:
        self.total += len(data)
        room = self.limit // 2 - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        self.tail += data
        keep = self.limit - self.limit // 2
        if len(self.tail) > keep:
            del self.tail[: len(self.tail) - keep]

    @property
    def truncated(self) -> bool:
        return self.total > len(self.head) + len(self.tail)

    def text(self) -> str:
        def decode(b: bytes) -> str:
            return b.decode("utf-8", "backslashreplace")

        if not self.truncated:
            return decode(bytes(self.head + self.tail))
        cut = self.total - len(self.head) - len(self.tail)
        marker = f"[... {cut} bytes cut: output over {self.limit} bytes ...]"
        return f"{decode(bytes(self.head))}\n{marker}\n{decode(bytes(self.tail))}"


@dataclass
class _Box:
    id: str
    claim: UidClaim
    folder: Path
    jails: set[asyncio.subprocess.Process] = field(default_factory=set)
    execs: int = 0  # execs and file transfers under way (a jail may be starting, a thread writing)
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    closing: str | None = None  # "deleted" / "reset": execs still running are ended, and told why
    options: bytes = b""  # bubblewrap's options (see jail_options), the same for every exec
    lifecycle: asyncio.Lock = field(default_factory=asyncio.Lock)  # one reset or delete at a time
    ran: bool = False  # a jail was started since the last sweep (else no process can exist)
    tmps: int = 0  # execs so far: each gets scratch/tmp.<n> as its /tmp

    def __post_init__(self) -> None:
        self.idle.set()

    @property
    def uid(self) -> int:
        return self.claim.uid

    @property
    def work(self) -> Path:
        return self.folder / "work"

    def new_tmp(self) -> Path:
        """A fresh, empty ``/tmp`` for one exec, in the sandbox's scratch tmpfs (whose caps hold)."""
        self.tmps += 1
        tmp = self.folder / "scratch" / f"tmp.{self.tmps}"
        os.mkdir(tmp)
        os.chmod(tmp, 0o1777)  # /tmp's usual mode (the umask would narrow mkdir's)
        return tmp


class LocalSandbox(Sandbox):
    """The ``local`` sandbox backend (see the module docstring)."""

    reusable = True

    @staticmethod
    def doctor() -> list[Check]:
        """The jail's tools and rights (bubblewrap, root, seccomp), probed as a sandbox would use them."""
        problem = jail_problem()
        return [Check("bubblewrap jail", problem is None, problem or "usable", "" if problem is None else PACKAGE_HINT)]

    def __init__(self, limits: Limits = Limits(), root: str | None = None):
        problem = jail_problem()
        if problem is not None:
            raise RuntimeError(f"sandbox 'local' cannot run here: {problem}")
        self.limits = limits
        self.store = SandboxStore(Path(root) if root else None)
        self._filter = keyring_filter()
        self._boxes: dict[str, _Box] = {}
        self._background: set[asyncio.Task] = set()

    # ------------------------------------------------------------------------------- lifecycle
    async def create(self, owner: SandboxOwner, deadline: float) -> str:
        check_owner(owner, deadline)
        claim = UidClaim()
        try:
            sandbox_id = self.store.make(owner, deadline, claim.uid, self.limits)
        except BaseException:
            claim.release()
            raise
        folder = self.store.folder(sandbox_id)
        options = jail_options(work=folder / "work", scratch=folder / "scratch", pts=folder / "pts")
        self._boxes[sandbox_id] = _Box(sandbox_id, claim, folder, options=options)
        return sandbox_id

    async def delete(self, sandbox_id: str) -> None:
        box = self._boxes.pop(sandbox_id, None)
        if box is not None:
            await asyncio.shield(self._spawn(self._destroy(box)))

    async def reset(self, sandbox_id: str, owner: SandboxOwner, deadline: float) -> None:
        check_owner(owner, deadline)
        box = self._box(sandbox_id)
        await asyncio.shield(self._spawn(self._renew(box, owner, deadline)))

    async def reap_orphans(self) -> int:
        """Remove the sandboxes under this root whose creating process is gone; how many."""
        return await asyncio.to_thread(self.store.reap_orphans)

    async def close(self) -> None:
        """Delete every sandbox of this backend and wait for background cleanups."""
        for sandbox_id in list(self._boxes):
            await self.delete(sandbox_id)
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

    def sandbox_ids(self) -> list[str]:
        return list(self._boxes)

    def uid_of(self, sandbox_id: str) -> int:
        return self._box(sandbox_id).uid

    async def _end_processes(self, box: _Box, why: str) -> None:
        box.closing = why
        for jail in list(box.jails):
            _kill_jail(jail)
        await box.idle.wait()
        if box.ran:
            box.ran = False
            await asyncio.to_thread(kill_uid, box.uid)  # a backstop: the namespaces took them already

    async def _destroy(self, box: _Box) -> None:
        async with box.lifecycle:  # a reset under way finishes first: its new mount is then removed too
            try:
                await self._end_processes(box, "deleted")
            finally:
                await asyncio.to_thread(self.store.remove, box.id)
                box.claim.release()

    async def _renew(self, box: _Box, owner: SandboxOwner, deadline: float) -> None:
        async with box.lifecycle:
            if self._boxes.get(box.id) is not box:
                raise LookupError(f"sandbox {box.id!r}: deleted before its reset")
            await self._end_processes(box, "reset")
            await asyncio.to_thread(self.store.empty_work, box.id, box.uid, self.limits)
            self.store.mark(box.id, owner, deadline, box.uid)
            box.closing = None

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # seen by its caller, if any is left
        return task

    def _box(self, sandbox_id: str) -> _Box:
        box = self._boxes.get(sandbox_id)
        if box is None:
            raise LookupError(f"sandbox {sandbox_id!r}: no such sandbox here (deleted, or never created)")
        return box

    # ------------------------------------------------------------------------------------ exec
    async def exec(self, sandbox_id: str, cmd: str, timeout: float) -> ExecResult:
        check_exec(cmd, timeout)
        box = self._box(sandbox_id)
        if box.closing is not None:
            raise LookupError(f"sandbox {sandbox_id!r}: being {box.closing}; no new commands")
        _hold(box)
        box.ran = True
        try:
            return await self._run(box, cmd, float(timeout))
        finally:
            _let_go(box)

    async def _run(self, box: _Box, cmd: str, timeout: float) -> ExecResult:
        out, err = Capture(self.limits.output_bytes), Capture(self.limits.output_bytes)
        start = time.monotonic()
        try:
            tmp = box.new_tmp()
        except OSError as exc:  # the scratch tmpfs is full: an exec running beside it took its inodes
            return ExecResult(None, None, "", "", False, False, time.monotonic() - start, f"could not start: {exc}")
        fds = []
        try:
            fds.append(os.memfd_create("bwrap-options", os.MFD_CLOEXEC))
            fds.append(os.memfd_create("seccomp", os.MFD_CLOEXEC))
            # each far below a memfd's limits; bwrap reads both from offset 0
            for fd, data in zip(fds, (box.options + exec_options(tmp=tmp, seccomp_fd=fds[1]), self._filter)):
                os.write(fd, data)
                os.lseek(fd, 0, os.SEEK_SET)
        except BaseException:
            for fd in fds:
                os.close(fd)
            _drop_tmp(tmp)
            raise
        argv = jail_argv(cmd, uid=box.uid, limits=self.limits, options_fd=fds[0])
        # shielded: Python 3.11 never finishes a subprocess transport cancelled while its pipes
        # connect (its exit waiters wait for pipes that never come); a cancelled caller leaves the
        # spawn to a background task that kills and collects what it makes
        spawn = asyncio.ensure_future(
            asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=jail_env(),
                start_new_session=True,
                pass_fds=tuple(fds),
            )
        )
        spawn.add_done_callback(lambda _: [os.close(fd) for fd in fds])
        try:
            jail = await asyncio.shield(spawn)
        except OSError as exc:  # the jail could not start (out of processes or memory on the host)
            await _clear_tmp(tmp)
            return ExecResult(None, None, "", "", False, False, time.monotonic() - start, f"could not start: {exc}")
        except BaseException:
            _hold(box)
            self._spawn(_abandon(box, spawn, tmp))
            raise
        box.jails.add(jail)
        timed_out = False
        try:
            if box.closing is not None:  # deleted while the jail was starting
                _kill_jail(jail)
            pumps = asyncio.gather(_pump(jail.stdout, out), _pump(jail.stderr, err))
            try:
                await asyncio.wait_for(jail.wait(), timeout)
            except TimeoutError:
                timed_out = True
                _kill_jail(jail)
                await jail.wait()
            wall = time.monotonic() - start
            try:
                await asyncio.wait_for(pumps, _DRAIN_S)
            except TimeoutError:
                pass
        except BaseException:  # cancelled: the command is abandoned, so is every process it started
            _kill_jail(jail)
            _hold(box)  # a delete or reset waits until its /tmp is gone too
            self._spawn(_collect(box, jail, tmp))
            raise
        finally:
            box.jails.discard(jail)
        await _clear_tmp(tmp)  # every process of the jail is gone: nothing writes there any more
        return exec_result(jail.returncode, timed_out, wall, out, err, box.closing)

    # ----------------------------------------------------------------------------------- files
    async def put(self, sandbox_id: str, path: str, data: bytes) -> None:
        box = self._box(sandbox_id)
        await self._files(box, paths.write_file, str(box.work), path, data, uid=box.uid, limit=self.limits.get_bytes)

    async def get(self, sandbox_id: str, path: str) -> bytes:
        box = self._box(sandbox_id)
        return await self._files(box, paths.read_file, str(box.work), path, limit=self.limits.get_bytes)

    async def put_archive(self, sandbox_id: str, path: str, archive: bytes) -> int:
        """Unpack the tar ``archive`` under ``path`` (``"."``: the work directory); files written.
        Links, devices, FIFOs and names leaving the directory refuse the whole archive."""
        box = self._box(sandbox_id)
        return await self._files(
            box, paths.extract_archive, str(box.work), path, archive, uid=box.uid, limit=self.limits.get_bytes
        )

    def host_path(self, sandbox_id: str) -> str:
        """The work directory as a path on this machine (what the command agent runs a program in)."""
        return str(self._box(sandbox_id).work)

    async def adopt(self, sandbox_id: str) -> int:
        """Give the files written into the work directory from the host to the sandbox's uid; how many."""
        box = self._box(sandbox_id)
        return await self._files(box, paths.give_files, str(box.work), box.uid)

    async def _files(self, box: _Box, fn, *args, **kwargs):
        """``fn`` in a thread, counted as work under way: a delete or reset waits for it (a thread
        goes on when its caller is cancelled, and must not write into a directory being removed)."""
        if box.closing is not None:
            raise LookupError(f"sandbox {box.id!r}: being {box.closing}; no file transfers")
        _hold(box)

        async def transfer():
            try:
                return await asyncio.to_thread(fn, *args, **kwargs)
            finally:
                _let_go(box)

        try:
            return await asyncio.shield(self._spawn(transfer()))
        except FileNotFoundError:
            if box.id not in self._boxes:
                raise LookupError(f"sandbox {box.id!r}: deleted during the file transfer") from None
            raise


def check_exec(cmd: str, timeout: float) -> None:
    """One line naming what is wrong with an exec's command or timeout (any backend)."""
    if not isinstance(cmd, str) or "\0" in cmd or not cmd.strip():
        raise ValueError(f"sandbox exec cmd={cmd!r}: must be a non-empty shell command without NUL bytes")
    if len(os.fsencode(cmd)) > MAX_CMD_BYTES:
        raise ValueError(
            f"sandbox exec cmd of {len(os.fsencode(cmd))} bytes: at most {MAX_CMD_BYTES}; "
            f"put a script into the sandbox and run that"
        )
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not (0 < timeout < math.inf):
        raise ValueError(f"sandbox exec timeout={timeout!r}: must be a positive finite number of seconds")


def check_owner(owner: SandboxOwner, deadline: float) -> None:
    if not isinstance(owner, SandboxOwner):
        raise ValueError(f"sandbox owner={owner!r}: must be a SandboxOwner(run, trajectory, attempt)")
    if isinstance(deadline, bool) or not isinstance(deadline, (int, float)) or not math.isfinite(deadline):
        raise ValueError(f"sandbox deadline={deadline!r}: must be time.time() seconds (a finite number)")


async def _pump(stream: asyncio.StreamReader, capture: Capture) -> None:
    while data := await stream.read(1 << 16):
        capture.add(data)


def _hold(box: _Box) -> None:
    box.execs += 1
    box.idle.clear()


def _let_go(box: _Box) -> None:
    box.execs -= 1
    if box.execs == 0:
        box.idle.set()


async def _abandon(box: _Box, spawn: asyncio.Future, tmp: Path) -> None:
    """The end of a jail whose exec was cancelled while it started: killed once it exists."""
    try:
        jail = await spawn
        _kill_jail(jail)
        # drained: a pipe left full is never read to its end, and the exit is reported only after
        await asyncio.gather(_pump(jail.stdout, Capture(1)), _pump(jail.stderr, Capture(1)), jail.wait())
    except Exception:  # noqa: BLE001 (it never started: nothing to kill)
        pass
    finally:
        await _clear_tmp(tmp)
        _let_go(box)


async def _collect(box: _Box, jail: asyncio.subprocess.Process, tmp: Path) -> None:
    try:
        with contextlib.suppress(Exception):
            await jail.wait()
        await _clear_tmp(tmp)
    finally:
        _let_go(box)


def _drop_tmp(tmp: Path) -> bool:
    """Remove an exec's ``/tmp`` if it is empty (the usual case: no thread needed); False if not."""
    try:
        os.rmdir(tmp)
    except OSError as exc:
        return exc.errno != errno.ENOTEMPTY  # gone already (the sandbox was removed): nothing to do
    return True


async def _clear_tmp(tmp: Path) -> None:
    """Remove an exec's ``/tmp`` with what its processes left there. ``rmtree`` works through
    descriptors and never follows a symlink the sandbox planted; a failure leaves files that the
    next reset or the delete removes with the whole tmpfs."""
    if not _drop_tmp(tmp):
        await asyncio.to_thread(shutil.rmtree, tmp, ignore_errors=True)


def _kill_jail(jail: asyncio.subprocess.Process) -> None:
    """SIGKILL the jail's init: the namespace dies with it, and bubblewrap exits only once all of
    it is gone, so awaiting bubblewrap's exit afterwards awaits the end of every process.

    bubblewrap is stopped first: between reading its children and killing them it cannot create
    the init. A killed bubblewrap whose init exists but has not yet armed its death signal would
    leave that init waiting for bubblewrap forever; stopped, it cannot die half-way. With an init
    killed, bubblewrap is let go on (it collects the namespace and exits); without one, it is killed
    where it stands, before it creates any. A jail already collected is left alone (its pid may
    name another process by now).
    """
    if jail.returncode is not None:
        return
    bwrap_pid = jail.pid
    try:
        os.kill(bwrap_pid, signal.SIGSTOP)
    except OSError:
        return  # gone already
    end = time.monotonic() + 1.0
    while _state(bwrap_pid) not in (b"T", b"t", b"Z", b"X", None) and time.monotonic() < end:
        time.sleep(0.0005)
    try:
        with open(f"/proc/{bwrap_pid}/task/{bwrap_pid}/children") as f:
            children = [int(p) for p in f.read().split()]
    except (OSError, ValueError):
        children = []
    for pid in children:
        with contextlib.suppress(OSError):
            pidfd = os.pidfd_open(pid)
            try:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            finally:
                os.close(pidfd)
    with contextlib.suppress(OSError):
        os.kill(bwrap_pid, signal.SIGCONT if children else signal.SIGKILL)


def _state(pid: int) -> bytes | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def exec_result(
    code: int | None, timed_out: bool, wall: float, out: Capture, err: Capture, closing: str | None
) -> ExecResult:
    exit_code, sig = code, None
    if timed_out or closing is not None:  # ended by the kill of its jail, whatever bubblewrap reported
        exit_code, sig = None, signal.SIGKILL.value
    elif code is not None and code < 0:  # bubblewrap itself was killed (before its init existed)
        exit_code, sig = None, -code
    elif code is not None and 128 < code <= 128 + 64:  # the shell's convention: 128 + signal
        exit_code, sig = None, code - 128
    error = None
    if closing is not None:
        error = f"the sandbox was {closing} while the command ran"
    elif timed_out:
        error = f"timed out after {wall:.1f} s; every process it started was killed"
    return ExecResult(exit_code, sig, out.text(), err.text(), out.truncated or err.truncated, timed_out, wall, error)
