"""Sampling seeds that follow the data stream, so that sampling is reproducible whatever runs it."""

from __future__ import annotations

_MASK64 = (1 << 64) - 1


def request_seed(base_seed: int, group_id: int) -> int:
    """The sampling seed of one group's requests, from the run's seed and the group's id alone.

    Group ids follow the data stream (they are saved with checkpoints), so a resumed run draws
    exactly the samples an uninterrupted one would: no engine's random state needs saving, and the
    draw does not depend on the engine backend, the number of replicas or what shares a batch.
    A splitmix64 finaliser keeps neighbouring ids' seeds unrelated.
    """
    z = (int(base_seed) * 0x9E3779B97F4A7C15 + int(group_id) + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 2  # 62 bits: a valid torch seed
