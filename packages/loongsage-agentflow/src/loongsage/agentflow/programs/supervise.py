"""The supervisor of one agent program: its deadline, the cleanup of everything it started, the
in-namespace end of the gateway relay.

Run as a script (standard library only, so ``python -I -S`` starts it fast, inside the network
jail too)::

    python supervise.py --status FILE --timeout S --grace S [--relay PORT=SOCKET] -- argv...

Why a process of its own rather than the runner signalling a process group: a program that forks a
daemon which calls ``setsid`` leaves the group, so no group signal reaches it. The supervisor marks
itself a *child subreaper* (``PR_SET_CHILD_SUBREAPER``): every orphan of the program's tree is
re-parented to it instead of to init, so walking ``/proc`` from the supervisor's pid finds every
process the program started, detached or not. It enforces the wall-clock timeout itself (inside
bubblewrap the runner cannot signal the program gracefully: bwrap does not forward signals), and
when the program ends or times out it sends SIGTERM to what is left, waits ``grace`` seconds, then
SIGKILLs until nothing is left. The runner only keeps a SIGKILL backstop.

``--relay PORT=SOCKET`` (the network jail): listen on ``127.0.0.1:PORT`` in the namespace's own
loopback and carry each connection over the Unix socket ``SOCKET`` (a file, so it crosses network
namespaces) to the runner's relay, which connects to the gateway.

The outcome is written to ``--status`` as JSON: ``exit_code`` or ``signal`` of the program,
``timed_out``, ``leftover`` (processes still alive when the program ended or timed out),
``relay_connections``, ``spawn_error``. The supervisor exits with the program's code (128 + signal).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, value: int) -> bool:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


# ---------------------------------------------------------------------------------- processes
def descendants(root: int) -> list[int]:
    """Live (not zombie) processes under ``root``, from ``/proc``."""
    children: dict[int, list[int]] = {}
    dead: set[int] = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()  # the command name may hold spaces and ')'
        pid, state, ppid = int(name), fields[0], int(fields[1])
        children.setdefault(ppid, []).append(pid)
        if state in (b"Z", b"X"):
            dead.add(pid)
    found, todo = [], [root]
    while todo:
        for pid in children.get(todo.pop(), ()):
            found.append(pid)
            todo.append(pid)
    return [p for p in found if p not in dead]


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


class Supervisor:
    def __init__(self, argv: list[str], timeout: float, grace: float):
        self.argv, self.timeout, self.grace = argv, timeout, grace
        self.status: int | None = None  # the program's wait status
        self.pid = -1
        self.stop_requested = False
        self._wake_r, wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(wake_w, False)
        # every handled signal writes a byte to the pipe, so select() wakes on a child's exit at once
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._on_stop)

    def _on_stop(self, *_: object) -> None:
        self.stop_requested = True

    def _wait(self, seconds: float) -> None:
        select.select([self._wake_r], [], [], max(0.0, seconds))
        try:
            while os.read(self._wake_r, 512):
                pass
        except BlockingIOError:
            pass

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid == self.pid:
                self.status = status

    def run(self) -> bool:
        """Start the program and wait for it until the deadline; True if it timed out."""
        # a new session: a program that signals its own process group cannot reach the supervisor
        child = subprocess.Popen(self.argv, start_new_session=True)
        self.pid = child.pid
        child.returncode = 0  # waited for below with waitpid(-1); Popen must not wait for it again
        deadline = time.monotonic() + self.timeout
        while True:
            self._reap()
            if self.status is not None or self.stop_requested:
                return False
            left = deadline - time.monotonic()
            if left <= 0:
                return True
            self._wait(left)

    def clean_up(self) -> int:
        """SIGTERM everything left, SIGKILL what outlives the grace period; returns how many were left."""
        me = os.getpid()
        left = descendants(me)
        count = len(left)
        _signal_all(left, signal.SIGTERM)
        end = time.monotonic() + self.grace
        while left and time.monotonic() < end:
            self._wait(min(0.05, end - time.monotonic()))
            self._reap()
            left = descendants(me)
        for _ in range(2000):  # a process forking as fast as it is killed still runs out of rounds
            if not left:
                break
            _signal_all(left, signal.SIGKILL)
            time.sleep(0.005)
            self._reap()
            left = descendants(me)
        self._reap()
        return count


# -------------------------------------------------------------------------------------- relay
class Relay:
    """``127.0.0.1:port`` in this network namespace -> the Unix socket of the runner's relay."""

    def __init__(self, port: int, path: str):
        self.path, self.connections = path, 0
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", port))
        self.listener.listen(128)  # bound before the program starts: its first connect cannot miss
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            conn, _ = self.listener.accept()
            # small writes (a reply's last bytes) must not wait for the client's delayed ACK (Nagle)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.connections += 1
            threading.Thread(target=self._bridge, args=(conn,), daemon=True).start()

    def _bridge(self, conn: socket.socket) -> None:
        up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            up.connect(self.path)
        except OSError:
            conn.close()
            up.close()
            return
        back = threading.Thread(target=_copy, args=(up, conn), daemon=True)
        back.start()
        _copy(conn, up)
        back.join()
        conn.close()
        up.close()


def _copy(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(1 << 16):
            dst.sendall(data)
    except OSError:
        pass
    try:
        dst.shutdown(socket.SHUT_WR)  # half-close: the peer sees the end of this direction only
    except OSError:
        pass


# --------------------------------------------------------------------------------------- main
def _write(path: str, outcome: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(outcome, f)
    os.replace(path + ".tmp", path)


def main(args: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="supervise")
    parser.add_argument("--status", required=True)
    parser.add_argument("--timeout", type=float, required=True)
    parser.add_argument("--grace", type=float, required=True)
    parser.add_argument("--relay")
    parser.add_argument("--parent", type=int, help="end with this process (host mode; bwrap has --die-with-parent)")
    parser.add_argument("argv", nargs=argparse.REMAINDER)
    opts = parser.parse_args(args)
    argv = opts.argv[1:] if opts.argv[:1] == ["--"] else opts.argv
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    sup = Supervisor(argv, opts.timeout, opts.grace)
    if opts.parent is not None and _prctl(PR_SET_PDEATHSIG, signal.SIGTERM) and os.getppid() != opts.parent:
        sup.stop_requested = True  # the runner was gone before the death signal was armed
    relay = None
    if opts.relay:
        port, path = opts.relay.split("=", 1)
        relay = Relay(int(port), path)
    outcome = {"exit_code": None, "signal": None, "timed_out": False, "leftover": 0, "spawn_error": None}
    try:
        outcome["timed_out"] = sup.run()
    except OSError as exc:  # no such program, not executable
        outcome["spawn_error"] = f"{type(exc).__name__}: {exc}"
    outcome["leftover"] = sup.clean_up()
    outcome["relay_connections"] = relay.connections if relay else 0
    code = 127
    if sup.status is not None:
        code = os.waitstatus_to_exitcode(sup.status)
        outcome["exit_code" if code >= 0 else "signal"] = abs(code)
        code = code if code >= 0 else 128 - code
    _write(opts.status, outcome)
    return code


if __name__ == "__main__":
    sys.exit(main())
