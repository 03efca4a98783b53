"""The ``docker`` backend through the official ``docker`` client against a real Docker Engine API:
Podman's compatible service (``podman system service``), started here on a socket of the test's
own, running real containers. Hostile programs are contained, limits hold for the whole container,
files stay inside, bad input gets clear results, and nothing is left: no container of the test's,
no process. Network tests aim only at a listener this test opened on the host's loopback."""

from __future__ import annotations

import asyncio
import io
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from loongsage.core.contracts import SandboxOwner
from loongsage.sandbox.limits import Limits
from loongsage.sandbox.store import UID_BASE, UID_COUNT
from tests.sandbox.engine_relay import EngineRelay

pytestmark = pytest.mark.timeout(300)
SMALL = Limits(
    cpu_s=20,
    memory_mb=128,
    processes=48,
    file_size_mb=8,
    open_files=64,
    work_mb=16,
    tmp_mb=8,
    output_bytes=64 << 10,
    get_bytes=4 << 20,
)


def _podman_problem() -> str | None:
    if shutil.which("podman") is None:
        return "podman is not installed (apt-get install -y podman runc)"
    try:
        import docker  # noqa: F401
    except ImportError:
        return "the docker Python client is missing (pip install 'loongsage-sandbox[docker]')"
    if os.geteuid() != 0:
        return "rootful podman needs root here"
    return None


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """The API socket of a Podman service of this module (runc where it is installed: crun refuses
    hybrid cgroup hierarchies)."""
    problem = _podman_problem()
    if problem:
        pytest.skip(problem)
    folder = tmp_path_factory.mktemp("podman")
    url = f"unix://{folder}/api.sock"
    runtime = ["--runtime", "runc"] if shutil.which("runc") else []
    service = subprocess.Popen(
        ["podman", *runtime, "system", "service", "--time=0", url],
        stdout=subprocess.DEVNULL,
        stderr=open(folder / "service.log", "wb"),
    )
    from loongsage.sandbox.docker_image import docker_problem

    end = time.monotonic() + 30
    while (why := docker_problem(url)) is not None and time.monotonic() < end:
        time.sleep(0.2)
    if why is not None:
        service.kill()
        pytest.skip(f"the Podman service did not answer: {why}; {(folder / 'service.log').read_text()[-300:]}")
    yield url
    service.terminate()
    service.wait(timeout=30)


def run(coro):
    return asyncio.run(coro)


def owner(name: str = "t") -> SandboxOwner:
    return SandboxOwner("run-docker-test", name, 0)


def backend(engine, limits: Limits = SMALL, **params):
    from loongsage.sandbox.docker_backend import DockerSandbox

    return DockerSandbox(limits, base_url=engine, **params)


def leftovers(engine) -> list[str]:
    """Containers of this test run (by their owner's run label) still known to the engine."""
    import docker

    client = docker.DockerClient(base_url=engine)
    try:
        return [
            c.name for c in client.containers.list(all=True, filters={"label": "loongsage.sandbox.run=run-docker-test"})
        ]
    finally:
        client.close()


@pytest.fixture
def clean(engine):
    yield
    assert leftovers(engine) == []


def sandbox_processes(ps: str) -> list[str]:
    """The commands of ``ps -e -o uid=,comm=`` run by a sandbox's uid (PID 1 and its sweeper are root's)."""
    return [line.split()[1] for line in ps.splitlines() if line.split()[0] != "0"]


async def two(sb):
    return [await sb.create(owner(name), time.time() + 120) for name in ("bad", "peer")]


async def peer_is_fine(sb, peer: str) -> None:
    await sb.put(peer, "mine.txt", b"peer")
    result = await sb.exec(peer, "cat mine.txt; ls; echo ok", 30)
    assert (result.exit_code, result.stdout) == (0, "peermine.txt\nok\n"), result


def test_commands_files_and_bad_input(engine, clean):
    async def go():
        sb = backend(engine)
        sid = await sb.create(owner(), time.time() + 120)
        try:
            result = await sb.exec(sid, "id -u; pwd; echo err >&2; exit 3", 10)
            uid, rest = result.stdout.split("\n", 1)
            assert (result.exit_code, rest, result.stderr) == (3, "/work\n", "err\n"), result
            assert UID_BASE <= int(uid) < UID_BASE + UID_COUNT  # a uid of its own (see the test below)
            missing = await sb.exec(sid, "no-such-command-here", 10)
            assert missing.exit_code == 127 and "not found" in missing.stderr
            binary = await sb.exec(sid, "printf '\\377\\000ok'", 10)
            assert binary.stdout == "\\xff\x00ok"  # undecodable bytes escaped, the rest kept
            huge = await sb.exec(sid, "head -c 5000000 /dev/zero | tr '\\0' x", 30)
            assert huge.truncated and huge.exit_code == 0 and "bytes cut" in huge.stdout
            assert len(huge.stdout) < 2 * SMALL.output_bytes
            await sb.put(sid, "a/b/c.txt", b"hello")
            with pytest.raises(ValueError, match="not valid UTF-8"):  # a non-UTF-8 name, as os.fsdecode gives it
                await sb.put(sid, "caf\udce9.txt", b"latin-1 name")
            odd = await sb.exec(sid, "printf x > \"$(printf 'caf\\351.txt')\"; ls", 10)  # made inside: fine
            assert odd.exit_code == 0 and "caf\\xe9.txt" in odd.stdout, odd
            assert await sb.get(sid, "a/b/c.txt") == b"hello"
            listing = await sb.exec(sid, "cat a/b/c.txt; ls | od -c | head -2 >/dev/null; stat -c %u a/b/c.txt", 10)
            assert listing.stdout == f"hello{uid}\n", listing  # put's files are the sandbox uid's
            for bad in ("/etc/passwd", "../x", "a/../../x", ""):
                with pytest.raises(ValueError, match="sandbox path"):
                    await sb.put(sid, bad, b"x")
            with pytest.raises(FileNotFoundError):
                await sb.get(sid, "nope.txt")
            with pytest.raises(ValueError, match="not a regular file"):
                await sb.get(sid, "a")
            for cmd, timeout in (("", 1), ("true", 0), ("true", float("inf")), ("a\0b", 1)):
                with pytest.raises(ValueError, match="sandbox exec"):
                    await sb.exec(sid, cmd, timeout)
        finally:
            await sb.close()
        with pytest.raises(LookupError):
            await sb.exec(sid, "true", 5)

    run(go())


def test_output_written_before_the_client_read_the_answer_is_kept(engine, clean, tmp_path):
    """A fast command on a loaded machine: its output reaches the client together with the answer's
    headers (the relay holds the engine's answer until the command's first output is there), and
    every byte of it is kept."""
    relay = EngineRelay(engine, tmp_path, hold=True)

    async def go():
        sb = backend(relay.url)
        sid = await sb.create(owner(), time.time() + 120)
        try:
            for i in range(3):
                result = await sb.exec(sid, f"echo out{i}; echo err{i} >&2; ls -d /work", 10)
                assert (result.exit_code, result.stdout, result.stderr) == (0, f"out{i}\n/work\n", f"err{i}\n"), result
        finally:
            await sb.close()

    try:
        run(go())
    finally:
        relay.close()
    assert relay.together >= 3, vars(relay)  # the arrangement that lost the output did happen


@pytest.mark.parametrize(
    "cut_after, why",
    [
        (4, "ended inside a frame header (4 of 8 bytes)"),
        (8 + 3, "ended 9 bytes short of the end of a frame"),
        (8 + 12, "ended while the command still ran"),  # between two frames: only the engine can tell
    ],
)
def test_a_cut_output_stream_is_an_error_not_a_short_output(engine, clean, tmp_path, cut_after, why):
    relay = EngineRelay(engine, tmp_path, cut_after=cut_after)

    async def go():
        sb = backend(relay.url)
        sid = await sb.create(owner(), time.time() + 120)
        try:
            result = await sb.exec(sid, "echo hello-world; sleep 30; echo never", 60)
            assert result.exit_code is None and result.signal is None and why in result.error, result
            assert result.wall_s < 20 and "never" not in result.stdout, result
            relay.cut_after = None
            ps = await sb.exec(sid, "ps -e -o comm= | grep -c sleep || true", 10)
            assert ps.stdout == "0\n", ps  # the abandoned command was ended
        finally:
            await sb.close()

    try:
        run(go())
    finally:
        relay.close()
    assert relay.cuts >= 1, vars(relay)


def test_fork_bomb_memory_bomb_cpu_spin_and_disk_fill_are_contained(engine, clean):
    async def go():
        sb = backend(engine)
        bad, peer = await two(sb)
        try:
            fork = await sb.exec(bad, "bomb() { bomb | bomb & }; bomb; sleep 3; echo survived", 20)
            assert fork.exit_code is not None or fork.timed_out  # the pids cgroup stopped it
            count = await sb.exec(bad, "ps -e --no-headers | wc -l", 20)
            assert count.exit_code == 0 and int(count.stdout) <= SMALL.processes + 2, count
            left = await sb.exec(bad, "ps -e -o uid=,comm=", 20)
            # nothing of the bomb outlived its command: this command's own shell and ps only
            assert sandbox_processes(left.stdout) == ["sh", "ps"], left
            memory = await sb.exec(bad, "python3 -c 'b = [bytearray(16 << 20) for _ in range(64)]'; echo rc=$?", 30)
            assert "rc=137" in memory.stdout or "MemoryError" in memory.stderr, memory  # the container's cgroup
            started = time.monotonic()
            spin = await sb.exec(bad, "python3 -c 'while True: pass'", 3)
            assert spin.timed_out and spin.signal == 9 and time.monotonic() - started < 15, spin
            big = await sb.exec(bad, "head -c 64000000 /dev/zero > big; echo rc=$?", 30)
            assert "rc=153" in big.stdout and "File size limit exceeded" in big.stderr, big  # 128 + SIGXFSZ
            disk = await sb.exec(bad, "for i in 1 2 3 4 5 6; do head -c 4000000 /dev/zero > f$i; done", 30)
            assert "No space left" in disk.stderr, disk  # the work directory's tmpfs (16 MiB)
            await peer_is_fine(sb, peer)
        finally:
            await sb.close()

    run(go())


def test_a_sandbox_using_its_whole_process_budget_leaves_a_peers_alone(engine, clean):
    """RLIMIT_NPROC counts a uid's processes on the whole host: under one uid for every container,
    one sandbox holding its processes failed a peer's forks (``Cannot fork``). Each runs as a uid
    of its own."""

    async def go():
        sb = backend(engine)
        bad, peer = await two(sb)
        try:
            uids = [(await sb.exec(s, "id -u", 10)).stdout for s in (bad, peer)]
            assert len(set(uids)) == 2, uids
            # the command's shell and its sleeps leave room for a counting exec (its runtime's setup
            # process, sh, ps, grep) running beside the forks: a fork failing at the limit would end the
            # holding shell; under one uid for both, the peer's 25 would still not fit
            held = SMALL.processes - 12
            assert 1 + held + 25 > SMALL.processes
            # held until cancelled: nothing here takes the 120 s of its timeout, however loaded the machine
            holding = asyncio.ensure_future(
                sb.exec(bad, f"for i in $(seq {held}); do sleep 300 & done; echo held; wait", 120)
            )
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                count = await sb.exec(bad, "ps -e -o comm= | grep -c '^sleep$'", 10)
                if count.exit_code == 0 and int(count.stdout) >= held:
                    break
                await asyncio.sleep(0.2)
            assert not holding.done(), holding.result()
            forks = await sb.exec(peer, "for i in $(seq 24); do sleep 1 & done; wait; echo forked", 30)
            assert (forks.exit_code, forks.stdout, forks.stderr) == (0, "forked\n", ""), forks
            holding.cancel()
            with pytest.raises(asyncio.CancelledError):
                await holding
        finally:
            await sb.close()

    run(go())


def test_what_a_command_leaves_running_ends_once_no_command_runs(engine, clean):
    async def go():
        sb = backend(engine)
        sid = await sb.create(owner(), time.time() + 120)
        try:
            # both counted as running before either ends: an exec yields first at its engine call
            other = asyncio.ensure_future(sb.exec(sid, "sleep 3; echo other", 30))
            left_behind = await sb.exec(sid, "setsid sleep 300 & (trap '' TERM; sleep 300) & echo started", 10)
            assert left_behind.stdout == "started\n", left_behind
            assert (await other).stdout == "other\n"  # a command's return does not end another's processes
            left = await sb.exec(sid, "ps -e -o uid=,comm=", 10)
            # this command's own shell and ps only: the detached sleeps ended with the last command
            assert sandbox_processes(left.stdout) == ["sh", "ps"], left
        finally:
            await sb.close()

    run(go())


def test_network_files_proc_and_signals_stay_inside(engine, clean, tmp_path):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    unix_path = tmp_path / "host.sock"
    unix_listener = socket.socket(socket.AF_UNIX)
    unix_listener.bind(str(unix_path))
    unix_listener.listen()
    secret = tmp_path / "secret.txt"
    secret.write_text("host secret")
    host_sleeper = subprocess.Popen(["sleep", "7777.5"])

    async def go():
        sb = backend(engine)
        bad, peer = await two(sb)
        try:
            probe = f"""
import socket
for family, kind, addr in ((socket.AF_INET, socket.SOCK_STREAM, ("127.0.0.1", {port})),
                           (socket.AF_INET, socket.SOCK_DGRAM, ("127.0.0.1", {port})),
                           (socket.AF_UNIX, socket.SOCK_STREAM, "{unix_path}")):
    s = socket.socket(family, kind)
    s.settimeout(2)
    try:
        s.connect(addr); s.send(b"x"); s.recv(1); print("REACHED", addr)
    except OSError as exc:
        print("blocked", type(exc).__name__)
try:
    socket.getaddrinfo("example.com", 80); print("RESOLVED")
except OSError:
    print("no dns")
"""
            await sb.put(bad, "probe.py", probe.encode())
            net = await sb.exec(bad, "python3 probe.py", 30)
            assert "REACHED" not in net.stdout and "RESOLVED" not in net.stdout and net.stdout.count("blocked") == 3, (
                net
            )
            files = await sb.exec(
                bad,
                f"cat {secret}; ls /root /home; echo x > /etc/x; echo x > /usr/x; "
                f"ls /proc/1/root/work; cat /proc/1/root{secret}",
                20,
            )
            assert "host secret" not in files.stdout and "Read-only" in files.stderr, files
            signals = await sb.exec(bad, f"kill -9 {host_sleeper.pid}; kill -9 -1; kill -9 1; echo done", 20)
            assert "done" in signals.stdout or signals.exit_code is not None
            assert host_sleeper.poll() is None  # the host's process lives (another PID namespace)
            # a daemon that detached and ignores SIGTERM ends with the command's timeout, then the sandbox
            orphans = await sb.exec(
                bad, "setsid sh -c 'trap \"\" TERM; sleep 300' & (trap '' TERM; sleep 300) & sleep 300", 2
            )
            assert orphans.timed_out, orphans
            left = await sb.exec(bad, "ps -e -o uid=,comm=", 10)
            assert sandbox_processes(left.stdout) == ["sh", "ps"], left  # this command's own shell and ps only
            # planted links: get refuses them, a put through one stays inside the container
            await sb.exec(bad, "ln -s /etc evil && ln -s /etc/passwd pw", 10)
            with pytest.raises(ValueError, match="symlink"):
                await sb.get(bad, "pw")
            try:
                await sb.put(bad, "evil/owned", b"x")
            except ValueError:
                pass  # refused by the engine: also fine
            assert not Path("/etc/owned").exists()
            await peer_is_fine(sb, peer)
        finally:
            await sb.close()

    try:
        run(go())
    finally:
        assert host_sleeper.poll() is None
        host_sleeper.kill()
        listener.close()
        unix_listener.close()


def test_delete_and_cancel_end_everything(engine, clean):
    async def go():
        sb = backend(engine)
        sid = await sb.create(owner(), time.time() + 120)
        running = asyncio.ensure_future(sb.exec(sid, "sleep 300", 120))
        await asyncio.sleep(1.0)
        await sb.delete(sid)
        result = await asyncio.wait_for(running, 30)
        assert result.error == "the sandbox was deleted while the command ran", result
        # a cancelled exec: its processes go, the sandbox stays usable
        other = await sb.create(owner("other"), time.time() + 120)
        task = asyncio.ensure_future(sb.exec(other, "sleep 300", 120))
        await asyncio.sleep(1.0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.5)
        ps = await sb.exec(other, "ps -e -o comm= | grep -c sleep || true", 10)
        assert ps.stdout.strip() == "0", ps  # the cancelled command's sleep was ended
        # a create cancelled half-way leaves nothing once its container exists
        made = asyncio.ensure_future(sb.create(owner("cancelled"), time.time() + 120))
        await asyncio.sleep(0.05)
        made.cancel()
        await sb.close()

    run(go())


def test_containers_of_a_dead_process_are_reaped(engine, clean):
    made = subprocess.run([sys.executable, "-c", ORPHAN_MAKER, engine], capture_output=True, text=True, timeout=120)
    name = made.stdout.strip()
    assert made.returncode == 0 and name in leftovers(engine), made.stderr[-500:]

    async def go():
        sb = backend(engine)
        try:
            assert await sb.reap_orphans() >= 1  # its creator exited without deleting it
            assert await sb.reap_orphans() == 0
        finally:
            await sb.close()

    run(go())


# a process that creates a sandbox and exits without deleting it (a crash, as the engine sees it)
ORPHAN_MAKER = """
import asyncio, os, sys, time
from loongsage.core.contracts import SandboxOwner
from loongsage.sandbox.docker_backend import DockerSandbox
from loongsage.sandbox.limits import Limits
from loongsage.sandbox.store import UID_BASE, UID_COUNT

async def main():
    sb = DockerSandbox(Limits(memory_mb=64, work_mb=4, tmp_mb=4), base_url=sys.argv[1])
    print(await sb.create(SandboxOwner("run-docker-test", "orphan", 0), time.time() + 120), flush=True)
    os._exit(0)

asyncio.run(main())
"""


def test_the_sandboxes_service_with_docker_runs_code_tests_in_the_trajectorys_container(
    ray_module, engine, clean, tmp_path
):
    from loongsage.core.contracts import RewardContext
    from loongsage.core.plugins import load_registry
    from loongsage.core.services import ServiceContext
    from loongsage.core.types import DataRecord, Trajectory
    from loongsage.sandbox.code_reward import CodeTestsReward
    from loongsage.sandbox.service import SandboxService

    record = DataRecord(source="code", index=0, prompt="write f", metadata={"tests": ["assert f(2) == 17"]})

    async def go():
        svc = SandboxService(backend={"name": "docker", "params": {"base_url": engine, "limits": {"memory_mb": 256}}})
        sandboxes = await svc.start(
            ServiceContext(
                engine=None, tokenizer=None, model_path="", run_dir=tmp_path / "run", registry=load_registry(), seed=0
            )
        )
        try:
            box = await sandboxes.acquire("g0-s0")
            assert box.host_path is None  # no directory on the host: the command agent refuses it
            await box.put("solution.py", b"def f(x):\n    return 7*x+3\n")
            t = Trajectory(
                source="code",
                group_id=0,
                sample_index=0,
                prompt_ids=[1],
                response_ids=[2],
                loss_mask=[1],
                rollout_logprobs=[0.0],
                versions=[0],
            )
            box.attach(t)
            reward = CodeTestsReward(solution_file="solution.py")
            assert await reward(t, record, RewardContext(services={"sandboxes": svc.share()})) == 1.0
            await svc.finish([t])
            assert svc.metrics()["sandbox/leased"] == 0
        finally:
            await svc.stop()

    # the service's actor creates the containers under its own run label
    run(go())
    import docker

    client = docker.DockerClient(base_url=engine)
    assert [c.name for c in client.containers.list(all=True, filters={"label": "loongsage.sandbox.run=run"})] == []
    client.close()


def test_tar_of_the_base_image_is_a_skeleton():
    from loongsage.sandbox.docker_image import base_image_tar

    with tarfile.open(fileobj=io.BytesIO(base_image_tar())) as tar:
        names = {m.name: m for m in tar.getmembers()}
    assert {"etc/passwd", "work", "tmp", "usr"} <= set(names)
    assert all(m.isdir() or m.issym() or m.name.startswith("etc/") for m in names.values())
    assert base_image_tar() == base_image_tar()  # content-addressed: imported once per engine
