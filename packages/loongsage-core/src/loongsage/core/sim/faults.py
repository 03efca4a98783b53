"""Engine failures planned for a simulated run (:func:`loongsage.core.sim.rollout.simulate_steps`).

A :class:`Fault` kills or silences one engine during one step's rollout, a given number of simulated
seconds after that step's batch was asked for. Its engine is either named, or drawn at the moment it
strikes among the engines holding requests then: least-loaded routing leaves engines idle when a
step has fewer requests than there are engines, and an idle engine's death is only noticed at its
next call or health probe. The draw uses the fault's own seed, so a run and a run resumed from its
checkpoint strike alike.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

KINDS = ("kill", "silence")


@dataclass(frozen=True)
class Fault:
    """``kind`` strikes an engine ``after_s`` simulated seconds into step ``step``'s rollout (0-based):
    ``kill`` (its calls fail as a dead actor's) or ``silence`` (nothing answers, health probes
    included). ``engine``: its index, or None for one of the engines holding requests then."""

    step: int
    after_s: float
    kind: Literal["kill", "silence"]
    engine: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Fault: kind={self.kind!r} must be one of {KINDS}")
        if self.step < 0 or not self.after_s >= 0:
            raise ValueError(f"Fault: step={self.step} and after_s={self.after_s} must be >= 0")

    def strike(self, handles: Sequence[Any]) -> int | None:
        """Apply it to one of ``handles`` (simulated engine handles); returns the index, or None when
        no engine is left to strike."""
        live = [i for i, h in enumerate(handles) if not (h.dead or h.silent)]
        busy = [i for i in live if handles[i].engine.rows or handles[i].engine.waiting]
        if self.engine is not None:
            index = self.engine
        elif busy or live:
            index = random.Random(self.seed).choice(busy or live)
        else:
            return None
        getattr(handles[index], self.kind)()
        return index


def random_faults(
    engines: int, fraction: float, steps: range, *, within_s: float, seed: int, kinds: Sequence[str] = KINDS
) -> list[Fault]:
    """``fraction`` of ``engines`` struck, each in a random step of ``steps``, at a random time in its
    first ``within_s`` simulated seconds, with a random kind of ``kinds``, on an engine holding
    requests then."""
    if not 0 < fraction <= 1:
        raise ValueError(f"random_faults: fraction={fraction} must be in (0, 1]")
    if not steps:
        raise ValueError("random_faults: no step to strike in")
    rng = random.Random(seed)
    return sorted(
        (
            Fault(rng.choice(steps), rng.uniform(0, within_s), rng.choice(list(kinds)), seed=rng.getrandbits(32))
            for _ in range(round(engines * fraction))
        ),
        key=lambda f: (f.step, f.after_s),
    )
