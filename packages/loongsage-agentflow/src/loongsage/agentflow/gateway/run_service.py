"""The chat gateway as a run-scoped service: ``services: [{name: gateway, params: {...}}]``.

The controller starts it with the run, on the rollout's event loop (see
:mod:`loongsage.core.services`), so the gateway generates through the run's engine router: turns
wait while a weight update holds generation, turns in flight at an update are cut and continued on
the new weights from their tokens (asynchronous schedulers), and a lost engine's requests go to its
replacement. Agents get the started :class:`~loongsage.agentflow.gateway.server.Gateway` as
``ctx.services["gateway"]`` and open one session per trajectory. Its counters (turns, segments by
category, refusals) join every step's metrics as ``agentflow/*``.

Under ``loongsage serve`` (the context's ``serving`` set) it listens on the port asked for, opens
sessions for agents outside a run and records them (:mod:`loongsage.agentflow.gateway.serve`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from loongsage.agentflow.chat.templates import QWEN3_TOOLS_TEMPLATE
from loongsage.agentflow.gateway.http_guard import REQUEST_S
from loongsage.agentflow.gateway.serve import Served
from loongsage.agentflow.gateway.server import Gateway
from loongsage.agentflow.gateway.service import ChatService
from loongsage.agentflow.trajectories.store import Budget
from loongsage.core.schema import ranged


@dataclass
class GatewayService:
    """An OpenAI/Anthropic-compatible chat endpoint on ``host`` (a free port), one session per trajectory."""

    kind: ClassVar[str] = "service"

    chat_parser: str | None = "qwen3"  # a chat_parser backend (tool calls, reasoning); null = text only
    # "qwen3": the package's Qwen3-style ChatML template with tools and reasoning; "tokenizer": the
    # model tokenizer's own template; anything else: a Jinja template string
    chat_template: str = "qwen3"
    max_context_tokens: int = ranged(4096, ge=1, note="prompt + new tokens of one engine call")
    max_response_tokens: int = ranged(16384, ge=1, note="model tokens of one trajectory, all turns")
    default_max_tokens: int = ranged(1024, ge=1, note="new tokens of a turn whose request names none")
    max_line_tokens: int | None = ranged(
        None, ge=1, note="tokens of one trajectory, prompt and every segment; null: 16 x max_context_tokens"
    )
    max_session_tokens: int | None = ranged(
        None, ge=1, note="model tokens of one session, all trajectories; null: 4 x max_response_tokens"
    )
    max_lines: int = ranged(64, ge=1, note="trajectories of one session: conversations and samples of n > 1")
    max_n: int = ranged(16, ge=1)
    model_name: str = "loongsage"
    host: str = "127.0.0.1"  # loopback: agents run on the driver's machine
    max_body_bytes: int = ranged(8 << 20, ge=1, note="a larger request body is refused (413)")
    max_connections: int | None = ranged(
        None, ge=1, note="open connections at most, more are refused (503); null: a share of the descriptor limit"
    )
    request_timeout_s: float = ranged(REQUEST_S, gt=0, note="to send one whole request; a slower one is closed (408)")
    # loongsage_gateway_middlewares specs, outermost first (see agentflow.gateway.middlewares); a middleware
    # whose factory takes ``run_dir`` gets the run's directory
    middlewares: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.gateway: Gateway | None = None
        self.chat: ChatService | None = None
        self.served: Served | None = None  # under `loongsage serve` only
        self._serving: Any = None

    def _template(self, tokenizer: Any) -> str | None:
        if self.chat_template == "qwen3":
            return QWEN3_TOOLS_TEMPLATE
        if self.chat_template == "tokenizer":
            return None
        return self.chat_template

    async def start(self, ctx: Any) -> Gateway:
        parser = None
        if self.chat_parser:
            parser = ctx.registry.create(
                "chat_parser", {"name": self.chat_parser}, "services.gateway.params.chat_parser"
            )
        budget = Budget(
            max_context_tokens=self.max_context_tokens,
            max_response_tokens=self.max_response_tokens,
            default_max_tokens=self.default_max_tokens,
            max_line_tokens=self.max_line_tokens,
            max_session_tokens=self.max_session_tokens,
            max_lines=self.max_lines,
        )
        self.chat = ChatService(
            ctx.engine,
            ctx.tokenizer,
            parser=parser,
            chat_template=self._template(ctx.tokenizer),
            budget=budget,
            model_name=self.model_name,
            max_n=self.max_n,
        )
        # `loongsage serve` (ctx.serving): its port and host, sessions for outside agents, recorded
        serving = self._serving = ctx.serving
        self.gateway = Gateway(
            self.chat,
            host=(serving and serving.host) or self.host,
            port=serving.port if serving else 0,
            max_body_bytes=self.max_body_bytes,
            max_connections=self.max_connections,
            request_timeout_s=self.request_timeout_s,
            middlewares=[
                self._middleware(ctx, spec, f"services.gateway.params.middlewares.{i}")
                for i, spec in enumerate(self.middlewares)
            ],
        )
        if serving is not None:
            self.served = Served(self.gateway, serving.record_dir)
        await self.gateway.start()
        if self.served is not None:
            serving.lines.extend(self.served.announce())
        return self.gateway

    @staticmethod
    def _middleware(ctx: Any, spec: Any, path: str) -> Any:
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise ValueError(f"{path}: expected a mapping with 'name' (and optional 'params'); got {spec!r}")
        entry = ctx.registry.entry("gateway_middleware", spec["name"], path)
        supplied = {"run_dir": str(ctx.run_dir)} if "run_dir" in entry.factory.receives else {}
        return ctx.registry.create("gateway_middleware", spec, path, **supplied)

    async def stop(self) -> None:
        if self.gateway is not None:
            await self.gateway.stop()
        if self.served is not None:  # after the server: no turn starts while the record is flushed
            self._serving.summary.append(await self.served.finish())

    def metrics(self) -> dict[str, float]:
        return self.chat.metrics() if self.chat is not None else {}
