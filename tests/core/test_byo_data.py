"""A data set of one's own through the ``file`` reader: JSON Lines, Parquet and JSON give the same
records; chat rows, other column names, nested answers, a system prompt and a prompt format are
mapped by the reader's params; malformed rows are named by file and row in one line, and a run
either stops before its first step (``on_bad_row: error``) or leaves them out, counted (``skip``).

Every file is written here; nothing is downloaded, and nothing starts Ray.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from loongsage.core.config import load_config
from loongsage.core.data import PROMPT_RULE, FileReader, Mixer, SourceCursor
from loongsage.core.types import BadRecordError, ConfigError

# A typical math set, as the verl/DAPO layout has it: chat messages, the answer nested.
MATH_ROWS: list[dict[str, Any]] = [
    {
        "prompt": [{"role": "user", "content": "What is 3 + 4?"}],
        "reward_model": {"ground_truth": "7", "style": "rule"},
        "source": "arith",
    },
    {
        "prompt": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Solve x + 2 = 5."},
        ],
        "reward_model": {"ground_truth": "3", "style": "rule"},
        "source": "algebra",
        "level": 2,  # only this row has it: Parquet gives the others a null, which counts as absent
    },
    {
        "prompt": [{"role": "user", "content": "Halve 10."}],
        "reward_model": {"ground_truth": "5", "style": "rule"},
        "source": "arith",
    },
]
NESTED = {"prompt_key": "prompt", "label_key": "reward_model.ground_truth"}


def one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text, f"error spans several lines: {text!r}"
    return text


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    """A column for every field of any row, null where a row has none (as pandas and datasets write them)."""
    columns = {key: [row.get(key) for row in rows] for row in rows for key in row}
    pq.write_table(pa.table(columns), path)
    return path


def records(reader: FileReader) -> list[Any]:
    return [reader[i] for i in range(len(reader))]


@pytest.fixture
def data_log():
    """Records of the data module's logger, every level (the launcher may stop propagation to root)."""
    logger = logging.getLogger("loongsage.core.data")
    seen: list[logging.LogRecord] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record)

    handler, level = Collect(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield seen
    logger.removeHandler(handler)
    logger.setLevel(level)


# ----------------------------------------------------------------------------- one set, three file types
def test_jsonl_parquet_and_json_with_the_same_rows_give_the_same_records(tmp_path) -> None:
    jsonl = write_jsonl(tmp_path / "math.jsonl", MATH_ROWS)
    parquet = write_parquet(tmp_path / "math.parquet", MATH_ROWS)
    array = tmp_path / "math.json"
    array.write_text(json.dumps(MATH_ROWS, indent=2))
    from_jsonl = records(FileReader(str(jsonl), **NESTED))
    assert records(FileReader(str(parquet), **NESTED)) == from_jsonl
    assert records(FileReader(str(array), **NESTED)) == from_jsonl
    assert [r.label for r in from_jsonl] == ["7", "3", "5"]
    assert [r.index for r in from_jsonl] == [0, 1, 2]
    assert from_jsonl[1].prompt == MATH_ROWS[1]["prompt"]
    assert from_jsonl[1].metadata == {
        "reward_model": {"ground_truth": "3", "style": "rule"},
        "source": "algebra",
        "level": 2,
    }
    assert "level" not in from_jsonl[0].metadata  # not a null that JSON Lines never had


def test_flat_rows_with_numbers_read_alike_from_jsonl_and_parquet(tmp_path) -> None:
    rows = [{"question": f"{i} * 3 = ?", "answer": i * 3, "weight": 0.5 + i} for i in range(4)]
    mapping = {"prompt_key": "question", "label_key": "answer"}
    from_jsonl = records(FileReader(str(write_jsonl(tmp_path / "flat.jsonl", rows)), **mapping))
    assert records(FileReader(str(write_parquet(tmp_path / "flat.parquet", rows)), **mapping)) == from_jsonl
    assert [(r.prompt, r.label, r.metadata) for r in from_jsonl[:2]] == [
        ("0 * 3 = ?", 0, {"weight": 0.5}),
        ("1 * 3 = ?", 3, {"weight": 1.5}),
    ]


def test_a_json_file_of_json_lines_is_read_as_json_lines(tmp_path) -> None:
    rows = [{"prompt": "1+1=", "label": "2"}, {"prompt": "2+2=", "label": "4"}]
    reader = FileReader(str(write_jsonl(tmp_path / "published_as.json", rows)))
    assert [(r.prompt, r.label) for r in records(reader)] == [("1+1=", "2"), ("2+2=", "4")]


def test_a_byte_order_mark_and_blank_lines_are_not_rows(tmp_path) -> None:
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b'{"prompt": "a", "label": "1"}\n\n  \n{"prompt": "b", "label": "2"}\n')
    assert [(r.index, r.prompt) for r in records(FileReader(str(path)))] == [(0, "a"), (1, "b")]


# ----------------------------------------------------------------------------- mapping
def test_chat_rows_under_a_messages_key(tmp_path) -> None:
    rows = [
        {"messages": [{"role": "user", "content": "What is 6 * 7?"}], "answer": "42"},
        {"messages": [{"role": "user", "content": "And 5 * 5?", "name": "asker"}], "answer": "25"},
    ]
    reader = FileReader(str(write_jsonl(tmp_path / "chat.jsonl", rows)), prompt_key="messages", label_key="answer")
    assert [(r.prompt, r.label, r.metadata) for r in records(reader)] == [
        (rows[0]["messages"], "42", {}),
        (rows[1]["messages"], "25", {}),  # a message's other fields (name) are kept
    ]


def test_a_prompt_format_wraps_text_and_the_last_user_message(tmp_path) -> None:
    fmt = "{prompt}\nPut the final answer in \\boxed{}."
    text = FileReader(str(write_jsonl(tmp_path / "text.jsonl", [{"prompt": "1+1?", "label": "2"}])), prompt_format=fmt)
    assert text[0].prompt == "1+1?\nPut the final answer in \\boxed{}."  # braces kept: no str.format
    chat = FileReader(str(write_jsonl(tmp_path / "chat.jsonl", MATH_ROWS)), prompt_format=fmt, **NESTED)
    assert chat[1].prompt == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Solve x + 2 = 5.\nPut the final answer in \\boxed{}."},
    ]
    assert MATH_ROWS[1]["prompt"][1]["content"] == "Solve x + 2 = 5."  # the rows read are not changed


def test_a_system_prompt_goes_first_where_a_row_has_none(tmp_path) -> None:
    text = write_jsonl(tmp_path / "text.jsonl", [{"prompt": "1+1?", "label": "2"}])
    assert FileReader(str(text), system_prompt="Think step by step.")[0].prompt == [
        {"role": "system", "content": "Think step by step."},
        {"role": "user", "content": "1+1?"},
    ]
    chat = FileReader(str(write_jsonl(tmp_path / "chat.jsonl", MATH_ROWS)), system_prompt="Think.", **NESTED)
    assert [m["role"] for m in chat[0].prompt] == ["system", "user"] and chat[0].prompt[0]["content"] == "Think."
    assert chat[1].prompt[0] == {"role": "system", "content": "Be brief."}  # the row's own system message stays


def test_no_label_key_for_rows_without_answers(tmp_path) -> None:
    reader = FileReader(
        str(write_jsonl(tmp_path / "tasks.jsonl", [{"prompt": "Write f.", "tests": ["f()"]}])), label_key=None
    )
    assert (reader[0].label, reader[0].metadata) == (None, {"tests": ["f()"]})


@pytest.mark.parametrize(
    ("param", "expected"),
    [
        (
            "prompt_format='Answer briefly.'",
            "prompt_format='Answer briefly.': must hold {prompt}, where each row's prompt goes",
        ),
        ("system_prompt=''", "system_prompt='': must be a non-empty string, or null for none"),
        ("prompt_key=''", "prompt_key='': must name a field of the rows (a.b for a nested one)"),
    ],
)
def test_a_bad_mapping_param_is_refused_naming_the_key(tmp_path, param, expected) -> None:
    data = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "1+1?", "label": "2"}])
    reader = f"data_sources.0.reader={{name: file, params: {{path: {data}}}}}"
    with pytest.raises(ConfigError) as exc:
        load_config("tiny/grpo_arith_cpu", [reader, f"data_sources.0.reader.params.{param}"])
    assert one_line(exc).startswith(f"data_sources[0].reader.params.{expected}")


# ----------------------------------------------------------------------------- malformed rows
BAD_LINES = [  # (raw line, what the reader says of it)
    (json.dumps({"prompt": "1+1?", "label": "2"}), None),
    ('{"prompt": "2+2?", "label": ', "not valid JSON (Expecting value: column 28)"),
    (json.dumps({"question": "3+3?", "label": "6"}), "missing key 'prompt'; present: label, question"),
    (
        json.dumps({"prompt": 44, "label": "8"}),
        "'prompt' must be a non-empty string or a list of {role, content} messages; got int",
    ),
    (
        json.dumps({"prompt": [{"role": "user", "content": ["a", "part"]}], "label": "1"}),
        "'prompt' must be a non-empty string or a list of {role, content} messages; message 0 has no string 'content'",
    ),
    (json.dumps({"prompt": "5+5?", "label": None}), "missing key 'label'; present: prompt"),
    (json.dumps({"prompt": "6+6?", "label": " "}), "'label' is empty; a label is the answer the reward checks"),
    (json.dumps(["a", "list"]), "expected a JSON object, got list"),
    (json.dumps({"prompt": "7+7?", "label": "14"}), None),
]


@pytest.fixture
def bad_file(tmp_path) -> Path:
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(line + "\n" for line, _ in BAD_LINES))
    return path


def test_each_malformed_row_is_named_by_file_and_row_in_one_line(bad_file) -> None:
    reader = FileReader(str(bad_file))
    assert len(reader) == len(BAD_LINES)
    expected = {i: f"{bad_file} row {i}: {what}" for i, (_, what) in enumerate(BAD_LINES) if what}
    assert reader.malformed == expected
    for index, message in expected.items():
        with pytest.raises(BadRecordError) as exc:
            reader[index]
        assert one_line(exc) == message
    assert [reader[0].label, reader[8].label] == ["2", "14"]


def test_the_same_malformed_rows_read_alike_from_parquet(tmp_path) -> None:
    rows = [{"prompt": "1+1?", "label": "2"}, {"prompt": "", "label": "0"}, {"prompt": "3+3?", "label": None}]
    path = write_parquet(tmp_path / "rows.parquet", rows)
    assert FileReader(str(path)).malformed == {
        1: f"{path} row 1: 'prompt' {PROMPT_RULE}; got an empty string",
        2: f"{path} row 2: missing key 'label'; present: prompt",
    }


def _mixer(reader: FileReader, on_bad_row: str) -> Mixer:
    cursor = SourceCursor(name="math", source=reader, seed=0, on_bad_row=on_bad_row)  # type: ignore[arg-type]
    return Mixer([cursor], {"math": 2})


def test_on_bad_row_error_stops_the_run_before_its_first_step(bad_file) -> None:
    with pytest.raises(BadRecordError) as exc:
        _mixer(FileReader(str(bad_file)), "error")
    assert one_line(exc) == (
        f"data source 'math': {bad_file} row 1: not valid JSON (Expecting value: column 28); fix the row, "
        f"or set on_bad_row: skip (7 of 9 rows of {bad_file} are malformed)"
    )


def test_on_bad_row_skip_leaves_them_out_and_says_how_many(bad_file, data_log) -> None:
    mixer = _mixer(FileReader(str(bad_file)), "skip")
    console = [r.getMessage() for r in data_log if not getattr(r, "file_only", False)]
    assert console == [
        f"data source math: 7 of 9 rows of {bad_file} are malformed and left out (on_bad_row: skip), e.g. "
        f"{bad_file} row 1: not valid JSON (Expecting value: column 28); the run's log names each"
    ]
    logged = sorted(r.getMessage() for r in data_log if getattr(r, "file_only", False))
    assert len(logged) == 7 and f"data source math: skipped row 2: {bad_file} row 2: missing key 'prompt'" in logged[1]
    drawn = [r for _ in range(3) for r in mixer.plan()["math"]]
    assert sorted(r.label for r in drawn) == ["14", "14", "14", "2", "2", "2"]  # three epochs of the two good rows
    assert sorted(mixer.cursors["math"].skipped) == [1, 2, 3, 4, 5, 6, 7]
    assert len(data_log) == 8  # nothing more is logged as the bad rows come up in the permutations


def test_a_key_no_row_has_is_a_mapping_to_fix_whatever_on_bad_row_says(tmp_path) -> None:
    rows = [{"problem": "1+1?", "solution": "2"}, {"problem": "2+2?", "solution": "4"}]
    path = write_jsonl(tmp_path / "other_names.jsonl", rows)
    for policy in ("skip", "error"):
        with pytest.raises(BadRecordError) as exc:
            _mixer(FileReader(str(path)), policy)
        assert one_line(exc) == (
            f"data source 'math': {path}: no row has the field 'prompt' (the first row's fields: problem, "
            "solution); set the reader's prompt_key to the field that holds the prompt"
        )
    with pytest.raises(BadRecordError) as exc:
        _mixer(FileReader(str(path), prompt_key="problem"), "skip")
    assert one_line(exc).endswith(
        "no row has the field 'label' (the first row's fields: problem, solution); set the reader's label_key "
        "to the field that holds the answer (or to null: rows without one)"
    )
    assert _mixer(FileReader(str(path), prompt_key="problem", label_key="solution"), "error").plan()["math"]


def test_a_file_of_bad_rows_only_stops_the_run(tmp_path) -> None:
    path = tmp_path / "broken.jsonl"
    path.write_text('{"prompt": "1+1?", "label": ""}\n{oops\n')
    with pytest.raises(BadRecordError) as exc:
        _mixer(FileReader(str(path)), "skip")
    assert one_line(exc) == (
        f"data source 'math': no valid row: 2 of 2 rows of {path} are malformed, the first: {path} row 0: "
        "'label' is empty; a label is the answer the reward checks"
    )


# ----------------------------------------------------------------------------- files that cannot be read
def test_a_file_that_cannot_be_read_is_one_line(tmp_path) -> None:
    (tmp_path / "rows.csv").write_text("prompt,label\n")
    with pytest.raises(ValueError) as exc:
        FileReader(str(tmp_path / "rows.csv"))
    assert (
        one_line(exc)
        == f"path={str(tmp_path / 'rows.csv')!r}: unsupported file type '.csv'; allowed: .jsonl, .parquet, .json"
    )
    (tmp_path / "cut.json").write_text('[{"prompt": "1+1?", "label": "2"},\n {"prompt": ')
    with pytest.raises(ValueError) as exc:
        FileReader(str(tmp_path / "cut.json"))
    assert one_line(exc) == (
        f"path={str(tmp_path / 'cut.json')!r}: not valid JSON (Expecting value: line 2 column 13); a .json "
        "file holds an array of row objects, or one object a line"
    )
    (tmp_path / "fake.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(ValueError) as exc:
        FileReader(str(tmp_path / "fake.parquet"))
    assert one_line(exc).startswith(f"path={str(tmp_path / 'fake.parquet')!r}: not a readable Parquet file (")


def test_parquet_without_pyarrow_names_the_package(tmp_path, monkeypatch) -> None:
    path = write_parquet(tmp_path / "rows.parquet", [{"prompt": "1+1?", "label": "2"}])
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # what an environment without pyarrow raises
    with pytest.raises(ValueError) as exc:
        FileReader(str(path))
    assert (
        one_line(exc)
        == f"path={str(path)!r}: reading .parquet needs pyarrow, which is not installed: pip install pyarrow"
    )


def test_through_the_config_a_missing_file_names_the_key(tmp_path) -> None:
    reader = f"data_sources.0.reader={{name: file, params: {{path: {tmp_path / 'nowhere.jsonl'}}}}}"
    with pytest.raises(ConfigError) as exc:
        load_config("tiny/grpo_arith_cpu", [reader])
    assert one_line(exc) == f"data_sources[0].reader.params.path={str(tmp_path / 'nowhere.jsonl')!r}: file not found"


def test_the_runs_data_files_are_what_agents_programs_may_not_read(tmp_path, monkeypatch) -> None:
    """Training and held-out files of every source, resolved (a link to the file is the file);
    a reader that reads no file adds none."""
    from loongsage.core.data import data_files

    train = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "1+1?", "label": "2"}])
    held = write_jsonl(tmp_path / "held.jsonl", [{"prompt": "2+2?", "label": "4"}])
    (tmp_path / "link.jsonl").symlink_to(train)
    monkeypatch.chdir(tmp_path)
    cfg, _ = load_config(
        "tiny/grpo_arith_cpu",
        [
            "data_sources.0.reader={name: file, params: {path: link.jsonl}}",
            f"data_sources.0.eval_reader={{name: file, params: {{path: {held}}}}}",
        ],
    )
    assert data_files(cfg.data_sources) == (str(train.resolve()), str(held.resolve()))
    cfg, _ = load_config("tiny/grpo_arith_cpu")  # generated rows: no file
    assert data_files(cfg.data_sources) == ()


def test_a_run_hands_its_agents_its_data_files_and_its_folder_as_private(tmp_path, monkeypatch) -> None:
    from loongsage.core.controller import Controller, resolve_model_path

    train = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "1+1?", "label": "2"}])
    monkeypatch.chdir(tmp_path)
    cfg, registry = load_config(
        "tiny/grpo_arith_cpu", ["run.name=private", f"data_sources.0.reader={{name: file, params: {{path: {train}}}}}"]
    )
    controller = Controller(cfg, registry)
    controller._build_local(resolve_model_path(cfg, registry))
    assert controller._rollout_parts["private_paths"] == (
        str(train.resolve()),
        str((tmp_path / "runs" / "private").resolve()),
    )
