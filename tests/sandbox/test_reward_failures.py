"""A reward that cannot score one trajectory fails or scores that trajectory, never its batch: an
agent that filled its own sandbox is scored 0 by ``code_tests``, and the reward worker turns what
any reward raises on one trajectory into that trajectory's failure."""

from __future__ import annotations

import asyncio

import pytest

from loongsage.core.contracts import RewardContext
from loongsage.core.plugins import load_registry
from loongsage.core.services import ServiceContext
from loongsage.core.types import DataRecord, Trajectory
from loongsage.sandbox.code_reward import CodeTestsReward
from loongsage.sandbox.service import SandboxService
from tests.sandbox.conftest import needs_jail, run

TESTS = ["assert f(0) == 3", "assert f(2) == 17"]
RECORD = DataRecord(source="code", index=0, prompt="write f", metadata={"tests": TESTS})


def trajectory(k: int) -> Trajectory:
    return Trajectory(
        source="code",
        group_id=0,
        sample_index=k,
        prompt_ids=[1],
        response_ids=[2],
        loss_mask=[1],
        rollout_logprobs=[0.0],
        versions=[0],
        response_text="def f(x):\n    return 7*x+3\n",
    )


@needs_jail
@pytest.mark.timeout(300)
def test_an_agent_that_fills_its_sandbox_scores_zero_and_the_batch_goes_on(ray_module, tmp_path, root):
    async def go():
        svc = SandboxService(
            backend={"name": "local", "params": {"root": str(root), "limits": {"work_mb": 4}}}, warm=0, max_sandboxes=2
        )
        sandboxes = await svc.start(
            ServiceContext(
                engine=None, tokenizer=None, model_path="", run_dir=tmp_path / "run", registry=load_registry(), seed=0
            )
        )
        try:
            full, fine = [await sandboxes.acquire(f"g0-s{k}") for k in range(2)]
            for box in (full, fine):
                await box.exec("printf 'def f(x):\\n    return 7*x+3\\n' > solution.py", 10)
            filled = await full.exec("cat /dev/zero > fill; df -k . | tail -1", 30)  # ENOSPC: the tmpfs is full
            assert " 100% " in filled.stdout, filled
            trajectories = [trajectory(k) for k in range(2)]
            full.attach(trajectories[0])
            fine.attach(trajectories[1])
            ctx = RewardContext(services={"sandboxes": svc.share()})
            reward = CodeTestsReward(solution_file="solution.py", timeout_s=20)
            assert await asyncio.gather(*(reward(t, RECORD, ctx) for t in trajectories)) == [0.0, 1.0]
            await svc.finish(trajectories)
        finally:
            await svc.stop()

    run(go())
