"""``tool_agent``: a multi-turn tool-calling agent that reaches the policy only through the gateway.

For each of a group's ``n`` samples the agent opens a gateway session, talks to it with the official
``openai`` client (the messages, the tools' schemas, the turn's sampling), runs the tool calls the
model makes and appends their results, until the model answers without a call or ``max_turns``
replies were sampled; then it closes the session and exports its trajectory. The tokens come from
the gateway's store (exact engine tokens, loss mask 1 on the model's tokens only, their log-probs
and weight versions), never from re-tokenized text; the reward is scored later, by the run's reward.

The gateway is the run's ``gateway`` service (``services: [{name: gateway}]`` in the config):
``ctx.services["gateway"]``, a started :class:`~loongsage.agentflow.gateway.server.Gateway` on the loop the
agent runs on. Sessions carry the agent's engine client (``ctx.engine``), so under an asynchronous
scheduler the episode's calls are in the group's call log that checkpoints replay.

Sampling per turn comes from ``ctx.sampling`` (temperature, top-p/k, min-p, ``max_new_tokens``
unless ``max_tokens`` is set). A sampled request's seed is derived from the group's seed, the
sample and the turn, so a group run twice asks the engine the same questions (what replaying a
checkpointed group needs); greedy requests carry none.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import tempfile
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, ClassVar

from loongsage.agentflow.agents.chat_agent import gateway_of
from loongsage.agentflow.agents.tools import ToolBox, schemas, write_files
from loongsage.core.concurrency import gather_all
from loongsage.core.rollout.seeds import request_seed
from loongsage.core.types import DataRecord, Trajectory

_UNSAFE = re.compile(r"[^A-Za-z0-9_.\-]")
_TURN_SEEDS = 1 << 16  # seed slots per sample: turns of one sample never share a seed with another's


@dataclass
class ToolAgent:
    """``tool_agent``: ``n`` independent multi-turn episodes per record, each in its own gateway session.

    ``tools`` names the tools offered (their schemas are sent with every request, so the chat
    template renders them: a warm start must be trained with the same list). ``read_file`` reads
    inside a folder of the episode's own, filled from ``record.metadata["files"]`` (relative path ->
    text) when the record has any. ``max_turns`` bounds the replies sampled per episode.
    """

    max_turns: int = 4
    tools: list[str] = field(default_factory=lambda: ["calculator"])
    system_prompt: str | None = None
    max_tokens: int | None = None  # per turn; None: ctx.sampling.max_new_tokens
    request_timeout: float = 300.0  # seconds per request (the engine may be busy with a whole batch)
    max_retries: int = 2  # transport-level retries; the gateway answers a repeated request from memory
    model: str = "policy"
    service: str = "gateway"

    required_services: ClassVar[tuple[str, ...]] = ("gateway",)
    _attempts: Counter = field(default_factory=Counter, init=False, repr=False, compare=False)
    _clients: weakref.WeakKeyDictionary = field(
        default_factory=weakref.WeakKeyDictionary, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ValueError(f"tool_agent.max_turns={self.max_turns}: must be >= 1")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"tool_agent.max_tokens={self.max_tokens}: must be >= 1 (or null)")
        self.required_services = (self.service,)  # checked against the config's services at validation
        self.tools = list(self.tools)
        try:
            self._schemas = schemas(self.tools)
        except ValueError as exc:
            raise ValueError(f"tool_agent.{exc}") from None

    async def run(self, record: DataRecord, ctx: Any) -> list[Trajectory]:
        gateway = gateway_of(ctx, self.service, "tool_agent")
        return await gather_all(*(self._episode(record, ctx, gateway, k) for k in range(ctx.sampling.n)))

    async def _episode(self, record: DataRecord, ctx: Any, gateway: Any, k: int) -> Trajectory:
        from openai import AsyncOpenAI, BadRequestError

        name = f"{_UNSAFE.sub('_', record.source)[:64] or 'source'}-g{ctx.group_id}-s{k}"
        trajectory_id = name if name[0].isalnum() else f"t{name}"
        # a group run again (a stale group's prompt, a restored run) is a newer attempt of its trajectory
        attempt = self._attempts[trajectory_id]
        self._attempts[trajectory_id] += 1
        info = gateway.open_session(trajectory_id, attempt, engine=ctx.engine)
        workdir = tempfile.mkdtemp(prefix="loongsage-episode-") if "read_file" in self.tools else None
        box = ToolBox(tuple(self.tools), workdir)
        messages = self._messages(record)
        ended, turns = "max_turns", 0
        try:
            if workdir is not None and record.metadata.get("files"):
                write_files(workdir, record.metadata["files"])
            client = AsyncOpenAI(
                base_url=info.openai_base_url,
                api_key=info.api_key or "none",
                timeout=self.request_timeout,
                max_retries=self.max_retries,
                http_client=self._http_client(),
            )
            for turn in range(self.max_turns):
                try:
                    response = await client.chat.completions.create(
                        model=self.model, messages=messages, tools=self._schemas, **self._sampling(ctx, k, turn)
                    )
                except BadRequestError as exc:
                    if getattr(exc, "code", None) == "context_length_exceeded":
                        ended = "budget"  # the gateway marked the line truncated
                        break
                    raise
                turns += 1
                message = response.choices[0].message
                messages.append(message.model_dump(exclude_none=True))
                if not message.tool_calls:
                    ended = "answer"
                    break
                for call in message.tool_calls:
                    result = box.execute(call.function.name, call.function.arguments)
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        finally:
            session = await gateway.close_session(trajectory_id, attempt)
            if workdir is not None:
                shutil.rmtree(workdir, ignore_errors=True)
        lines = session.trajectories(source=record.source, group_id=ctx.group_id, first_sample_index=k)
        if not lines:
            raise RuntimeError(f"tool_agent: session {trajectory_id}/{attempt} recorded no turn")
        trajectory = lines[-1]  # the line the conversation ended on (there is one: every turn extends it)
        trajectory.sample_index = k
        trajectory.metadata.update(
            {
                "record_index": record.index,
                "turns": turns,
                "ended": ended,
                "lines": len(lines),
                "tool_calls": box.calls,
                "tool_errors": box.errors,
                "tool_used": bool(box.used),
            }
        )
        return trajectory

    def _http_client(self) -> Any:
        """One HTTP client per event loop, shared by the episodes on it: a client of its own per
        episode would cost tens of milliseconds (its TLS context) and a connection pool each."""
        import httpx

        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None or client.is_closed:
            # as many connections as episodes in flight: the engine batches what arrives together
            client = httpx.AsyncClient(limits=httpx.Limits(max_connections=4096, max_keepalive_connections=512))
            self._clients[loop] = client
        return client

    def _messages(self, record: DataRecord) -> list[dict[str, Any]]:
        prompt = record.prompt
        messages = [dict(m) for m in prompt] if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        if self.system_prompt and not (messages and messages[0].get("role") == "system"):
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages

    def _sampling(self, ctx: Any, sample: int, turn: int) -> dict[str, Any]:
        """The request fields of one turn (``top_k``/``min_p`` are no OpenAI fields: sent as extras)."""
        sampling = ctx.sampling
        fields: dict[str, Any] = {
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "max_tokens": self.max_tokens or sampling.max_new_tokens,
            "n": 1,
        }
        if not sampling.greedy:
            # the rollout seeds each group (request_seed of the run's seed and the group id)
            base = request_seed(0, ctx.group_id) if sampling.seed is None else sampling.seed
            fields["seed"] = request_seed(base, sample * _TURN_SEEDS + turn)
        extra = {k: v for k, v in (("top_k", sampling.top_k), ("min_p", sampling.min_p)) if v}
        if extra:
            fields["extra_body"] = extra
        return fields
