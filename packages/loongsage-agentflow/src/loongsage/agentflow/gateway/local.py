"""Agents against a model of this process, without Ray: a gateway over the embedded engine, and
held-out evaluation (greedy success, pass@k) through it. For tests, calibration and debugging; in a
run the gateway sits on the rollout's engine router instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from loongsage.agentflow.chat.parsers import Qwen3ChatParser
from loongsage.agentflow.gateway.engines import DirectEngine
from loongsage.agentflow.gateway.server import Gateway
from loongsage.agentflow.gateway.service import ChatService
from loongsage.agentflow.trajectories.store import Budget
from loongsage.core.concurrency import gather_all
from loongsage.core.rollout.agents import AgentContext
from loongsage.core.rollout.seeds import request_seed
from loongsage.core.types import DataRecord, SamplingParams


@contextlib.asynccontextmanager
async def local_gateway(
    model_path: str,
    *,
    engine_client: Any = None,
    max_model_len: int = 512,
    max_batch_size: int = 256,
    seed: int = 0,
    budget: Budget | None = None,
    chat_template: str | None = None,
) -> AsyncIterator[Gateway]:
    """A started gateway on this loop over a :class:`~loongsage.core.engine.native.NativeEngine`
    of ``model_path`` (the tokenizer's own chat template unless ``chat_template``, the qwen3 parser).
    ``engine_client(direct)`` may wrap the engine client (a recorder, say)."""
    from transformers import AutoTokenizer

    from loongsage.core.engine.native import NativeEngine

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    engine = NativeEngine(model_path, max_model_len=max_model_len, max_batch_size=max_batch_size, seed=seed)
    client = DirectEngine(engine)
    if engine_client is not None:
        client = engine_client(client)
    service = ChatService(
        client,
        tokenizer,
        parser=Qwen3ChatParser(),
        chat_template=chat_template,
        budget=budget or Budget(max_context_tokens=max_model_len, default_max_tokens=64),
    )
    gateway = Gateway(service)
    await gateway.start()
    try:
        yield gateway
    finally:
        await gateway.stop()


def contexts(gateway: Gateway, sampling: SamplingParams, group_ids: list[int], seed: int) -> list[AgentContext]:
    """Agent contexts handing ``gateway`` as the run's ``gateway`` service, seeded per group as the
    rollout seeds them."""
    return [
        AgentContext(
            gateway.service.engine,
            gateway.service.renderer.tokenizer,
            sampling if sampling.greedy else replace(sampling, seed=request_seed(seed, gid)),
            gid,
            services={"gateway": gateway},
        )
        for gid in group_ids
    ]


async def evaluate(
    agent: Any,
    reward: Any,
    records: list[DataRecord],
    gateway: Gateway,
    sampling: SamplingParams,
    *,
    pass_k: int = 8,
    seed: int = 0,
    concurrency: int = 32,
) -> dict[str, float]:
    """``accuracy`` (greedy, one sample), ``pass@k`` and ``pass@1_sampled`` over ``records``, as the
    run's evaluation counts them (reward >= 1), how often the tool was used (``tool_use_*``), and
    greedy accuracy per ``record.metadata["kind"]`` where records have one (``accuracy/<kind>``)."""
    gate = asyncio.Semaphore(concurrency)

    async def group(record: DataRecord, ctx: AgentContext) -> list[float]:
        async with gate:
            trajectories = await agent.run(record, ctx)
        scores = []
        for t in trajectories:
            value = reward(t, record)
            if inspect.isawaitable(value):  # a reward may grade off the event loop (math-verify does)
                value = await value
            scores.append((value >= 1.0, t.metadata.get("tool_used", False)))
        return scores

    async def phase(s: SamplingParams, phase_id: int) -> list[list[tuple[bool, bool]]]:
        ids = [-1 - (phase_id * len(records) + i) for i in range(len(records))]
        return await gather_all(*(group(r, c) for r, c in zip(records, contexts(gateway, s, ids, seed))))

    greedy = await phase(replace(sampling, temperature=0.0, n=1, seed=None), 0)
    metrics = {
        "accuracy": sum(g[0][0] for g in greedy) / len(greedy),
        "tool_use_greedy": sum(g[0][1] for g in greedy) / len(greedy),
    }
    kinds = [r.metadata.get("kind") for r in records]
    for kind in sorted({k for k in kinds if isinstance(k, str)}):
        hits = [g[0][0] for g, k in zip(greedy, kinds) if k == kind]
        metrics[f"accuracy/{kind}"] = sum(hits) / len(hits)
    if pass_k > 0:
        sampled = await phase(replace(sampling, n=pass_k), 1)
        metrics[f"pass@{pass_k}"] = sum(any(hit for hit, _ in g) for g in sampled) / len(sampled)
        metrics["pass@1_sampled"] = sum(sum(hit for hit, _ in g) / len(g) for g in sampled) / len(sampled)
        metrics["tool_use_sampled"] = sum(sum(used for _, used in g) / len(g) for g in sampled) / len(sampled)
    return metrics
