"""Building a model folder into the cache once, safely, and saying how far it is.

:func:`cached_build` makes ``<cache>/models/<key>`` by running a builder into a temporary sibling
renamed into place, with processes building the same key taking turns on a lock file that names
its holder; a build's temporary folder goes when it fails or gets SIGTERM, and the one a killed
build left (SIGKILL) goes with the next build. The warm starts (:mod:`.warmstart`, the agentflow
and sandbox ones) and the shape-only models (:mod:`.shapes`) are all built this way.

A build says what it builds, then how far its SFT is every ``LOONGSAGE_PROGRESS_SECONDS`` (default
10) seconds with the time left at the rate so far, on the launcher's log (stderr outside the
launcher): on two busy cores a build takes minutes, and a silent terminal looks like a hang. A
process waiting for another's build of the same folder says for whom it waits (the lock file holds
the builder's pid and host).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

INFO_FILE = "loongsage_warmstart.json"  # a model folder counts as built once it holds this file
PROGRESS_ENV = "LOONGSAGE_PROGRESS_SECONDS"  # seconds between progress lines of a build or a wait
BUILDING = ".building-"  # in the name of a folder being built: .<key>.building-<host>-<pid>-<random>

log = logging.getLogger("loongsage.warmstart")  # the name these lines have always had on the log
_last_said = time.monotonic()  # when say() last wrote: a build's heartbeat fills the silences


def default_cache_dir() -> Path:
    """``$LOONGSAGE_CACHE`` or ``~/.cache/loongsage``."""
    return Path(os.environ.get("LOONGSAGE_CACHE") or Path.home() / ".cache" / "loongsage")


# ----------------------------------------------------------------------------- saying what happens
def say(message: str) -> None:
    """One progress line: into the launcher's log (its console is stderr) when it is set up, else
    straight to stderr (a build run from a script or a test)."""
    global _last_said
    _last_said = time.monotonic()
    launcher = logging.getLogger("loongsage")
    if launcher.handlers and log.isEnabledFor(logging.INFO):
        log.info(message)
    else:
        print(f"[loongsage] {message}", file=sys.stderr, flush=True)


def progress_seconds() -> float:
    try:
        return max(0.0, float(os.environ.get(PROGRESS_ENV, "10")))
    except ValueError:
        return 10.0


def duration(seconds: float) -> str:
    """``42 s``, ``3 min 05 s``, ``1 h 02 min``."""
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


class Progress:
    """Lines ``<what>: step k/n, <elapsed> elapsed, about <left> left`` at most every
    :func:`progress_seconds` (the estimate assumes the rate so far goes on)."""

    def __init__(self, what: str, total: int):
        self.what, self.total = what, total
        self.every = progress_seconds()
        self.start = self.last = time.perf_counter()

    def step(self, done: int) -> None:
        now = time.perf_counter()
        if now - self.last < self.every or done >= self.total:
            return
        self.last = now
        elapsed = now - self.start
        left = elapsed / done * (self.total - done) if done else float("nan")
        estimate = f"about {duration(left)} left" if done else "no estimate yet"
        say(f"{self.what}: step {done}/{self.total}, {duration(elapsed)} elapsed, {estimate}")


@contextlib.contextmanager
def heartbeat(what: str) -> Iterator[None]:
    """``<what>: <elapsed> so far`` whenever nothing was said for :func:`progress_seconds` (the phases
    without steps to count: imports, a tokenizer's training, saving)."""
    every, start, done = progress_seconds(), time.monotonic(), threading.Event()

    def beat() -> None:
        while not done.wait(min(1.0, every or 1.0)):
            if time.monotonic() - _last_said >= every:
                say(f"{what}: {duration(time.monotonic() - start)} so far")

    thread = threading.Thread(target=beat, name="loongsage-build-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


# ----------------------------------------------------------------------------- building once
def cached_build(key: str, build: Callable[[Path], Any], cache_dir: str | Path | None = None, what: str = "") -> Path:
    """``<cache_dir>/models/<key>`` (default cache: :func:`default_cache_dir`), made by
    ``build(folder)`` on first use; a folder counts as built once it holds :data:`INFO_FILE`.

    ``build`` writes into a temporary sibling that is renamed into place, so a crash never leaves
    a half-written model behind; the sibling is removed when the build fails or the process gets
    SIGTERM, and the sibling a killed process left (SIGKILL) by the next build. Builders of the same
    key take turns on a lock file: the first builds, the others wait (saying for whom) and then find
    it (two processes never spend the CPU on the same build). ``what`` describes the build in the
    line that announces it.
    """
    models = (Path(cache_dir) if cache_dir is not None else default_cache_dir()) / "models"
    final = models / key
    if (final / INFO_FILE).is_file():
        return final
    models.mkdir(parents=True, exist_ok=True)
    remove_abandoned(models)
    # opened without truncating: the holder's pid and host in it are what a waiting process reports
    with open(os.open(models / f".{key}.lock", os.O_RDWR | os.O_CREAT, 0o644), "r+") as lock:
        _take_turn(lock, key)  # released when the file closes, also if this process dies
        if (final / INFO_FILE).is_file():  # built while this process waited
            return final
        lock.seek(0)
        lock.truncate()
        lock.write(f"pid {os.getpid()} on {socket.gethostname()}, building since {time.strftime('%H:%M:%S')}\n")
        lock.flush()
        say(f"building {key} into {models} (once; later runs find it there){': ' + what if what else ''}")
        start = time.perf_counter()
        with _sigterm_unwinds():
            tmp = Path(tempfile.mkdtemp(prefix=f".{key}{BUILDING}{socket.gethostname()}-{os.getpid()}-", dir=models))
            try:
                with heartbeat(f"building {key}"):
                    build(tmp)
                os.rename(tmp, final)
            finally:
                if tmp.exists():
                    shutil.rmtree(tmp, ignore_errors=True)
        say(f"built {key} in {duration(time.perf_counter() - start)}")
    return final


def _take_turn(lock, key: str) -> None:
    """Hold ``lock`` exclusively, saying whom this process waits for while another holds it."""
    import fcntl

    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return
    except BlockingIOError:
        pass
    start, said = time.perf_counter(), None
    every = max(progress_seconds(), 30.0)  # a wait changes little: a line every half minute at most
    while True:
        time.sleep(0.2)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            now = time.perf_counter()
            if said is None and now - start >= 1.0:  # not for a turn of a moment (a sweep of old folders)
                said = now
                say(f"waiting for {key}: another process is building it ({_holder(lock)}); this one uses it once built")
            elif said is not None and now - said >= every:
                said = now
                say(f"still waiting for {key} ({_holder(lock)}), {duration(now - start)} so far")
    if said is not None:
        say(f"waited {duration(time.perf_counter() - start)} for {key}")


def _holder(lock) -> str:
    lock.seek(0)
    return lock.read().strip() or "its pid not written yet"


def remove_abandoned(models: Path) -> None:
    """Remove the temporary folders of builds that no process runs any more: those of a key whose
    lock nobody holds (a builder holds it for as long as its folder exists; a killed one lets go)."""
    import fcntl

    try:
        entries = list(models.iterdir())
    except OSError:
        return
    keys = {e.name[1 : -len(".lock")] for e in entries if e.name.startswith(".") and e.name.endswith(".lock")}
    for key in keys:
        # this key's temporary folders: ".<key>.building-...", and ".<key>.<random>" of earlier versions
        pattern = re.compile(rf"\.{re.escape(key)}\.({re.escape(BUILDING[1:])}.*|[a-z0-9_]{{8}})")
        temps = [e for e in entries if e.is_dir() and pattern.fullmatch(e.name)]
        if not temps:
            continue
        with contextlib.suppress(OSError), open(models / f".{key}.lock", "a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # being built now
            for temp in temps:
                say(f"removing {temp.name}, left by a build that did not finish")
                shutil.rmtree(temp, ignore_errors=True)


class _Terminated(BaseException):
    """SIGTERM during a build, raised so that the build's temporary folder is removed on the way out."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise _Terminated(signum)


@contextlib.contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """While a build runs, SIGTERM unwinds it (its ``finally`` blocks remove what it wrote), then ends
    the process by SIGTERM as it would have. Only where SIGTERM would kill the process outright (the
    default action, in the main thread): a program with a handler of its own keeps it."""
    main = threading.current_thread() is threading.main_thread()
    if not main or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    except _Terminated:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        raise
    finally:
        if signal.getsignal(signal.SIGTERM) is _raise_terminated:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
