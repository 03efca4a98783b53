"""MOPD's configuration: teacher specs, checked and resolved before any actor starts, one teacher
actor per distinct spec (the step's part is :mod:`loongsage.core.step.distillation`).

A data source names its teacher like the policy names its model::

    teacher:
      name: embedded                       # a backend of kind `teacher`
      params:
        path: /models/math-teacher         # an HF folder, or
        builder: {name: tiny_arith, params: {...}}   # a model_builder that makes one (cached)
        micro_batch_tokens: 8192           # the backend's own params

``path`` / ``builder`` are the framework's (resolved in the driver, before any actor, and handed to
the backend as ``model_path``); everything else is the backend's and is validated against its
signature. Sources with the same spec share one teacher actor.

``name: trainer`` is not a teacher backend: the trainer's ranks hold the teacher themselves, built
by the trainer backend like the policy (its dtype, head and model-parallel layout, so a teacher as
large as the student is split as the student is). Its distribution (top-k or full vocabulary) is
computed beside the student's in each micro-batch of the train step and never leaves the device;
only the log-probs of the sampled tokens travel back for the PG branch. Token-level distillation compares
the two models' next-token distributions, so a teacher must share the student's vocabulary: that is
checked once the models exist.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loongsage.core.config import SUPPLIED
from loongsage.core.types import ConfigError

if TYPE_CHECKING:
    from loongsage.core.config import Config

SOURCE_KEYS = ("path", "builder")  # where the teacher's weights come from: the framework's keys
HELD_BY_TRAINER = "trainer"  # the teacher name that puts the teacher on the trainer's ranks


def held_by_trainer(spec: Any) -> bool:
    """Whether a source's ``teacher`` spec asks the trainer's ranks to hold the teacher."""
    return isinstance(spec, dict) and spec.get("name") == HELD_BY_TRAINER


def split_teacher_spec(spec: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(model source {path | builder}, backend spec {name, params without them})``."""
    params = dict(spec.get("params") or {}) if isinstance(spec, dict) else {}
    source = {k: params.pop(k) for k in SOURCE_KEYS if k in params}
    backend = {**spec, "params": params} if isinstance(spec, dict) else spec
    return source, backend


def check_teacher(registry: Any, spec: dict[str, Any], path: str, trainer: dict[str, Any]) -> None:
    """Validate a source's ``teacher`` spec without loading anything (ConfigError, one line);
    ``trainer``: the trainer backend's spec (which holds a ``name: trainer`` teacher)."""
    source, backend = split_teacher_spec(spec)
    if held_by_trainer(spec):
        for key in sorted(set(spec) - {"name", "params"}):
            raise ConfigError(f"{path}.{key}: unknown key; allowed: name, params")
        for key in sorted(backend["params"]):
            raise ConfigError(
                f"{path}.params.{key}: a teacher held by the trainer is built like the policy (the "
                "trainer's dtype, head and layout); allowed: path, builder"
            )
        factory = registry.entry("trainer", trainer["name"], "trainer.backend").factory
        if factory.add_teacher is None:  # a flag the registry filled in on the class when it loaded it
            raise ConfigError(
                f"{path}.name={HELD_BY_TRAINER!r}: the {trainer['name']!r} trainer cannot hold teachers; "
                f"use a teacher backend ({', '.join(registry.names('teacher'))})"
            )
    else:
        registry.check("teacher", backend, path, skip=SUPPLIED["teacher"])
    given = [k for k in SOURCE_KEYS if source.get(k) is not None]
    if len(given) != 1:
        raise ConfigError(
            f"{path}.params: set exactly one of path (an HF folder) or builder (a model_builder "
            f"spec) for the teacher's weights; got {', '.join(given) or 'neither'}"
        )
    if given == ["builder"]:
        registry.create("model_builder", source["builder"], f"{path}.params.builder")
    elif not isinstance(source["path"], str) or not (Path(source["path"]) / "config.json").is_file():
        raise ConfigError(f"{path}.params.path={source['path']!r}: not an HF model folder (no config.json there)")


@dataclass
class TeacherPlan:
    """One teacher actor to start: its backend spec, its resolved weights and the sources it serves."""

    spec: dict[str, Any]  # backend {name, params} (without path / builder)
    model_path: str
    sources: list[str] = field(default_factory=list)

    @property
    def held_by_trainer(self) -> bool:
        return held_by_trainer(self.spec)


def plan_teachers(cfg: Config, registry: Any, student_path: str) -> list[TeacherPlan]:
    """Resolve every source's teacher (building cached models now), one plan per distinct spec."""
    plans: dict[str, TeacherPlan] = {}
    for i, src in enumerate(cfg.data_sources):
        if src.teacher is None:
            continue
        key = json.dumps(src.teacher, sort_keys=True)
        if key not in plans:
            source, backend = split_teacher_spec(src.teacher)
            if source.get("builder") is not None:
                builder = registry.create(
                    "model_builder", source["builder"], f"data_sources[{i}].teacher.params.builder"
                )
                model_path = str(builder.build())
            else:
                model_path = str(source["path"])
            check_same_vocabulary(student_path, model_path, f"data_sources[{i}].teacher")
            plans[key] = TeacherPlan(backend, model_path)
        plans[key].sources.append(src.name)
    return list(plans.values())


def check_same_vocabulary(student_path: str, teacher_path: str, where: str) -> None:
    """Token-level distillation needs one vocabulary: refuse a teacher whose tokenizer differs."""
    from transformers import AutoTokenizer

    student = AutoTokenizer.from_pretrained(student_path).get_vocab()
    teacher = AutoTokenizer.from_pretrained(teacher_path).get_vocab()
    if student != teacher:
        differ = len(set(student.items()) ^ set(teacher.items()))
        raise ConfigError(
            f"{where}: the teacher at {teacher_path} has another vocabulary than the student "
            f"({len(teacher)} vs {len(student)} tokens, {differ} entries differ); token-level "
            "distillation needs the student's tokenizer"
        )
