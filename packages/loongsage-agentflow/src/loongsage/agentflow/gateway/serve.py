"""The gateway opened to agents outside a training run (``loongsage serve``), recording every session.

``loongsage serve`` starts the ``gateway`` service with a :class:`~loongsage.core.services.Serving`
in its context; the service then wraps its gateway in :class:`Served`, which

* opens a first session and tells the user where its clients point (the OpenAI and Anthropic base
  URLs, the session's key) and how to open more: one session per agent run, each with its own key,
  since a session's token lines are one agent's trajectory::

      POST   /sessions             (Authorization: Bearer <serve key>) -> a new session's URLs and key
      DELETE /sessions/{session}   (the session's key, or the serve key) -> closed, its record final

* records each session as JSON lines in ``<record_dir>/<session>.jsonl``, rewritten after every
  turn (a crash loses at most the turn in flight), one row per token line of the session (a
  request with ``n > 1`` or an unrelated conversation starts a line of its own): the core
  trajectory's fields (``prompt_ids``, ``response_ids``, with ``loss_mask``, ``rollout_logprobs``
  and ``versions`` per response token, ``segments`` over prompt + response), the conversation
  (``messages``, ``tools``, ``turns``) and ``finished`` (the session was closed);
* on stop closes every open session (a turn in flight gets ``flush_timeout_s`` to commit) and
  writes its final record.

Session ids start with the serving's start time (``20250101-120000-1``), so serving twice into
one folder adds to what is there.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import logging
import os
import secrets
import time
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from loongsage.agentflow.chat.errors import APIError
from loongsage.agentflow.gateway.server import Gateway, SessionInfo
from loongsage.agentflow.trajectories.store import Session

log = logging.getLogger("loongsage.agentflow")


class Served:
    """The sessions a gateway serves to outside agents, and their record (see the module). Built
    before the gateway starts (it adds routes and a middleware), announced after."""

    flush_timeout_s = 10.0

    def __init__(self, gateway: Gateway, record_dir: Path):
        self.gateway, self.record_dir = gateway, Path(record_dir)
        self.record_dir.mkdir(parents=True, exist_ok=True)  # `loongsage serve` made it already (or said why not)
        self.key = secrets.token_urlsafe(24)  # opens sessions; never a session's own key
        self.prefix = _free_prefix(self.record_dir)
        self._numbers = itertools.count(1)
        self.sessions: dict[str, Session] = {}  # sessions open, by id (closed ones are recorded and dropped)
        self.rows: dict[str, int] = {}  # rows last written per session
        # innermost, so it sees the turns the other middlewares let through, errors included
        gateway.middlewares.append(self._record)
        gateway.app.router.routes[:0] = [
            Route("/sessions", self._open, methods=["POST"]),
            Route("/sessions/{session}", self._close, methods=["DELETE"]),
        ]

    # ------------------------------------------------------------------ sessions
    def open(self) -> SessionInfo:
        session_id = f"{self.prefix}-{next(self._numbers)}"
        info = self.gateway.open_session(session_id)
        self.sessions[session_id] = self.gateway.service.store.get(session_id, 0)
        return info

    def announce(self) -> list[str]:
        """What the user is told once serving: a first session's URLs and key, how to open more."""
        first = self.open()
        return [
            f"serving {self.gateway.service.model_name} at {self.gateway.url}, recording sessions to "
            f"{self.record_dir}/ (Ctrl-C stops)",
            f"export OPENAI_BASE_URL={first.openai_base_url} OPENAI_API_KEY={first.api_key}",
            f"export ANTHROPIC_BASE_URL={first.anthropic_base_url} ANTHROPIC_API_KEY={first.api_key}",
            f"one session per agent run; another: curl -s -X POST {self.gateway.url}/sessions "
            f"-H 'Authorization: Bearer {self.key}'",
        ]

    async def _open(self, request: Request) -> Response:
        if not _sent(request, self.key):
            return _error(401, "POST /sessions: missing or wrong serve key (the one `loongsage serve` printed)")
        info = self.open()
        return JSONResponse(
            {
                "session": info.trajectory,
                "openai_base_url": info.openai_base_url,
                "anthropic_base_url": info.anthropic_base_url,
                "api_key": info.api_key,
            }
        )

    async def _close(self, request: Request) -> Response:
        session_id = request.path_params["session"]
        session = self.sessions.get(session_id)
        if session is None:
            return _error(
                404, f"no open session {session_id!r} (closed already, or never opened; POST /sessions opens one)"
            )
        if not (_sent(request, self.key) or _sent(request, session.api_key)):
            return _error(401, f"session {session_id}: missing or wrong API key")
        if not session.closed:
            await self.gateway.close_session(session_id, 0)
        rows = self.write(session)
        self.sessions.pop(session_id, None)
        return JSONResponse(
            {"session": session_id, "trajectories": rows, "record": str(self.record_dir / f"{session_id}.jsonl")}
        )

    # ------------------------------------------------------------------ record
    async def _record(self, request: dict[str, Any], call_next: Any) -> dict[str, Any]:
        reply = await call_next(request)
        session = self.sessions.get(request["trajectory"])
        if session is not None:
            self.write(session)
        return reply

    def write(self, session: Session) -> int:
        """Write ``session``'s record in full (atomically: a reader never sees half a file); returns
        its rows. Written on the gateway's loop, so writes of one session never overtake each other."""
        rows = [_row(t, session.closed) for t in session.trajectories(source="served")]
        if not rows and session.trajectory not in self.rows:
            return 0  # nothing to keep yet
        path = self.record_dir / f"{session.trajectory}.jsonl"
        part = path.with_suffix(".jsonl.part")
        part.write_text("".join(json.dumps(row, ensure_ascii=False, separators=(",", ":")) + "\n" for row in rows))
        os.replace(part, path)
        self.rows[session.trajectory] = len(rows)
        return len(rows)

    async def finish(self) -> str:
        """Close every open session (a turn in flight may commit first) and write its final record;
        returns what was recorded, in one line. Call once the gateway stopped taking requests."""
        for session_id, session in list(self.sessions.items()):
            if not session.closed:
                try:
                    await asyncio.wait_for(self.gateway.close_session(session_id, 0), self.flush_timeout_s)
                except (TimeoutError, KeyError):
                    log.warning("serve: session %s still had a turn in flight; recorded without it", session_id)
            self.write(session)
        self.sessions.clear()
        sessions = sum(1 for n in self.rows.values() if n)
        rows = sum(self.rows.values())
        return (
            f"recorded {sessions} session{'' if sessions == 1 else 's'} ({rows} "
            f"trajector{'y' if rows == 1 else 'ies'}) in {self.record_dir}/"
        )


def _row(trajectory: Any, finished: bool) -> dict[str, Any]:
    meta = trajectory.metadata
    return {
        "session": meta["trajectory"],
        "line": meta["line"],
        "finished": finished,
        "status": trajectory.status.value,
        "prompt_ids": trajectory.prompt_ids,
        "response_ids": trajectory.response_ids,
        "loss_mask": trajectory.loss_mask,
        "rollout_logprobs": trajectory.rollout_logprobs,
        "versions": trajectory.versions,
        "segments": [[s.start, s.end, s.kind] for s in trajectory.segments],
        "response_text": trajectory.response_text,
        "messages": meta["messages"],
        "tools": meta["tools"],
        "turns": meta["turns"],
        "refusals": meta["refusals"],
    }


def _free_prefix(record_dir: Path) -> str:
    """The serving's start time, made unique in ``record_dir`` (two servings in one second)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for extra in itertools.count():
        prefix = stamp if extra == 0 else f"{stamp}.{extra}"
        if not any(record_dir.glob(f"{prefix}-*.jsonl")):
            return prefix
    raise AssertionError("unreachable")


def _sent(request: Request, key: str | None) -> bool:
    if not key:
        return False
    sent = request.headers.get("x-api-key") or request.headers.get("authorization", "").removeprefix("Bearer ")
    return hmac.compare_digest(sent.strip().encode(), key.encode())


def _error(status: int, message: str) -> Response:
    return JSONResponse(APIError(status, message).openai_body(), status)
