"""Response lengths: every sample to ``max_new_tokens``, or the simulation's log-normal.

The log-normal is :class:`loongsage.core.sim.engine.LengthModel`'s: a sample's length is its draw
rounded and clamped to ``[1, limit]``. The model needs more than draws from it: the expected number
of live rows at every decode step, ``n · P(L > t)``, and the expected longest of ``n`` samples, which
a synchronous step waits for. Both follow from the survival function ``P(L > t)`` over integer
``t < limit``, computed here once per source (``tests/core/test_throughput.py`` checks it against
``LengthModel.draw``).

Every expectation is a sum over the survival function:

* ``E[L] = Σ_t P(L > t)`` (the decode steps a sample is live);
* ``E[L (L - 1) / 2] = Σ_t t · P(L > t)`` (the generated tokens its keys and values span, summed
  over its decode steps);
* ``E[max of n] = Σ_t (1 - P(L <= t)^n)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from loongsage.core.sim.engine import LengthModel

Z99 = 2.3263478740408408  # the standard normal's 99th percentile, as LengthModel.draw divides by it


@dataclass(frozen=True)
class Lengths:
    """Sampled tokens per sample, at most ``limit`` (the source's ``max_new_tokens``): every sample
    runs to ``limit`` when ``model`` is None, else log-normal by ``model``'s median and 99th percentile."""

    limit: int
    model: LengthModel | None = None
    survival: tuple[float, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.limit < 1:
            raise ValueError(f"limit={self.limit}: a sample has at least one token")
        object.__setattr__(self, "survival", tuple(_survival(self.limit, self.model)))

    @property
    def exact(self) -> bool:
        return self.model is None

    def mean(self) -> float:
        """``E[L]``."""
        return math.fsum(self.survival)

    def generated_context(self) -> float:
        """``E[L (L - 1) / 2]``: over a sample's decode steps, the generated tokens before each one."""
        return math.fsum(t * s for t, s in enumerate(self.survival))

    def mean_square(self) -> float:
        """``E[L^2] = 2 E[L (L - 1) / 2] + E[L]``."""
        return 2 * self.generated_context() + self.mean()


def _survival(limit: int, model: LengthModel | None) -> list[float]:
    """``P(L > t)`` for ``t = 0 .. limit - 1`` (zero from ``limit`` on)."""
    if model is None:
        return [1.0] * limit
    mu, sigma = math.log(model.median), math.log(model.p99 / model.median) / Z99
    if sigma <= 0:  # median == p99: every sample has the median's length
        length = max(1, min(limit, round(model.median)))
        return [1.0 if t < length else 0.0 for t in range(limit)]
    out = [1.0]  # every sample has at least one token
    for t in range(1, limit):  # round(X) > t  <=>  X >= t + 0.5
        out.append(0.5 * math.erfc((math.log(t + 0.5) - mu) / (sigma * math.sqrt(2))))
    return out


def expected_max(parts: Sequence[tuple[Lengths, float]]) -> float:
    """The expected longest sample of ``count`` samples from each ``(lengths, count)`` (counts may be
    fractional: an engine's share), independent draws: ``Σ_t (1 - Π P(L <= t)^count)``."""
    longest = max((lengths.limit for lengths, count in parts if count > 0), default=0)
    total = 0.0
    for t in range(longest):
        below = 1.0
        for lengths, count in parts:
            if count > 0 and t < lengths.limit:
                below *= (1.0 - lengths.survival[t]) ** count
        total += 1.0 - below
    return total
