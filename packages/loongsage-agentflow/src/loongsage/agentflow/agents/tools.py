"""Python tools an agent runs for the model: a calculator and a file reader confined to a folder.

Every tool takes the model's arguments as they came (a JSON object, usually) and returns a string
the model sees as the tool's result. Bad input, from a malformed call to a hostile expression or
a path that leaves the folder, is answered with a one-line ``error: ...`` string: the model wrote
it, so it is the model's to read, and neither an exception nor a hang may reach the agent.

``calculator`` evaluates arithmetic by walking the parsed expression (numbers, ``+ - * /``,
unary signs, parentheses) and nothing else: no ``eval``, no names, calls, attributes or powers.
Its input length and the size of every intermediate value are bounded, so no expression can
take long or grow large. ``read_file`` reads a text file inside one folder (the episode's own);
absolute paths, ``..`` and links that lead outside are refused.
"""

from __future__ import annotations

import ast
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MAX_EXPRESSION_CHARS = 200  # also bounds the nesting depth the parser is asked to handle
MAX_MAGNITUDE = 10**18  # every operand and intermediate value stays below this in absolute value
MAX_FILE_BYTES = 4096  # read_file returns at most this much of a file

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: _divide(a, b),
}
_SYMBOL = {
    ast.Pow: "**",
    ast.FloorDiv: "//",
    ast.Mod: "%",
    ast.MatMult: "@",
    ast.LShift: "<<",
    ast.RShift: ">>",
    ast.BitAnd: "&",
    ast.BitOr: "|",
    ast.BitXor: "^",
}


class ToolError(ValueError):
    """A tool's refusal; its message is what the model reads (after ``error: ``)."""


# ------------------------------------------------------------------------------------ calculator
def _divide(a: Any, b: Any) -> Any:
    if b == 0:
        raise ToolError("division by zero")
    if isinstance(a, int) and isinstance(b, int) and a % b == 0:
        return a // b  # exact: no float rounding of large quotients
    return a / b


def _checked(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        raise ToolError("the result is not a finite number")
    if abs(value) >= MAX_MAGNITUDE:
        raise ToolError(f"a value exceeds {MAX_MAGNITUDE:.0e} in magnitude")
    return value


def _evaluate(node: ast.AST) -> Any:
    if isinstance(node, ast.Constant):
        # bool is an int subclass; complex and strings are numbers or text the calculator does not do
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise ToolError(f"unsupported constant {node.value!r}")
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _evaluate(node.operand)
        return value if isinstance(node.op, ast.UAdd) else -value
    if isinstance(node, ast.BinOp):
        op = _BINARY.get(type(node.op))
        if op is None:
            raise ToolError(
                f"unsupported operator {_SYMBOL.get(type(node.op), type(node.op).__name__)}"
                " (allowed: + - * / and parentheses)"
            )
        return _checked(op(_evaluate(node.left), _evaluate(node.right)))
    if isinstance(node, ast.Name):
        raise ToolError(f"unknown name {node.id!r} (only numbers are allowed)")
    raise ToolError(f"unsupported syntax: {type(node).__name__} (allowed: numbers, + - * / and parentheses)")


def format_number(value: Any) -> str:
    """An integer as its digits; a float with up to 12 significant digits, integral ones without ``.0``."""
    if isinstance(value, int):
        return str(value)
    if value == int(value):
        return str(int(value))
    return f"{value:.12g}"


def calculate(expression: str) -> str:
    """The value of an arithmetic expression as text; raises :class:`ToolError` on anything else."""
    if not isinstance(expression, str):
        raise ToolError(f"expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    if not expression.strip():
        raise ToolError("empty expression")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise ToolError(f"cannot parse {expression.strip()[:40]!r} as arithmetic") from None
    try:
        return format_number(_evaluate(tree.body))
    except RecursionError:
        raise ToolError("expression nested too deeply") from None
    except OverflowError:
        raise ToolError("the result is too large") from None


def calculator(expression: str) -> str:
    """The ``calculator`` tool: the value, or an error string."""
    try:
        return calculate(expression)
    except ToolError as exc:
        return f"error: {exc}"


# ------------------------------------------------------------------------------------- read_file
def read_inside(root: str | Path, path: str) -> str:
    """Text of the file ``path`` relative to ``root`` (at most :data:`MAX_FILE_BYTES`); raises
    :class:`ToolError` for a path that is absolute, climbs with ``..``, or resolves outside ``root``."""
    if not isinstance(path, str) or not path.strip():
        raise ToolError("path must be a non-empty string")
    if "\0" in path:
        raise ToolError("path contains a NUL character")
    rel = Path(path.strip())
    if rel.is_absolute() or path.strip().startswith(("/", "\\", "~")):
        raise ToolError(f"{path!r}: absolute paths are not allowed (paths are relative to the working directory)")
    if ".." in rel.parts or ".." in Path(path.replace("\\", "/")).parts:
        raise ToolError(f"{path!r}: '..' is not allowed")
    base = Path(root).resolve()
    target = (base / rel).resolve()  # follows links: one pointing outside is caught below
    if target != base and base not in target.parents:
        raise ToolError(f"{path!r}: outside the working directory")
    if not target.exists():
        raise ToolError(f"{path!r}: no such file")
    if not target.is_file():
        raise ToolError(f"{path!r}: not a regular file")
    with open(target, "rb") as f:
        data = f.read(MAX_FILE_BYTES + 1)
    text = data[:MAX_FILE_BYTES].decode("utf-8", errors="replace")
    return text + ("\n[truncated]" if len(data) > MAX_FILE_BYTES else "")


# ------------------------------------------------------------------------------------ the schemas
CALCULATOR_SCHEMA = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression: numbers, + - * / and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "the expression to evaluate"}},
            "required": ["expression"],
        },
    },
}
READ_FILE_SCHEMA = {
    "type": "function",
    "function": {
        "name": "read_file",
        "description": "Read a text file of the working directory.",
        "parameters": {
            "type": "object",
            "properties": {"path": {"type": "string", "description": "a relative path"}},
            "required": ["path"],
        },
    },
}
SCHEMAS = {"calculator": CALCULATOR_SCHEMA, "read_file": READ_FILE_SCHEMA}


def schemas(names: list[str] | tuple[str, ...]) -> list[dict[str, Any]]:
    """The OpenAI function schemas of ``names``, in that order (the order the template renders)."""
    unknown = [n for n in names if n not in SCHEMAS]
    if unknown:
        raise ValueError(f"tools: unknown tool {unknown[0]!r}; allowed: {', '.join(SCHEMAS)}")
    if len(set(names)) != len(names):
        raise ValueError(f"tools: {list(names)} names a tool twice")
    return [SCHEMAS[n] for n in names]


@dataclass
class ToolBox:
    """The tools of one episode; ``workdir`` is the folder ``read_file`` is confined to."""

    names: tuple[str, ...] = ("calculator",)
    workdir: str | Path | None = None
    calls: int = 0
    errors: int = 0
    used: dict[str, int] = field(default_factory=dict)

    def execute(self, name: str, arguments: Any) -> str:
        """Run one call of the model (``arguments``: its JSON text or an object); never raises."""
        self.calls += 1
        try:
            result = self._run(name, arguments)
            self.used[name] = self.used.get(name, 0) + 1
            return result
        except ToolError as exc:
            self.errors += 1
            return f"error: {exc}"

    def _run(self, name: str, arguments: Any) -> str:
        if name not in self.names:
            raise ToolError(f"unknown tool {str(name)[:40]!r}; available: {', '.join(self.names)}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except (ValueError, RecursionError):
                raise ToolError("arguments are not valid JSON") from None
        if not isinstance(arguments, dict):
            raise ToolError("arguments must be a JSON object")
        expected = set(SCHEMAS[name]["function"]["parameters"]["required"])
        if set(arguments) != expected:
            raise ToolError(f"{name} takes exactly the argument(s) {', '.join(sorted(expected))}")
        if name == "calculator":
            return calculate(arguments["expression"])
        if self.workdir is None:
            raise ToolError("read_file: this episode has no working directory")
        return read_inside(self.workdir, arguments["path"])


def write_files(root: str | Path, files: dict[str, str]) -> None:
    """Put a record's files (relative path -> text) into an episode's folder."""
    for rel, text in files.items():
        target = Path(root) / rel
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise ValueError(f"record file {rel!r}: must be a relative path without '..'")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        os.chmod(target, 0o444)
