"""The batch audit (``tracking.batches``): which groups each step trained, where and how stale.

One row per training step in ``<run_dir>/batches.jsonl``: every trained group's source, record
index, group id, staleness (policy version minus its oldest token's), rank and mini-batch. A
resumed run appends; the last row of a step is the one that counts.
"""

from __future__ import annotations

import json
from pathlib import Path

from loongsage.core.step.state import StepFeature, StepState
from loongsage.core.types import Trajectory


class BatchAudit(StepFeature):
    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / "batches.jsonl"

    def fetch(self, state: StepState) -> None:
        trajs, version = state.trajectories, state.version
        groups = []
        for rank, rank_rows in enumerate(state.plan.rows):
            for mb, rows in enumerate(rank_rows):
                members: dict[int, list[Trajectory]] = {}
                for i in rows:
                    members.setdefault(trajs[i].group_id, []).append(trajs[i])
                for gid, group in members.items():
                    tokens = [v for t in group for v in t.versions if v >= 0]
                    groups.append(
                        {
                            "source": group[0].source,
                            "index": group[0].metadata.get("record_index"),
                            "group_id": gid,
                            "staleness": version - min(tokens, default=version),
                            "rank": rank,
                            "mini_batch": mb,
                        }
                    )
        with open(self.path, "a") as fh:
            fh.write(json.dumps({"step": state.step, "version": version, "groups": groups}) + "\n")
