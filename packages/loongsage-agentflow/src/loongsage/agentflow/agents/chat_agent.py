"""The ``chat`` agent: a record's prompt as one chat-completion request through the run's gateway.

The simplest agent that reaches the policy only through the standard endpoint: it opens a gateway
session per group, sends the record's messages (a plain prompt becomes one user message) with the
official ``openai`` client, ``n`` = the group's samples, and takes the session's token
trajectories (exact tokens the engine sampled, rebuilt by the gateway). The same recipe with the
built-in ``single_turn`` agent, which calls the engine with token ids, trains on the same tokens
when the gateway renders the model's own chat template (``chat_template: tokenizer``).

Needs the gateway service in the config: ``services: [{name: gateway, params: {...}}]``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, ClassVar

from loongsage.core.types import DataRecord, Trajectory


def gateway_of(ctx: Any, name: str, agent: str) -> Any:
    """The started gateway service ``name`` from an agent's context, or a one-line error."""
    gateway = ctx.services.get(name)
    if gateway is None:
        raise RuntimeError(
            f"agent {agent!r}: no service {name!r} in this run; add "
            f"services: [{{name: gateway}}] to the config (running: {sorted(ctx.services) or 'none'})"
        )
    return gateway


@dataclass
class ChatAgent:
    """One chat completion (``n`` choices) per group through the gateway service ``service``."""

    service: str = "gateway"
    system: str | None = None  # a system message put before the record's messages
    _attempts: Counter = field(default_factory=Counter, init=False, repr=False)
    required_services: ClassVar[tuple[str, ...]] = ("gateway",)

    def __post_init__(self) -> None:
        self.required_services = (self.service,)  # checked against the config's services at validation

    async def run(self, record: DataRecord, ctx: Any) -> list[Trajectory]:
        from openai import AsyncOpenAI

        gateway = gateway_of(ctx, self.service, "chat")
        messages = record.prompt if isinstance(record.prompt, list) else [{"role": "user", "content": record.prompt}]
        if self.system is not None:
            messages = [{"role": "system", "content": self.system}, *messages]
        # a group run again (a stale group's prompt, a restored run) is a newer attempt of its trajectory
        trajectory = f"g{ctx.group_id}".replace("-", "m")
        attempt = self._attempts[trajectory]
        self._attempts[trajectory] += 1
        info = gateway.open_session(trajectory, attempt, engine=ctx.engine)
        s = ctx.sampling
        client = AsyncOpenAI(base_url=info.openai_base_url, api_key=info.api_key, max_retries=0, timeout=600)
        try:
            await client.chat.completions.create(
                model="loongsage",
                messages=messages,
                n=s.n,
                temperature=s.temperature,
                top_p=s.top_p,
                max_tokens=s.max_new_tokens,
                seed=s.seed,
                extra_body={"top_k": s.top_k, "min_p": s.min_p},
            )
        finally:
            await client.close()
            session = await gateway.close_session(trajectory, attempt)
        trajectories = session.trajectories(source=record.source, group_id=ctx.group_id)
        if len(trajectories) != s.n:
            raise RuntimeError(f"agent 'chat': the gateway recorded {len(trajectories)} lines for n={s.n}")
        for t in trajectories:
            t.metadata["record_index"] = record.index
        return trajectories
