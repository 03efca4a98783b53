"""Hostile programs against the real ``local`` sandbox.

Each test asserts containment (the program is stopped or its effect confined), that a sandbox
running beside it and a host process are unaffected, and (the ``root`` fixture) that nothing of
the sandbox is left: no process under a sandbox uid, no jail process, no mount, no directory.
Network tests only ever target listeners this test opened on the host's loopback or host paths.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tarfile
import time

import pytest

from loongsage.sandbox.limits import Limits
from loongsage.sandbox.local import LocalSandbox
from tests.sandbox.conftest import SMALL, deadline, needs_jail, owner, run, sandbox_processes

pytestmark = needs_jail
PY = "/usr/bin/python3"


@pytest.fixture
def host_process():
    """A host process (not in any sandbox) that sandboxes must not be able to touch."""
    proc = subprocess.Popen(["sleep", "7777.25"])
    yield proc
    assert proc.poll() is None, "the host process was killed"
    proc.kill()
    proc.wait()


async def contained(sb: LocalSandbox, cmd: str, timeout: float, *, files: dict[str, bytes] | None = None):
    """Run ``cmd`` in a fresh sandbox while a second sandbox runs a check beside it; returns the
    hostile result. The peer must see only its own file and finish normally."""
    bad = await sb.create(owner("hostile"), deadline())
    peer = await sb.create(owner("peer"), deadline())
    for path, data in (files or {}).items():
        await sb.put(bad, path, data)
    await sb.put(peer, "mine.txt", b"peer")

    async def beside():
        await asyncio.sleep(0.3)
        return await sb.exec(peer, "cat mine.txt; ls; echo ok", 30)

    result, peer_result = await asyncio.gather(sb.exec(bad, cmd, timeout), beside())
    assert (peer_result.exit_code, peer_result.stdout) == (0, "peermine.txt\nok\n"), peer_result
    assert not [p for p, uid in sandbox_processes() if uid == sb.uid_of(bad)], "processes outlived the exec"
    await sb.delete(bad)
    await sb.delete(peer)
    return result


def test_fork_bomb(root, host_process):
    async def go():
        sb = LocalSandbox(SMALL, str(root))
        try:
            result = await contained(sb, "f(){ f | f & }; f; sleep 10", 3)
            assert result.timed_out and result.signal == signal.SIGKILL
            assert subprocess.run(["true"]).returncode == 0  # the host can still fork
        finally:
            await sb.close()

    run(go())


def test_process_limit_is_per_sandbox(root):
    async def go():
        sb = LocalSandbox(Limits(processes=8), str(root))
        try:
            result = await contained(sb, "for i in $(seq 20); do sleep 5 & done; wait", 10)
            assert "fork" in result.stderr.lower() or "resource" in result.stderr.lower(), result
        finally:
            await sb.close()

    run(go())


def test_memory_bomb(root):
    async def go():
        sb = LocalSandbox(SMALL, str(root))
        try:
            grow = f"{PY} -c 'l=[]\nwhile True: l.append(bytearray(1<<20))'"
            result = await contained(sb, grow, 30)
            assert result.exit_code == 1 and "MemoryError" in result.stderr and not result.timed_out
            result = await contained(sb, f"{PY} -c 'b=bytearray(4<<30)'", 30)
            assert "MemoryError" in result.stderr
        finally:
            await sb.close()

    run(go())


def test_cpu_spin(root):
    async def go():
        sb = LocalSandbox(Limits(cpu_s=1), str(root))
        try:
            start = time.monotonic()
            result = await contained(sb, f"{PY} -c 'while True: pass'", 30)
            assert result.signal in (signal.SIGXCPU, signal.SIGKILL) and not result.timed_out, result
            assert time.monotonic() - start < 20
            result = await contained(sb, "while :; do :; done", 1)  # under the CPU limit: the wall clock ends it
            assert result.timed_out and result.wall_s < 5
        finally:
            await sb.close()

    run(go())


def test_disk_fill(root):
    async def go():
        sb = LocalSandbox(SMALL, str(root))  # files up to 8 MiB, work 16 MiB, /tmp 8 MiB
        try:
            result = await contained(sb, "head -c 20M /dev/zero > big; echo $?; ls -l big | awk '{print $5}'", 20)
            assert result.signal == signal.SIGXFSZ or "8388608" in result.stdout, result
            fill = "for i in 1 2 3 4 5; do head -c 6M /dev/zero > f$i || echo full; done; du -sm . | cut -f1"
            result = await contained(sb, fill, 20)
            assert "full" in result.stdout and int(result.stdout.split()[-1]) <= 16, result
            result = await contained(sb, "head -c 20M /dev/zero > /tmp/x || echo tmpfull; du -sm /tmp | cut -f1", 20)
            assert "tmpfull" in result.stdout and int(result.stdout.split()[-1]) <= 8, result
        finally:
            await sb.close()

    run(go())


NET_PROBE = r"""
import socket, sys
tcp_port, udp_port, unix_path, abstract = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
def attempt(name, fn):
    try:
        fn()
        print(name, "CONNECTED")
    except OSError as e:
        print(name, "blocked", type(e).__name__)
attempt("tcp", lambda: socket.create_connection(("127.0.0.1", tcp_port), timeout=2))
def udp():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.sendto(b"leak", ("127.0.0.1", udp_port))
    s.settimeout(1); s.recv(10)
attempt("udp", udp)
attempt("dns", lambda: socket.getaddrinfo("example.com", 80))
def unix(path):
    s = socket.socket(socket.AF_UNIX); s.settimeout(2); s.connect(path)
attempt("unix", lambda: unix(unix_path))
attempt("abstract", lambda: unix("\0" + abstract))
print(open("/proc/net/dev").read())
"""


def test_network_egress(root, tmp_path):
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    tcp.listen(8)
    tcp.settimeout(0.5)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    udp.settimeout(0.5)
    unix_path = str(tmp_path / "host.sock")
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(unix_path)
    unix.listen(8)
    unix.settimeout(0.5)
    abstract_name = f"loongsage-test-{os.getpid()}"
    abstract = socket.socket(socket.AF_UNIX)
    abstract.bind("\0" + abstract_name)
    abstract.listen(8)
    abstract.settimeout(0.5)

    async def go():
        sb = LocalSandbox(SMALL, str(root))
        try:
            args = f"{tcp.getsockname()[1]} {udp.getsockname()[1]} {unix_path} {abstract_name}"
            return await contained(sb, f"{PY} probe.py {args}", 30, files={"probe.py": NET_PROBE.encode()})
        finally:
            await sb.close()

    try:
        result = run(go())
        assert result.exit_code == 0, result
        for name in ("tcp", "udp", "dns", "unix", "abstract"):
            assert f"{name} blocked" in result.stdout, result.stdout
        interfaces = [
            line.split(":")[0].strip() for line in result.stdout.splitlines() if ":" in line and "|" not in line
        ]
        assert interfaces == ["lo"], result.stdout
        for listener in (tcp, unix, abstract):  # nothing arrived on the host side
            with pytest.raises(TimeoutError):
                listener.accept()
        with pytest.raises(TimeoutError):
            udp.recv(10)
    finally:
        for s in (tcp, udp, unix, abstract):
            s.close()


def test_files_outside_the_work_dir(root, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("host secret")
    probes = {
        f"cat {secret}": "No such file",
        "cat /etc/shadow": "No such file",
        "ls /root": "No such file",
        "ls /home /var /sys": "No such file",
        "touch /usr/x": "Read-only file system",
        "touch /etc/x": "Permission denied",
        "touch /x": "Permission denied",
        "ls /proc/1/root/": "Permission denied",
        "cat /proc/1/environ": "Permission denied",
        f"ls /proc/1/root{tmp_path}": "Permission denied",
    }
    script = "".join(f"echo '== {i}'; {cmd} 2>&1 && echo SUCCEEDED\n" for i, cmd in enumerate(probes))

    async def go():
        sb = LocalSandbox(SMALL, str(root))
        try:
            return await contained(sb, script, 20)
        finally:
            await sb.close()

    result = run(go())
    outputs = result.stdout.split("== ")[1:]
    assert len(outputs) == len(probes), result
    for (cmd, expected), out in zip(probes.items(), outputs):
        assert expected in out and "SUCCEEDED" not in out and "host secret" not in out, (cmd, out)
    assert not (tmp_path / "x").exists()


def test_proc_shows_only_the_sandbox(root, host_process):
    probe = (
        "ls /proc | grep -E '^[0-9]+$' | wc -l; cat /proc/[0-9]*/cmdline | tr '\\0' ' '; echo; "
        f"kill -9 {host_process.pid}; kill -9 -1; echo after"
    )

    async def go():
        sb = LocalSandbox(SMALL, str(root))
        try:
            return await contained(sb, probe, 20)
        finally:
            await sb.close()

    result = run(go())
    count = int(result.stdout.split()[0])
    assert count <= 5, result.stdout  # bwrap's init, the shell, ls/grep/wc: not the host's hundreds
    assert "7777.25" not in result.stdout and str(root) not in result.stdout  # no host process, no host path
    assert host_process.poll() is None


def test_orphans_die_with_the_exec(root):
    detach = (
        "setsid sleep 301 & (sleep 302 &) ; nohup sleep 303 >/dev/null 2>&1 & "
        f"{PY} -c 'import os\nif os.fork() == 0:\n  os.setsid()\n  os.fork() or __import__(\"time\").sleep(304)'"
    )

    async def go():
        sb = LocalSandbox(SMALL, str(root))
        try:
            finished = await contained(sb, f"{detach}; echo started", 20)
            assert finished.exit_code == 0 and "started" in finished.stdout
            timed = await contained(sb, f"{detach}; sleep 60", 1)
            assert timed.timed_out
        finally:
            await sb.close()

    run(go())


def test_sigterm_ignored(root):
    async def go():
        sb = LocalSandbox(SMALL, str(root))
        try:
            ignore_term = "import signal,time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(99)"
            cmd = f"trap '' TERM; {PY} -c '{ignore_term}'"
            result = await contained(sb, cmd, 1)
            assert result.timed_out and result.wall_s < 5
        finally:
            await sb.close()

    run(go())


def test_delete_kills_a_running_exec(root):
    async def go():
        sb = LocalSandbox(SMALL, str(root))
        try:
            sid = await sb.create(owner(), deadline())
            running = asyncio.ensure_future(sb.exec(sid, "setsid sleep 300 & sleep 300", 60))
            await asyncio.sleep(0.5)
            assert sandbox_processes()
            await sb.delete(sid)
            result = await running
            assert result.error and "deleted" in result.error and result.signal == signal.SIGKILL
            assert not sandbox_processes()
            await sb.delete(sid)  # twice: nothing
            with pytest.raises(LookupError, match="no such sandbox"):
                await sb.exec(sid, "true", 1)
        finally:
            await sb.close()

    run(go())


def test_put_get_escapes(root, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("host secret")

    async def go():
        sb = LocalSandbox(SMALL, str(root))
        try:
            sid = await sb.create(owner(), deadline())
            plant = f"ln -s /etc etc_link; ln -s / root_link; ln -s {secret} secret_link; mkfifo fifo; mkdir d; echo ok"
            assert (await sb.exec(sid, plant, 10)).stdout == "ok\n"
            for bad in ("/etc/passwd", "../x", "d/../../x", "", ".", "a\0b"):
                with pytest.raises(ValueError, match="sandbox path"):
                    await sb.put(sid, bad, b"x")
            for bad in ("etc_link/passwd", "root_link/etc/passwd", "secret_link", "fifo", "d"):
                with pytest.raises(ValueError):
                    await sb.get(sid, bad)
            for bad in ("etc_link/evil", "secret_link", "fifo", "root_link/tmp/evil"):
                with pytest.raises(ValueError):
                    await sb.put(sid, bad, b"evil")
            assert secret.read_text() == "host secret"
            with pytest.raises(FileNotFoundError):
                await sb.get(sid, "missing.txt")
            with pytest.raises(ValueError, match="must be bytes"):
                await sb.put(sid, "x.txt", "text")
            await sb.put(sid, "d/e/f.txt", b"deep")
            assert await sb.get(sid, "d/e/f.txt") == b"deep"
            assert (await sb.exec(sid, "cat d/e/f.txt; echo more >> d/e/f.txt", 10)).stdout == "deep"
        finally:
            await sb.close()

    run(go())


def _tar(*members: tuple[str, bytes | None, bytes]) -> bytes:
    """Members ``(name, kind, payload)``: kind tarfile type (None: a regular file)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, kind, payload in members:
            info = tarfile.TarInfo(name)
            if kind is None:
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
            else:
                info.type = kind
                info.linkname = payload.decode()
                tar.addfile(info)
    return buf.getvalue()


def test_tar_slip(root, tmp_path):
    async def go():
        sb = LocalSandbox(SMALL, str(root))
        try:
            sid = await sb.create(owner(), deadline())
            bad = {
                "../escape.txt": _tar(("ok.txt", None, b"1"), ("../escape.txt", None, b"x")),
                "/abs": _tar(("/tmp/abs.txt", None, b"x")),
                "symlink": _tar(("link", tarfile.SYMTYPE, b"/etc"), ("link/passwd", None, b"x")),
                "hard link": _tar(("hard", tarfile.LNKTYPE, b"/etc/passwd")),
                "device": _tar(("dev", tarfile.CHRTYPE, b"")),
                "FIFO": _tar(("fifo", tarfile.FIFOTYPE, b"")),
            }
            for what, archive in bad.items():
                with pytest.raises(ValueError) as err:
                    await sb.put_archive(sid, ".", archive)
                assert what.split("/")[-1].split(".")[0] in str(err.value) or "sandbox" in str(err.value)
            assert (await sb.exec(sid, "ls -A", 10)).stdout == ""  # nothing of a refused archive was written
            with pytest.raises(ValueError, match="not a readable tar"):
                await sb.put_archive(sid, ".", b"not a tar")
            good = _tar(("pkg/a.py", None, b"print(1)"), ("pkg/sub/b.txt", None, b"b"))
            assert await sb.put_archive(sid, "src", good) == 2
            assert await sb.get(sid, "src/pkg/sub/b.txt") == b"b"
            assert not (tmp_path / "escape.txt").exists()
        finally:
            await sb.close()

    run(go())


def test_bad_input_gets_clear_results(root):
    async def go():
        sb = LocalSandbox(SMALL, str(root))  # 64 KiB of output per stream
        try:
            sid = await sb.create(owner(), deadline())
            missing = await sb.exec(sid, "no-such-program --flag", 10)
            assert missing.exit_code == 127 and "not found" in missing.stderr
            binary = await sb.exec(sid, "head -c 4096 /dev/urandom; printf '\\377\\376end'", 10)
            assert binary.exit_code == 0 and binary.stdout.endswith("\\xff\\xfeend") and not binary.truncated
            start = time.monotonic()
            huge = await sb.exec(sid, "yes loongsage | head -c 50000000; echo tail-marker", 60)
            assert huge.exit_code == 0 and huge.truncated and len(huge.stdout) < 70_000
            assert huge.stdout.startswith("loongsage\n") and huge.stdout.endswith("tail-marker\n")
            assert "bytes cut" in huge.stdout and time.monotonic() - start < 30
            name = "caf\udce9.txt"  # the bytes b"caf\xe9.txt": not UTF-8
            await sb.put(sid, name, b"latin-1 name")
            listing = await sb.exec(sid, "ls; cat caf*", 10)
            assert listing.stdout == "caf\\xe9.txt\nlatin-1 name"
            assert await sb.get(sid, name) == b"latin-1 name"
            for cmd, timeout, match in (
                ("", 1, "non-empty"),
                ("true", 0, "timeout"),
                ("true", float("inf"), "timeout"),
                ("a\0b", 1, "NUL"),
                (["ls"], 1, "shell command"),
                ("echo " + "x" * 200_000, 1, "put a script"),
            ):
                with pytest.raises(ValueError, match=match):
                    await sb.exec(sid, cmd, timeout)
            with pytest.raises(LookupError, match="no such sandbox"):
                await sb.get("sbx-unknown", "x")
        finally:
            await sb.close()

    run(go())


def test_limits_and_owner_are_checked():
    with pytest.raises(ValueError, match="memory_mb=0: must be a positive integer"):
        Limits(memory_mb=0)
    with pytest.raises(ValueError, match="processes=1"):
        Limits(processes=1)


def test_orphans_of_a_dead_process_are_reaped(root):
    child = r"""
import asyncio, sys, time
from loongsage.sandbox.local import LocalSandbox
from loongsage.core.contracts import SandboxOwner
async def main():
    sb = LocalSandbox(root=sys.argv[1])
    sid = await sb.create(SandboxOwner("dead-run", "t"), time.time() + 600)
    await sb.put(sid, "f.txt", b"x")
    task = asyncio.ensure_future(sb.exec(sid, "setsid sleep 300 & sleep 300", 600))
    await asyncio.sleep(0.5)
    print("ready", flush=True)
    await task
asyncio.run(main())
"""
    proc = subprocess.Popen(
        [sys.executable, "-c", child, str(root)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert proc.stdout.readline().strip() == "ready"
    assert [p for p in root.iterdir() if p.name.startswith("sbx-")]
    proc.kill()  # the run dies without cleaning up
    proc.wait()

    async def go():
        sb = LocalSandbox(SMALL, str(root))
        try:
            dead_uid = json.loads(next(root.glob("sbx-*/owner.json")).read_text())["uid"]
            live = await sb.create(owner("alive"), deadline())  # a live process's sandbox is not an orphan
            assert sb.uid_of(live) == dead_uid  # the uid was free again: the reaper must not kill by it
            running = asyncio.ensure_future(sb.exec(live, "sleep 1; echo survived", 20))
            await asyncio.sleep(0.3)
            assert await sb.reap_orphans() == 1
            assert [p.name for p in root.iterdir() if p.name.startswith("sbx-")] == [live]
            assert (await running).stdout == "survived\n"
        finally:
            await sb.close()

    run(go())


def test_cancelled_exec_leaves_no_process(root):
    async def go():
        sb = LocalSandbox(SMALL, str(root))
        try:
            sid = await sb.create(owner(), deadline())
            task = asyncio.ensure_future(sb.exec(sid, "setsid sleep 300 & (sleep 301 &); sleep 302", 60))
            await asyncio.sleep(0.5)
            assert [p for p, uid in sandbox_processes() if uid == sb.uid_of(sid)]
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            end = time.monotonic() + 3
            while [p for p, uid in sandbox_processes() if uid == sb.uid_of(sid)] and time.monotonic() < end:
                await asyncio.sleep(0.02)
            assert not [p for p, uid in sandbox_processes() if uid == sb.uid_of(sid)]
            assert (await sb.exec(sid, "echo still usable", 10)).stdout == "still usable\n"
        finally:
            await sb.close()

    run(go())


def test_exec_cancelled_or_timed_out_while_its_jail_starts(root):
    """Killing bubblewrap while it creates its init could leave that init waiting for it forever
    (it arms its own death signal only later): the jail is stopped before it is killed."""

    async def go():
        sb = LocalSandbox(SMALL, str(root))
        rng = random.Random(1)
        try:
            sid = await sb.create(owner(), deadline())
            for _ in range(300):
                task = asyncio.ensure_future(sb.exec(sid, "sleep 100", rng.choice([0.0005, 0.002, 0.004, 0.008, 30])))
                asyncio.get_running_loop().call_later(rng.uniform(0, 0.01), task.cancel)
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            assert (await sb.exec(sid, "echo fine", 10)).stdout == "fine\n"
        finally:
            await sb.close()

    run(go())
