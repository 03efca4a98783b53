"""``code_tests``: a reward that runs the model's code against the record's unit tests in a sandbox.

Each trajectory gets a fresh ``local`` sandbox (about a millisecond to make and remove): the
model's code is written to ``solution.py`` and the tests to ``tests.json``, a small harness
(:data:`HARNESS`) imports the solution and runs each test, and the sandbox is deleted, whatever
happened. Nothing the code does (loops, bombs, network, files outside its directory, leftover
processes) reaches the reward worker or the host: see :mod:`loongsage.sandbox.local`.

The code is the last fenced block of the response (```` ```python ... ``` ````), or the whole response
when it has none. A record's tests are ``record.metadata["tests"]``: Python statements, each run
in the solution's namespace (``assert f(2) == 5``); a test passes when it raises nothing.

Score: 1.0 when every test passes, else 0.0; with ``partial`` the fraction that pass. A solution
that does not compile, crashes on import, or runs past ``timeout_s`` in all scores 0.

The harness learns a random token on its standard input before it imports the solution, and the
score counts only when the result line carries that token, so code that prints a made-up result,
or exits early with status 0, scores 0. (Code that walks the interpreter's frames or memory to
the harness's token could still forge a result: the sandbox bounds what code can do, not what it
can claim. The tests here cover the cheap forgeries.)
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from loongsage.core.contracts import SandboxOwner
from loongsage.core.types import DataRecord, RewardInfraError, Trajectory
from loongsage.sandbox.limits import Limits

_FENCE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)```", re.S | re.I)
_STRIP = ("<|im_end|>", "<|endoftext|>")

# Reads the token first (the solution never sees it), then runs each test in the solution's
# namespace; one line out: the token, then how many passed of how many.
HARNESS = r'''
import json, os, sys
token = sys.stdin.readline().strip()
os.close(0)  # the file behind it is unlinked already; with the descriptor gone nothing reopens it
tests = json.load(open("tests.json"))
sys.path.insert(0, os.getcwd())  # isolated mode (-I) leaves the work directory off the path
out = sys.stdout
passed = 0
try:
    import solution
    namespace = dict(vars(solution))
except BaseException as exc:
    namespace = None
    print(f"import failed: {type(exc).__name__}: {exc}"[:500], file=sys.stderr)
if namespace is not None:
    for test in tests:
        try:
            exec(compile(test, "<test>", "exec"), dict(namespace))
            passed += 1
        except BaseException as exc:
            print(f"test failed: {test[:200]!r}: {type(exc).__name__}: {exc}"[:500], file=sys.stderr)
out.write(f"{token} {passed} {len(tests)}\n")
out.flush()
'''


def extract_code(text: str) -> str:
    """The last fenced code block of ``text``, or ``text`` itself when it has none."""
    for token in _STRIP:
        text = text.replace(token, "")
    blocks = _FENCE.findall(text)
    return blocks[-1] if blocks else text


@dataclass
class CodeTestsReward:
    """``code_tests``: 1.0 when the model's code passes every test of the record (``partial``: the
    fraction passed), run in a fresh ``local`` sandbox with the limits given here."""

    timeout_s: float = 10.0  # wall clock of the whole test run
    partial: bool = False
    limits: dict[str, Any] = field(default_factory=lambda: {"cpu_s": 10, "memory_mb": 512, "processes": 32,
                                                              "work_mb": 16, "tmp_mb": 16, "output_bytes": 65536})
    python: str = "python3"  # the interpreter inside the sandbox (the host's system Python)
    # test runs at once (the reward worker scores a whole batch concurrently): thousands of jails
    # contending for two cores would run every solution past its timeout and score it 0
    max_concurrency: int = 8

    def __post_init__(self) -> None:
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) or self.timeout_s <= 0:
            raise ValueError(f"code_tests.timeout_s={self.timeout_s!r}: must be a positive number of seconds")
        if isinstance(self.max_concurrency, bool) or not isinstance(self.max_concurrency, int) or self.max_concurrency < 1:
            raise ValueError(f"code_tests.max_concurrency={self.max_concurrency!r}: must be a positive integer")
        self._gates: dict[asyncio.AbstractEventLoop, asyncio.Semaphore] = {}
        try:
            self._limits = Limits(**self.limits)
        except TypeError as exc:
            raise ValueError(f"code_tests.limits: {exc}; allowed: {', '.join(Limits.__dataclass_fields__)}") from None
        self._backend = None

    def _sandbox(self):
        if self._backend is None:
            from loongsage.sandbox.local import LocalSandbox

            self._backend = LocalSandbox(self._limits)  # one line naming what is missing, if it cannot run
        return self._backend

    async def __call__(self, trajectory: Trajectory, record: DataRecord) -> float:
        tests = record.metadata.get("tests")
        if not isinstance(tests, list) or not tests or not all(isinstance(t, str) for t in tests):
            raise ValueError(f"code_tests: record {record.source}[{record.index}] needs metadata['tests'], "
                             f"a non-empty list of Python statements; got {tests!r:.80}")
        loop = asyncio.get_running_loop()
        gate = self._gates.setdefault(loop, asyncio.Semaphore(self.max_concurrency))
        async with gate:
            passed, total = await self.run(extract_code(trajectory.response_text), tests,
                                           f"{record.source}-{trajectory.group_id}-{trajectory.sample_index}")
        trajectory.metadata["code_tests"] = {"passed": passed, "total": total}
        if self.partial:
            return passed / total
        return float(passed == total)

    async def run(self, code: str, tests: list[str], name: str) -> tuple[int, int]:
        """``(passed, total)`` of ``tests`` against ``code`` in a fresh sandbox (0 passed when the
        run did not report with its token)."""
        sandbox = self._sandbox()
        token = secrets.token_hex(16)
        try:
            sandbox_id = await sandbox.create(SandboxOwner("code_tests", name[:100] or "t"), time.time() + 600)
        except (OSError, RuntimeError) as exc:
            raise RewardInfraError(f"code_tests: no sandbox: {exc}") from exc
        try:
            await sandbox.put(sandbox_id, "solution.py", code.encode("utf-8", "surrogatepass"))
            await sandbox.put(sandbox_id, "tests.json", json.dumps(tests).encode())
            await sandbox.put(sandbox_id, "harness.py", HARNESS.encode())
            await sandbox.put(sandbox_id, "token", f"{token}\n".encode())
            # the token file is opened as standard input, then unlinked before the harness starts
            result = await sandbox.exec(sandbox_id, f"{{ rm -f token; {self.python} -I -B harness.py; }} < token",
                                        self.timeout_s)
        finally:
            await sandbox.delete(sandbox_id)
        if result.error is not None and result.exit_code is None and result.signal is None:
            raise RewardInfraError(f"code_tests: the test run could not start: {result.error}")
        for line in reversed(result.stdout.splitlines()):
            fields = line.split()
            if len(fields) == 3 and fields[0] == token and fields[1].isdigit() and fields[2] == str(len(tests)):
                return min(int(fields[1]), len(tests)), len(tests)
        return 0, len(tests)
