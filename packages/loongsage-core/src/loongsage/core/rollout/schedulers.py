"""Rollout schedulers (hook ``loongsage_rollout_schedulers``): pure decisions over counters."""

from __future__ import annotations

from dataclasses import dataclass

from loongsage.core.types import SchedulerState


@dataclass
class SyncScheduler:
    """Synchronous: dispatch exactly one step's groups, and only once the previous step is consumed."""

    def groups_to_dispatch(self, state: SchedulerState) -> int:
        if state.in_flight or state.buffered:
            return 0
        return state.groups_per_step
