"""The HTTP gateway: uvicorn on loopback serving both chat protocols, one URL prefix per session.

::

    GET  /health
    GET  /v1/models                                      the served model
    HEAD /{trajectory}/{attempt}                         200 while the session is open (clients probe their base URL)
    GET  /{trajectory}/{attempt}/v1/models
    POST /{trajectory}/{attempt}/v1/chat/completions     OpenAI (base_url = .../{trajectory}/{attempt}/v1)
    POST /{trajectory}/{attempt}/v1/messages             Anthropic (base_url = .../{trajectory}/{attempt})
    POST /{trajectory}/{attempt}/v1/responses            OpenAI Responses (base_url = .../{trajectory}/{attempt}/v1)

A session exists once :meth:`Gateway.open_session` opened it and answers with its own key
(``Authorization: Bearer <key>`` or ``x-api-key``), so a client bound to one session can neither
read nor write another's trajectory; a request for a session never opened, closed or retired by a
newer attempt is a 404/410. Every error is a JSON body in the endpoint's protocol (Anthropic's
under ``/v1/messages``, OpenAI's elsewhere); malformed input is a 4xx, never a 5xx. An error
of the gateway itself is one 500 and one logged traceback; a client that hangs up while sending
its request is one log line.

The body is read as UTF-8 JSON with lone UTF-16 surrogates replaced by U+FFFD
(:func:`~loongsage.agentflow.chat.fields.json_body`); everything heavier than that (hashing the request,
rendering and tokenizing the prompt) runs on worker threads, see
:mod:`~loongsage.agentflow.gateway.service`.

The gateway runs on the caller's event loop (:meth:`Gateway.start`, beside the engine router it
generates with) or on a thread of its own (:meth:`Gateway.start_background`, for synchronous
callers). Streams are written once the turn is generated: the engine answers whole samples, and a
turn that fails must still get its 4xx status.

Starting the gateway freezes the objects the process holds at that moment (``gc.freeze``: the
loaded model and libraries): the turns' allocations otherwise set off full collections that walk
them all, pausing the event loop, and an engine stepping on it, for hundreds of milliseconds each.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hmac
import json
import logging
import socket
import threading
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from loongsage.agentflow.chat import fields
from loongsage.agentflow.chat.errors import APIError
from loongsage.agentflow.gateway import anthropic_api, openai_api, responses_api
from loongsage.agentflow.gateway.http_guard import REQUEST_S, default_max_connections, guarded
from loongsage.agentflow.gateway.service import ChatService
from loongsage.agentflow.trajectories.store import Budget, Session

log = logging.getLogger("loongsage.agentflow")

# Seconds an idle connection is kept open. Longer than clients keep an idle pooled connection
# (httpx, under the openai and anthropic SDKs: 5 s; aiohttp: 15 s), so that the client always drops
# it first. At uvicorn's default, also 5 s, a request sent on a connection idle for about 5 s met the
# server closing it and failed with a connection error: up to 239 of the 6,000 turns of 2,000 agents
# whose tools ran 1.5-4.5 s between turns, on a loaded machine; none at 75 s (bench/gateway_scale.py
# runs both).
KEEP_ALIVE_S = 75
# Requests of one session read or waiting at once; more are answered 429 before their body is read.
# Agents send a few in parallel at most (sub-agents, a title beside the main turn).
SESSION_REQUESTS = 16


@dataclass(frozen=True)
class SessionInfo:
    """Where a client of one session points: ``openai_base_url`` or ``anthropic_base_url``, with ``api_key``."""

    trajectory: str
    attempt: int
    base_url: str
    api_key: str | None

    @property
    def openai_base_url(self) -> str:
        return f"{self.base_url}/v1"

    @property
    def anthropic_base_url(self) -> str:
        return self.base_url


class _Server(uvicorn.Server):
    """Uvicorn without its signal handlers: the gateway lives inside a run, whose signals are its own."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class Gateway:
    def __init__(
        self,
        service: ChatService,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        max_body_bytes: int = 8 << 20,
        max_connections: int | None = None,
        request_timeout_s: float = REQUEST_S,
        middlewares: Iterable[Any] = (),
    ):
        self.service, self.host, self.port, self.max_body_bytes = service, host, int(port), int(max_body_bytes)
        # open connections at most (None: a share of the descriptor limit), and the time to send a
        # request: the HTTP protocol's limits (http_guard)
        self.http = guarded(max_connections=max_connections or default_max_connections(), request_s=request_timeout_s)
        # loongsage_gateway_middlewares, outermost first: each sees every chat request (see _turn)
        self.middlewares = list(middlewares)
        self.app = self._app()
        self._server: _Server | None = None
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # ----------------------------------------------------------------------------- lifecycle
    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> str:
        """Serve on the running loop; returns the base URL once the socket accepts connections."""
        # proto IPPROTO_TCP, not the default 0: asyncio turns Nagle off (TCP_NODELAY) only on
        # connections whose socket says TCP, and accepted connections inherit the listener's proto.
        # With Nagle on, a response's body (written after its head) waited for the client's delayed
        # ACK: about 40 ms added to every request on Linux.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        # proxy_headers off: that middleware only rewrites the client's address and the scheme from
        # X-Forwarded-* headers, neither of which the gateway reads, yet it scans every request
        config = uvicorn.Config(
            _logged_once(self.app),
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=2,
            timeout_keep_alive=KEEP_ALIVE_S,
            proxy_headers=False,
            http=self.http,  # limits on a request's head, its time and the connections (http_guard)
        )
        self._server, self._loop = _Server(config), asyncio.get_running_loop()
        gc.freeze()  # see the module's docstring
        self._task = asyncio.ensure_future(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()
                raise RuntimeError("gateway: the server stopped before it started")
            await asyncio.sleep(0.005)
        return self.url

    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await self._task
            self._server = self._task = None

    def start_background(self) -> str:
        """Serve on a thread with its own event loop (the engine client must be usable there)."""
        ready, failure = threading.Event(), []

        async def run() -> None:
            try:
                await self.start()
            except BaseException as exc:  # noqa: BLE001 - handed to the starting thread
                failure.append(exc)
                return
            finally:
                ready.set()
            await self._task

        self._thread = threading.Thread(target=asyncio.run, args=(run(),), name="agentflow-gateway", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            raise failure[0]
        return self.url

    def stop_background(self) -> None:
        if self._thread is not None:
            self._server.should_exit = True
            self._thread.join()
            self._thread = None

    # ------------------------------------------------------------------------------ sessions
    def open_session(
        self,
        trajectory: str,
        attempt: int = 0,
        *,
        budget: Budget | None = None,
        api_key: str | None = "",
        engine: Any = None,
        sampling: Any = None,
    ) -> SessionInfo:
        """A new session; ``engine``: the engine client its turns use instead of the gateway's (an
        agent's ``ctx.engine``, so the run's per-group call log records them); ``sampling``: the
        SamplingParams whose temperature, top-p, top-k and min-p its turns sample with, whatever
        the client asks (None: the client's)."""
        session = self.service.store.open(trajectory, attempt, budget=budget, api_key=api_key, sampling=sampling)
        session.engine = engine
        return SessionInfo(trajectory, attempt, f"{self.url}/{trajectory}/{attempt}", session.api_key)

    async def close_session(self, trajectory: str, attempt: int = 0) -> Session:
        """Stop serving a session; returns it after its turn in flight committed (call on the gateway's loop)."""
        session = await self.service.store.close(trajectory, attempt)
        (session.engine or self.service.engine).release_session(session.route_key)
        return session

    def close_session_threadsafe(self, trajectory: str, attempt: int = 0) -> Session:
        """:meth:`close_session` from another thread (a gateway started with :meth:`start_background`)."""
        return asyncio.run_coroutine_threadsafe(self.close_session(trajectory, attempt), self._loop).result()

    # ---------------------------------------------------------------------------------- HTTP
    def _app(self) -> Starlette:
        routes = [
            Route("/health", self._health, methods=["GET"]),
            Route("/v1/models", self._models, methods=["GET"]),
            Route("/{trajectory}/{attempt:int}", self._base, methods=["GET", "HEAD"]),
            Route("/{trajectory}/{attempt:int}/v1/models", self._session_models, methods=["GET"]),
            Route("/{trajectory}/{attempt:int}/v1/chat/completions", self._chat, methods=["POST"]),
            Route("/{trajectory}/{attempt:int}/v1/messages", self._messages, methods=["POST"]),
            Route("/{trajectory}/{attempt:int}/v1/responses", self._responses, methods=["POST"]),
        ]
        return Starlette(routes=routes, exception_handlers={HTTPException: _http_error, Exception: _crash})

    async def _health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "sessions": len(self.service.store.sessions())})

    async def _models(self, request: Request) -> Response:
        return JSONResponse(
            {
                "object": "list",
                "data": [{"id": self.service.model_name, "object": "model", "created": 0, "owned_by": "loongsage"}],
            }
        )

    async def _base(self, request: Request) -> Response:
        """The session's base URL: Claude Code sends a HEAD there before its first request. No key
        is asked for: the answer says only whether the session is open."""
        params = request.path_params
        try:
            self.service.store.get(params["trajectory"], params["attempt"])
        except APIError as exc:
            return JSONResponse(exc.anthropic_body(), exc.status)
        return JSONResponse({"status": "ok"})

    async def _session_models(self, request: Request) -> Response:
        try:
            self._session(request)
        except APIError as exc:
            return JSONResponse(exc.openai_body(), exc.status)
        return await self._models(request)

    async def _chat(self, request: Request) -> Response:
        return await self._turn(request, "openai")

    async def _messages(self, request: Request) -> Response:
        return await self._turn(request, "anthropic")

    async def _responses(self, request: Request) -> Response:
        return await self._turn(request, "responses")

    async def _turn(self, request: Request, protocol: str) -> Response:
        """One chat request through the middleware chain.

        A middleware gets ``{"protocol", "trajectory", "attempt", "body"}`` (it may rewrite the body)
        and ``call_next``, and returns ``{"status", "body"}``: the reply as the client gets it (for a
        streamed reply, its non-streamed form: the stream itself is written from the turn), or a
        reply of its own without calling ``call_next`` (a rate limit's 429). Errors are replies too,
        so a logging middleware sees them (a failure of the gateway itself as a 500). A reply may
        carry ``"headers"`` (a 429's ``Retry-After``).
        """
        error_body = APIError.anthropic_body if protocol == "anthropic" else APIError.openai_body
        streamed: dict[str, Any] = {}

        async def handle(req: dict[str, Any]) -> dict[str, Any]:
            try:
                return await answer(req)
            except APIError as exc:
                return {"status": exc.status, "body": error_body(exc)}
            except Exception as exc:  # noqa: BLE001 - a fault of the gateway: one 500 the middlewares see
                log.exception("gateway: unhandled error on %s", request.url.path)
                return {"status": 500, "body": error_body(APIError(500, f"internal error: {type(exc).__name__}"))}

        async def answer(req: dict[str, Any]) -> dict[str, Any]:
            if protocol == "openai":
                chat, options = openai_api.parse(req["body"])
                model, stream = options.model or self.service.model_name, options.stream
            elif protocol == "responses":
                chat, options = responses_api.parse(req["body"])
                model, stream = options.model or self.service.model_name, options.stream
            else:
                chat, model, stream = anthropic_api.parse(req["body"])
            result = await self.service.complete(req["trajectory"], req["attempt"], chat)
            if protocol == "openai":
                body = openai_api.response(result, model, options, self._token_text)
                if stream:
                    streamed["events"] = [
                        f"data: {_dump(c)}\n\n" for c in openai_api.chunks(result, model, options, self._token_text)
                    ] + ["data: [DONE]\n\n"]
            elif protocol == "responses":
                body = responses_api.response(result, model, options)
                if stream:
                    streamed["events"] = [
                        f"event: {name}\ndata: {_dump(data)}\n\n"
                        for name, data in responses_api.events(result, model, options)
                    ]
            else:
                body = anthropic_api.response(result, model)
                if stream:
                    streamed["events"] = [
                        f"event: {name}\ndata: {_dump(data)}\n\n" for name, data in anthropic_api.events(result, model)
                    ]
            return {"status": 200, "body": body}

        try:
            session = self._session(request)
        except APIError as exc:
            return JSONResponse(error_body(exc), exc.status)
        if session.requests >= SESSION_REQUESTS:
            # a session's turns run one at a time: more waiting would only hold their bodies
            # (a parsed JSON body takes up to 20 times its bytes) for nothing
            error = APIError(429, f"session {session.route_key} has {SESSION_REQUESTS} requests in flight, its limit")
            return JSONResponse(error_body(error), 429, headers={"retry-after": "1"})
        session.requests += 1
        try:
            try:
                req = {
                    "protocol": protocol,
                    "trajectory": session.trajectory,
                    "attempt": session.attempt,
                    "body": await self._body(request),
                }
            except APIError as exc:
                return JSONResponse(error_body(exc), exc.status)
            except ClientDisconnect:  # nobody is left to answer: one line, no traceback
                log.info("gateway: the client of %s hung up while sending its request", request.url.path)
                return Response(status_code=400)
            reply = await _chain(self.middlewares, handle)(req)
        finally:
            session.requests -= 1
        if reply.get("status") == 200 and "events" in streamed:
            return _sse(streamed["events"])
        return JSONResponse(reply["body"], int(reply["status"]), headers=reply.get("headers"))

    def _token_text(self, token: int) -> str:
        return self.service.renderer.decode([token])

    def _session(self, request: Request) -> Session:
        params = request.path_params
        session = self.service.store.get(params["trajectory"], params["attempt"])
        if session.api_key is not None:
            sent = request.headers.get("x-api-key") or request.headers.get("authorization", "").removeprefix("Bearer ")
            if not hmac.compare_digest(sent.strip().encode(), session.api_key.encode()):
                raise APIError(401, f"session {session.route_key}: missing or wrong API key")
        return session

    async def _body(self, request: Request) -> dict[str, Any]:
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            raise APIError(413, f"request body of {declared} bytes exceeds the limit of {self.max_body_bytes}")
        data, size = [], 0
        async for part in request.stream():
            size += len(part)
            if size > self.max_body_bytes:
                raise APIError(413, f"request body exceeds the limit of {self.max_body_bytes} bytes")
            data.append(part)
        body = fields.json_body(b"".join(data))
        if not isinstance(body, dict):
            raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
        return body


def _chain(middlewares: list[Any], handle: Any) -> Any:
    """``handle`` wrapped by the middlewares, the first one outermost."""
    call = handle
    for middleware in reversed(middlewares):
        call = (lambda mw, nxt: lambda req: mw(req, nxt))(middleware, call)
    return call


def _dump(data: Any) -> str:
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))


def _sse(events: Iterable[str]) -> StreamingResponse:
    async def body() -> AsyncIterator[bytes]:
        for event in events:
            yield event.encode()

    return StreamingResponse(body(), media_type="text/event-stream", headers={"cache-control": "no-cache"})


def _error_body(path: str, error: APIError) -> dict[str, Any]:
    """An error in the shape of the protocol the path belongs to (Anthropic's under /v1/messages)."""
    return error.anthropic_body() if "/v1/messages" in path else error.openai_body()


async def _http_error(request: Request, exc: HTTPException) -> Response:
    path = request.url.path
    message = {
        404: f"no route {path}: sessions live under /{{trajectory}}/{{attempt}}/v1/",
        405: f"method {request.method} not allowed on {path}",
    }.get(exc.status_code, str(exc.detail))
    return JSONResponse(_error_body(path, APIError(exc.status_code, message)), exc.status_code, headers=exc.headers)


async def _crash(request: Request, exc: Exception) -> Response:
    # the traceback is logged once, by _logged_once: Starlette re-raises the error after this answer
    return JSONResponse(_error_body(request.url.path, APIError(500, f"internal error: {type(exc).__name__}")), 500)


def _logged_once(app: Any) -> Any:
    """``app`` with its errors logged here, once, and not passed on to uvicorn: Starlette answers
    an error (``_crash``) and then raises it again for the server, whose own traceback would be a
    second report of the same failure."""

    async def logged(scope: dict[str, Any], receive: Any, send: Any) -> None:
        try:
            await app(scope, receive, send)
        except ClientDisconnect:
            log.info("gateway: the client of %s hung up while sending its request", scope.get("path"))
        except Exception:  # noqa: BLE001 - already answered 500 by _crash
            log.exception("gateway: unhandled error on %s", scope.get("path"))

    return logged
