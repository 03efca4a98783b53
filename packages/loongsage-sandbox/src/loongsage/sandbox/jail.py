"""The jail of one exec: the bubblewrap command line, and whether this machine can build it.

Every exec is a fresh ``bwrap`` (cheap: tens of milliseconds) whose mount, PID, network, IPC and
UTS namespaces are new:

* files: ``/usr`` (and ``/bin``, ``/lib``... as the host links them) read-only, a minimal ``/etc``
  (the loader's cache, alternatives, the time zone, and the sandbox's own ``passwd``/``group``/
  ``hosts``), a fresh ``/proc`` of the new PID namespace, a minimal ``/dev``, a private size-capped
  ``/tmp``, and the sandbox's work directory read-write at ``/work``. Nothing else of the host
  exists inside: no ``/root``, ``/home``, ``/var``, ``/sys``, no other sandbox.
* processes: the command is PID 2 under bubblewrap's init (PID 1); when the command exits, or
  when the host kills that init (timeout, delete), the kernel kills every process left in the
  namespace, detached (``setsid``, double fork) or not. ``--die-with-parent`` ties the init to
  bubblewrap, and ``setpriv --pdeathsig KILL`` ties bubblewrap to the process that started it.
* network: a namespace with only its own loopback (``lo``): nothing to route to, and the host's
  loopback listeners are not there. Host Unix sockets are files outside the jail's view.
* identity: bubblewrap starts as root (it needs to mount), keeps only CAP_SETUID/CAP_SETGID, then
  ``prlimit`` lowers the per-process limits and ``setpriv`` drops to the sandbox's uid/gid for good
  (no supplementary groups, no capabilities, ``no_new_privs``: setuid programs cannot raise it back).
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

from loongsage.sandbox.limits import MIB, Limits

PACKAGE_HINT = "install bubblewrap and util-linux (apt-get install -y bubblewrap util-linux)"
TOOLS = ("bwrap", "prlimit", "setpriv")
WORK = "/work"  # the work directory, as the command sees it
ENV_PATH = "/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin"
# host paths bound read-only at the same place; a link at the root (merged /usr) is recreated as a link
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
ETC_PATHS = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/alternatives", "/etc/localtime",
             "/etc/nsswitch.conf", "/etc/mime.types")


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


def identity_files(folder: Path, uid: int) -> None:
    """``passwd``, ``group`` and ``hosts`` of a sandbox whose user is ``uid`` (bound into its ``/etc``)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "passwd").write_text(f"root:x:0:0:root:/root:/usr/sbin/nologin\n"
                                   f"sandbox:x:{uid}:{uid}:sandbox:{WORK}:/bin/sh\n")
    (folder / "group").write_text(f"root:x:0:\nsandbox:x:{uid}:\n")
    (folder / "hosts").write_text("127.0.0.1 localhost sandbox\n::1 localhost ip6-localhost\n")


def jail_options(*, work: Path, etc: Path, limits: Limits) -> bytes:
    """bubblewrap's options for a sandbox, NUL-separated: they reach it on a descriptor
    (``--args FD``), so the init's command line, which the sandbox can read in
    ``/proc/1/cmdline``, shows no host path."""
    options = ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
               "--hostname", "sandbox", "--die-with-parent", "--new-session",
               "--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID",
               *system_binds(),
               *[arg for name in ("passwd", "group", "hosts") for arg in ("--ro-bind", str(etc / name), f"/etc/{name}")],
               "--proc", "/proc", "--dev", "/dev",
               "--perms", "1777", "--size", str(limits.tmp_mb * MIB), "--tmpfs", "/tmp",
               "--bind", str(work), WORK, "--chdir", WORK]
    return b"".join(os.fsencode(a) + b"\0" for a in options)


def jail_argv(cmd: str, *, uid: int, limits: Limits, options_fd: int) -> list[str]:
    """The command line of one exec of ``cmd`` (``/bin/sh -c``), bubblewrap's options on ``options_fd``."""
    drop = [tool("setpriv"), f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--no-new-privs",
            "--inh-caps=-all", "--bounding-set=-all", "--"]
    return [tool("setpriv"), "--pdeathsig", "KILL", "--", tool("bwrap"), "--args", str(options_fd), "--",
            tool("prlimit"), *limits.prlimit_args(), "--", *drop, "/bin/sh", "-c", cmd]


def jail_env() -> dict[str, str]:
    """The whole environment of a command (nothing of the host's leaks in)."""
    return {"PATH": ENV_PATH, "HOME": WORK, "TMPDIR": "/tmp", "LANG": "C.UTF-8", "USER": "sandbox",
            "PYTHONDONTWRITEBYTECODE": "1"}


@functools.lru_cache(maxsize=1)
def jail_problem() -> str | None:
    """Why the local sandbox cannot run here (None: it can), in one line."""
    if os.geteuid() != 0:
        return ("the local sandbox needs root (it mounts each work directory as a size-capped tmpfs and runs "
                "each sandbox under a uid of its own); run the sandbox worker as root")
    try:
        paths = [tool(name) for name in TOOLS]
    except FileNotFoundError as exc:
        return str(exc)
    if not os.access("/bin/sh", os.X_OK):
        return "/bin/sh is missing: commands run through it"
    probe = [paths[0], "--unshare-pid", "--unshare-net", "--die-with-parent", *system_binds(), "--proc", "/proc",
             "--dev", "/dev", "--", "/bin/sh", "-c", "true"]
    try:
        done = subprocess.run(probe, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bwrap could not run: {exc}"
    if done.returncode != 0:
        reason = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        return f"bwrap cannot create PID and network namespaces here ({reason})"
    return None
