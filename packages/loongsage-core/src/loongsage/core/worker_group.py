"""Worker groups: the Ray actors of one role (trainer ranks, engine replicas, ...) handled as one.

A :class:`WorkerGroup` holds its role's actor handles in rank order and, per rank, the :class:`Slot`
it was started from (placement bundle, Ray options, constructor arguments), so that a lost member
can be started again exactly as before. Calls go to every member (or to some ranks) with the same
arguments, or with one argument per rank (:func:`per_rank`); results come back in rank order.

``ray`` is imported inside the methods: importing this module must not start or configure Ray (the
launcher sets Ray's environment first, see ``ray_runtime.init_ray_environment``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("loongsage")


@dataclass(frozen=True)
class Slot:
    """How one member is started: its placement bundle (None: outside the placement group), the
    Ray actor options that place it there, and its constructor arguments."""

    bundle: int | None
    options: dict[str, Any] = field(default_factory=dict)
    args: tuple = ()


class _PerRank:
    def __init__(self, values: Sequence[Any]):
        self.values = list(values)


def per_rank(values: Sequence[Any]) -> Any:
    """An argument that differs per rank: the ``i``-th called member gets ``values[i]``."""
    return _PerRank(values)


class WorkerGroup:
    """The actors of one role, in rank order.

    ``actors`` is the live list: a holder may swap a member in itself (the engine router does, once a
    lost engine's replacement holds the current weights), so it is shared by reference, never copied.
    ``ready`` names the member method whose first answer means the member has started.
    """

    def __init__(
        self,
        role: str,
        actors: Sequence[Any],
        slots: Sequence[Slot] = (),
        *,
        ready: str = "__ray_ready__",
        actor_class: Any = None,
    ):
        if slots and len(slots) != len(actors):
            raise ValueError(f"{role}: {len(actors)} actors but {len(slots)} slots")
        self.role, self.actors, self.slots, self.ready = role, list(actors), list(slots), ready
        self._actor_class = actor_class  # the ray.remote class, to start a replacement
        # every actor this group started and has not killed, replacements not (yet) in ``actors``
        # included: what kill() releases
        self._owned: list[Any] = list(actors)
        self._lock = threading.Lock()  # replacements of different ranks start in worker threads

    @classmethod
    def start(
        cls, role: str, worker_class: type, slots: Sequence[Slot], *, ready: str = "__ray_ready__"
    ) -> WorkerGroup:
        """Start one ``worker_class`` actor per slot, in rank order, without waiting for them (see
        :meth:`ready_refs`); what was started before a failure is killed."""
        import ray

        remote = ray.remote(worker_class)
        actors: list[Any] = []
        try:
            for slot in slots:
                actors.append(remote.options(**slot.options).remote(*slot.args))
        except BaseException:
            for actor in actors:
                ray.kill(actor)
            raise
        return cls(role, actors, slots, ready=ready, actor_class=remote)

    # ------------------------------------------------------------------ members
    def __len__(self) -> int:
        return len(self.actors)

    def __repr__(self) -> str:
        return f"WorkerGroup({self.role!r}, {len(self.actors)} actors)"

    def only(self) -> Any | None:
        """The member of a role that has at most one (the reward worker, the critic); None when empty."""
        if len(self.actors) > 1:
            raise ValueError(f"{self.role}: {len(self.actors)} actors, not one")
        return self.actors[0] if self.actors else None

    # ------------------------------------------------------------------ calls
    def call_async(self, method: str, *args: Any, ranks: Sequence[int] | None = None, **kwargs: Any) -> list[Any]:
        """Call ``method`` on every member (or on ``ranks``, in that order) without waiting: one Ray
        ObjectRef per called member, in order (``ray.get`` them, or ``await`` them on an event loop).
        An argument wrapped in :func:`per_rank` gives each called member its own value."""
        targets = list(range(len(self.actors))) if ranks is None else list(ranks)
        for value in (*args, *kwargs.values()):
            if isinstance(value, _PerRank) and len(value.values) != len(targets):
                raise ValueError(f"{self.role}.{method}: {len(value.values)} per-rank values for {len(targets)} ranks")

        def pick(value: Any, i: int) -> Any:
            return value.values[i] if isinstance(value, _PerRank) else value

        return [
            getattr(self.actors[rank], method).remote(
                *(pick(a, i) for a in args), **{k: pick(v, i) for k, v in kwargs.items()}
            )
            for i, rank in enumerate(targets)
        ]

    def call(self, method: str, *args: Any, ranks: Sequence[int] | None = None, **kwargs: Any) -> list[Any]:
        """:meth:`call_async` and wait: the results in rank order (the first failure raises)."""
        import ray

        return ray.get(self.call_async(method, *args, ranks=ranks, **kwargs))

    def ready_refs(self) -> list[Any]:
        """One ref per member that resolves once it has started (its ``ready`` method's first answer),
        to wait for several groups together, so that they start concurrently."""
        return self.call_async(self.ready)

    # ------------------------------------------------------------------ lifecycle
    def replace(self, rank: int, *, install: bool = True, timeout_s: float | None = None) -> Any:
        """Kill member ``rank`` (a hung actor must let go of its bundle) and start a new one from the
        same slot; blocks until it has started (at most ``timeout_s``) and returns its handle.
        ``install=False`` leaves ``actors`` as it is, for a holder that swaps the replacement in
        itself once it is usable; the group still owns it (:meth:`kill` releases it)."""
        import ray

        if self._actor_class is None or not self.slots:
            raise RuntimeError(f"{self.role}: the group was not started from slots; it cannot start a member again")
        lost = self.actors[rank]
        try:
            ray.kill(lost, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
        actor = self._actor_class.options(**self.slots[rank].options).remote(*self.slots[rank].args)
        with self._lock:
            self._owned = [a for a in self._owned if a is not lost] + [actor]
        try:
            ray.get(getattr(actor, self.ready).remote(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            ray.kill(actor)
            with self._lock:
                self._owned = [a for a in self._owned if a is not actor]
            raise RuntimeError(
                f"{self.role} {rank}: its replacement did not start within {timeout_s:g} s "
                f"(free: {ray.available_resources()})"
            ) from None
        log.info("%s %d: replacement started", self.role, rank)
        if install:
            self.actors[rank] = actor
        return actor

    def kill(self) -> None:
        """Kill every actor the group started and has not killed (replacements not swapped in yet
        included), each on its own: one that fails to die does not keep the others alive. The first
        failure is raised once all were tried."""
        import ray

        with self._lock:
            owned, self._owned = self._owned, []
        errors: list[Exception] = []
        for actor in owned:
            try:
                ray.kill(actor)
            except Exception as exc:  # noqa: BLE001 - raised below, after the others
                errors.append(exc)
        if errors:
            raise errors[0]


def wait_ready(groups: Sequence[WorkerGroup]) -> None:
    """Block until every member of ``groups`` has started (they start concurrently)."""
    import ray

    ray.get([ref for group in groups for ref in group.ready_refs()])
