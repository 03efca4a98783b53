"""The agent's tools: arithmetic by AST walk (hostile input is an error string, never an exception or a
hang), and file reads confined to the episode's folder."""

from __future__ import annotations

import json
import os
import time

import pytest

from loongsage.agentflow.agents.tools import (
    CALCULATOR_SCHEMA,
    MAX_FILE_BYTES,
    READ_FILE_SCHEMA,
    ToolBox,
    calculator,
    read_inside,
    schemas,
    write_files,
)


@pytest.mark.parametrize(
    "expression, value",
    [
        ("347*29+18", "10081"),
        ("2+3*4", "14"),
        ("(2+3)*4", "20"),
        ("7/2", "3.5"),
        ("6/3", "2"),
        ("-5+2", "-3"),
        ("+4", "4"),
        ("1.5*2", "3"),
        ("  12 * ( 3 + 4 )  ", "84"),
        ("10-20", "-10"),
        ("999999999*999999999", "999999998000000001"),
        ("1/3", "0.333333333333"),
        ("123456789012*1000", "123456789012000"),
    ],
)
def test_the_calculator_evaluates_arithmetic(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize(
    "expression, reason",
    [
        ("9**9**9**9", "unsupported operator **"),
        ("2**100000", "unsupported operator **"),
        ("1e308*10", "exceeds"),
        ("1e17*1e17", "exceeds"),
        ("1e999", "not a finite number"),
        ("9" * 150, "exceeds"),
        ("999999999*999999999*999999999", "exceeds"),
        ("__import__('os').system('echo hi')", "unsupported syntax"),
        ("os.system", "unsupported syntax"),
        ("().__class__.__bases__[0].__subclasses__()", "unsupported syntax"),
        ("x+1", "unknown name 'x'"),
        ("open('/etc/passwd')", "unsupported syntax"),
        ("[1, 2]", "unsupported syntax"),
        ("lambda: 1", "unsupported syntax"),
        ("'a'*10", "unsupported constant"),
        ("True+1", "unsupported constant"),
        ("1j*2", "unsupported constant"),
        ("1/0", "division by zero"),
        ("5//2", "unsupported operator //"),
        ("5%2", "unsupported operator %"),
        ("1 if 1 else 2", "unsupported syntax"),
        ("(" * 100 + "1" + ")" * 100, ""),  # too long, or parsed and computed: never an exception
        ("(" * 5000 + "1" + ")" * 5000, "longer than"),
        ("-" * 199 + "1", ""),
        ("1+", "cannot parse"),
        ("", "empty expression"),
        ("1\x00+2", "cannot parse"),
        ("a = 1", "cannot parse"),
    ],
)
def test_hostile_expressions_get_an_error_string_at_once(expression, reason):
    start = time.perf_counter()
    result = calculator(expression)
    assert time.perf_counter() - start < 1.0
    assert isinstance(result, str) and "\n" not in result
    if reason:
        assert result.startswith("error: ") and reason in result, result
    else:
        assert result.startswith("error: ") or result.lstrip("-").isdigit(), result


def test_the_calculator_refuses_non_strings():
    assert calculator(12) == "error: expression must be a string, got int"  # type: ignore[arg-type]


def test_read_file_reads_inside_its_folder_and_refuses_escapes(tmp_path):
    root = tmp_path / "episode"
    write_files(root, {"note.txt": "18", "sub/data.txt": "hello"})
    (tmp_path / "secret.txt").write_text("top secret")
    os.symlink(tmp_path / "secret.txt", root / "link.txt")
    os.symlink(tmp_path, root / "up")
    os.mkfifo(root / "pipe")
    assert read_inside(root, "note.txt") == "18"
    assert read_inside(root, "./sub/data.txt") == "hello"
    box = ToolBox(("calculator", "read_file"), root)
    for path, reason in [
        ("../secret.txt", "'..' is not allowed"),
        ("sub/../../secret.txt", "'..' is not allowed"),
        (str(tmp_path / "secret.txt"), "absolute paths"),
        ("/etc/passwd", "absolute paths"),
        ("~/x", "absolute paths"),
        ("link.txt", "outside the working directory"),
        ("up/secret.txt", "outside the working directory"),
        ("missing.txt", "no such file"),
        ("sub", "not a regular file"),
        ("pipe", "not a regular file"),
        ("a\x00b", "NUL"),
        ("..\\secret.txt", "'..' is not allowed"),
        ("", "non-empty"),
    ]:
        result = box.execute("read_file", json.dumps({"path": path}))
        assert result.startswith("error: ") and reason in result, (path, result)
        assert "top secret" not in result
    assert box.errors == 13 and box.used == {}


def test_read_file_truncates_large_files(tmp_path):
    (tmp_path / "big.txt").write_text("x" * (MAX_FILE_BYTES + 10))
    text = read_inside(tmp_path, "big.txt")
    assert text == "x" * MAX_FILE_BYTES + "\n[truncated]"


def test_the_toolbox_answers_every_bad_call_with_an_error_string(tmp_path):
    box = ToolBox(("calculator",), None)
    assert box.execute("calculator", '{"expression": "2*21"}') == "42"
    assert box.execute("calculator", {"expression": "2*21"}) == "42"
    for name, arguments, reason in [
        ("shell", '{"cmd": "ls"}', "unknown tool 'shell'"),
        ("read_file", '{"path": "x"}', "unknown tool 'read_file'"),  # not offered in this episode
        ("calculator", "{not json", "not valid JSON"),
        ("calculator", "[1, 2]", "must be a JSON object"),
        ("calculator", '{"expr": "1"}', "exactly the argument(s) expression"),
        ("calculator", '{"expression": "1", "x": 2}', "exactly the argument(s) expression"),
        ("calculator", '{"expression": 5}', "must be a string"),
        ("calculator", "[" * 100000, "not valid JSON"),
    ]:
        result = box.execute(name, arguments)
        assert result.startswith("error: ") and reason in result, (name, arguments, result)
    assert (box.calls, box.errors, box.used) == (10, 8, {"calculator": 2})
    assert ToolBox(("read_file",), None).execute("read_file", '{"path": "a"}').startswith("error: read_file: this")


def test_schemas_are_openai_function_tools():
    assert schemas(["calculator", "read_file"]) == [CALCULATOR_SCHEMA, READ_FILE_SCHEMA]
    for schema in (CALCULATOR_SCHEMA, READ_FILE_SCHEMA):
        fn = schema["function"]
        assert schema["type"] == "function" and fn["parameters"]["type"] == "object"
        assert set(fn["parameters"]["required"]) == set(fn["parameters"]["properties"])
    with pytest.raises(ValueError, match="unknown tool 'shell'"):
        schemas(["shell"])
    with pytest.raises(ValueError, match="twice"):
        schemas(["calculator", "calculator"])
