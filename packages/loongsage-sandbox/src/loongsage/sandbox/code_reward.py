"""``code_tests``: a reward that runs the model's code against the record's unit tests in a sandbox.

Each trajectory gets a fresh ``local`` sandbox (about a millisecond to make and remove): the
model's code is written to ``solution.py``, a small harness (:data:`HARNESS`) imports it and
evaluates what each test needs of it, and the sandbox is deleted, whatever happened. Nothing the
code does (loops, bombs, network, files outside its directory, leftover processes) reaches the
reward worker or the host: see :mod:`loongsage.sandbox.local`.

With ``solution_file`` the code is instead that file in the sandbox the trajectory's agent worked in
(an agent of the ``sandboxes`` service, the command agent with ``sandbox: true`` say): the tests run
in that very sandbox, after the episode, next to whatever else the agent left there (the R2E/SWE
pattern). A trajectory that worked in a sandbox is always tested in it; its lease ends when the
rollout is done with the trajectory. The harness's files go to ``.loongsage_tests/``. An agent that
left its sandbox unable to take them (full, or a symlink where they go) scores 0.

Otherwise the code is the last fenced block of the response (```` ```python ... ``` ````), or the
whole response when it has none. A record's tests are ``record.metadata["tests"]``, each one
``assert <condition>`` over the solution's names (``assert f(2) == 5``).

Score: 1.0 when every test passes, else 0.0; with ``partial`` the fraction that pass. A solution
that does not compile, crashes on import, or runs past ``timeout_s`` in all scores 0.

Whether a test passed is decided outside the process that runs the solution
(:mod:`loongsage.sandbox.judging`): the sandboxed child only evaluates the parts of each condition
that need the solution and sends their values as literals; the host's judge compares them with the
expected values, which never enter the sandbox. Code that rewrites the harness, its builtins, its
output or its exit can therefore change only the values it reports, which is what solving the task
means.
"""

from __future__ import annotations

import asyncio
import functools
import json
import secrets
import shlex
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

from loongsage.core.contracts import RewardContext, SandboxOwner
from loongsage.core.types import DataRecord, RewardInfraError, Trajectory
from loongsage.sandbox.code_text import extract_code
from loongsage.sandbox.judging import judge, split_test
from loongsage.sandbox.limits import Limits
from loongsage.sandbox.service import sandbox_of

_DIR = ".loongsage_tests"  # the harness's files, in the sandbox's work directory

# The child's side of a test run (see :mod:`loongsage.sandbox.judging`): reads the token first (it
# only tells the answer line from the solution's own prints), imports the solution and evaluates
# each test's probes in a fresh copy of its namespace. One line out: the token and, per test, a
# [kind, text] per probe: "value" (its repr), "iter" (an iterator's items, as a list) or "raised".
# Nothing here decides a score: the solution can rewrite all of it, and gains nothing by that.
HARNESS = r"""
import collections.abc, importlib.util, itertools, json, os, sys
token = sys.stdin.readline().strip()
os.close(0)  # the file behind it is unlinked already; with the descriptor gone nothing reopens it
probes = json.load(open(sys.argv[2]))
sys.path.insert(0, os.getcwd())  # isolated mode (-I) leaves the work directory off the path
out = sys.stdout

def answer(expression, namespace):
    try:
        value = eval(compile(expression, "<probe>", "eval"), namespace)
        if isinstance(value, (collections.abc.Iterator, range)):
            return ["iter", repr(list(itertools.islice(value, 100000)))]
        return ["value", repr(value)]
    except BaseException as exc:
        return ["raised", f"{type(exc).__name__}: {exc}"[:200]]

try:
    spec = importlib.util.spec_from_file_location("solution", sys.argv[1])
    solution = importlib.util.module_from_spec(spec)
    sys.modules["solution"] = solution
    spec.loader.exec_module(solution)
    namespace = dict(vars(solution))
except BaseException as exc:
    namespace = None
    print(f"import failed: {type(exc).__name__}: {exc}"[:500], file=sys.stderr)
answers = None
if namespace is not None:
    answers = []
    for test in probes:
        scope = dict(namespace)
        answers.append([answer(p, scope) for p in test])
out.write(f"{token} {json.dumps(answers)}\n")
out.flush()
"""


@dataclass
class CodeTestsReward:
    """``code_tests``: 1.0 when the model's code passes every test of the record (``partial``: the
    fraction passed), run in a fresh ``local`` sandbox with the limits given here."""

    # called with the run's services, to find the sandbox the trajectory worked in (solution_file)
    takes_context: ClassVar[bool] = True

    timeout_s: float = 10.0  # wall clock of the whole test run
    partial: bool = False
    limits: dict[str, Any] = field(
        default_factory=lambda: {
            "cpu_s": 10,
            "memory_mb": 512,
            "processes": 32,
            "work_mb": 16,
            "tmp_mb": 16,
            "output_bytes": 65536,
        }
    )
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
        if (
            isinstance(self.max_concurrency, bool)
            or not isinstance(self.max_concurrency, int)
            or self.max_concurrency < 1
        ):
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
            raise ValueError(
                f"code_tests: record {record.source}[{record.index}] needs metadata['tests'], "
                f"a non-empty list of Python statements; got {tests!r:.80}"
            )
        own = sandbox_of(trajectory, ctx)
        if self.solution_file is not None and own is None:
            raise ValueError(
                f"code_tests.solution_file={self.solution_file!r}: trajectory {trajectory.group_id}/"
                f"{trajectory.sample_index} of {record.source!r} worked in no sandbox; give its agent "
                f"one (command agent: sandbox: true, with services: [{{name: sandboxes}}])"
            )
        code = None if self.solution_file is not None else extract_code(trajectory.response_text)
        loop = asyncio.get_running_loop()
        gate = self._gates.setdefault(loop, asyncio.Semaphore(self.max_concurrency))
        async with gate:
            if own is not None:
                passed, total = await self._test(own.exec, own.put, code, tests, own=True)
            else:
                passed, total = await self.run(
                    code, tests, f"{record.source}-{trajectory.group_id}-{trajectory.sample_index}"
                )
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
            return await self._test(
                functools.partial(sandbox.exec, sandbox_id),
                functools.partial(sandbox.put, sandbox_id),
                code,
                tests,
                own=False,
            )
        finally:
            await sandbox.delete(sandbox_id)

    async def _test(self, exec_, put, code: str | None, tests: list[str], own: bool) -> tuple[int, int]:
        """Run the solution's side in a sandbox reached through ``exec_(cmd, timeout)`` and
        ``put(path, data)``, then judge its answers on this side; ``code`` None: the solution is
        :attr:`solution_file`, there already; ``own``: the sandbox is the trajectory's."""
        checks = [split_test(test) for test in tests]
        token = secrets.token_hex(16)
        folder = f"{_DIR}/{token[:12]}"  # its own: the trajectories of one episode share a sandbox
        solution = self.solution_file
        try:
            if code is not None:
                solution = f"{folder}/solution.py"
                await put(solution, code.encode("utf-8", "surrogatepass"))
            await put(f"{folder}/probes.json", json.dumps([c.probes for c in checks]).encode())
            await put(f"{folder}/harness.py", HARNESS.encode())
            await put(f"{folder}/token", f"{token}\n".encode())
        except ValueError:  # the agent left a symlink or a non-file where the harness goes: no score
            return 0, len(tests)
        except LookupError as exc:
            raise RewardInfraError(f"code_tests: sandbox gone: {exc}") from exc
        except OSError as exc:  # the trajectory's agent filled its own sandbox: its doing, scored 0
            if own:
                return 0, len(tests)
            raise RewardInfraError(f"code_tests: could not write the test files: {exc}") from exc
        # the token file is opened as standard input, then unlinked before the harness starts
        try:
            result = await exec_(
                f"{{ rm -f {folder}/token; {self.python} -I -B {folder}/harness.py "
                f"{shlex.quote(solution)} {folder}/probes.json; }} < {folder}/token",
                self.timeout_s,
            )
        except LookupError as exc:  # the sandbox went away (deadline passed, run ending)
            raise RewardInfraError(f"code_tests: sandbox gone: {exc}") from exc
        if result.error is not None and result.exit_code is None and result.signal is None:
            raise RewardInfraError(f"code_tests: the test run could not start: {result.error}")
        # the judge has a budget of its own: a solution that used up its time must not starve it
        verdicts = await judge(
            checks, _answers(result.stdout, token), timeout_s=self.timeout_s, memory_mb=max(256, self._limits.memory_mb)
        )
        return sum(passed for passed, _ in verdicts), len(tests)


def _answers(stdout: str, token: str) -> list | None:
    """The child's answers: the JSON after the token on its last line that starts with it."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(f"{token} "):
            try:
                return json.loads(line[len(token) + 1 :])
            except ValueError:
                return None
    return None
