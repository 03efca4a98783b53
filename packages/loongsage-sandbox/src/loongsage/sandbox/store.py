"""Where sandboxes live on the host, who owns them, and finding those nobody owns any more.

One root (``$LOONGSAGE_SANDBOX_ROOT``, default ``/tmp/loongsage-sandboxes``) holds::

    <id>/owner.json     run, trajectory, attempt, deadline, uid, and the creating process (pid + start time)
    <id>/work/          the work directory: a tmpfs of ``work_mb``, owned by the sandbox's uid
    <id>/scratch/       a tmpfs of ``tmp_mb``: etc/{passwd,group,hosts}, and tmp.<n>/, each exec's /tmp
    <id>/pts/           the sandbox's devpts instance (``max=ptys``)

Both tmpfs have ``nr_inodes`` as well as ``size``: empty files take no space but kernel memory.

uids are claimed machine-wide, whatever the root: :data:`UID_LOCKS` holds ``<uid>.lock``, held
(flock) by the process using that uid for a sandbox. Two backends with different roots (two runs on
one machine) never share a uid, so never a process limit, and one's delete or orphan sweep, which
kill by uid, never reaches the other's processes. The lock goes away with the process that held it
(a crash included), so no claim goes stale. A sandbox is an *orphan* when its creating process is
gone: the pid no longer exists, or now names another process (a different start time). Orphans are
removed by the next pool that starts on their root (:meth:`SandboxStore.reap_orphans`).
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
from loongsage.sandbox.limits import Limits

ROOT_VARIABLE = "LOONGSAGE_SANDBOX_ROOT"
DEFAULT_ROOT = "/tmp/loongsage-sandboxes"
UID_BASE = 3_000_000  # far above real users and the usual subordinate-uid ranges (100000 + 65536 * n)
UID_COUNT = 100_000
# one directory for the whole machine (not under a root: two roots must not hand out one uid);
# /run is root's, and cleared at boot where it is a tmpfs, when no claim can be alive anyway
UID_LOCKS = Path("/run/loongsage-sandbox/uids")
MS_NOSUID, MS_NODEV, MS_NOEXEC = 2, 4, 8
MNT_DETACH = 2
MOUNTS = ("work", "scratch", "pts")  # what each sandbox directory has mounted
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
    return int(stat[stat.rfind(b")") + 2 :].split()[19])


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

    def __init__(self, only: int | None = None, locks: Path = UID_LOCKS):
        """The lowest free uid (lock files stay few), or ``only`` that one (LookupError if taken)."""
        locks.mkdir(mode=0o700, parents=True, exist_ok=True)
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

    def make(self, owner: SandboxOwner, deadline: float, uid: int, limits: Limits) -> str:
        """A new sandbox directory with its marker, an empty work tmpfs, its scratch tmpfs and its
        devpts; its id.

        No await inside (callers run it on the event loop): a cancelled caller cannot leave half of it.
        """
        sandbox_id = f"sbx-{secrets.token_hex(6)}"
        folder = self.folder(sandbox_id)
        folder.mkdir(mode=0o700)  # only root on the host reaches a work directory
        try:
            self.mark(sandbox_id, owner, deadline, uid)
            for name in MOUNTS:
                (folder / name).mkdir(mode=0o700)
            self._fill(folder, uid, limits)
            mount_devpts(folder / "pts", limits.ptys)
        except BaseException:
            self.remove(sandbox_id)
            raise
        return sandbox_id

    @staticmethod
    def _fill(folder: Path, uid: int, limits: Limits) -> None:
        """Mount the work and scratch tmpfs at ``folder`` (empty, then the identity files)."""
        mount_tmpfs(folder / "work", limits.work_mb, limits.inodes(limits.work_mb), uid=uid, mode=0o711)
        # root's, like /etc; a few inodes more than tmp_mb's share for etc/, its files and each exec's /tmp
        mount_tmpfs(folder / "scratch", limits.tmp_mb, limits.inodes(limits.tmp_mb) + 16, uid=0, mode=0o711)
        identity_files(folder / "scratch", uid)

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

    def empty_work(self, sandbox_id: str, uid: int, limits: Limits) -> None:
        """Fresh work and scratch tmpfs in place of the old ones (faster and surer than deleting
        files). The devpts stays: no process is left to hold a pseudo-terminal of it."""
        folder = self.folder(sandbox_id)
        unmount(folder / "work")
        unmount(folder / "scratch")
        self._fill(folder, uid, limits)

    def remove(self, sandbox_id: str) -> None:
        """Unmount and delete everything of a sandbox (its processes must be gone already)."""
        folder = self.folder(sandbox_id)
        for name in MOUNTS:
            unmount(folder / name)
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
                    claim = UidClaim(only=marker.uid)
                except LookupError:
                    claim = None
                if claim is not None:
                    kill_uid(marker.uid)
                    claim.release()
            self.remove(sandbox_id)
            count += 1
        return count


def mount_tmpfs(path: Path, size_mb: int, inodes: int, *, uid: int, mode: int) -> None:
    # x for all (0711): bwrap chdirs into the work directory without capabilities
    _mount(
        b"tmpfs", path, f"size={size_mb}m,nr_inodes={inodes},mode={mode:04o},uid={uid},gid={uid}", MS_NOSUID | MS_NODEV
    )


def mount_devpts(path: Path, ptys: int) -> None:
    """A devpts instance of its own (``newinstance``) holding at most ``ptys`` pseudo-terminals;
    ``ptmxmode=0666`` lets the sandbox's uid open its ``ptmx`` (bwrap's ``/dev/ptmx`` links there)."""
    _mount(b"devpts", path, f"newinstance,ptmxmode=0666,mode=0620,max={ptys}", MS_NOSUID | MS_NOEXEC)


def _mount(kind: bytes, path: Path, data: str, flags: int) -> None:
    if _libc.mount(kind, os.fsencode(path), kind, flags, data.encode()) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"could not mount a {kind.decode()} at {path} ({data}): {os.strerror(err)}")


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
    return stat[stat.rfind(b")") + 2 :][:1] in (b"Z", b"X")


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
