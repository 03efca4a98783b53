"""Held-out evaluation: greedy accuracy and, optionally, pass@k with temperature sampling."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from loongsage.core.config import Config
from loongsage.core.types import BadRecordError, DataRecord

if TYPE_CHECKING:
    from loongsage.core.rollout import RolloutService

log = logging.getLogger("loongsage.core.data")  # beside the training rows' skips


class Evaluator:
    """Evaluates every data source that names an ``eval_reader`` on its first ``max_prompts`` rows."""

    def __init__(self, cfg: Config, registry: Any):
        self.cfg = cfg
        self.records: dict[str, list[DataRecord]] = {}
        self.agents: dict[str, Any] = {}
        for i, src in enumerate(cfg.data_sources):
            if src.eval_reader is None:
                continue
            spec, key = (src.eval_agent, "eval_agent") if src.eval_agent is not None else (src.agent, "agent")
            self.agents[src.name] = registry.create("agent", spec, f"data_sources[{i}].{key}")
            reader = registry.create("data_source", src.eval_reader, f"data_sources[{i}].eval_reader")
            self.records[src.name] = _eval_rows(src.name, reader, cfg.evaluation.max_prompts, src.on_bad_row)

    async def run(self, rollout: RolloutService, step: int, pass_k: bool = True) -> dict[str, float]:
        """Greedy accuracy after ``step`` training steps, generated through ``rollout``; with
        ``pass_k`` (first and last evaluation) also pass@k and sampled pass@1."""
        if not self.records:
            return {}
        ev = self.cfg.evaluation
        records = [r for rows in self.records.values() for r in rows]
        greedy = {name: replace(s, temperature=0.0, n=1, seed=None) for name, s in rollout.sampling.items()}
        metrics: dict[str, float] = {}
        answers = await rollout.generate(records, greedy, self.agents, self._ids(step, 0))
        for name, groups in _by_source(answers).items():
            hits = [_success(g[0].reward, ev.success_threshold) for g in groups]
            metrics[f"eval/{name}/accuracy"] = sum(hits) / len(hits)
            metrics[f"eval/{name}/response_length"] = sum(len(g[0].response_ids) for g in groups) / len(groups)
        if pass_k and ev.pass_k > 0:
            sampled = {name: replace(s, n=ev.pass_k) for name, s in rollout.sampling.items()}
            answers = await rollout.generate(records, sampled, self.agents, self._ids(step, 1))
            for name, groups in _by_source(answers).items():
                per_group = [[_success(t.reward, ev.success_threshold) for t in g] for g in groups]
                metrics[f"eval/{name}/pass@{ev.pass_k}"] = sum(any(h) for h in per_group) / len(per_group)
                metrics[f"eval/{name}/pass@1_sampled"] = sum(sum(h) / len(h) for h in per_group) / len(per_group)
        # Training after this must not reuse evaluation's prefixes: it would compute (to rounding)
        # differently from a run resumed here, whose engines never ran this evaluation.
        await rollout.flush_caches()
        return metrics

    def _ids(self, step: int, phase: int) -> list[int]:
        """Group ids of one evaluation phase: negative (never a training id) and a function of the
        step alone, so evaluation neither shifts the training stream nor depends on when a run
        was resumed."""
        n = sum(len(rows) for rows in self.records.values())
        first = (2 * step + phase) * n
        return [-1 - (first + k) for k in range(n)]


def _eval_rows(name: str, reader: Any, count: int, on_bad_row: str) -> list[DataRecord]:
    """The first ``count`` valid rows of ``reader``. A bad row is handled as the source's
    ``on_bad_row`` says, as in training: ``skip`` goes past it (logged; the next rows fill its
    place), ``error`` stops the run."""
    rows: list[DataRecord] = []
    skipped: list[int] = []
    for index in range(len(reader)):
        if len(rows) == count:
            break
        try:
            record = reader[index]
        except BadRecordError as exc:
            if on_bad_row == "error":
                raise BadRecordError(
                    f"data source {name!r} (eval_reader): {exc}; fix the row, or set on_bad_row: skip"
                ) from None
            skipped.append(index)
            log.warning("data source %s: skipped evaluation row %d: %s", name, index, exc)
            continue
        record.source = name
        rows.append(record)
    if skipped and not rows:
        raise BadRecordError(
            f"data source {name!r} (eval_reader): no valid evaluation row (all {len(skipped)} bad); "
            "fix the file, or drop eval_reader"
        )
    return rows


def _success(reward: float | None, threshold: float) -> bool:
    return reward is not None and reward >= threshold


def _by_source(groups: list[list[Any]]) -> dict[str, list[list[Any]]]:
    out: dict[str, list[list[Any]]] = {}
    for g in groups:
        if g:
            out.setdefault(g[0].source, []).append(g)
    return out
