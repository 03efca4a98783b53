"""The contracts of the rollout side: what turns a record into trajectories and scores them.

The agent (driver, per prompt), the reward and its :class:`RewardContext` (reward worker, per
trajectory), the sandbox backend with its owner and command result (the actor that owns the pool),
and the chat gateway's middlewares and completion parsers (the gateway service, per request).
"""

from __future__ import annotations

import types
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol

from loongsage.core.types import Check, DataRecord, Trajectory


class Agent(Protocol):
    """``loongsage_agents``: turns one data record into its group of trajectories.

    Runs in the driver (the controller's process, on the rollout's event loop), concurrently with
    the other prompts of the step. Called once per prompt: the step's, every refill round's, and
    (as a source's ``eval_agent``) every evaluation prompt's.
    """

    required_services: ClassVar[tuple[str, ...]] = ()
    """Names of the run services (config ``services``) the agent reaches through ``ctx.services``;
    a config without one of them is refused at validation (an instance may compute it from its
    params)."""

    async def run(self, record: DataRecord, ctx: Any) -> list[Trajectory]:
        """The group of ``record``; ``ctx`` (:class:`~loongsage.core.rollout.AgentContext`) holds
        the engine client (token-in, token-out), the tokenizer, the sampling and the group id."""
        ...


@dataclass(frozen=True)
class RewardContext:
    """What a reward that declares ``takes_context`` gets besides the trajectory and its record: the shared
    handles of the run's services (``RunService.share``) by service name,
    e.g. the sandbox service, through which a reward reaches the sandbox its trajectory worked in."""

    services: Mapping[str, Any]


class Reward(Protocol):
    """``loongsage_rewards``: scores one finished trajectory.

    Runs in the reward worker actor; called once per trajectory (concurrently when it returns an
    awaitable). Raises :class:`~loongsage.core.types.RewardInfraError` when the scorer itself
    failed: the trajectory is then marked ``failed`` instead of scored 0.

    A reward that declares ``takes_context`` is called with a :class:`RewardContext` as well
    (``__call__(trajectory, record, ctx=...)``; see :func:`~loongsage.core.rewarding.call_reward`).
    Whatever the trajectory held (its sandbox) is kept until every reward of its batch has returned.
    """

    takes_context: bool = False
    """``__call__`` takes a keyword argument ``ctx``, the :class:`RewardContext` (a wrapper whose inner
    reward may take one declares it too, and passes it on; may follow the params)."""

    nested: ClassVar[Mapping[str, str]] = types.MappingProxyType({})
    """Wrapped entries: ``{param: category}``. The registry builds the ``{name, params}`` spec each
    such param holds (validated like any entry) and hands it to ``bind``."""
    bind: ClassVar[Callable[..., Reward] | None] = None
    """``bind(**built) -> Reward``: a copy that calls the built entries (required with ``nested``)."""

    def __call__(self, trajectory: Trajectory, record: DataRecord) -> float | Awaitable[float]: ...


@dataclass(frozen=True)
class SandboxOwner:
    """Who a sandbox belongs to: the run, the trajectory and its attempt (a retried trajectory gets
    a fresh sandbox; a resumed one may get its kept sandbox back)."""

    run: str
    trajectory: str
    attempt: int = 0


@dataclass(frozen=True)
class ExecResult:
    """One command's outcome in a sandbox.

    ``exit_code`` is set when the command exited, ``signal`` when a signal ended it (both None when
    it never ran, see ``error``). ``stdout``/``stderr`` are the captured bytes decoded as UTF-8 with
    undecodable bytes written ``\\xNN`` (binary output is kept, not lost); a stream beyond the
    backend's cap keeps its head and tail around a one-line marker and sets ``truncated``.
    ``timed_out``: the wall-clock timeout ended it (every process it started is then gone).
    ``error``: why the command could not run or finish normally (sandbox deleted meanwhile, say).
    """

    exit_code: int | None
    signal: int | None
    stdout: str
    stderr: str
    truncated: bool
    timed_out: bool
    wall_s: float
    error: str | None = None


class Sandbox(Protocol):
    """``loongsage_sandboxes``: isolated execution for agents and rewards (loongsage-sandbox ships
    ``local``, a bubblewrap jail per sandbox).

    Runs in the actor (a sandbox or reward worker) that owns the sandbox pool; ``create``/``delete``
    once per sandbox (one per trajectory that needs one), ``exec``/``put``/``get`` once per tool call
    or file transfer, any of them concurrently. Every sandbox has an owner and a deadline
    (``time.time()`` seconds) after which the backend may remove it; a backend marks what it
    creates so that the sandboxes of a process that died are found and removed (orphans). An
    unknown or deleted ``sandbox_id`` raises ``LookupError``; a bad ``path`` (absolute, ``..``,
    through a symlink, outside the work directory) raises ``ValueError``.
    """

    doctor: ClassVar[Callable[[], list[Check]] | None] = None
    """Optional staticmethod ``doctor()``: what this backend needs on this machine (its libraries and
    their versions, a device, a system tool), one :class:`~loongsage.core.types.Check` each; read by
    ``loongsage doctor``, never during a run."""
    reusable: ClassVar[bool] = False
    """Offers ``reset``: a released sandbox can be emptied and handed to another owner."""
    reset: ClassVar[Callable[[str, SandboxOwner, float], Awaitable[None]] | None] = None
    """``reset(sandbox_id, owner, deadline)``: kill its processes, empty its work directory, give it
    to ``owner`` until ``deadline`` (required with ``reusable``)."""
    reap_orphans: ClassVar[Callable[[], Awaitable[int]] | None] = None
    """``reap_orphans() -> count``: remove the sandboxes whose creating process is gone (a pool
    calls it when it starts)."""
    put_archive: ClassVar[Callable[[str, str, bytes], Awaitable[int]] | None] = None
    """``put_archive(sandbox_id, path, tar_bytes) -> files``: unpack a tar archive under ``path``;
    links, devices and names leaving the directory refuse the whole archive."""
    host_path: ClassVar[Callable[[str], str] | None] = None
    """``host_path(sandbox_id) -> str``: the work directory as a path on the pool's machine, for a
    program that runs outside the sandbox but works in its directory (the command agent)."""
    adopt: ClassVar[Callable[[str], Awaitable[int]] | None] = None
    """``adopt(sandbox_id) -> count``: hand what such a program wrote there to the sandbox (owner,
    permissions), before commands inside change it (required with ``host_path``)."""
    close: ClassVar[Callable[[], Awaitable[None]] | None] = None
    """``close()``: delete every sandbox the backend still holds and wait for its background work
    (called once, when the pool that owns the backend closes at the end of the run)."""

    async def create(self, owner: SandboxOwner, deadline: float) -> str:
        """A new empty sandbox for ``owner``; its id."""
        ...

    async def exec(self, sandbox_id: str, cmd: str, timeout: float) -> ExecResult:
        """Run ``cmd`` with ``/bin/sh -c`` in the work directory; after ``timeout`` seconds every
        process it started is killed. A failing command is a result, never an exception."""
        ...

    async def put(self, sandbox_id: str, path: str, data: bytes) -> None:
        """Write ``data`` to ``path``, relative to the work directory (parents are created)."""
        ...

    async def get(self, sandbox_id: str, path: str) -> bytes:
        """The bytes of the regular file ``path``, relative to the work directory."""
        ...

    async def delete(self, sandbox_id: str) -> None:
        """Kill every process of the sandbox and remove everything it had; deleting twice is a no-op."""
        ...


class GatewayMiddleware(Protocol):
    """``loongsage_gateway_middlewares``: rewrites, logs or limits the chat gateway's traffic.

    Runs in the gateway service (loongsage-agentflow), once per chat request (OpenAI chat
    completions, Responses or Anthropic Messages): ``request`` is ``{"protocol", "trajectory",
    "attempt", "body"}`` (the JSON body, which it may rewrite); it calls ``call_next`` (the rest of
    the chain) or answers by itself, and returns the reply ``{"status", "body"}`` (a streamed reply
    in its non-streamed form), with an optional ``"headers"`` mapping for the HTTP answer (a rate
    limit's ``Retry-After``). An answer of its own should take the shape of ``request["protocol"]``.
    """

    receives: ClassVar[tuple[Literal["run_dir"], ...]] = ()
    """What the gateway hands the factory besides its params: ``run_dir`` (where the run writes)."""

    async def __call__(
        self, request: dict[str, Any], call_next: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]
    ) -> dict[str, Any]: ...


class ChatParser(Protocol):
    """A ``chat_parser`` backend (loongsage-agentflow ships ``qwen3``): splits a model family's
    completion text into the chat-completion message fields.

    Runs in the gateway, once per completion.
    """

    kind: ClassVar[Literal["chat_parser"]] = "chat_parser"

    def parse(self, text: str) -> dict[str, Any]:
        """``{"content", "reasoning_content", "tool_calls"}`` as in an OpenAI chat message."""
        ...
