"""The jail of one exec: the bubblewrap command line, and whether this machine can build it.

Every exec is a fresh ``bwrap`` (cheap: tens of milliseconds) whose mount, PID, network, IPC and
UTS namespaces are new:

* files: ``/usr`` (and ``/bin``, ``/lib``... as the host links them) read-only, a minimal ``/etc``
  (the loader's cache, alternatives, the time zone, and the sandbox's own ``passwd``/``group``/
  ``hosts``), a fresh ``/proc`` of the new PID namespace (``/proc/keys`` and ``/proc/key-users``
  read as empty files), a minimal ``/dev`` whose ``/dev/pts`` is the sandbox's own devpts
  instance (``max=ptys``: one sandbox cannot take the pseudo-terminals of all), a private
  ``/tmp``, and the sandbox's work directory read-write at ``/work``. Nothing else of the host
  exists inside: no ``/root``, ``/home``, ``/var``, ``/sys``, no other sandbox.
* host paths: every sandbox path is bound from a file system of the sandbox's own (the work
  tmpfs, the scratch tmpfs holding ``/etc``'s three files and each exec's ``/tmp``, the devpts),
  so ``/proc/self/mountinfo`` shows paths inside those (``/``, ``/etc/passwd``, ``/tmp.3``),
  never where the sandbox lives on the host; bubblewrap reads its options from a descriptor, so
  ``/proc/1/cmdline`` shows none either.
* processes: the command is PID 2 under bubblewrap's init (PID 1); when the command exits, or
  when the host kills that init (timeout, delete), the kernel kills every process left in the
  namespace, detached (``setsid``, double fork) or not. ``--die-with-parent`` ties the init to
  bubblewrap, and ``setpriv --pdeathsig KILL`` ties bubblewrap to the process that started it.
* network: a namespace with only its own loopback (``lo``): nothing to route to, and the host's
  loopback listeners are not there. Host Unix sockets are files outside the jail's view.
* system calls: :mod:`loongsage.sandbox.seccomp`'s filter makes the kernel keyring calls fail
  (keyrings are shared with the host and outlive a sandbox; no namespace separates them).
* identity: bubblewrap starts as root (it needs to mount), keeps only CAP_SETUID, CAP_SETGID and
  CAP_SETPCAP, then ``prlimit`` lowers the per-process limits and ``setpriv`` empties the
  capability bounding set and drops to the sandbox's uid/gid for good (no supplementary groups,
  no capabilities, ``no_new_privs``: setuid programs cannot raise it back). CAP_SETPCAP is kept
  for that one step: setpriv empties the bounding set through libcap-ng, which skips the bounding
  set, without an error, unless it holds CAP_SETPCAP (without it the jail kept a full bounding set).
  A per-sandbox uid makes ``RLIMIT_NPROC`` a per-sandbox count, keeps the sandbox from signalling
  any host process (the host's are another uid, and outside its PID namespace anyway) and from
  touching another sandbox's files.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from pathlib import Path

from loongsage.sandbox.limits import Limits
from loongsage.sandbox.seccomp import keyring_filter

PACKAGE_HINT = "install bubblewrap and util-linux (apt-get install -y bubblewrap util-linux)"
TOOLS = ("bwrap", "prlimit", "setpriv")
WORK = "/work"  # the work directory, as the command sees it
ENV_PATH = "/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin"
# host paths bound read-only at the same place; a link at the root (merged /usr) is recreated as a link
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
ETC_PATHS = (
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/alternatives",
    "/etc/localtime",
    "/etc/nsswitch.conf",
    "/etc/mime.types",
)
KEPT_CAPS = ("CAP_SETUID", "CAP_SETGID", "CAP_SETPCAP")  # until setpriv: see the module docstring
IDENTITY = ("passwd", "group", "hosts")  # the sandbox's own files of /etc, in <scratch>/etc
EMPTY = "empty"  # an empty file in the scratch tmpfs, bound over what /proc must not show
# the keys the jail possesses (those of its inherited session keyring), and every uid's key counts
MASKED_PROC = ("/proc/keys", "/proc/key-users")


def tool(name: str) -> str:
    """The absolute path of a required tool (in a system directory, so it exists inside the jail too)."""
    for folder in ("/usr/bin", "/bin", "/usr/sbin", "/sbin"):
        if os.access(os.path.join(folder, name), os.X_OK):
            return os.path.join(folder, name)
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"{name} is not installed: {PACKAGE_HINT}")
    return found


def system_binds() -> list[str]:
    out: list[str] = []
    for path in SYSTEM_PATHS:
        if os.path.islink(path):
            out += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            out += ["--ro-bind", path, path]
    out += ["--perms", "0755", "--dir", "/etc"]
    for path in ETC_PATHS:
        if os.path.exists(path):
            out += ["--ro-bind", path, path]
    return out


def identity_files(scratch: Path, uid: int) -> None:
    """``etc/passwd``, ``etc/group`` and ``etc/hosts`` of a sandbox whose user is ``uid`` (bound
    into its ``/etc``), and the empty file bound over :data:`MASKED_PROC`, in its scratch tmpfs."""
    etc = scratch / "etc"
    etc.mkdir(mode=0o755, exist_ok=True)
    (etc / "passwd").write_text(
        f"root:x:0:0:root:/root:/usr/sbin/nologin\nsandbox:x:{uid}:{uid}:sandbox:{WORK}:/bin/sh\n"
    )
    (etc / "group").write_text(f"root:x:0:\nsandbox:x:{uid}:\n")
    (etc / "hosts").write_text("127.0.0.1 localhost sandbox\n::1 localhost ip6-localhost\n")
    (scratch / EMPTY).write_bytes(b"")


def jail_options(*, work: Path, scratch: Path, pts: Path) -> bytes:
    """bubblewrap's options for a sandbox (the same for each of its execs; :func:`exec_options`
    follows them), NUL-separated: they reach it on a descriptor (``--args FD``), so the init's
    command line, which the sandbox can read in ``/proc/1/cmdline``, shows no host path."""
    options = [
        "--unshare-pid",
        "--unshare-net",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--hostname",
        "sandbox",
        "--die-with-parent",
        "--new-session",
        "--cap-drop",
        "ALL",
        *[a for cap in KEPT_CAPS for a in ("--cap-add", cap)],
        *system_binds(),
        *[arg for name in IDENTITY for arg in ("--ro-bind", str(scratch / "etc" / name), f"/etc/{name}")],
        "--proc",
        "/proc",
        *[arg for path in MASKED_PROC for arg in ("--ro-bind", str(scratch / EMPTY), path)],
        # a device bind: a plain one is nodev, and /dev/pts/ptmx would not open
        "--dev",
        "/dev",
        "--dev-bind",
        str(pts),
        "/dev/pts",
        "--bind",
        str(work),
        WORK,
        "--chdir",
        WORK,
    ]
    return b"".join(os.fsencode(a) + b"\0" for a in options)


def exec_options(*, tmp: Path, seccomp_fd: int) -> bytes:
    """The options of one exec that follow :func:`jail_options`: its own ``/tmp`` (a directory of
    the scratch tmpfs, so the tmpfs's size and inode caps hold) and the filter's descriptor."""
    options = ["--bind", str(tmp), "/tmp", "--seccomp", str(seccomp_fd)]
    return b"".join(os.fsencode(a) + b"\0" for a in options)


def jail_argv(cmd: str, *, uid: int, limits: Limits, options_fd: int) -> list[str]:
    """The command line of one exec of ``cmd`` (``/bin/sh -c``), bubblewrap's options on ``options_fd``."""
    drop = [
        tool("setpriv"),
        f"--reuid={uid}",
        f"--regid={uid}",
        "--clear-groups",
        "--no-new-privs",
        "--inh-caps=-all",
        "--bounding-set=-all",
        "--",
    ]
    return [
        tool("setpriv"),
        "--pdeathsig",
        "KILL",
        "--",
        tool("bwrap"),
        "--args",
        str(options_fd),
        "--",
        tool("prlimit"),
        *limits.prlimit_args(),
        "--",
        *drop,
        "/bin/sh",
        "-c",
        cmd,
    ]


def jail_env() -> dict[str, str]:
    """The whole environment of a command (nothing of the host's leaks in)."""
    return {
        "PATH": ENV_PATH,
        "HOME": WORK,
        "TMPDIR": "/tmp",
        "LANG": "C.UTF-8",
        "USER": "sandbox",
        "PYTHONDONTWRITEBYTECODE": "1",
    }


@functools.lru_cache(maxsize=1)
def jail_problem() -> str | None:
    """Why the local sandbox cannot run here (None: it can), in one line."""
    if os.geteuid() != 0:
        return (
            "the local sandbox needs root (it mounts each work directory as a size-capped tmpfs and runs "
            "each sandbox under a uid of its own); run the sandbox worker as root"
        )
    try:
        paths = [tool(name) for name in TOOLS]
    except FileNotFoundError as exc:
        return str(exc)
    if not os.access("/bin/sh", os.X_OK):
        return "/bin/sh is missing: commands run through it"
    try:
        program = keyring_filter()
    except ValueError as exc:
        return str(exc)
    fd = os.memfd_create("seccomp-probe", os.MFD_CLOEXEC)
    try:
        os.write(fd, program)
        os.lseek(fd, 0, os.SEEK_SET)
        probe = [
            paths[0],
            "--unshare-pid",
            "--unshare-net",
            "--die-with-parent",
            *system_binds(),
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--seccomp",
            str(fd),
            "--",
            "/bin/sh",
            "-c",
            "true",
        ]
        done = subprocess.run(probe, capture_output=True, text=True, timeout=30, pass_fds=(fd,))
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bwrap could not run: {exc}"
    finally:
        os.close(fd)
    if done.returncode != 0:
        reason = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        return f"bwrap cannot create PID and network namespaces with a seccomp filter here ({reason})"
    return None
