"""A simulated trainer: a step's seconds follow the tokens of the batch it trains.

The step costs 6 x (parameters in matmuls) x (prompt + response tokens of every trajectory) FLOPs at
the trainer's MFU of the card's bf16 matmul rate, plus the fixed seams of batch building and
transfers: the train-phase terms of the throughput model (:mod:`loongsage.core.throughput`), with
its constants measured on the H200. Long-tailed response lengths make the trainer's step long-tailed
too, which a fixed step time hides.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from loongsage.core.throughput.constants import H200_PEAK_BF16, TRAIN_SEAMS_S, TRAINER_MFU
from loongsage.core.types import Trajectory


@dataclass(frozen=True)
class SimulatedTrainer:
    matmul_params: float  # parameters a token meets in matmuls (the LM head included)
    mfu: float = TRAINER_MFU["torch_compiled"]
    peak_flops: float = H200_PEAK_BF16  # per card
    cards: int = 1  # data-parallel ranks, each training its share of the tokens
    seams_s: float = TRAIN_SEAMS_S

    def __post_init__(self) -> None:
        if not (self.matmul_params > 0 and 0 < self.mfu <= 1 and self.peak_flops > 0 and self.cards >= 1):
            raise ValueError(
                f"SimulatedTrainer: matmul_params={self.matmul_params}, mfu={self.mfu}, "
                f"peak_flops={self.peak_flops}, cards={self.cards}: need positive figures, mfu in (0, 1]"
            )

    def step_s(self, groups: Sequence[Sequence[Trajectory]]) -> float:
        """Simulated seconds of one optimizer step over ``groups``."""
        tokens = sum(len(t.prompt_ids) + len(t.response_ids) for group in groups for t in group)
        return 6 * self.matmul_params * tokens / (self.peak_flops * self.mfu * self.cards) + self.seams_s
