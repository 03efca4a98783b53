"""``code_tests``: a reward that runs the model's code against the record's unit tests in a sandbox.

Each trajectory gets a fresh ``local`` sandbox (about a millisecond to make and remove): the
model's code is written to ``solution.py`` and the tests to ``tests.json``, a small harness
(:data:`HARNESS`) imports the solution and runs each test, and the sandbox is deleted, whatever
happened. Nothing the code does (loops, bombs, network, files outside its directory, leftover
processes) reaches the reward worker or the host: see :mod:`loongsage.sandbox.local`.

With ``solution_file`` the code is instead that file in the sandbox the trajectory's agent worked in
(an agent of the ``sandboxes`` service, the command agent with ``sandbox: true`` say): the tests run
in that very sandbox, after the episode, next to whatever else the agent left there (the R2E/SWE
pattern). A trajectory that worked in a sandbox is always tested in it; its lease ends when the
rollout is done with the trajectory. The harness's files go to ``.loongsage_tests/``.

Otherwise the code is the last fenced block of the response (```` ```python ... ``` ````), or the
whole response when it has none. A record's tests are ``record.metadata["tests"]``: Python statements, each run
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
import functools
import secrets
import shlex
import time
from dataclasses import dataclass, field
from typing import Any

from loongsage.core.contracts import RewardContext, SandboxOwner
from loongsage.core.types import DataRecord, RewardInfraError, Trajectory
from loongsage.sandbox.code_text import extract_code
from loongsage.sandbox.limits import Limits
from loongsage.sandbox.service import sandbox_of

_DIR = ".loongsage_tests"  # the harness's files, in the sandbox's work directory

# Reads the token first (the solution never sees it), then runs each test in the solution's
# namespace; one line out: the token, then how many passed of how many.
HARNESS = r'''
import importlib.util, json, os, sys
token = sys.stdin.readline().strip()
os.close(0)  # the file behind it is unlinked already; with the descriptor gone nothing reopens it
tests = json.load(open(sys.argv[2]))
sys.path.insert(0, os.getcwd())  # isolated mode (-I) leaves the work directory off the path
out = sys.stdout
passed = 0
try:
    spec = importlib.util.spec_from_file_location("solution", sys.argv[1])
    solution = importlib.util.module_from_spec(spec)
    sys.modules["solution"] = solution
    spec.loader.exec_module(solution)
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
    # the solution is this file of the trajectory's own sandbox (relative to its work directory),
    # not the response's code; null: the response's last fenced block
    solution_file: str | None = None

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

    async def __call__(self, trajectory: Trajectory, record: DataRecord, ctx: RewardContext | None = None) -> float:
        tests = record.metadata.get("tests")
        if not isinstance(tests, list) or not tests or not all(isinstance(t, str) for t in tests):
            raise ValueError(f"code_tests: record {record.source}[{record.index}] needs metadata['tests'], "
                             f"a non-empty list of Python statements; got {tests!r:.80}")
        own = sandbox_of(trajectory, ctx)
        if self.solution_file is not None and own is None:
            raise ValueError(f"code_tests.solution_file={self.solution_file!r}: trajectory {trajectory.group_id}/"
                             f"{trajectory.sample_index} of {record.source!r} worked in no sandbox; give its agent "
                             f"one (command agent: sandbox: true, with services: [{{name: sandboxes}}])")
        code = None if self.solution_file is not None else extract_code(trajectory.response_text)
        loop = asyncio.get_running_loop()
        gate = self._gates.setdefault(loop, asyncio.Semaphore(self.max_concurrency))
        async with gate:
            if own is not None:
                passed, total = await self._test(own.exec, own.put, code, tests)
            else:
                passed, total = await self.run(code, tests,
                                               f"{record.source}-{trajectory.group_id}-{trajectory.sample_index}")
        trajectory.metadata["code_tests"] = {"passed": passed, "total": total, "in_own_sandbox": own is not None}
        if self.partial:
            return passed / total
        return float(passed == total)

    async def run(self, code: str, tests: list[str], name: str) -> tuple[int, int]:
        """``(passed, total)`` of ``tests`` against ``code`` in a fresh sandbox (0 passed when the
        run did not report with its token)."""
        sandbox = self._sandbox()
        try:
            sandbox_id = await sandbox.create(SandboxOwner("code_tests", name[:100] or "t"), time.time() + 600)
        except (OSError, RuntimeError) as exc:
            raise RewardInfraError(f"code_tests: no sandbox: {exc}") from exc
        try:
            return await self._test(functools.partial(sandbox.exec, sandbox_id),
                                    functools.partial(sandbox.put, sandbox_id), code, tests)
        finally:
            await sandbox.delete(sandbox_id)

    async def _test(self, exec_, put, code: str | None, tests: list[str]) -> tuple[int, int]:
        """Run the harness in a sandbox reached through ``exec_(cmd, timeout)`` and ``put(path, data)``;
        ``code`` None: the solution is :attr:`solution_file`, there already."""
        token = secrets.token_hex(16)
        folder = f"{_DIR}/{token[:12]}"  # its own: the trajectories of one episode share a sandbox
        solution = self.solution_file
        try:
            if code is not None:
                solution = f"{folder}/solution.py"
                await put(solution, code.encode("utf-8", "surrogatepass"))
            await put(f"{folder}/tests.json", json.dumps(tests).encode())
            await put(f"{folder}/harness.py", HARNESS.encode())
            await put(f"{folder}/token", f"{token}\n".encode())
        except ValueError:  # the agent left a symlink or a non-file where the harness goes: no score
            return 0, len(tests)
        except LookupError as exc:
            raise RewardInfraError(f"code_tests: sandbox gone: {exc}") from exc
        # the token file is opened as standard input, then unlinked before the harness starts
        try:
            result = await exec_(f"{{ rm -f {folder}/token; {self.python} -I -B {folder}/harness.py "
                                 f"{shlex.quote(solution)} {folder}/tests.json; }} < {folder}/token", self.timeout_s)
        except LookupError as exc:  # the sandbox went away (deadline passed, run ending)
            raise RewardInfraError(f"code_tests: sandbox gone: {exc}") from exc
        if result.error is not None and result.exit_code is None and result.signal is None:
            raise RewardInfraError(f"code_tests: the test run could not start: {result.error}")
        for line in reversed(result.stdout.splitlines()):
            fields = line.split()
            if len(fields) == 3 and fields[0] == token and fields[1].isdigit() and fields[2] == str(len(tests)):
                return min(int(fields[1]), len(tests)), len(tests)
        return 0, len(tests)
