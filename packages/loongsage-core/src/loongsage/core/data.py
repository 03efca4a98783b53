"""Data: the built-in file reader and the mixer that plans exact per-source prompt quotas.

The mixer walks each source in a seeded per-epoch permutation; its state is just
``(epoch, offset)`` per source, saved with every checkpoint, so a resumed run continues with exactly
the prompts it would have seen.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from loongsage.core.types import BadRecordError, DataRecord, DataSource

log = logging.getLogger(__name__)


@dataclass
class FileReader:
    """Rows of a ``.jsonl`` or ``.parquet`` file, with field mapping.

    Each row must have ``prompt_key`` (a string, or a list of chat messages with ``role`` and
    ``content``) and, when ``label_key`` is set, that key too. Other fields land in metadata.
    """

    path: str
    prompt_key: str = "prompt"
    label_key: str | None = "label"

    def __post_init__(self) -> None:
        p = Path(self.path)
        if not p.is_file():
            raise ValueError(f"path={self.path!r}: file not found")
        if p.suffix == ".jsonl":
            self._rows: list[Any] = []
            with p.open() as fh:
                for line in fh:
                    if not line.strip():
                        continue
                    try:
                        self._rows.append(json.loads(line))
                    except json.JSONDecodeError as exc:
                        self._rows.append(BadRecordError(f"not valid JSON ({exc.msg})"))
        elif p.suffix == ".parquet":
            import pyarrow.parquet as pq  # optional dependency, imported where used

            self._rows = pq.read_table(p).to_pylist()
        else:
            raise ValueError(f"path={self.path!r}: unsupported file type {p.suffix!r}; allowed: .jsonl, .parquet")

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, index: int) -> DataRecord:
        row = self._rows[index]
        where = f"{self.path} row {index}"
        if isinstance(row, BadRecordError):
            raise BadRecordError(f"{where}: {row}")
        if not isinstance(row, dict):
            raise BadRecordError(f"{where}: expected a JSON object, got {type(row).__name__}")
        if self.prompt_key not in row:
            raise BadRecordError(f"{where}: missing key {self.prompt_key!r}; present: {', '.join(sorted(row))}")
        prompt = row[self.prompt_key]
        if not (isinstance(prompt, str) and prompt) and not _is_messages(prompt):
            raise BadRecordError(
                f"{where}: {self.prompt_key!r} must be a non-empty string or a list of {{role, content}} messages"
            )
        if self.label_key is not None and self.label_key not in row:
            raise BadRecordError(f"{where}: missing key {self.label_key!r}; present: {', '.join(sorted(row))}")
        label = row.get(self.label_key) if self.label_key else None
        meta = {k: v for k, v in row.items() if k not in (self.prompt_key, self.label_key)}
        return DataRecord(source="", index=index, prompt=prompt, label=label, metadata=meta)


def _is_messages(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value
        )
    )


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
            try:
                record = self.source[index]
            except BadRecordError as exc:
                if self.on_bad_row == "error":
                    raise
                if index not in self.skipped:
                    self.skipped.append(index)
                    log.warning("data source %s: skipped row %d: %s", self.name, index, exc)
                if len(self.skipped) == len(self.source):
                    raise BadRecordError(f"data source {self.name!r}: no valid row left") from exc
                continue
            record.source = self.name
            out.append(record)
        return out

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
