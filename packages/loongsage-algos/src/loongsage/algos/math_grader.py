"""``math-verify`` in a process of its own, which a hung grading cannot take down with it.

``math-verify`` evaluates the answers it parses with SymPy: ``\\boxed{9^{9^{9^{9}}}}`` starts an
integer power that runs for ever inside one C call, which neither its ``SIGALRM`` timeout (main
thread only, and only between bytecodes) nor a thread can stop. In the reward worker that froze
the whole run on one response, and a policy finds such a response. So grading runs in a child
process (``python -m loongsage.algos.math_grader``, one JSON line per question and per answer)
that is killed and replaced when it does not answer in time; the response it hung on scores 0.

A replacement starts by importing SymPy (seconds on a loaded machine). After the first kill, a
spare child is kept started and ready, so a batch of such responses costs the deadline each, not
the deadline and a start-up each.

math-verify is pure Python: one process grades one answer at a time. :class:`GraderPool` keeps up
to ``size`` children, so a batch's answers are graded side by side (the ``math`` reward hands each
answer to one of the pool's threads, which waits on a free child's answer); its graders share one
spare, so the pool holds at most ``size + 1`` children.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import queue
import resource
import select
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

_log = logging.getLogger(__name__)
_START_S = 300.0
_MEMORY_MB = 4096  # the child's address space: SymPy on a hostile expression may also try to fill memory


class Spare:
    """At most one grader child started ahead of need, importing while nothing waits on it, for the
    graders that share it. Wanted from the first kill on: until then a grader starts its own."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self._wanted = False
        self._lock = threading.Lock()

    def want(self) -> None:
        """Keep one started from now on (a grader's child was just killed)."""
        with self._lock:
            self._wanted = True
            self._keep()

    def take(self) -> subprocess.Popen:
        """The started spare (another is started behind it when wanted), or a fresh child."""
        with self._lock:
            proc, self.proc = self.proc, None
            if proc is None or proc.poll() is not None:
                proc = _spawn()
            if self._wanted:
                self._keep()
            return proc

    def _keep(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = _spawn()

    def close(self) -> None:
        with self._lock:
            if self.proc is not None:
                self.proc.kill()
                self.proc.wait()
                self.proc = None

    def __del__(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()


class IsolatedGrader:
    """``grade(response, label)`` with ``math-verify`` in a child process, within ``deadline_s``
    of wall clock per answer (the child is started on first use and after each kill, from
    ``spare``: a pool's shared one, or one of its own)."""

    def __init__(self, timeout: int, deadline_s: float, spare: Spare | None = None):
        self.timeout, self.deadline_s = timeout, deadline_s
        self._proc: subprocess.Popen | None = None
        self.spare = spare or Spare()
        self._owns_spare = spare is None
        self._lock = threading.Lock()
        self.kills = 0
        self.starts = 0  # children that took over (the first one included)

    def grade(self, response: str, label: str) -> bool:
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._start()
            question = json.dumps({"response": response, "label": label, "timeout": self.timeout})
            try:
                self._proc.stdin.write(question + "\n")
                self._proc.stdin.flush()
                line = self._answer(self._proc, time.monotonic() + self.deadline_s)
                return bool(json.loads(line)["equal"])
            except (OSError, ValueError, KeyError, TimeoutError) as exc:
                self._stop()
                self.kills += 1
                self.spare.want()
                _log.warning(
                    "math grading gave up on a response of %d characters (%s): scored 0",
                    len(response),
                    exc or type(exc).__name__,
                )
                return False

    def _start(self) -> None:
        self._proc = self.spare.take()
        self.starts += 1
        try:  # its start-up (importing SymPy: seconds on a loaded machine) is not an answer's time
            self._answer(self._proc, time.monotonic() + _START_S)
        except (OSError, TimeoutError) as exc:
            self._stop()
            raise RuntimeError(f"math: the math-verify grader process did not start: {exc}") from None

    def _answer(self, proc: subprocess.Popen, deadline: float) -> str:
        while not select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))[0]:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no answer within {self.deadline_s} s")
        line = proc.stdout.readline()
        if not line:
            raise OSError(f"the grader exited ({proc.poll()})")
        return line

    def _stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def close(self) -> None:
        with self._lock:
            self._stop()
            if self._owns_spare:
                self.spare.close()

    def __del__(self) -> None:  # its spare, once unreferenced, kills its own child
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()


class GraderPool:
    """Up to ``size`` :class:`IsolatedGrader` children grading side by side. :meth:`grade` takes a
    free one (waiting while all are busy), the one used last first, so a child is started only when
    every started one is busy; after a kill the graders share one spare child (:class:`Spare`).
    :meth:`graded` runs it on the pool's own ``size`` threads: a batch of answers waits in their
    queue, not on threads of the event loop's shared executor."""

    def __init__(self, size: int, timeout: int, deadline_s: float):
        self.spare = Spare()
        self.graders = [IsolatedGrader(timeout, deadline_s, self.spare) for _ in range(size)]
        self._free: queue.LifoQueue[IsolatedGrader] = queue.LifoQueue()
        for grader in reversed(self.graders):
            self._free.put(grader)
        self._threads = ThreadPoolExecutor(max_workers=size, thread_name_prefix="math-grader")

    def grade(self, response: str, label: str) -> bool:
        grader = self._free.get()
        try:
            return grader.grade(response, label)
        finally:
            self._free.put(grader)

    async def graded(self, response: str, label: str) -> bool:
        """:meth:`grade` on one of the pool's threads, awaited on the caller's event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._threads, self.grade, response, label)

    @property
    def kills(self) -> int:
        return sum(g.kills for g in self.graders)

    @property
    def starts(self) -> int:
        return sum(g.starts for g in self.graders)

    def close(self) -> None:
        self._threads.shutdown(wait=False)
        for grader in self.graders:
            grader.close()
        self.spare.close()


def _spawn() -> subprocess.Popen:
    """A grader child; it says ``{"ready": true}`` once its imports are done."""
    return subprocess.Popen(
        [sys.executable, "-m", __name__],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        encoding="utf-8",
        errors="surrogatepass",
        bufsize=1,
    )


def _serve() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (_MEMORY_MB << 20, _MEMORY_MB << 20))
    from loongsage.algos.rewards import math_equal_verify

    math_equal_verify("\\boxed{1}", "1", timeout=0)  # its lazy imports, before the first timed answer
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        question = json.loads(line)
        try:
            equal = math_equal_verify(question["response"], question["label"], timeout=question["timeout"])
        except Exception:  # noqa: BLE001 - an answer math-verify cannot read is not equal
            equal = False
        print(json.dumps({"equal": equal}), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _serve()
