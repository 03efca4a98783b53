"""Rollout: the engine router, the agent context, the single-turn agent and the sync scheduler.

The single-turn agent calls an engine directly with token ids (no HTTP on the hot path). The
router sends each request to the least-loaded engine replica, sticky per session so the turns of one
trajectory reuse that engine's prefix cache.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass
from typing import Any, Literal

from loongsage.core.types import (
    DataRecord,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    SchedulerState,
    Status,
    Trajectory,
)


class EngineRouter:
    """Least-loaded routing over engine actor handles; sticky per session id.

    Requests made in the same event-loop tick are sent to an engine in ONE actor call, so the engine
    sees them together and batches them, and a step of many prompts costs one round trip per engine.
    """

    def __init__(self, engines: list[Any]):
        if not engines:
            raise ValueError("EngineRouter needs at least one engine")
        self.engines = engines
        self.in_flight = [0] * len(engines)
        self._sticky: dict[str, int] = {}
        self._ids = itertools.count()
        self._pending: dict[int, list[tuple[GenerationRequest, asyncio.Future]]] = {}

    def pick(self, session: str | None = None) -> int:
        if session is not None and session in self._sticky:
            return self._sticky[session]
        index = min(range(len(self.engines)), key=lambda i: self.in_flight[i])
        if session is not None:
            self._sticky[session] = index
        return index

    def release_session(self, session: str) -> None:
        self._sticky.pop(session, None)

    async def generate(self, input_ids: list[int], sampling: SamplingParams, session: str | None = None) -> list[GenerationResult]:
        index = self.pick(session)
        request = GenerationRequest(request_id=f"r{next(self._ids)}", input_ids=input_ids, sampling=sampling)
        future = asyncio.get_running_loop().create_future()
        if index not in self._pending:
            self._pending[index] = []
            asyncio.get_running_loop().call_soon(lambda: asyncio.ensure_future(self._flush(index)))
        self._pending[index].append((request, future))
        self.in_flight[index] += 1
        try:
            return await future
        finally:
            self.in_flight[index] -= 1

    async def _flush(self, index: int) -> None:
        batch = self._pending.pop(index)
        try:
            results = await self.engines[index].generate_many.remote([r for r, _ in batch])
        except Exception as exc:  # the whole call failed: every caller sees it
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        for (_, future), result in zip(batch, results):
            if future.done():
                continue
            if isinstance(result, Exception):
                future.set_exception(result)
            else:
                future.set_result(result)


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


@dataclass
class AgentContext:
    """What an agent may use: the engine (token-in, token-out), the tokenizer, its sampling."""

    engine: EngineRouter
    tokenizer: Any
    sampling: SamplingParams
    group_id: int


_STATUS = {FinishReason.STOP: Status.OK, FinishReason.LENGTH: Status.TRUNCATED, FinishReason.ABORT: Status.ABORTED}


def encode_prompt(tokenizer: Any, prompt: str | list[dict[str, Any]], template: str) -> list[int]:
    if isinstance(prompt, list) or template == "chat":
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))
    return tokenizer.encode(prompt, add_special_tokens=False)


@dataclass
class SingleTurnAgent:
    """One prompt, ``n`` sampled responses, straight from the engine with token ids."""

    prompt_template: Literal["raw", "chat"] = "raw"

    async def run(self, record: DataRecord, ctx: AgentContext) -> list[Trajectory]:
        prompt_ids = encode_prompt(ctx.tokenizer, record.prompt, self.prompt_template)
        results = await ctx.engine.generate(prompt_ids, ctx.sampling, session=f"g{ctx.group_id}")
        ctx.engine.release_session(f"g{ctx.group_id}")
        return [
            Trajectory(
                source=record.source, group_id=ctx.group_id, sample_index=k, prompt_ids=list(prompt_ids),
                response_ids=list(r.output_ids), loss_mask=[1] * len(r.output_ids),
                rollout_logprobs=list(r.logprobs), versions=list(r.versions), status=_STATUS[r.finish_reason],
                response_text=ctx.tokenizer.decode(r.output_ids, skip_special_tokens=True),
                metadata={"record_index": record.index},
            )
            for k, r in enumerate(results)
        ]


@dataclass
class SyncScheduler:
    """Synchronous: dispatch exactly one step's groups, and only once the previous step is consumed."""

    def groups_to_dispatch(self, state: SchedulerState) -> int:
        if state.in_flight or state.buffered:
            return 0
        return state.groups_per_step


async def gather_groups(agent_for: dict[str, Any], records: list[DataRecord], contexts: list[AgentContext]) -> list[list[Trajectory]]:
    """Run every record's agent concurrently; the engine batches what arrives together."""
    return list(await asyncio.gather(*(agent_for[r.source].run(r, c) for r, c in zip(records, contexts))))
