"""Where sandboxes live on the host, who owns them, and finding those nobody owns any more.

One root (``$LOONGSAGE_SANDBOX_ROOT``, default ``/tmp/loongsage-sandboxes``) holds::

    uids/<uid>.lock     held (flock) by the process using that uid for a sandbox
    <id>/owner.json     run, trajectory, attempt, deadline, uid, and the creating process (pid + start time)
    <id>/etc/           the sandbox's passwd, group, hosts
    <id>/work/          the work directory: a tmpfs of ``work_mb``, owned by the sandbox's uid

A uid is claimed by locking its file, and the lock goes away with the process that held it (a
crash included), so two processes (two runs on one machine) never share a uid and no claim goes
stale. A sandbox is an *orphan* when its creating process is gone: the pid no longer exists, or
now names another process (a different start time). Orphans are removed by the next pool that
starts (:meth:`SandboxStore.reap_orphans`).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import os
import secrets
import shutil
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from loongsage.core.contracts import SandboxOwner
from loongsage.sandbox.jail import identity_files

ROOT_VARIABLE = "LOONGSAGE_SANDBOX_ROOT"
DEFAULT_ROOT = "/tmp/loongsage-sandboxes"
UID_BASE = 3_000_000  # far above real users and the usual subordinate-uid ranges (100000 + 65536 * n)
UID_COUNT = 100_000
MS_NOSUID, MS_NODEV = 2, 4
MNT_DETACH = 2
_libc = ctypes.CDLL(None, use_errno=True)


def default_root() -> Path:
    return Path(os.environ.get(ROOT_VARIABLE) or DEFAULT_ROOT)


def process_start(pid: int) -> int | None:
    """The start time of ``pid`` (clock ticks since boot), None if it does not exist."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat[stat.rfind(b")") + 2:].split()[19])


@dataclass(frozen=True)
class Marker:
    """``owner.json``: what the reaper of another process needs to know about a sandbox."""

    run: str
    trajectory: str
    attempt: int
    deadline: float
    uid: int
    pid: int
    pid_start: int

    @property
    def owner(self) -> SandboxOwner:
        return SandboxOwner(self.run, self.trajectory, self.attempt)

    def creator_alive(self) -> bool:
        return process_start(self.pid) == self.pid_start


class UidClaim:
    """One uid of the range, held by this process until :meth:`release`."""

    def __init__(self, locks: Path, only: int | None = None):
        """The lowest free uid (lock files stay few), or ``only`` that one (LookupError if taken)."""
        locks.mkdir(parents=True, exist_ok=True)
        candidates = range(UID_BASE, UID_BASE + UID_COUNT) if only is None else (only,)
        for uid in candidates:
            fd = os.open(locks / f"{uid}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self.uid, self._fd = uid, fd
            return
        if only is not None:
            raise LookupError(f"sandbox uid {only} is held by a live sandbox")
        raise RuntimeError(f"all {UID_COUNT} sandbox uids from {UID_BASE} are in use")

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class SandboxStore:
    """The sandboxes of one root: making, marking, emptying and removing their directories."""

    def __init__(self, root: Path | None = None):
        self.root = Path(root) if root is not None else default_root()
        self.root.mkdir(mode=0o711, parents=True, exist_ok=True)  # others may traverse to /work, not list
        self._pid, self._pid_start = os.getpid(), process_start(os.getpid()) or 0

    def folder(self, sandbox_id: str) -> Path:
        return self.root / sandbox_id

    def make(self, owner: SandboxOwner, deadline: float, uid: int, work_mb: int) -> str:
        """A new sandbox directory with its marker and an empty work tmpfs; its id.

        No await inside (callers run it on the event loop): a cancelled caller cannot leave half of it.
        """
        sandbox_id = f"sbx-{secrets.token_hex(6)}"
        folder = self.folder(sandbox_id)
        folder.mkdir(mode=0o700)  # only root on the host reaches a work directory
        try:
            self.mark(sandbox_id, owner, deadline, uid)
            identity_files(folder / "etc", uid)
            (folder / "work").mkdir(mode=0o700)
            mount_tmpfs(folder / "work", work_mb, uid)
        except BaseException:
            self.remove(sandbox_id)
            raise
        return sandbox_id

    def mark(self, sandbox_id: str, owner: SandboxOwner, deadline: float, uid: int) -> None:
        marker = Marker(owner.run, owner.trajectory, owner.attempt, deadline, uid, self._pid, self._pid_start)
        path = self.folder(sandbox_id) / "owner.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(marker)))
        os.replace(tmp, path)

    def read_marker(self, sandbox_id: str) -> Marker | None:
        try:
            return Marker(**json.loads((self.folder(sandbox_id) / "owner.json").read_text()))
        except (OSError, ValueError, TypeError):
            return None

    def empty_work(self, sandbox_id: str, uid: int, work_mb: int) -> None:
        """A fresh work tmpfs in place of the old one (faster and surer than deleting its files)."""
        work = self.folder(sandbox_id) / "work"
        unmount(work)
        mount_tmpfs(work, work_mb, uid)

    def remove(self, sandbox_id: str) -> None:
        """Unmount and delete everything of a sandbox (its processes must be gone already)."""
        folder = self.folder(sandbox_id)
        unmount(folder / "work")
        shutil.rmtree(folder, ignore_errors=True)

    def sandbox_ids(self) -> list[str]:
        with contextlib.suppress(FileNotFoundError):
            return sorted(p.name for p in self.root.iterdir() if p.name.startswith("sbx-"))
        return []

    def reap_orphans(self) -> int:
        """Remove every sandbox whose creating process is gone (killing what still runs under its
        uid first); returns how many. A sandbox without a readable marker counts as an orphan once
        it is older than a minute (its creator died while making it)."""
        count = 0
        for sandbox_id in self.sandbox_ids():
            marker = self.read_marker(sandbox_id)
            if marker is None:
                with contextlib.suppress(OSError):
                    if time.time() - self.folder(sandbox_id).stat().st_mtime < 60:
                        continue
            elif marker.creator_alive():
                continue
            if marker is not None:
                # killed only while this process holds the uid: a live sandbox may have it again
                # (its processes are its own), and the orphan's jails died with their creator
                try:
                    claim = UidClaim(self.root / "uids", only=marker.uid)
                except LookupError:
                    claim = None
                if claim is not None:
                    kill_uid(marker.uid)
                    claim.release()
            self.remove(sandbox_id)
            count += 1
        return count


def mount_tmpfs(path: Path, size_mb: int, uid: int) -> None:
    data = f"size={size_mb}m,mode=0711,uid={uid},gid={uid}".encode()  # x for all: bwrap chdirs there without capabilities
    if _libc.mount(b"tmpfs", os.fsencode(path), b"tmpfs", MS_NOSUID | MS_NODEV, data) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"could not mount the work tmpfs at {path}: {os.strerror(err)}")


def unmount(path: Path) -> None:
    """Detach every mount at ``path`` (a tmpfs mounted twice by a race is detached twice)."""
    for _ in range(8):
        if _libc.umount2(os.fsencode(path), MNT_DETACH) != 0:
            return


def uid_pids(uid: int) -> list[int]:
    """Live processes of the sandbox whose uid is ``uid``: those running as ``uid``, and its jails'
    processes still running as root (bubblewrap outside and as the namespace's init, ``prlimit``,
    ``setpriv`` before the switch), known by the ``--reuid=<uid>`` in their command line."""
    return [int(name) for name in os.listdir("/proc") if name.isdigit() and _belongs(name, uid)]


def _belongs(pid: str, uid: int) -> bool:
    try:
        owner = os.stat(f"/proc/{pid}").st_uid
        if owner == 0:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f"--reuid={uid}".encode() not in f.read().split(b"\0"):
                    return False
        elif owner != uid:
            return False
        return not _zombie(pid)
    except OSError:
        return False


def _zombie(pid: str) -> bool:
    """Dead, waiting for its parent to collect it (the kernel does once the namespace's init is gone)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    return stat[stat.rfind(b")") + 2:][:1] in (b"Z", b"X")


def kill_uid(uid: int, rounds: int = 200) -> int:
    """SIGKILL every process of ``uid`` until none is left; returns how many were found.

    Each kill goes through a pidfd opened *before* the owner is checked again, so a pid reused by
    another process between the scan and the kill is never signalled.
    """
    killed: set[int] = set()
    for _ in range(rounds):
        pids = uid_pids(uid)
        if not pids:
            break
        for pid in pids:
            try:
                pidfd = os.pidfd_open(pid)
            except OSError:
                continue
            try:
                if _belongs(str(pid), uid):
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                    killed.add(pid)
            except OSError:
                pass
            finally:
                os.close(pidfd)
        time.sleep(0.002)
    return len(killed)
