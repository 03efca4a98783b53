"""Data: the built-in file reader and the mixer that plans exact per-source prompt quotas.

The file reader reads its whole file when it is built and maps every row to a record or to what is
wrong with it, so a run knows a file's malformed rows before its first step (the mixer says what
the source's ``on_bad_row`` does with them). The mixer walks each source in a seeded per-epoch
permutation; its state is just ``(epoch, offset)`` per source, saved with every checkpoint, so a
resumed run continues with exactly the prompts it would have seen.
"""

from __future__ import annotations

import codecs
import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from loongsage.core.types import BadRecordError, DataRecord, DataSource

log = logging.getLogger(__name__)

FILE_TYPES = (".jsonl", ".parquet", ".json")
PROMPT_RULE = "must be a non-empty string or a list of {role, content} messages"
_ABSENT = object()  # a field a row does not have (a null one counts as absent)
_FIX_OR_SKIP = "fix the row, or set on_bad_row: skip"


@dataclass
class FileReader:
    """Rows of a ``.jsonl``, ``.parquet`` or ``.json`` file, with field mapping.

    A row's prompt is a non-empty string or a list of chat messages with string ``role`` and
    ``content``; its label is any value but null or empty (the reward decides what it accepts:
    ``math`` and ``exact_match`` compare its text, a list's items each). A key may name a nested field
    with dots. A null field counts as absent (a Parquet file gives every row every column, null where
    the row has none), so the same rows give the same records from either file type. Other fields land
    in metadata. A malformed row is a ``BadRecordError`` naming the file and the row (counted from 0,
    blank lines left out), raised when the row is drawn.
    """

    # a .jsonl file (one JSON object a line), a .parquet file, or a .json file (an array of objects)
    path: str
    # the field holding the prompt, text or chat messages [{role, content}, ...]; a.b names a nested field
    prompt_key: str = "prompt"
    # the field holding the answer the reward checks; a.b names a nested field; null = the rows have none
    label_key: str | None = "label"
    # a system message put first in every prompt that has none of its own (a text prompt becomes chat)
    system_prompt: str | None = None
    # the text around each prompt (in a chat prompt, around its last user message); {prompt} stands for
    # the row's prompt, e.g. '{prompt} Put the final answer in \boxed{}.'
    prompt_format: str | None = None

    def __post_init__(self) -> None:
        self._check_params()
        rows = _read_rows(Path(self.path), self.path)
        self._records = [self._record_or_problem(row, index) for index, row in enumerate(rows)]
        # index -> what is wrong with that row (the mixer reports them before the first step)
        self.malformed = {i: str(r) for i, r in enumerate(self._records) if isinstance(r, BadRecordError)}
        # a key no row has: the mapping is wrong, not the rows
        self.unmapped = self._key_no_row_has(rows)

    def _check_params(self) -> None:
        for name in ("prompt_key", "label_key"):
            key = getattr(self, name)
            if key is not None and not (isinstance(key, str) and key.strip()):
                raise ValueError(f"{name}={key!r}: must name a field of the rows (a.b for a nested one)")
        if self.system_prompt is not None and not self.system_prompt.strip():
            raise ValueError(f"system_prompt={self.system_prompt!r}: must be a non-empty string, or null for none")
        if self.prompt_format is not None and "{prompt}" not in self.prompt_format:
            raise ValueError(
                f"prompt_format={self.prompt_format!r}: must hold {{prompt}}, where each row's prompt goes "
                "(e.g. '{prompt} Put the final answer in \\boxed{}.')"
            )

    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, index: int) -> DataRecord:
        record = self._records[index]
        if isinstance(record, BadRecordError):
            raise BadRecordError(str(record))  # a new one: a raised exception keeps its traceback
        return dataclasses.replace(record)  # the cursor sets its source on the copy it hands out

    def _record_or_problem(self, row: Any, index: int) -> DataRecord | BadRecordError:
        try:
            return self._record(row, index)
        except BadRecordError as exc:
            return BadRecordError(f"{self.path} row {index}: {exc}")

    def _record(self, row: Any, index: int) -> DataRecord:
        if isinstance(row, _Unreadable):
            raise BadRecordError(row.problem)
        if not isinstance(row, dict):
            raise BadRecordError(f"expected a JSON object, got {type(row).__name__}")
        prompt = _required(row, self.prompt_key)
        _check_prompt(self.prompt_key, prompt)
        label = None
        if self.label_key is not None:
            label = _required(row, self.label_key)
            if _is_empty(label):
                raise BadRecordError(f"{self.label_key!r} is empty; a label is the answer the reward checks")
        meta = {k: v for k, v in row.items() if k not in (self.prompt_key, self.label_key)}
        return DataRecord(source="", index=index, prompt=self._shaped(prompt), label=label, metadata=meta)

    def _shaped(self, prompt: str | list[dict[str, Any]]) -> str | list[dict[str, Any]]:
        """The row's prompt with ``prompt_format`` and ``system_prompt`` applied."""
        if self.prompt_format is not None:
            prompt = _formatted(prompt, self.prompt_format, self.prompt_key)
        if self.system_prompt is not None:
            prompt = _with_system(prompt, self.system_prompt)
        return prompt

    def _key_no_row_has(self, rows: list[Any]) -> str | None:
        objects = [row for row in rows if isinstance(row, dict)]
        keys = (
            ("prompt_key", self.prompt_key, "the prompt"),
            ("label_key", self.label_key, "the answer (or to null: rows without one)"),
        )
        for name, key, holds in keys:
            if key is None or not objects or any(_lookup(row, key) is not _ABSENT for row in objects):
                continue
            fields = ", ".join(sorted(objects[0])) or "none"
            return (
                f"no row has the field {key!r} (the first row's fields: {fields}); set the reader's {name} "
                f"to the field that holds {holds}"
            )
        return None


@dataclass(frozen=True)
class _Unreadable:
    """A line that is not JSON: kept as a row, so the rows after it keep their indices."""

    problem: str


def data_files(sources: list[Any]) -> tuple[str, ...]:
    """The files the data sources read, training and held-out (each reader's ``path`` param that
    names an existing file), resolved: what an agent's programs are not to read (the labels)."""
    found: dict[str, None] = {}
    for source in sources:
        for spec in (source.reader, source.eval_reader):
            path = ((spec or {}).get("params") or {}).get("path")
            if isinstance(path, str) and path and os.path.isfile(path):
                found[os.path.realpath(path)] = None
    return tuple(found)


def _read_rows(path: Path, shown: str) -> list[Any]:
    """Every row of the file, nulls left out (see :func:`_without_nulls`); a line that is not JSON
    is an :class:`_Unreadable` row. A file that cannot be read at all is one ``ValueError``."""
    if not path.is_file():
        raise ValueError(f"path={shown!r}: file not found")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        rows = _jsonl_rows(path)
    elif suffix == ".parquet":
        rows = _parquet_rows(path, shown)
    elif suffix == ".json":
        rows = _json_rows(path, shown)
    else:
        raise ValueError(f"path={shown!r}: unsupported file type {path.suffix!r}; allowed: {', '.join(FILE_TYPES)}")
    return [row if isinstance(row, _Unreadable) else _without_nulls(row) for row in rows]


def _jsonl_rows(path: Path) -> list[Any]:
    rows: list[Any] = []
    with path.open("rb") as fh:  # bytes: a line that is not UTF-8 is a bad row, not a failed file
        for number, line in enumerate(fh, 1):
            if number == 1:
                line = line.removeprefix(codecs.BOM_UTF8)  # some editors start a file with one
            if not line.strip():
                continue  # a blank line is no row
            try:
                rows.append(json.loads(line.rstrip()))  # the newline cut: an error is on this line
            except json.JSONDecodeError as exc:
                rows.append(_Unreadable(f"not valid JSON ({exc.msg}: column {exc.colno})"))
            except UnicodeDecodeError:
                rows.append(_Unreadable("not valid JSON (not UTF-8 text)"))
    return rows


def _json_rows(path: Path, shown: str) -> list[Any]:
    """A ``.json`` file: an array of row objects, or JSON Lines under that name (as many data sets
    are published)."""
    with path.open("rb") as fh:
        start = fh.read(4096).removeprefix(codecs.BOM_UTF8).lstrip()
    if not start.startswith(b"["):
        return _jsonl_rows(path)
    try:
        rows = json.loads(path.read_bytes().removeprefix(codecs.BOM_UTF8))
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"path={shown!r}: not valid JSON ({exc.msg}: line {exc.lineno} column {exc.colno}); a .json file "
            "holds an array of row objects, or one object a line"
        ) from None
    except UnicodeDecodeError:
        raise ValueError(f"path={shown!r}: not UTF-8 text") from None
    return list(rows)


def _parquet_rows(path: Path, shown: str) -> list[Any]:
    try:
        import pyarrow.parquet as pq  # imported where used: only Parquet files need it
    except ImportError:
        raise ValueError(
            f"path={shown!r}: reading .parquet needs pyarrow, which is not installed: pip install pyarrow"
        ) from None
    try:
        return list(pq.read_table(path).to_pylist())
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError, ArrowIOError an OSError
        problem = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"path={shown!r}: not a readable Parquet file ({problem})") from None


def _without_nulls(value: Any) -> Any:
    """``value`` with the null fields of its objects left out, at any depth (list items are kept)."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) if isinstance(v, (dict, list)) else v for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) if isinstance(v, (dict, list)) else v for v in value]
    return value


def _lookup(row: dict[str, Any], key: str) -> Any:
    """The field ``key`` of ``row``: a top-level field of that name, else a dotted path into nested
    objects (``reward_model.ground_truth``); ``_ABSENT`` where there is none."""
    if key in row:
        return row[key]
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return _ABSENT
        value = value[part]
    return value


def _required(row: dict[str, Any], key: str) -> Any:
    value = _lookup(row, key)
    if value is _ABSENT:
        raise BadRecordError(f"missing key {key!r}; present: {', '.join(sorted(row))}")
    return value


def _is_empty(value: Any) -> bool:
    return (isinstance(value, str) and not value.strip()) or (isinstance(value, (list, dict)) and not value)


def _check_prompt(key: str, prompt: Any) -> None:
    if isinstance(prompt, str):
        if not prompt.strip():
            raise BadRecordError(f"{key!r} {PROMPT_RULE}; got an empty string")
        return
    if not isinstance(prompt, list):
        raise BadRecordError(f"{key!r} {PROMPT_RULE}; got {type(prompt).__name__}")
    if not prompt:
        raise BadRecordError(f"{key!r} {PROMPT_RULE}; got an empty list")
    for i, message in enumerate(prompt):
        if not isinstance(message, dict):
            raise BadRecordError(f"{key!r} {PROMPT_RULE}; message {i} is {type(message).__name__}, not an object")
        for part in ("role", "content"):
            if not isinstance(message.get(part), str):
                raise BadRecordError(f"{key!r} {PROMPT_RULE}; message {i} has no string {part!r}")


def _formatted(prompt: str | list[dict[str, Any]], fmt: str, key: str) -> str | list[dict[str, Any]]:
    # str.replace, not str.format: a prompt format is full of LaTeX braces (\boxed{})
    if isinstance(prompt, str):
        return fmt.replace("{prompt}", prompt)
    users = [i for i, m in enumerate(prompt) if m["role"] == "user"]
    if not users:
        raise BadRecordError(f"{key!r} has no user message for prompt_format to wrap")
    messages = [dict(m) for m in prompt]
    messages[users[-1]]["content"] = fmt.replace("{prompt}", messages[users[-1]]["content"])
    return messages


def _with_system(prompt: str | list[dict[str, Any]], system: str) -> list[dict[str, Any]]:
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if messages[0]["role"] == "system":
        return messages  # the row's own system message is more specific than the reader's
    return [{"role": "system", "content": system}, *messages]


@dataclass
class SourceCursor:
    """Position of one source: which epoch's permutation and how far into it."""

    name: str
    source: DataSource
    seed: int
    on_bad_row: Literal["skip", "error"] = "skip"
    epoch: int = 0
    offset: int = 0
    skipped: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.source) == 0:
            raise ValueError(f"data source {self.name!r} is empty")
        self._perm = self._permutation(self.epoch)
        self._left_out = set(self.skipped)  # ``skipped`` as a set: a large file may have many bad rows

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.source))

    def take(self, count: int) -> list[DataRecord]:
        out: list[DataRecord] = []
        while len(out) < count:
            if self.offset >= len(self._perm):
                self.epoch, self.offset = self.epoch + 1, 0
                self._perm = self._permutation(self.epoch)
            index = int(self._perm[self.offset])
            self.offset += 1
            if index in self._left_out:
                continue  # known bad: reported once, when it was first found
            try:
                record = self.source[index]
            except BadRecordError as exc:
                if self.on_bad_row == "error":
                    raise BadRecordError(f"data source {self.name!r}: {exc}; {_FIX_OR_SKIP}") from None
                self._leave_out(index)
                log.warning(
                    "data source %s: skipped row %d: %s (%d skipped so far)", self.name, index, exc, len(self.skipped)
                )
                if len(self._left_out) == len(self.source):
                    raise BadRecordError(f"data source {self.name!r}: no valid row left") from exc
                continue
            record.source = self.name
            out.append(record)
        return out

    def check_rows(self) -> None:
        """Say before the first step what a file source's malformed rows do to this run.

        A file is read whole when its reader is built, so its bad rows are known then: a key that no
        row has is a mapping to fix, whatever ``on_bad_row`` says; ``error`` stops at the first bad
        row; ``skip`` leaves them all out, counted on the console and each named in the run's log.
        Other sources are found out row by row, as their rows are drawn.
        """
        reader = self.source
        if not isinstance(reader, FileReader):
            return
        if reader.unmapped is not None:
            raise BadRecordError(f"data source {self.name!r}: {reader.path}: {reader.unmapped}")
        bad = reader.malformed
        if not bad:
            return
        count = f"{len(bad)} of {len(reader)} rows of {reader.path} are malformed"
        first = next(iter(bad.values()))
        if self.on_bad_row == "error":
            raise BadRecordError(f"data source {self.name!r}: {first}; {_FIX_OR_SKIP} ({count})")
        if len(bad) == len(reader):
            raise BadRecordError(f"data source {self.name!r}: no valid row: {count}, the first: {first}")
        for index, problem in bad.items():
            if index not in self._left_out:
                self._leave_out(index)
                log.warning("data source %s: skipped row %d: %s", self.name, index, problem, extra={"file_only": True})
        log.warning(
            "data source %s: %s and left out (on_bad_row: skip), e.g. %s; the run's log names each",
            self.name,
            count,
            first,
        )

    def _leave_out(self, index: int) -> None:
        self.skipped.append(index)
        self._left_out.add(index)

    def state(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "offset": self.offset}

    def restore(self, state: dict[str, Any]) -> None:
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        self._perm = self._permutation(self.epoch)


class Mixer:
    """Exact per-source quotas: every step takes ``prompts_per_step`` records from each source."""

    def __init__(self, cursors: list[SourceCursor], quotas: dict[str, int]):
        self.cursors = {c.name: c for c in cursors}
        self.quotas = quotas
        # the mixer is made before any actor starts: bad data stops a run there, not at the step that
        # draws the row
        for cursor in cursors:
            cursor.check_rows()

    def plan(self) -> dict[str, list[DataRecord]]:
        return {name: cursor.take(self.quotas[name]) for name, cursor in self.cursors.items()}

    def take(self, source: str, count: int) -> list[DataRecord]:
        """Extra records of one source (refills after filtering), from the same exact stream."""
        return self.cursors[source].take(count)

    def state(self) -> dict[str, Any]:
        return {name: c.state() for name, c in self.cursors.items()}

    def restore(self, state: dict[str, Any]) -> None:
        for name, s in state.items():
            self.cursors[name].restore(s)
