"""The ``sandboxes`` run service under a real Ray: an actor holding the pool, sessions reached from
the caller's process, a host program's files handed to the sandbox, the ``code_tests`` reward
testing inside a trajectory's own sandbox, leases ended by ``finish``, and the command agent giving
its sandbox back when it is cancelled mid-episode."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

from loongsage.agentflow.agents.blackbox import CommandAgent
from loongsage.agentflow.gateway.server import Gateway
from loongsage.agentflow.gateway.service import ChatService
from loongsage.core.contracts import RewardContext
from loongsage.core.plugins import load_registry
from loongsage.core.rollout import AgentContext
from loongsage.core.services import ServiceContext
from loongsage.core.types import DataRecord, SamplingParams, Trajectory
from loongsage.sandbox.code_reward import CodeTestsReward
from loongsage.sandbox.service import SandboxService, sandbox_of
from tests.sandbox.conftest import assert_clean, needs_jail, run

pytestmark = [needs_jail, pytest.mark.timeout(300)]

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
        response_text="```python\ndef f(x):\n    return 0\n```",
    )


def context(tmp_path: Path) -> ServiceContext:
    return ServiceContext(
        engine=None, tokenizer=None, model_path="", run_dir=tmp_path / "run", registry=load_registry(), seed=0
    )


def service(root: Path, **params) -> SandboxService:
    return SandboxService(backend={"name": "local", "params": {"root": str(root)}}, **params)


def test_reward_tests_in_the_trajectorys_own_sandbox_and_finish_releases_it(ray_module, tmp_path, root):
    async def go():
        svc = service(root, warm=1, max_sandboxes=4)
        sandboxes = await svc.start(context(tmp_path))
        try:
            right, wrong, planted = [await sandboxes.acquire(f"g0-s{k}") for k in range(3)]
            # what a program on the host writes into the sandbox's directory...
            Path(right.host_path, "solution.py").write_text("def f(x):\n    return 7*x+3\n")
            Path(wrong.host_path, "solution.py").write_text("def f(x):\n    return 7*x\n")
            os.symlink("/etc", Path(planted.host_path, ".loongsage_tests"))  # where the harness would go
            assert await right.adopt() == 1 and await right.adopt() == 0
            # ...is the sandbox's: its uid may change it, and reads it back through the actor
            result = await right.exec("echo '# edited inside' >> solution.py && tail -1 solution.py", 10)
            assert result.exit_code == 0 and result.stdout == "# edited inside\n", result
            assert (await right.get("solution.py")).startswith(b"def f(x)")

            trajectories = [trajectory(k) for k in range(4)]
            for box, t in zip((right, wrong, planted), trajectories):
                box.attach(t)
            ctx = RewardContext(services={"sandboxes": svc.share()})
            assert sandbox_of(trajectories[0], ctx).sandbox_id == right.sandbox_id
            assert sandbox_of(trajectories[3], ctx) is None
            reward = CodeTestsReward(solution_file="solution.py", timeout_s=20)
            scores = await asyncio.gather(*(reward(t, RECORD, ctx) for t in trajectories[:3]))
            assert scores == [1.0, 0.0, 0.0]  # the files, not the responses (which all return 0)
            assert trajectories[0].metadata["code_tests"] == {"passed": 2, "total": 2, "in_own_sandbox": True}
            with pytest.raises(
                ValueError, match=r"^code_tests.solution_file='solution.py': trajectory 0/3 .* no sandbox"
            ):
                await reward(trajectories[3], RECORD, ctx)
            # without solution_file a trajectory with a sandbox is still tested in it, on its response
            assert await CodeTestsReward()(trajectories[0], RECORD, ctx) == 0.0
            assert trajectories[0].metadata["code_tests"]["in_own_sandbox"]

            await svc.finish(trajectories)
            stats = svc.metrics()
            assert stats["sandbox/leased"] == 0 and stats["sandbox/acquired"] == stats["sandbox/released"] == 3, stats
            with pytest.raises(LookupError):  # released: the id is no longer a lease (deleted or emptied)
                await right.get("solution.py")
        finally:
            await svc.stop()

    run(go())
    assert_clean(root)


def test_a_cancelled_command_episode_gives_its_sandbox_back(ray_module, tmp_path, root, tag):
    from loongsage.agentflow.gateway.engines import DirectEngine
    from loongsage.core.engine.native import NativeEngine
    from loongsage.core.tinytask.tiny_model import build_tiny_qwen3

    _, tokenizer = build_tiny_qwen3(tmp_path / "model")
    engine = DirectEngine(NativeEngine(str(tmp_path / "model"), max_model_len=256, max_batch_size=2))
    pids = tmp_path / "pids"
    pids.mkdir()
    agent = CommandAgent(
        command=[sys.executable, str(Path(__file__).parents[1] / "agentflow" / "programs" / "sleeper.py")],
        sandbox=True,
        network="host",
        env={"PIDS_DIR": str(pids), "LOONGSAGE_TEST_TAG": tag},
    )
    assert agent.required_services == ("gateway", "sandboxes")

    async def go():
        svc = service(root, max_sandboxes=4)
        sandboxes = await svc.start(context(tmp_path))
        gateway = Gateway(ChatService(engine, tokenizer))  # the sleeper never asks it anything
        await gateway.start()
        try:
            ctx = AgentContext(
                engine=None,
                tokenizer=tokenizer,
                sampling=SamplingParams(n=2),
                group_id=3,
                services={"gateway": gateway, "sandboxes": sandboxes},
            )
            task = asyncio.ensure_future(agent.run(RECORD, ctx))
            while len(list(pids.iterdir())) < 2:  # both episodes' programs are running, in their sandboxes
                await asyncio.sleep(0.05)
            assert (await svc._host.stats.remote())["sandbox/leased"] == 2
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            stats = await svc._host.stats.remote()
            assert stats["sandbox/leased"] == 0 and stats["sandbox/released"] == 2, stats
        finally:
            await gateway.stop()
            await svc.stop()

    run(go())
    from tests._procs import survivors

    assert survivors(tag) == []
    assert_clean(root)
