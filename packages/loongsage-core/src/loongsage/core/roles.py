"""Typed role groups: each role's worker methods as Python methods, over one :class:`WorkerGroup`.

The step and the controller speak to roles (``trainer.logprobs(batch, plan)``,
``engines.release_memory()``), never to method names written as strings; how a call reaches the
actors (every rank, some ranks, one value per rank) and how the answers are collected (in rank
order, the data-parallel leader's) is declared here, once per method, the way verl's worker
decorators declare dispatch and collection.

The trainer group owns the data layout: rows are dealt to data-parallel ranks, and the trainer ranks
of one data-parallel rank (a model-parallel group) all get its rows while only its leader's answer is
read. Calls that the step overlaps (a trainer's and the critic's optimizer steps) return
:class:`Pending` answers; ``Pending.wait`` is where Ray is waited on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from loongsage.core.worker_group import WorkerGroup, per_rank

if TYPE_CHECKING:
    import torch

    from loongsage.core.planning import StepPlan
    from loongsage.core.types import TrainBatch
    from loongsage.core.workers import PushResult


class Pending:
    """The answers of calls under way, in call order; :meth:`wait` blocks until all are in."""

    def __init__(self, refs: Sequence[Any] = ()):
        self.refs = list(refs)

    def wait(self) -> list[Any]:
        if not self.refs:
            return []
        import ray

        return ray.get(self.refs)


class RoleGroup:
    """A role's actors (``group``) behind typed methods. Empty when the run has no such role."""

    def __init__(self, group: WorkerGroup):
        self.group = group

    def __len__(self) -> int:
        return len(self.group)

    def __bool__(self) -> bool:
        return len(self.group) > 0

    @property
    def actors(self) -> list[Any]:
        """The live actor list (a holder may swap a replacement into it: never copied)."""
        return self.group.actors


class ModelGroup(RoleGroup):
    """A role whose actors hold trained weights (the policy's ranks, the critic): they move between
    the device and host memory and take part in checkpoints."""

    def offload(self, weights: bool = True) -> None:
        self.group.call("offload", weights=weights)

    def onload(self) -> None:
        self.group.call("onload")

    def save(self, path: str) -> Pending:
        return Pending(self.group.call_async("save", path))

    def load(self, path: str) -> Pending:
        return Pending(self.group.call_async("load", path))


class TrainerGroup(ModelGroup):
    """The policy's trainer ranks and their data-parallel layout."""

    def __init__(self, group: WorkerGroup, world_size: int | None = None):
        super().__init__(group)
        world = len(group) if world_size is None else world_size
        self.set_layout([(r, world, True) for r in range(world)])  # each rank its own until told otherwise

    def set_layout(self, layout: Sequence[tuple[int, int, bool]]) -> None:
        """``(data-parallel rank, data-parallel size, leader)`` per trainer rank."""
        self.dp_size = int(layout[0][1])
        self.dp_of = [int(d) for d, _, _ in layout]
        self.dp_leader = {int(d): r for r, (d, _, lead) in enumerate(layout) if lead}

    def read_layout(self) -> None:
        """Ask the ranks how they split the model (a backend with model parallelism says so)."""
        self.set_layout(self.group.call("data_layout"))

    def _per_dp_rank(self, method: str, batch: TrainBatch, plan: StepPlan) -> list[tuple[list[int], Any]]:
        """``(rows, answer)`` of each data-parallel rank with rows: every trainer rank runs ``method`` on
        its data-parallel rank's rows (even none: a split model's forward is a collective) and the
        leader's answer is kept."""
        rank_rows = [plan.rank_rows(r) for r in range(plan.world_size)]
        answers = self.group.call(method, per_rank([batch.select(rank_rows[d]) for d in self.dp_of]))
        return [(rows, answers[self.dp_leader[d]]) for d, rows in enumerate(rank_rows) if rows]

    def logprobs(self, batch: TrainBatch, plan: StepPlan) -> list[tuple[list[int], dict[str, torch.Tensor]]]:
        """Old (and reference) log-probs of each data-parallel rank's rows of ``plan``."""
        return self._per_dp_rank("logprobs", batch, plan)

    def teacher_logprobs(self, batch: TrainBatch, plan: StepPlan) -> list[tuple[list[int], torch.Tensor]]:
        """The log-probs of the teachers the ranks hold, of each data-parallel rank's rows."""
        return self._per_dp_rank("teacher_logprobs", batch, plan)

    def train_step(self, shards: Sequence[TrainBatch]) -> Pending:
        """One optimizer step; ``shards[d]``: data-parallel rank ``d``'s rows of the mini-batch."""
        return Pending(self.group.call_async("train_step", per_rank([shards[d] for d in self.dp_of])))

    def push_weights(self, engines: Sequence[Any]) -> PushResult:
        """Every rank exports its weights (gathering shards is a collective); rank 0 sends them."""
        pushed: PushResult = self.group.call("push_weights", list(engines))[0]
        return pushed

    def push_weights_to(self, engine: Any) -> None:
        """The weights to one engine (a lost engine's replacement)."""
        self.group.call("push_weights", [engine])

    def export_hf(self, path: str) -> None:
        self.group.call("export_hf", path)


class CriticGroup(ModelGroup):
    """PPO's value model (at most one actor)."""

    def values(self, batch: TrainBatch) -> torch.Tensor:
        values: torch.Tensor = self.group.call("values", batch)[0]
        return values

    def train_step(self, mini_batch: TrainBatch) -> Pending:
        return Pending(self.group.call_async("train_step", mini_batch))


class TeacherGroup(RoleGroup):
    """MOPD teacher workers, one per distinct teacher spec; ``sources[j]``: the data sources teacher
    ``j`` scores."""

    def __init__(self, group: WorkerGroup, sources: Sequence[Sequence[str]] = ()):
        super().__init__(group)
        self.sources = [list(s) for s in sources]

    def score(self, batch: TrainBatch, topk: int, full_vocab: bool) -> list[tuple[list[int], dict[str, Any]]]:
        """``(rows, scores)`` per teacher with rows in ``batch``, the teachers scoring concurrently."""
        rows_of = {
            j: [i for i, s in enumerate(batch.sources) if s in sources] for j, sources in enumerate(self.sources)
        }
        rows_of = {j: rows for j, rows in rows_of.items() if rows}  # a teacher with no row is not called
        scores = self.group.call(
            "score", per_rank([batch.select(rows) for rows in rows_of.values()]), topk, full_vocab, ranks=list(rows_of)
        )
        return list(zip(rows_of.values(), scores))


class EngineGroup(RoleGroup):
    """The rollout engine replicas."""

    def release_memory(self) -> None:
        """Give the device to a colocated trainer."""
        self.group.call("release_memory")

    def resume_memory(self) -> None:
        self.group.call("resume_memory")

    def set_version(self, version: int) -> None:
        self.group.call("set_version", version)

    def replace(self, index: int, timeout_s: float) -> Any:
        """A new replica ``index`` from the lost one's slot, not put in the list (the rollout's engine
        recovery swaps it in once it holds the current weights)."""
        return self.group.replace(index, install=False, timeout_s=timeout_s)

    @staticmethod
    def set_version_of(engine: Any, version: int) -> None:
        import ray

        ray.get(engine.set_version.remote(version))
