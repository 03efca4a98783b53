"""One metrics type from the loss to the trackers.

A step's metrics are made in several processes: the loss of every micro-batch and the optimizer
step in each trainer rank, the critic in its actor, the step-level sums in the controller. They
travel as :class:`Metrics`, are merged where they meet, and become the tracker's plain
``{name: float}`` once, with :meth:`Metrics.means`.

Three kinds, told apart by how they combine:

* **ratios**, ``(numerator, denominator)`` pairs: summed, reported as their quotient. A token mean
  kept as a pair is the mean over the whole step whatever the micro-batching or DP size;
* **totals**: summed, reported as they are (the weighted loss, whose weights already carry the
  global denominators, so its sum over micro-batches and ranks is the mini-batch's loss);
* **gauges**: the latest value replaces the earlier one (the gradient norm and learning rate of the
  last optimizer step).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Metrics:
    ratios: dict[str, tuple[float, float]] = field(default_factory=dict)
    totals: dict[str, float] = field(default_factory=dict)
    gauges: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, numerator: float, denominator: float) -> Metrics:
        """Add to the ratio ``name``."""
        num, den = self.ratios.get(name, (0.0, 0.0))
        self.ratios[name] = (num + float(numerator), den + float(denominator))
        return self

    def total(self, name: str, value: float) -> Metrics:
        """Add to the total ``name``."""
        self.totals[name] = self.totals.get(name, 0.0) + float(value)
        return self

    def gauge(self, name: str, value: float) -> Metrics:
        """Set the gauge ``name``."""
        self.gauges[name] = float(value)
        return self

    def merge(self, other: Metrics) -> Metrics:
        """Fold ``other`` in (in place): ratios and totals add up, ``other``'s gauges replace these."""
        for name, (num, den) in other.ratios.items():
            self.add(name, num, den)
        for name, value in other.totals.items():
            self.total(name, value)
        self.gauges.update(other.gauges)
        return self

    def without_gauges(self) -> Metrics:
        """The ratios and totals alone: what a process adds to others' reports of the same gauges."""
        return Metrics(dict(self.ratios), dict(self.totals))

    def renamed(self, old_prefix: str, new_prefix: str) -> Metrics:
        """A copy whose names starting with ``old_prefix`` start with ``new_prefix`` instead."""

        def name(key: str) -> str:
            return new_prefix + key[len(old_prefix) :] if key.startswith(old_prefix) else key

        return Metrics(
            {name(k): v for k, v in self.ratios.items()},
            {name(k): v for k, v in self.totals.items()},
            {name(k): v for k, v in self.gauges.items()},
        )

    def means(self) -> dict[str, float]:
        """What the trackers log: totals and gauges as they are, each ratio as its quotient (a ratio
        whose denominator is 0, nothing measured, is left out)."""
        out = {**self.totals, **self.gauges}
        out.update({name: num / den for name, (num, den) in self.ratios.items() if den > 0})
        return out
