"""Rollout schedulers (hook ``loongsage_rollout_schedulers``): pure decisions over counters.

The rollout service asks its scheduler, per data source, how many groups to dispatch now
(:meth:`groups_to_dispatch`) and whether a finished group may enter the next training batch
(:meth:`collectable`); both look only at a :class:`SchedulerState`, so they are tested without Ray.
``max_staleness`` (η) is how many policy versions the oldest token of a trained trajectory may lag
behind the policy that trains on it; the service never trains on a group beyond it.

Counting in groups of one source, with ``B`` its groups per step:

* ``sync`` (η = 0): dispatch one step's ``B`` groups once the previous ones are consumed.
* ``one_step_off`` (η = 1): the next step's groups are generated while the current step trains:
  one step's worth is kept in flight or buffered (what a batch consumed, or a filter dropped, is
  dispatched again).
* ``no_window`` (η): keep the pipe full up to the staleness bound: the groups consumed, kept or
  running may not exceed ``(η + version + 1) · B`` (AReaL's bound; ``consumed = version · B``, so at
  most ``(η + 1) · B`` are in flight or buffered).
* ``window_gated`` (η): as ``no_window``, and the span from the oldest unconsumed group to the next
  one dispatched stays under ``(η + 1) · B``, so one slow group holds dispatch back instead of
  letting the others run ahead.
* ``windowed_fifo`` (η): as ``window_gated``, and a batch takes only groups within ``B`` of the
  oldest unconsumed one: batches follow dispatch order closely (the most reproducible async mode).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from loongsage.core.schema import ranged
from loongsage.core.types import SchedulerState


@dataclass
class SyncScheduler:
    """Synchronous: dispatch exactly one step's groups, and only once the previous step is consumed."""

    asynchronous: ClassVar[bool] = False
    max_staleness: ClassVar[int] = 0
    collectable: ClassVar[None] = None  # any finished group

    def groups_to_dispatch(self, state: SchedulerState) -> int:
        if state.in_flight or state.buffered:
            return 0
        return state.groups_per_step


@dataclass
class OneStepOffScheduler:
    """The next step's groups are generated while the current step trains (staleness 1)."""

    asynchronous: ClassVar[bool] = True
    max_staleness: ClassVar[int] = 1
    collectable: ClassVar[None] = None

    def groups_to_dispatch(self, state: SchedulerState) -> int:
        # exactly one step ahead: what the step being trained consumed is dispatched again (a second
        # step's worth would be sampled two versions behind the policy that trains on it, and dropped)
        return max(0, state.groups_per_step - state.in_flight - state.buffered)


@dataclass
class NoWindowScheduler:
    """Fully asynchronous: as many groups in flight as the staleness bound allows."""

    max_staleness: int = ranged(1, ge=0, note="policy versions a trained token may lag")
    asynchronous: ClassVar[bool] = True
    collectable: ClassVar[None] = None

    def budget(self, state: SchedulerState) -> int:
        """Groups the staleness bound still allows: (η + version + 1)·B minus those consumed, kept
        or running (filtered-out groups no longer count: their places are refilled)."""
        live = state.consumed + state.buffered + state.in_flight
        return (self.max_staleness + state.version + 1) * state.groups_per_step - live

    def groups_to_dispatch(self, state: SchedulerState) -> int:
        return max(0, self.budget(state))


@dataclass
class WindowGatedScheduler(NoWindowScheduler):
    """Fully asynchronous, with dispatch gated by a window over the oldest unconsumed group."""

    def groups_to_dispatch(self, state: SchedulerState) -> int:
        window = (self.max_staleness + 1) * state.groups_per_step - (state.dispatched - state.oldest_unconsumed)
        return max(0, min(self.budget(state), window))


@dataclass
class WindowedFifoScheduler(WindowGatedScheduler):
    """Fully asynchronous; a batch takes only groups within one step of the oldest unconsumed one."""

    def collectable(self, seq: int, state: SchedulerState) -> bool:
        return seq < state.oldest_unconsumed + state.groups_per_step


SCHEDULERS = {
    "sync": SyncScheduler,
    "one_step_off": OneStepOffScheduler,
    "no_window": NoWindowScheduler,
    "window_gated": WindowGatedScheduler,
    "windowed_fifo": WindowedFifoScheduler,
}
