"""What the ``local`` jail keeps from crossing between the host and sandboxes, checked against
real jails and real hostile programs: kernel keyrings, inode counts, machine-wide uids,
pseudo-terminals and capabilities, all-or-nothing archives, deep trees handed over by ``adopt``,
and host paths in ``/proc/self/mountinfo``."""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import io
import json
import os
import platform
import subprocess
import sys
import tarfile

import pytest

from loongsage.sandbox.limits import Limits
from loongsage.sandbox.local import LocalSandbox
from loongsage.sandbox.seccomp import keyring_filter
from tests.sandbox.conftest import SMALL, assert_clean, deadline, needs_jail, owner, run

pytestmark = needs_jail
PY = "/usr/bin/python3"
# add_key, request_key, keyctl: written out here rather than taken from the module under test
KEY_SYSCALLS = {"x86_64": (248, 249, 250), "aarch64": (217, 218, 219)}.get(platform.machine())
needs_key_numbers = pytest.mark.skipif(KEY_SYSCALLS is None, reason=f"no key syscall numbers for {platform.machine()}")

KEY_PROBE = r"""
import ctypes, json, os, sys
add_key, request_key, keyctl = map(int, sys.argv[1:4])
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
SESSION, USER = -3, -4  # KEY_SPEC_SESSION_KEYRING, KEY_SPEC_USER_KEYRING
def call(*args):
    ctypes.set_errno(0)
    result = libc.syscall(*[ctypes.c_long(a) if isinstance(a, int) else a for a in args])
    return result, ctypes.get_errno()
out = {}
out["add_user"] = call(add_key, b"user", b"note-of-a", b"left behind", 11, USER)
out["add_session"] = call(add_key, b"user", b"note-of-a", b"left behind", 11, SESSION)
out["request"] = call(request_key, b"user", b"loongsage-planted", None, 0)
out["search_session"] = call(keyctl, 10, SESSION, b"user", b"loongsage-planted", 0)  # KEYCTL_SEARCH
out["search_user"] = call(keyctl, 10, USER, b"user", b"note-of-a", 0)
buf = ctypes.create_string_buffer(64)
found = out["search_session"][0]
out["read"] = call(keyctl, 11, found, buf, 64) + (buf.value.decode(errors="replace"),) if found > 0 else None
out["proc_keys"] = open("/proc/keys").read()
out["proc_key_users"] = open("/proc/key-users").read()
print(json.dumps(out))
"""


def _key_probe(result) -> dict:
    assert result.exit_code == 0, result
    return json.loads(result.stdout)


def _assert_keyrings_closed(probe: dict) -> None:
    for call in ("add_user", "add_session", "request", "search_session", "search_user"):
        assert probe[call] == [-1, errno.ENOSYS], (call, probe)
    assert probe["read"] is None and probe["proc_keys"] == "" and probe["proc_key_users"] == "", probe


@needs_key_numbers
def test_keyring_calls_fail_in_the_jail(root):
    """Without the filter a note planted in the uid's user keyring by one trajectory was read by
    the next one to get the sandbox (the user keyring outlives every process of the uid)."""

    async def go():
        sb = LocalSandbox(SMALL, str(root))
        try:
            sid = await sb.create(owner("a"), deadline())
            await sb.put(sid, "probe.py", KEY_PROBE.encode())
            args = " ".join(map(str, KEY_SYSCALLS))
            _assert_keyrings_closed(_key_probe(await sb.exec(sid, f"{PY} probe.py {args}", 30)))
            await sb.reset(sid, owner("b"), deadline())  # the warm reuse: trajectory b gets a's uid
            await sb.put(sid, "probe.py", KEY_PROBE.encode())
            _assert_keyrings_closed(_key_probe(await sb.exec(sid, f"{PY} probe.py {args}", 30)))
            # keyutils' own tool, where installed
            keyctl = await sb.exec(sid, "keyctl show @u 2>&1 || echo refused", 30)
            assert "note-of-a" not in keyctl.stdout
        finally:
            await sb.close()

    run(go())


PLANTER = r"""
import asyncio, ctypes, json, sys, time
from loongsage.core.contracts import SandboxOwner
from loongsage.sandbox.local import LocalSandbox
from loongsage.sandbox.limits import Limits
add_key, request_key, keyctl = map(int, sys.argv[2:5])
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
# a session keyring of this process's own (KEYCTL_JOIN_SESSION_KEYRING, anonymous), as an SSH
# login or a systemd service gives its processes, holding a key of the host's
if libc.syscall(ctypes.c_long(keyctl), ctypes.c_long(1), None) < 0:
    print(json.dumps({"skip": f"no session keyring here (errno {ctypes.get_errno()})"})); sys.exit()
key = libc.syscall(ctypes.c_long(add_key), b"user", b"loongsage-planted", b"host secret", ctypes.c_long(11),
                   ctypes.c_long(-3))
assert key > 0, ctypes.get_errno()
async def main():
    sb = LocalSandbox(Limits(work_mb=16, tmp_mb=8), root=sys.argv[1])
    try:
        sid = await sb.create(SandboxOwner("keys", "t"), time.time() + 60)
        await sb.put(sid, "probe.py", sys.stdin.read().encode())
        result = await sb.exec(sid, "/usr/bin/python3 probe.py " + " ".join(sys.argv[2:5]), 30)
        print(json.dumps({"exit": result.exit_code, "stdout": result.stdout, "stderr": result.stderr}))
    finally:
        await sb.close()
asyncio.run(main())
"""


@needs_key_numbers
def test_parent_session_keyring_is_not_reachable(root):
    """A worker started from a login or a service has a session keyring, which every jail it
    starts inherits: the host's key must be neither readable nor listed inside."""
    done = subprocess.run(
        [sys.executable, "-c", PLANTER, str(root), *map(str, KEY_SYSCALLS)],
        input=KEY_PROBE,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    if "skip" in out:
        pytest.skip(out["skip"])
    assert out["exit"] == 0, out
    probe = json.loads(out["stdout"])
    _assert_keyrings_closed(probe)
    assert "host secret" not in out["stdout"] and "loongsage-planted" not in probe["proc_keys"]


# 32-bit and x32 system calls have numbers of their own: a filter checking only x86-64 numbers
# would let keyctl through them, so any call through another ABI kills the process
FOREIGN_ABI = r"""
import ctypes, mmap, sys
code = {"i386": b"\xb8\x14\x00\x00\x00\xcd\x80\xc3",          # mov eax, 20 (getpid); int 0x80; ret
        "x32": b"\xb8\x27\x00\x00\x40\x0f\x05\xc3"}[sys.argv[1]]  # mov eax, 0x40000027 (x32 getpid); syscall; ret
page = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
page.write(code)
fn = ctypes.CFUNCTYPE(ctypes.c_long)(ctypes.addressof(ctypes.c_char.from_buffer(page)))
print("returned", fn(), flush=True)
"""


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the i386 and x32 ABIs exist on x86-64 only")
def test_foreign_abi_system_calls_are_killed(root):
    async def go():
        sb = LocalSandbox(SMALL, str(root))
        try:
            sid = await sb.create(owner(), deadline())
            await sb.put(sid, "abi.py", FOREIGN_ABI.encode())
            for abi in ("i386", "x32"):
                result = await sb.exec(sid, f"{PY} abi.py {abi}", 30)
                assert result.signal == 31 and "returned" not in result.stdout, (abi, result)  # SIGSYS
        finally:
            await sb.close()

    run(go())


def test_new_limits_are_checked():
    for name in ("inodes_per_mb", "ptys"):
        with pytest.raises(ValueError, match=f"sandbox limit {name}=0: must be a positive integer"):
            Limits(**{name: 0})
    assert Limits(work_mb=16).inodes(16) == 4096


def test_filter_names_an_unknown_machine():
    with pytest.raises(ValueError, match="no system-call filter for machine 'sparc64': known are x86_64"):
        keyring_filter("sparc64")
    assert len(keyring_filter("x86_64")) % 8 == 0 and len(keyring_filter("aarch64")) % 8 == 0


MANY_FILES = r"""
import errno, os, sys
folder = sys.argv[1]
os.makedirs(folder, exist_ok=True)
made = 0
try:
    for i in range(int(sys.argv[2])):
        os.close(os.open(os.path.join(folder, str(i)), os.O_CREAT | os.O_WRONLY))
        made += 1
except OSError as exc:
    print(made, errno.errorcode[exc.errno])
else:
    print(made, "none")
"""


def test_inodes_are_capped(root):
    """Empty files cost no space but kernel memory: without nr_inodes a 16 MiB work directory
    took a million of them (810 MB of kernel memory nobody accounted)."""

    async def go():
        sb = LocalSandbox(SMALL, str(root))  # work 16 MiB, /tmp 8 MiB, 256 inodes per MiB
        try:
            sid = await sb.create(owner(), deadline())
            peer = await sb.create(owner("peer"), deadline())
            await sb.put(sid, "many.py", MANY_FILES.encode())
            cap = {"/work/many": 16 * 256, "/tmp/many": 8 * 256 + 16}
            for attempt in range(2):  # twice: each exec's /tmp is removed after it, its inodes back
                for folder, inodes in cap.items():
                    result = await sb.exec(sid, f"{PY} many.py {folder} 50000", 60)
                    made, why = result.stdout.split()
                    assert why == "ENOSPC" and inodes - 64 < int(made) < inodes, (folder, attempt, result)
                await sb.exec(sid, "rm -r /work/many", 30)
            assert (await sb.exec(peer, "touch a b c && ls | wc -l", 30)).stdout == "3\n"
        finally:
            await sb.close()

    run(go())


def test_each_exec_has_its_own_tmp(root):
    """/tmp is a directory of the scratch tmpfs per exec (bubblewrap's --tmpfs has no inode cap):
    empty when the exec starts, unseen by an exec beside it, removed with what is in it after."""

    async def go():
        sb = LocalSandbox(SMALL, str(root))
        try:
            sid = await sb.create(owner(), deadline())
            write = "mkdir /tmp/d && touch /tmp/d/x /tmp/y && sleep 1 && ls -A /tmp"
            first = asyncio.ensure_future(sb.exec(sid, write, 30))
            await asyncio.sleep(0.5)
            beside = await sb.exec(sid, "ls -A /tmp; stat -c %a /tmp", 30)
            assert beside.stdout == "1777\n" and (await first).stdout == "d\ny\n", (beside, first.result())
            assert (await sb.exec(sid, "ls -A /tmp", 30)).stdout == ""
            assert sorted(os.listdir(root / sid / "scratch")) == ["empty", "etc"]  # no exec's /tmp left
        finally:
            await sb.close()

    run(go())


def test_uids_are_claimed_machine_wide(root, tmp_path):
    """Two backends with different roots got the same uid: one's delete killed the other's
    running command (deleting kills by uid), and they shared one process limit."""
    other_root = tmp_path / "other-root"

    async def go():
        a, b = LocalSandbox(SMALL, str(root)), LocalSandbox(SMALL, str(other_root))
        try:
            in_a = await a.create(owner("a"), deadline())
            in_b = await b.create(owner("b"), deadline())
            assert a.uid_of(in_a) != b.uid_of(in_b)
            assert (await b.exec(in_b, "true", 10)).exit_code == 0  # a delete sweeps a uid that ran
            running = asyncio.ensure_future(a.exec(in_a, "sleep 1.5; echo survived", 30))
            await asyncio.sleep(0.5)
            await b.delete(in_b)
            result = await running
            assert (result.exit_code, result.stdout) == (0, "survived\n"), result
        finally:
            await a.close()
            await b.close()

    run(go())
    assert_clean(other_root)


ORPHAN_MAKER = r"""
import asyncio, sys, time
from loongsage.sandbox.local import LocalSandbox
from loongsage.core.contracts import SandboxOwner
async def main():
    sb = LocalSandbox(root=sys.argv[1])
    await sb.create(SandboxOwner("dead-run", "t"), time.time() + 600)
    print("ready", flush=True)
    await asyncio.sleep(600)
asyncio.run(main())
"""


def test_reaping_one_root_spares_another_roots_sandbox(root, tmp_path):
    """The orphan sweep of one root kills by the orphan's uid once it can claim it; a claim per
    root let it claim a uid that a live sandbox of another root held, and kill that sandbox."""
    dead_root = tmp_path / "dead-root"
    proc = subprocess.Popen(
        [sys.executable, "-c", ORPHAN_MAKER, str(dead_root)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert proc.stdout.readline().strip() == "ready"
    proc.kill()  # its run died without cleaning up: an orphan under dead_root, its uid free again
    proc.wait()
    orphan_uid = json.loads(next(dead_root.glob("sbx-*/owner.json")).read_text())["uid"]

    async def go():
        live, sweeper = LocalSandbox(SMALL, str(root)), LocalSandbox(SMALL, str(dead_root))
        try:
            sid = await live.create(owner("alive"), deadline())
            assert live.uid_of(sid) == orphan_uid  # the lowest free uid: the one the dead run held
            running = asyncio.ensure_future(live.exec(sid, "sleep 1.5; echo survived", 30))
            await asyncio.sleep(0.5)
            assert await sweeper.reap_orphans() == 1
            result = await running
            assert (result.exit_code, result.stdout) == (0, "survived\n"), result
        finally:
            await live.close()
            await sweeper.close()

    run(go())
    assert_clean(dead_root)


def test_bounding_set_is_empty(root):
    async def go():
        sb = LocalSandbox(SMALL, str(root))
        try:
            sid = await sb.create(owner(), deadline())
            result = await sb.exec(sid, "grep ^Cap /proc/self/status", 10)
        finally:
            await sb.close()
        caps = dict(line.split(":\t") for line in result.stdout.splitlines())
        assert caps == {name: "0000000000000000" for name in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")}, caps

    run(go())


PTYS = r"""
import os, sys, time
held = []
try:
    for _ in range(int(sys.argv[1])):
        held.append(os.openpty())
    print(len(held), "none", flush=True)
except OSError as exc:
    print(len(held), exc.strerror, flush=True)
time.sleep(float(sys.argv[2]))
"""


def test_ptys_are_capped_per_sandbox(root):
    """One sandbox could take all 3,071 pseudo-terminals of the machine; with its own devpts
    capped it takes ``ptys`` and another sandbox still opens one meanwhile."""

    async def go():
        sb = LocalSandbox(dataclasses.replace(SMALL, ptys=4), str(root))
        try:
            greedy, other = await sb.create(owner("greedy"), deadline()), await sb.create(owner("other"), deadline())
            for sid in (greedy, other):
                await sb.put(sid, "ptys.py", PTYS.encode())
            hog = asyncio.ensure_future(sb.exec(greedy, f"{PY} ptys.py 25 2", 30))
            await asyncio.sleep(1.0)  # it holds what it could open
            beside = await sb.exec(other, f"{PY} ptys.py 1 0", 30)
            assert beside.stdout == "1 none\n", beside
            assert (await hog).stdout == "4 No space left on device\n"
            again = await sb.exec(greedy, f"{PY} ptys.py 25 0", 30)  # the last exec's ptys went with it
            assert again.stdout == "4 No space left on device\n", again
        finally:
            await sb.close()

    run(go())


def _tar(*members: tuple[str, bytes | None]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            if data is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_refused_archive_writes_nothing(root):
    """A refusal found while writing (a symlink the sandbox planted on a member's way, a name
    both file and directory, a full work directory) left the members before it written."""

    async def go():
        sb = LocalSandbox(dataclasses.replace(SMALL, get_bytes=64 << 20), str(root))  # work 16 MiB
        try:
            sid = await sb.create(owner(), deadline())
            await sb.exec(sid, "ln -s /etc planted && mkdir kept && echo old > kept/file", 10)
            refused = {
                "planted": _tar(("first.txt", b"1"), ("kept/file", b"new"), ("planted/passwd", b"x")),
                "both a file and a directory": _tar(("first.txt", b"1"), ("a", b"file"), ("a/b", b"under a file")),
                "does not fit": _tar(("first.txt", b"1"), *[(f"big{i}", bytes(6 << 20)) for i in range(3)]),
            }
            for why, archive in refused.items():
                with pytest.raises(ValueError, match=why) as err:
                    await sb.put_archive(sid, ".", archive)
                assert "\n" not in str(err.value)
                listing = await sb.exec(sid, "ls -A; cat kept/file", 10)  # -A: no staging directory left either
                assert listing.stdout == "kept\nplanted\nold\n", (why, listing)
            assert await sb.put_archive(sid, "src", _tar(("pkg/", None), ("pkg/a.py", b"a"), ("kept", b"k"))) == 2
            assert (
                await sb.exec(sid, "find src | sort; ls -A", 10)
            ).stdout == "src\nsrc/kept\nsrc/pkg\nsrc/pkg/a.py\nkept\nplanted\nsrc\n"
        finally:
            await sb.close()

    run(go())


def test_adopt_hands_over_a_deep_tree(root, tmp_path):
    """``adopt`` walked by recursion and raised RecursionError on 5,000 nested directories."""
    outside = tmp_path / "host-file"
    outside.write_text("host's")
    depth = 5000

    async def go():
        sb = LocalSandbox(dataclasses.replace(SMALL, work_mb=64), str(root))  # 16,384 inodes
        try:
            sid = await sb.create(owner(), deadline())
            fd = os.open(sb.host_path(sid), os.O_RDONLY | os.O_DIRECTORY)
            for _ in range(depth):  # by descriptor: the path is far past PATH_MAX
                os.mkdir("d", dir_fd=fd)
                nxt = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
                os.close(fd)
                fd = nxt
            os.close(os.open("leaf", os.O_CREAT | os.O_WRONLY, 0o644, dir_fd=fd))
            os.symlink(str(outside), "link", dir_fd=fd)
            os.close(fd)
            assert await sb.adopt(sid) == depth + 2
            assert await sb.adopt(sid) == 0
            write_leaf = f"import os\nfor _ in range({depth}): os.chdir('d')\nopen('leaf', 'w').write('mine')\nprint(1)"
            await sb.put(sid, "deep.py", write_leaf.encode())
            assert (await sb.exec(sid, f"{PY} deep.py", 60)).stdout == "1\n"
        finally:
            await sb.close()

    run(go())
    assert os.stat(outside).st_uid == os.getuid()  # the link was handed over, not its target


def test_mountinfo_shows_no_host_path(root):
    async def go():
        sb = LocalSandbox(SMALL, str(root))
        try:
            sid = await sb.create(owner(), deadline())
            result = await sb.exec(sid, "cat /proc/self/mountinfo", 10)
        finally:
            await sb.close()
        assert result.exit_code == 0 and "/work" in result.stdout
        assert str(root) not in result.stdout and "sbx-" not in result.stdout, result.stdout
        roots = {line.split()[3] for line in result.stdout.splitlines()}  # each mount's path in its file system
        assert not [r for r in roots if r.startswith(("/tmp/", "/run/", "/home/", "/root/", "/var/"))], roots

    run(go())
