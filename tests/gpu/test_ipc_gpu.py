"""The ``ipc`` transport on one GPU under Ray: a trainer-side actor pushes into a real engine worker on
the same card, packed in many buckets and in place (the engine reading the trainer's tensors). After
every update the engine's weights equal the pushed ones bit for bit; a bad update is a clear error
and the engine keeps its version and keeps serving; tensors that are new at every push go the packed
way after two pushes."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
ray = pytest.importorskip("ray")

sys.path.insert(0, str(Path(__file__).parents[1] / "core" / "engine"))
from _engine_helpers import build_engine_test_model, prompts  # noqa: E402

PLUGINS = "plugins=[loongsage.algos.plugin,loongsage.sync.plugin]"


class Sender:
    def __init__(self, model_path: str):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).cuda()
        self.transports = {}  # one per way, kept across pushes as a trainer keeps its transport

    def push(
        self,
        engine,
        seed: int,
        bucket_mb: float,
        *,
        in_place: bool = False,
        extra: dict | None = None,
        copies: bool = False,
    ) -> tuple[dict, dict, int]:
        """Change the weights, push them; ``copies``: push fresh copies (new tensors at every push)."""
        from loongsage.core.buckets import checksums
        from loongsage.sync.ipc import IpcTransport

        g = torch.Generator(device="cuda").manual_seed(seed)
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=g, device="cuda", dtype=p.dtype))
        weights = {n: t.clone() if copies else t for n, t in self.model.state_dict().items()}
        weights.update({n: t.cuda() for n, t in (extra or {}).items()})
        transport = self.transports.setdefault(
            (bucket_mb, in_place), IpcTransport(bucket_mb=bucket_mb, in_place=in_place)
        )
        stats = transport.push(weights.items(), [engine])
        return stats, checksums(self.model.state_dict().items()), transport._shares


@pytest.fixture(scope="module")
def cluster():
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Sender travels by value to its actor
    ray.init(num_gpus=1, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_ipc_updates_arrive_bit_for_bit_and_a_bad_one_changes_nothing(cluster, tmp_path):
    from loongsage.core.config import load_config
    from loongsage.core.rollout import EngineRouter
    from loongsage.core.types import SamplingParams
    from loongsage.core.workers import EngineWorker

    model = build_engine_test_model(tmp_path / "m")
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(model).to(torch.bfloat16).save_pretrained(model)
    cfg, _ = load_config(
        "tiny/grpo_arith_cpu",
        [
            PLUGINS,
            "model.dtype=bfloat16",
            "rollout.transport={name: ipc}",
            "rollout.engine={name: native, params: {device: cuda, max_model_len: 256}}",
        ],
    )
    gpu = {"num_gpus": 0.4, "num_cpus": 0}
    engine = ray.remote(EngineWorker).options(**gpu, max_concurrency=8).remote(cfg, model, 0, 1)
    sender = ray.remote(Sender).options(**gpu).remote(model)

    def pushed(version: int, **how) -> tuple[dict, int]:
        stats, expected, shares = ray.get(sender.push.remote(engine, version, 0.01, **how))
        assert stats["sync/version"] == version, stats
        got = ray.get(engine.weight_checksums.remote())
        assert {n: got[n] for n in expected} == expected
        return stats, shares

    for version in (1, 2):  # packed
        assert pushed(version)[0]["sync/buckets"] > 5
    # in place: shared once, then "the same tensors" and one copy
    assert [pushed(v, in_place=True)[1] for v in (3, 4, 5)] == [1, 1, 1]
    with pytest.raises(Exception, match="has shape"):
        bad = {"model.norm.weight": torch.zeros(3, dtype=torch.bfloat16)}
        ray.get(sender.push.remote(engine, 6, 0.01, in_place=True, extra=bad))
    assert ray.get(engine.version.remote()) == 5
    assert [pushed(v, in_place=True)[1] for v in (6, 7)] == [3, 3]  # shared again after the refused share
    with pytest.raises(Exception, match="has shape"):
        ray.get(sender.push.remote(engine, 8, 0.01, extra=bad))  # packed, same refusal
    assert ray.get(engine.version.remote()) == 7
    results = asyncio.run(EngineRouter([engine]).generate(prompts(1)[0], SamplingParams(max_new_tokens=4)))
    assert len(results[0].output_ids) == 4
    # fresh tensors at every push: shared while no two pushes in a row missed, then packed buckets
    ways = [pushed(v, in_place=True, copies=True) for v in (8, 9, 10)]
    assert [shares for _, shares in ways] == [4, 5, 5]
    assert ways[2][0]["sync/buckets"] > 5
