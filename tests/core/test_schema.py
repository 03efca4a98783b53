"""Typed validation of plain values (config and plugin params) and of dataset rows."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pytest

from loongsage.core.data import FileReader, SourceCursor
from loongsage.core.schema import build_dataclass, check_params, coerce, describe_params
from loongsage.core.types import BadRecordError, ConfigError


def one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text, f"error spans several lines: {text!r}"
    return text


# ----------------------------------------------------------------------------- coerce
@pytest.mark.parametrize(
    ("value", "tp", "expected"),
    [
        (3, float, 3.0),
        (2.5, float, 2.5),
        (True, bool, True),
        ("x", str, "x"),
        (None, int | None, None),
        (4, int | None, 4),
        ("skip", Literal["skip", "error"], "skip"),
        ([1, 2], list[float], [1.0, 2.0]),
        ((1, 2), list[int], [1, 2]),
        ({"a": 1}, dict[str, float], {"a": 1.0}),
        ({"anything": [object]}, Any, {"anything": [object]}),
        ({"name": "x"}, dict[str, Any], {"name": "x"}),
    ],
)
def test_coerce_accepts(value, tp, expected) -> None:
    out = coerce(value, tp, "k")
    assert out == expected and type(out) is type(expected)


@pytest.mark.parametrize(
    ("value", "tp", "expected"),
    [
        (True, int, "k: got True; expected an integer"),
        (True, float, "k: got True; expected a number"),
        (1.0, int, "k: got 1.0; expected an integer"),
        ("1", int, "k: got '1'; expected an integer"),
        (1, bool, "k: got 1; expected true or false"),
        (1, str, "k: got 1; expected a string"),
        ("maybe", Literal["skip", "error"], "k: got 'maybe'; allowed: 'skip', 'error'"),
        ("x", int | None, "k: got 'x'; expected an integer"),
        ("x", list[int], "k: got 'x'; expected a list"),
        ([1, "b"], list[int], "k[1]: got 'b'; expected an integer"),
        ({"a": "b"}, dict[str, float], "k.a: got 'b'; expected a number"),
        ([1], dict[str, int], "k: got [1]; expected a mapping"),
    ],
)
def test_coerce_rejects_with_path(value, tp, expected) -> None:
    with pytest.raises(ConfigError) as exc:
        coerce(value, tp, "k")
    assert one_line(exc) == expected


def test_long_values_are_shortened() -> None:
    with pytest.raises(ConfigError) as exc:
        coerce("y" * 500, int, "k")
    msg = one_line(exc)
    assert len(msg) < 120 and msg.endswith("...; expected an integer")


# ----------------------------------------------------------------------------- dataclasses and factories
@dataclass
class Inner:
    size: int = 1
    mode: Literal["a", "b"] = "a"


@dataclass
class Outer:
    name: str
    inner: Inner = field(default_factory=Inner)
    items: list[Inner] = field(default_factory=list)
    ratio: float = 0.5

    def __post_init__(self) -> None:
        if not 0 <= self.ratio <= 1:
            raise ValueError(f"ratio={self.ratio}: must be in [0, 1]\nsecond line that must not show")


def test_build_dataclass_nested() -> None:
    out = build_dataclass(Outer, {"name": "n", "inner": {"size": 3}, "items": [{"mode": "b"}], "ratio": 1}, "cfg")
    assert out == Outer(name="n", inner=Inner(size=3), items=[Inner(mode="b")], ratio=1.0)
    assert isinstance(out.ratio, float)


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({}, "cfg.name: missing required key (type str)"),
        ({"name": "n", "extra": 1, "zzz": 2}, "cfg.extra: unknown key; allowed: inner, items, name, ratio"),
        ({"name": "n", "inner": {"size": "big"}}, "cfg.inner.size: got 'big'; expected an integer"),
        ({"name": "n", "inner": 3}, "cfg.inner: got 3; expected a mapping of Inner keys"),
        ({"name": "n", "items": [{}, {"mode": "c"}]}, "cfg.items[1].mode: got 'c'; allowed: 'a', 'b'"),
        ({"name": "n", "items": [{"sise": 1}]}, "cfg.items[0].sise: unknown key; allowed: mode, size"),
        ({"name": "n", "ratio": 2}, "cfg.ratio=2.0: must be in [0, 1]"),
    ],
)
def test_build_dataclass_errors(values, expected) -> None:
    with pytest.raises(ConfigError) as exc:
        build_dataclass(Outer, values, "cfg")
    assert one_line(exc) == expected


def plain_factory(path: str, *args: Any, retries: int = 3, label: str | None = None, **kwargs: Any) -> dict:
    return {"path": path, "retries": retries, "label": label}


class ClassFactory:
    def __init__(self, width: int, scale: float = 1.0) -> None:
        self.width, self.scale = width, scale


def test_check_params_on_functions_and_classes() -> None:
    assert check_params(plain_factory, {"path": "p", "retries": 1}, "x.params") == {"path": "p", "retries": 1}
    with pytest.raises(ConfigError) as exc:
        check_params(plain_factory, {"path": "p", "kwargs": 1}, "x.params")
    assert one_line(exc) == "x.params.kwargs: unknown key; allowed: label, path, retries"  # no *args/**kwargs
    with pytest.raises(ConfigError) as exc:
        check_params(plain_factory, {}, "x.params")
    assert one_line(exc) == "x.params.path: missing required key (type str)"
    assert check_params(ClassFactory, {"width": 2, "scale": 3}, "y") == {"width": 2, "scale": 3.0}
    with pytest.raises(ConfigError) as exc:
        check_params(ClassFactory, {"width": 2.5}, "y")
    assert one_line(exc) == "y.width: got 2.5; expected an integer"
    # a parameter the framework supplies is neither required nor settable
    assert check_params(ClassFactory, {}, "y", skip=("width",)) == {}
    with pytest.raises(ConfigError) as exc:
        check_params(ClassFactory, {"width": 1}, "y", skip=("width",))
    assert one_line(exc) == "y.width: unknown key; allowed: scale"


def test_check_params_without_parameters() -> None:
    @dataclass(frozen=True)
    class NoParams:
        pass

    assert check_params(NoParams, {}, "z") == {}
    with pytest.raises(ConfigError) as exc:
        check_params(NoParams, {"a": 1}, "z")
    assert one_line(exc) == "z.a: unknown key; allowed: (none)"


def test_unresolvable_annotations_fall_back_to_no_type_check() -> None:
    def factory(n: NotDefinedAnywhere = 1):  # noqa: F821
        return n

    assert check_params(factory, {"n": "anything"}, "w") == {"n": "anything"}


def test_describe_params() -> None:
    assert describe_params(Inner) == "size: int = 1, mode: 'a' | 'b' = 'a'"
    assert describe_params(plain_factory) == "path: str, retries: int = 3, label: str | null = None"
    assert describe_params(Outer).startswith("name: str, inner: Inner = Inner(size=1, mode='a')")


# ----------------------------------------------------------------------------- dataset rows
GOOD = [
    {"prompt": "1+1=", "label": "2"},
    {"prompt": [{"role": "user", "content": "2+2="}], "label": "4", "difficulty": 1},
    *({"prompt": f"{i}+{i}=", "label": str(2 * i)} for i in range(3, 8)),
]
BAD = {  # line index -> (raw line, what the error says)
    1: ('{"prompt": "oops", "label": ', "not valid JSON"),
    2: (json.dumps({"question": "5+5=", "label": "10"}), "missing key 'prompt'; present: label, question"),
    3: (json.dumps({"prompt": "", "label": "0"}), "'prompt' must be a non-empty string"),
    5: (json.dumps({"prompt": [{"role": "user"}], "label": "0"}), "'prompt' must be a non-empty string"),
    6: (json.dumps(["a", "list"]), "expected a JSON object, got list"),
    7: (json.dumps({"prompt": "7+0="}), "missing key 'label'"),
}


@pytest.fixture
def rows_file(tmp_path) -> Path:
    lines, good = [], iter(GOOD)
    for i in range(len(GOOD) + len(BAD)):
        lines.append(BAD[i][0] if i in BAD else json.dumps(next(good)))
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(lines[:4]) + "\n\n" + "\n".join(lines[4:]) + "\n")  # a blank line is no row
    return path


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def data_log():
    """Warnings of the data module, on its own logger (the launcher may stop propagation to root)."""
    logger = logging.getLogger("loongsage.core.data")
    handler, level = _Collect(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


def test_file_reader_reports_each_bad_row_by_index(rows_file) -> None:
    reader = FileReader(str(rows_file))
    assert len(reader) == len(GOOD) + len(BAD)
    for index, (_, what) in BAD.items():
        with pytest.raises(BadRecordError) as exc:
            reader[index]
        msg = str(exc.value)
        assert "\n" not in msg and msg.startswith(f"{rows_file} row {index}: ") and what in msg, msg
    good = [reader[i] for i in range(len(reader)) if i not in BAD]
    assert [r.label for r in good] == [g["label"] for g in GOOD]
    assert [r.index for r in good] == [0, 4, 8, 9, 10, 11, 12]
    assert good[1].prompt == GOOD[1]["prompt"] and good[1].metadata == {"difficulty": 1}


def test_cursor_skips_bad_rows_with_a_warning_each(rows_file, data_log) -> None:
    cursor = SourceCursor(name="rows", source=FileReader(str(rows_file)), seed=3, on_bad_row="skip")
    records = cursor.take(len(GOOD) + 1)  # more than one epoch's worth of good rows: every row is visited
    assert len(records) == len(GOOD) + 1
    assert {r.label for r in records} == {g["label"] for g in GOOD}
    assert len({r.index for r in records[: len(GOOD)]}) == len(GOOD)  # one epoch: each good row once
    assert all(r.source == "rows" for r in records)
    assert sorted(cursor.skipped) == sorted(BAD)
    warnings = [r.getMessage() for r in data_log.records if r.levelno == logging.WARNING]
    assert len(warnings) == len(BAD), warnings  # once per bad row, not once per epoch
    for index, (_, what) in BAD.items():
        (line,) = [w for w in warnings if f"skipped row {index}:" in w]
        assert line.startswith("data source rows: skipped row") and what in line


def test_cursor_keeps_going_while_one_valid_row_exists(tmp_path, data_log) -> None:
    """Two of three rows bad: each epoch yields the one good row; the source is not exhausted."""
    path = tmp_path / "mostly_bad.jsonl"
    rows = ["not json", json.dumps({"prompt": "1+1=", "label": "2"}), json.dumps({"label": "x"})]
    path.write_text("\n".join(rows) + "\n")
    cursor = SourceCursor(name="mostly_bad", source=FileReader(str(path)), seed=0, on_bad_row="skip")
    records = cursor.take(4)  # four epochs, two misses each
    assert [r.index for r in records] == [1, 1, 1, 1] and sorted(cursor.skipped) == [0, 2]


def test_cursor_error_policy_names_the_row(tmp_path) -> None:
    path = tmp_path / "one_bad.jsonl"
    rows = [json.dumps({"prompt": f"{i}+0=", "label": str(i)}) for i in range(6)]
    rows[4] = json.dumps({"prompt": "", "label": "4"})
    path.write_text("\n".join(rows) + "\n")
    cursor = SourceCursor(name="one_bad", source=FileReader(str(path)), seed=0, on_bad_row="error")
    with pytest.raises(BadRecordError) as exc:
        cursor.take(6)
    msg = str(exc.value)
    assert "\n" not in msg and f"{path} row 4: 'prompt' must be a non-empty string" in msg
    assert cursor.skipped == []


def test_cursor_with_no_valid_row_stops(tmp_path, data_log) -> None:
    path = tmp_path / "all_bad.jsonl"
    path.write_text("not json\n" + json.dumps({"label": "1"}) + "\n")
    cursor = SourceCursor(name="all_bad", source=FileReader(str(path)), seed=0, on_bad_row="skip")
    with pytest.raises(BadRecordError, match="data source 'all_bad': no valid row left"):
        cursor.take(1)


def test_file_reader_rejects_bad_paths(tmp_path) -> None:
    with pytest.raises(ValueError, match="file not found"):
        FileReader(str(tmp_path / "missing.jsonl"))
    (tmp_path / "rows.csv").write_text("prompt,label\n")
    with pytest.raises(ValueError, match=r"unsupported file type '\.csv'; allowed: \.jsonl, \.parquet"):
        FileReader(str(tmp_path / "rows.csv"))
