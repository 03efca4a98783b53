"""What agents see and the built-in single-turn agent.

The single-turn agent calls an engine directly with token ids (no HTTP on the hot path).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from loongsage.core.concurrency import gather_all
from loongsage.core.rollout.router import EngineRouter
from loongsage.core.types import DataRecord, FinishReason, SamplingParams, Status, Trajectory


@dataclass
class AgentContext:
    """What an agent may use: the engine (token-in, token-out), the tokenizer, its sampling.

    ``engine`` has the router's interface: ``async generate(input_ids, sampling, session=None)`` and
    ``release_session(session)``. It is the :class:`EngineRouter` itself, or, for a training group of
    an asynchronous run, a recorder in front of it that logs the group's calls for checkpoints
    (:mod:`loongsage.core.rollout.replay`). ``services`` are the run's services by name (the chat
    gateway: ``services["gateway"]``; see :mod:`loongsage.core.services`). ``private_paths``: paths
    of the run that the programs an agent runs must not see: every data source's file (they hold
    the labels) and the run's folder (its checkpoints); the ``command`` agent hides them inside its
    jail.
    """

    engine: EngineRouter | Any
    tokenizer: Any
    sampling: SamplingParams
    group_id: int
    services: dict[str, Any] = field(default_factory=dict)
    private_paths: tuple[str, ...] = ()


_STATUS = {FinishReason.STOP: Status.OK, FinishReason.LENGTH: Status.TRUNCATED, FinishReason.ABORT: Status.ABORTED}


def encode_prompt(tokenizer: Any, prompt: str | list[dict[str, Any]], template: str) -> list[int]:
    if isinstance(prompt, list) or template == "chat":
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        return list(
            tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        )
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
                source=record.source,
                group_id=ctx.group_id,
                sample_index=k,
                prompt_ids=list(prompt_ids),
                response_ids=list(r.output_ids),
                loss_mask=[1] * len(r.output_ids),
                rollout_logprobs=list(r.logprobs),
                versions=list(r.versions),
                status=_STATUS[r.finish_reason],
                response_text=ctx.tokenizer.decode(r.output_ids, skip_special_tokens=True),
                routed_experts=r.routed_experts,
                metadata={"record_index": record.index},
            )
            for k, r in enumerate(results)
        ]


async def gather_groups(
    agent_for: dict[str, Any], records: list[DataRecord], contexts: list[AgentContext]
) -> list[list[Trajectory]]:
    """Run every record's agent concurrently; the engine batches what arrives together."""
    return await gather_all(*(agent_for[r.source].run(r, c) for r, c in zip(records, contexts)))
