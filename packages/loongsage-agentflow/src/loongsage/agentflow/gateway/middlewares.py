"""Gateway middlewares shipped with AgentFlow (hook ``loongsage_gateway_middlewares``).

A middleware is ``async __call__(request, call_next) -> reply`` (contract
:class:`loongsage.core.contracts.GatewayMiddleware`): ``request`` is ``{"protocol": "openai" |
"anthropic" | "responses", "trajectory", "attempt", "body"}`` (the JSON body, which it may
rewrite), the reply ``{"status", "body"}`` and optionally ``"headers"`` for the HTTP answer.
Configure them on the gateway service, outermost first::

    services:
      - name: gateway
        params:
          middlewares: [{name: request_log}, {name: rate_limit, params: {requests_per_second: 5}}]
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from loongsage.agentflow.chat.errors import APIError
from loongsage.core.schema import ranged

CallNext = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


@dataclass
class RequestLog:
    """One JSON line per chat request: session, protocol, what was asked (message count, tool names,
    streaming), status, wall seconds, the sampled token count, and the error message of a refused
    request. ``path`` defaults to ``<run_dir>/gateway_requests.jsonl``."""

    receives: ClassVar[tuple[str, ...]] = ("run_dir",)
    run_dir: str | None = None  # supplied by the gateway service
    path: str | None = None

    def __post_init__(self) -> None:
        if self.path is None and self.run_dir is None:
            raise ValueError("path: required outside a run (no run directory to write into)")
        self.file = Path(self.path) if self.path else Path(self.run_dir) / "gateway_requests.jsonl"
        self.file.parent.mkdir(parents=True, exist_ok=True)

    async def __call__(self, request: dict[str, Any], call_next: CallNext) -> dict[str, Any]:
        start = time.perf_counter()
        asked = _shape(request["body"], request["protocol"])  # before the chain: a later middleware may rewrite it
        try:
            reply = await call_next(request)
        except Exception as exc:  # a later middleware failed: the client gets a 500, the log says so
            self._write(
                request,
                asked,
                start,
                {"status": 500, "body": {"error": {"message": f"internal error: {type(exc).__name__}"}}},
            )
            raise
        self._write(request, asked, start, reply)
        return reply

    def _write(self, request: dict[str, Any], asked: dict[str, Any], start: float, reply: dict[str, Any]) -> None:
        body = reply.get("body") or {}
        usage = body.get("usage") or {}
        error = body.get("error") or {}
        row = {
            "time": time.time(),
            "trajectory": request["trajectory"],
            "attempt": request["attempt"],
            "protocol": request["protocol"],
            **asked,
            "status": reply.get("status"),
            "seconds": round(time.perf_counter() - start, 6),
            "completion_tokens": usage.get("completion_tokens", usage.get("output_tokens")),
            "error": error.get("message"),
        }
        with self.file.open("a") as fh:
            fh.write(json.dumps(row) + "\n")


def _shape(body: Any, protocol: str) -> dict[str, Any]:
    """What a request asked for, in any protocol: its message count (Responses: ``input`` items, a
    string being one), tool names, streaming."""
    if not isinstance(body, dict):
        return {"messages": None, "tools": None, "stream": None}
    messages, tools = body.get("input" if protocol == "responses" else "messages"), body.get("tools")
    if isinstance(messages, str):
        messages = [messages]
    names = None
    if isinstance(tools, list):  # OpenAI {"type": "function", "function": {"name"}}; Anthropic, Responses {"name"}
        names = [
            str((t.get("function") if isinstance(t.get("function"), dict) else t).get("name"))
            for t in tools
            if isinstance(t, dict)
        ]
    return {
        "messages": len(messages) if isinstance(messages, list) else None,
        "tools": names,
        "stream": bool(body.get("stream")),
    }


@dataclass
class RateLimit:
    """At most ``requests_per_second`` per session on average, bursts of ``burst``; a request over
    the limit is answered 429 (``rate_limit_error``, in its protocol's error shape) with
    ``Retry-After`` without reaching the model, so an agent's client backs off and retries as it
    would against a hosted API."""

    requests_per_second: float = ranged(10.0, gt=0)
    burst: int = ranged(1, ge=1)
    _buckets: dict[tuple[str, int], tuple[float, float]] = field(default_factory=dict, init=False, repr=False)

    async def __call__(self, request: dict[str, Any], call_next: CallNext) -> dict[str, Any]:
        key, now = (request["trajectory"], request["attempt"]), time.monotonic()
        tokens, seen = self._buckets.get(key, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - seen) * self.requests_per_second)
        if tokens < 1.0:
            self._buckets[key] = (tokens, now)
            wait = (1.0 - tokens) / self.requests_per_second
            error = APIError(
                429,
                f"rate limit: at most {self.requests_per_second:g} requests per second per session; "
                f"retry in {wait:.2f} s",
            )
            body = error.anthropic_body() if request["protocol"] == "anthropic" else error.openai_body()
            # Retry-After counts whole seconds (rounded up: sooner would be refused again); both
            # official clients read the finer retry-after-ms first
            headers = {
                "retry-after": str(max(1, math.ceil(wait))),
                "retry-after-ms": str(max(1, math.ceil(wait * 1000))),
            }
            return {"status": 429, "body": body, "headers": headers}
        self._buckets[key] = (tokens - 1.0, now)
        return await call_next(request)


MIDDLEWARES = {"request_log": RequestLog, "rate_limit": RateLimit}
