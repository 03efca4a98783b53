"""Judging unit tests outside the process that runs the model's code.

A test is ``assert <condition>``. Run in the same interpreter as the solution, any test can be
forged by the solution: it can rebind ``builtins.exec``, patch the harness's counters through
``__main__``, print the harness's result line and exit, or register ``atexit``/signal/``__del__``
hooks that do the same later. So the condition is taken apart on the host, from the test's text
alone (:func:`split_test`):

- the **probes** are the parts of the condition that need the solution (``f(2)``,
  ``Solution().two_sum([2, 7], 9)``, ``f(3)[0]``): the sandboxed child evaluates only these and
  sends back their values as Python literal text;
- the **check** is the rest, with each probe replaced by a placeholder: the comparisons, the
  expected values and the judge-side helpers (``abs``, ``sorted``, ``math.isclose``...).

The check is evaluated by :data:`JUDGE`, a fresh interpreter on the host that never imports the
solution, over values parsed with :func:`ast.literal_eval` (numbers, strings, bytes, ``None``,
booleans, tuples, lists, sets, dicts): no object of the solution's making, so no ``__eq__`` that
always says yes, crosses over. The child never sees an expected value, so it can only pass a test
by producing the value the test expects. A child that answers nothing, or out of protocol, passes
no test. The judge runs each check in a forked process of its own under a CPU and memory bound,
since a check such as ``2 ** f(3)`` over a value the policy chose could otherwise run for ever:
such a check fails alone, and the tests not judged within the wall-clock budget fail.

The judge does not look inside comprehensions and lambdas: one that needs the solution is a probe
as a whole (``[f(i) for i in range(5)]``, whose list the child sends). What the split cannot take
apart is refused when a record is scored, in one line naming the test: a statement other than
``assert``, and a comparison inside such a probe (``all(f(i) == i * i for i in range(5))``), which
would show the child the expected values; compare whole lists instead
(``assert [f(i) for i in range(5)] == [0, 1, 4, 9, 16]``).
"""

from __future__ import annotations

import ast
import asyncio
import functools
import json
import sys
from dataclasses import dataclass

# names a check may use without the solution; any other free name belongs to the solution
JUDGE_BUILTINS = frozenset(
    {
        "abs",
        "all",
        "any",
        "ascii",
        "bin",
        "bool",
        "bytes",
        "callable",
        "chr",
        "complex",
        "dict",
        "divmod",
        "enumerate",
        "filter",
        "float",
        "format",
        "frozenset",
        "hash",
        "hex",
        "int",
        "isinstance",
        "iter",
        "len",
        "list",
        "map",
        "max",
        "min",
        "next",
        "oct",
        "ord",
        "pow",
        "range",
        "repr",
        "reversed",
        "round",
        "set",
        "slice",
        "sorted",
        "str",
        "sum",
        "tuple",
        "type",
        "zip",
        "Exception",
        "ValueError",
        "TypeError",
        "KeyError",
        "IndexError",
        "ZeroDivisionError",
    }
)
JUDGE_MODULES = frozenset({"math"})
_JUDGE_NAMES = JUDGE_BUILTINS | JUDGE_MODULES
_PROBE = "__probe_{}"

# the parts of a condition the judge evaluates itself, taking apart the operands below them
_STRUCTURE = (
    ast.Compare,
    ast.BoolOp,
    ast.UnaryOp,
    ast.BinOp,
    ast.IfExp,
    ast.Tuple,
    ast.List,
    ast.Set,
    ast.Dict,
    ast.JoinedStr,
    ast.FormattedValue,
    ast.keyword,
    ast.Starred,
)
_SCOPES = (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


@dataclass(frozen=True)
class SplitTest:
    """A test taken apart: ``probes`` for the child, ``check`` for the judge (``__probe_i`` names
    the value of ``probes[i]``)."""

    probes: tuple[str, ...]
    check: str


def _bound_inside(node: ast.AST) -> set[str]:
    """Names that comprehensions and lambdas within ``node`` bind for themselves."""
    bound: set[str] = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Lambda):
            args = sub.args
            bound.update(a.arg for a in args.posonlyargs + args.args + args.kwonlyargs)
            bound.update(a.arg for a in (args.vararg, args.kwarg) if a is not None)
        elif isinstance(sub, ast.comprehension):
            bound.update(n.id for n in ast.walk(sub.target) if isinstance(n, ast.Name))
    return bound


def _free_names(node: ast.AST) -> set[str]:
    used = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return used - _bound_inside(node)


def _judge_callee(func: ast.expr) -> bool:
    """``sorted(...)``, ``math.isclose(...)``: a helper the judge has, whatever its arguments."""
    if isinstance(func, ast.Name):
        return func.id in JUDGE_BUILTINS
    return isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in JUDGE_MODULES


class _Splitter:
    def __init__(self, test: str):
        self.test, self.probes = test, []

    def _refuse(self, why: str) -> ValueError:
        return ValueError(f"code_tests: test {self.test!r:.120}: {why}")

    def split(self, node: ast.expr) -> ast.expr:
        if not _free_names(node) - _JUDGE_NAMES:
            return node  # needs nothing of the solution: the judge evaluates it as written
        descend = isinstance(node, _STRUCTURE) or (isinstance(node, ast.Call) and _judge_callee(node.func))
        if descend:
            for name, value in ast.iter_fields(node):
                if isinstance(value, ast.expr) and not (isinstance(node, ast.Call) and name == "func"):
                    setattr(node, name, self.split(value))
                elif isinstance(value, list):
                    setattr(node, name, [self.split(v) if isinstance(v, (ast.expr, ast.keyword)) else v for v in value])
            return node
        return self._probe(node)

    def _probe(self, node: ast.expr) -> ast.expr:
        if any(isinstance(sub, ast.Compare) for sub in ast.walk(node)):
            raise self._refuse(
                f"the comparison inside `{ast.unparse(node):.60}` would run beside the solution, "
                "which could then forge it; compare whole values outside comprehensions and "
                "lambdas (`assert [f(i) for i in range(3)] == [...]`)"
            )
        self.probes.append(ast.unparse(node))
        return ast.Name(_PROBE.format(len(self.probes) - 1), ast.Load())


@functools.lru_cache(maxsize=4096)
def split_test(test: str) -> SplitTest:
    """``test`` (``assert <condition>[, message]``) as the child's probes and the judge's check;
    ``ValueError`` (one line naming the test) for what cannot be judged apart from the solution."""
    try:
        tree = ast.parse(test)
    except SyntaxError as exc:
        raise ValueError(f"code_tests: test {test!r:.120} is not valid Python: {exc.msg}") from None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assert):
        raise ValueError(
            f"code_tests: test {test!r:.120} must be one `assert <condition>` statement (e.g. `assert f(2) == 5`)"
        )
    condition = tree.body[0].test
    splitter = _Splitter(test)
    check = ast.fix_missing_locations(splitter.split(condition))
    return SplitTest(tuple(splitter.probes), ast.unparse(check))


# The judge: a fresh interpreter without site-packages (-I -S). Input: one JSON object
# {"tests": [{"check", "probes", "answers"}]}, where answers are the child's [kind, text] per probe,
# or null when the child gave none for that test. Each check runs in a forked process of its own
# under a CPU and memory bound (SIGXCPU ends even one long C call, such as a huge power), so one
# costly check fails itself alone. Output: one JSON line [passed, why] per test, as each is judged.
JUDGE = r"""
import ast, json, math, os, resource, sys
cpu_s, memory_mb = int(sys.argv[1]), int(sys.argv[2])
import builtins
SAFE = {name: getattr(builtins, name) for name in json.loads(sys.argv[3])}
FLOATS = {"nan": float("nan"), "inf": float("inf")}

def literal(text):
    tree = ast.parse(text, mode="eval")
    for node in ast.walk(tree):  # repr writes nan and inf as bare names
        for name, value in ast.iter_fields(node):
            if isinstance(value, ast.Name) and value.id in FLOATS:
                setattr(node, name, ast.Constant(FLOATS[value.id]))
    body = tree.body
    if isinstance(body, ast.Name) and body.id in FLOATS:
        return FLOATS[body.id]
    return ast.literal_eval(body)

def judge(test):
    answers = test["answers"]
    if not isinstance(answers, list) or len(answers) != test["probes"]:
        return [False, "no answer from the solution's process"]
    scope = {"__builtins__": SAFE, "math": math}
    for i, answer in enumerate(answers):
        if not (isinstance(answer, list) and len(answer) == 2 and all(isinstance(a, str) for a in answer)):
            return [False, "an answer out of protocol"]
        kind, text = answer
        if kind == "raised":
            return [False, f"raised {text[:200]}"]
        if kind not in ("value", "iter"):
            return [False, "an answer out of protocol"]
        try:
            value = literal(text)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError) as exc:
            return [False, f"a value that is not a Python literal ({type(exc).__name__}): {text[:80]}"]
        if kind == "iter":
            if not isinstance(value, list):
                return [False, "an answer out of protocol"]
            value = iter(value)
        scope[f"__probe_{i}"] = value
    return [bool(eval(compile(test["check"], "<check>", "eval"), scope)), ""]

def isolated(test):
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
        sys.setrecursionlimit(500)
        try:
            verdict = judge(test)
        except BaseException as exc:
            verdict = [False, f"{type(exc).__name__}: {exc}"[:300]]
        os.write(write, json.dumps(verdict).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        data = pipe.read()
    os.waitpid(pid, 0)
    return json.loads(data) if data else [False, f"the check ran past its bounds ({cpu_s} CPU s, {memory_mb} MiB)"]

for test in json.loads(sys.stdin.read())["tests"]:
    print(json.dumps(isolated(test)), flush=True)
"""


async def judge(
    checks: list[SplitTest], answers: list | None, *, timeout_s: float, cpu_s: int = 2, memory_mb: int = 1024
) -> list[tuple[bool, str]]:
    """``(passed, why)`` per test: each check over the child's ``answers`` (``answers[i]``: the
    ``[kind, text]`` of each probe of test ``i``; anything else fails that test), in the judge
    process, each check within ``cpu_s`` and ``memory_mb``; the tests not judged within
    ``timeout_s`` of wall clock fail."""
    if not isinstance(answers, list) or len(answers) != len(checks):
        answers = [None] * len(checks)
    payload = json.dumps(
        {"tests": [{"check": c.check, "probes": len(c.probes), "answers": a} for c, a in zip(checks, answers)]}
    ).encode()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-I",
        "-S",
        "-c",
        JUDGE,
        str(cpu_s),
        str(memory_mb),
        json.dumps(sorted(JUDGE_BUILTINS)),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    verdicts: list[tuple[bool, str]] = []
    try:
        async with asyncio.timeout(timeout_s):
            proc.stdin.write(payload)
            await proc.stdin.drain()
            proc.stdin.close()
            while len(verdicts) < len(checks) and (line := await proc.stdout.readline()):
                passed, why = json.loads(line)
                verdicts.append((passed is True, str(why)))
    except TimeoutError:
        pass
    except (ValueError, TypeError):  # not our judge's line: count nothing more from it
        pass
    finally:
        if proc.returncode is None:
            proc.kill()
            await asyncio.shield(proc.wait())
    missing = (False, f"not judged within {timeout_s:.3g} s")
    return verdicts + [missing] * (len(checks) - len(verdicts))
