"""The trajectory store: what each session's turns left, token by token.

A *session* is one attempt at one trajectory (``/{trajectory}/{attempt}/v1/...``). It holds one or
more *lines*: flat token records that grow turn by turn. Per token a line keeps the loss mask (1
only on tokens the model sampled), the engine's log-prob (0 elsewhere) and the weight version
that sampled it (-1 elsewhere); its segments are the spans rendered from one prompt (a new one
starts where a turn could not be appended, see :mod:`loongsage.agentflow.trajectories.tito`). A request with
``n > 1`` forks the line once per extra sample; a conversation unrelated to every line starts a
line of its own. Each line becomes one core :class:`~loongsage.core.types.Trajectory`.

A session serialises its turns with one lock, remembers its recent answers so a retried request
gets the same answer instead of a second generation, and carries its budgets.
"""

from __future__ import annotations

import asyncio
import re
import secrets
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any

from loongsage.agentflow.chat.errors import APIError
from loongsage.agentflow.chat.messages import Message
from loongsage.agentflow.trajectories.tito import TurnPlan
from loongsage.core.types import Segment, Status, Trajectory

_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}")
_KIND = {"first": "turn", "new_conversation": "turn", "rewound": "turn", "compaction": "compaction"}  # else: rewritten
_REMEMBERED = 64  # answers kept per session for retries
# closed trajectories whose latest attempt is still known: a straggler's request to one is told it
# was closed or retired, and an older attempt is refused. Bounded: a run opens a trajectory per
# group or episode, and the table would otherwise grow with every one, ever.
_CLOSED_KEPT = 1024


@dataclass(frozen=True)
class Budget:
    """Limits of one session; a request past them is refused (400) and its line marked truncated."""

    max_context_tokens: int = 4096  # prompt + new tokens of one engine call
    max_response_tokens: int = 16384  # tokens the model samples on one line, all turns together
    default_max_tokens: int = 1024  # new tokens of a turn whose request names none
    # tokens of one line, its prompt and every segment (one training row). A segment is at most one
    # engine call, so None (16 x max_context_tokens) leaves a line 16 full contexts: room for many
    # compactions of a long run, while a row stays a bounded multiple of what the engine is fed
    max_line_tokens: int | None = None
    # tokens the model samples in one session, all lines and forks together. None: 4 x
    # max_response_tokens, so a few sub-conversations or samples of n > 1 may each fill a line's
    # share, while the session's sampling stays bounded whatever n and however many lines it opens
    max_session_tokens: int | None = None
    # lines of one session (each conversation unrelated to the others, each extra sample of n > 1).
    # 64: agents such as Claude Code open side conversations (titles, summaries, sub-agents) beside
    # the main one, a handful to a few dozen per run; the limit bounds the rows one episode yields
    max_lines: int = 64

    def __post_init__(self) -> None:
        for name in ("max_context_tokens", "max_response_tokens", "default_max_tokens", "max_lines"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Budget.{name}={value!r}: must be an int >= 1")
        for name in ("max_line_tokens", "max_session_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"Budget.{name}={value!r}: must be an int >= 1 or None (the derived default)")

    @property
    def line_tokens(self) -> int:
        """``max_line_tokens``, or its default: 16 x ``max_context_tokens``."""
        return 16 * self.max_context_tokens if self.max_line_tokens is None else self.max_line_tokens

    @property
    def session_tokens(self) -> int:
        """``max_session_tokens``, or its default: 4 x ``max_response_tokens``."""
        return 4 * self.max_response_tokens if self.max_session_tokens is None else self.max_session_tokens


@dataclass
class Sample:
    """One sample of a turn as the line keeps it."""

    ids: list[int]  # the engine's tokens (cut after a stop string)
    logprobs: list[float]
    versions: list[int]
    finish_reason: str  # how the engine ended it: stop (a stop token or string) | length | abort
    message: Message  # the reply as returned to the client
    tail: str  # closing text still to write before the next turn's tokens
    # the experts every MoE layer chose for each token fed to the engine: the prompt, then the
    # kept tokens but the last ([tokens, layers, topk]; None: the engine records none)
    routes: Any = None
    # tokens the engine sampled for it, those a stop string cut away included (None: the kept ones):
    # what the budgets charge, since the engine cannot stop on a string and samples them all
    sampled: int | None = None

    @property
    def spent(self) -> int:
        return len(self.ids) if self.sampled is None else self.sampled


@dataclass
class Line:
    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    segments: list[list[Any]] = field(default_factory=list)  # [start, end, category]
    turns: list[dict[str, Any]] = field(default_factory=list)  # token offsets and finish reason per turn
    messages: list[Message] = field(default_factory=list)
    tools: list | None = None
    tail: str = ""
    generated: int = 0
    truncated: bool = False
    # R3: per segment, the record of its latest turn (whose prompt was the segment so far, rendered
    # whole), covering the segment's tokens but its last; None where the engine recorded none
    routes: list[Any] = field(default_factory=list)

    @property
    def segment_start(self) -> int:
        return self.segments[-1][0] if self.segments else 0

    def copy(self) -> Line:
        return Line(
            list(self.tokens),
            list(self.mask),
            list(self.logprobs),
            list(self.versions),
            [list(s) for s in self.segments],
            [dict(t) for t in self.turns],
            list(self.messages),
            self.tools,
            self.tail,
            self.generated,
            self.truncated,
            list(self.routes),
        )

    def add(self, plan: TurnPlan, messages: list[Message], tools: list | None, sample: Sample) -> None:
        prompt_start = len(self.tokens)
        if plan.category is not None:
            self.segments.append([prompt_start, prompt_start, plan.category])
        self._extend(plan.appended, 0, [0.0] * len(plan.appended), [-1] * len(plan.appended))
        response_start = len(self.tokens)
        self._extend(sample.ids, 1, sample.logprobs, sample.versions)
        self.segments[-1][1] = len(self.tokens)
        self.turns.append(
            {
                "prompt_start": prompt_start,
                "response_start": response_start,
                "response_end": len(self.tokens),
                "finish_reason": sample.finish_reason,
            }
        )
        self.messages, self.tools, self.tail = [*messages, sample.message], tools, sample.tail
        self.generated += sample.spent
        # a turn's prompt is its segment rendered whole, so the engine was fed the segment from its
        # first token: the record covers the segment's earlier turns too
        if plan.category is not None:
            self.routes.append(sample.routes)
        else:
            self.routes[-1] = sample.routes

    def _extend(self, ids: list[int], mask: int, logprobs: list[float], versions: list[int]) -> None:
        self.tokens.extend(ids)
        self.mask.extend([mask] * len(ids))
        self.logprobs.extend(logprobs)
        self.versions.extend(versions)

    def trajectory(self, *, source: str, group_id: int, sample_index: int, metadata: dict[str, Any]) -> Trajectory:
        """The line as a core record: the first turn's prompt, then everything after it."""
        cut = self.turns[0]["response_start"]
        aborted = self.turns[-1]["finish_reason"] == "abort"
        return Trajectory(
            source=source,
            group_id=group_id,
            sample_index=sample_index,
            prompt_ids=self.tokens[:cut],
            response_ids=self.tokens[cut:],
            loss_mask=self.mask[cut:],
            rollout_logprobs=self.logprobs[cut:],
            versions=self.versions[cut:],
            routed_experts=_one_or_per_segment(self.routes),
            status=Status.TRUNCATED if self.truncated else Status.ABORTED if aborted else Status.OK,
            response_text=self.messages[-1].get("content", ""),
            segments=[Segment(s, e, _KIND.get(c, "rewritten")) for s, e, c in self.segments],
            metadata={
                **metadata,
                "messages": self.messages,
                "tools": self.tools,
                "turns": self.turns,
                "segment_categories": [c for _, _, c in self.segments],
            },
        )


def _one_or_per_segment(routes: list[Any]) -> Any:
    """A trajectory's routed experts: its one segment's record, or one record per segment (None
    when a turn's engine recorded none)."""
    if not routes or any(r is None for r in routes):
        return None
    return routes[0] if len(routes) == 1 else list(routes)


class Session:
    """One attempt at one trajectory: its lines, turn lock, remembered answers and budget."""

    def __init__(self, trajectory: str, attempt: int, budget: Budget, api_key: str | None, sampling: Any = None):
        self.trajectory, self.attempt, self.budget, self.api_key = trajectory, attempt, budget, api_key
        # the SamplingParams whose temperature, top-p, top-k and min-p every turn samples with,
        # whatever the client asks (None: the client's own)
        self.sampling = sampling
        self.lock = asyncio.Lock()
        self.lines: list[Line] = []
        self.closed = False
        self.categories: Counter[str] = Counter()  # why segments started
        self.refusals = 0  # requests refused by the budget
        self.requests = 0  # requests of the session being read or answered (the gateway caps them)
        self.generated = 0  # tokens the model sampled in this session, all lines together
        self._answers: OrderedDict[str, Any] = OrderedDict()
        # the engine client of this session's turns (None: the gateway's): an agent passes its own
        # context's engine, so a run's per-group call log (checkpoints of groups in flight) sees them
        self.engine: Any = None

    @property
    def route_key(self) -> str:
        """The engine router's session: turns of one session go to the engine holding its prefix."""
        return f"{self.trajectory}/{self.attempt}"

    def answer_for(self, key: str) -> Any:
        return self._answers.get(key)

    def remember(self, key: str, answer: Any) -> None:
        self._answers[key] = answer
        while len(self._answers) > _REMEMBERED:
            self._answers.popitem(last=False)

    def commit(
        self,
        plan: TurnPlan,
        messages: list[Message],
        tools: list | None,
        samples: list[Sample],
        truncated: list[bool],
        sampling: dict[str, Any] | None = None,
    ) -> None:
        """Sample 0 goes on the planned line (or a new one); every other sample on a fork of it.
        ``sampling``: what the turn sampled with, kept in its record (``turns``)."""
        if plan.category is not None:
            self.categories[plan.category] += 1
        base = self.lines[plan.line] if plan.line is not None else Line()
        targets = [base] + [base.copy() for _ in samples[1:]]
        if plan.line is None:
            self.lines.append(base)
        self.lines.extend(targets[1:])
        for line, sample, cut in zip(targets, samples, truncated):
            line.add(plan, messages, tools, sample)
            line.truncated = line.truncated or cut
            if sampling is not None:
                line.turns[-1]["sampling"] = sampling
            self.generated += sample.spent

    def trajectories(self, *, source: str = "", group_id: int = 0, first_sample_index: int = 0) -> list[Trajectory]:
        """One record per line that has a turn, in the order lines started."""
        meta = {"trajectory": self.trajectory, "attempt": self.attempt, "refusals": self.refusals}
        lines = [line for line in self.lines if line.turns]
        return [
            line.trajectory(
                source=source, group_id=group_id, sample_index=first_sample_index + k, metadata={**meta, "line": k}
            )
            for k, line in enumerate(lines)
        ]


class TrajectoryStore:
    """Sessions by ``(trajectory, attempt)``. Opening attempt ``a`` retires older attempts of the
    same trajectory: a straggler of a failed attempt can no longer write into it. A closed
    trajectory's latest attempt is remembered while it is among the last ``closed_kept`` closed
    (then a straggler's request gets a plain 404, and the store holds nothing of it)."""

    def __init__(self, budget: Budget | None = None):
        self.budget = budget or Budget()
        self._sessions: dict[tuple[str, int], Session] = {}
        self._latest: dict[str, int] = {}  # the open trajectories' attempts
        self._closed: OrderedDict[str, int] = OrderedDict()  # recently closed ones', oldest first
        self.closed_kept = _CLOSED_KEPT

    def open(
        self,
        trajectory: str,
        attempt: int = 0,
        *,
        budget: Budget | None = None,
        api_key: str | None = "",
        sampling: Any = None,
    ) -> Session:
        """A new session; ``api_key=""`` draws a random key the client must send, None needs none;
        ``sampling``: SamplingParams its turns sample with, whatever the client asks (see Session)."""
        if not isinstance(trajectory, str) or not _ID.fullmatch(trajectory):
            raise ValueError(
                f"trajectory id {trajectory!r}: 1-128 characters of [A-Za-z0-9_.-], not starting with . - _"
            )
        if not isinstance(attempt, int) or attempt < 0:
            raise ValueError(f"attempt={attempt!r}: must be an int >= 0")
        latest = self._latest_attempt(trajectory)
        if latest is not None and attempt <= latest:
            raise ValueError(f"trajectory {trajectory!r}: attempt {attempt} is not newer than attempt {latest}")
        # the trajectory's open session, if any, is its latest attempt: retired without scanning every
        # open session (which made an open cost O(open sessions): 46 us at 2,000 open, 173 us at 8,000,
        # against 2 us; bench/gateway_scale.py)
        previous = self._latest.get(trajectory)
        if previous is not None:
            self._sessions.pop((trajectory, previous)).closed = True
        key = secrets.token_urlsafe(24) if api_key == "" else api_key
        session = Session(trajectory, attempt, budget or self.budget, key, sampling)
        self._sessions[(trajectory, attempt)] = session
        self._closed.pop(trajectory, None)
        self._latest[trajectory] = attempt
        return session

    def _latest_attempt(self, trajectory: str) -> int | None:
        latest = self._latest.get(trajectory)
        return self._closed.get(trajectory) if latest is None else latest

    def get(self, trajectory: str, attempt: int) -> Session:
        session = self._sessions.get((trajectory, attempt))
        if session is not None:
            return session
        latest = self._latest_attempt(trajectory)
        if latest is None:
            raise APIError(404, f"unknown session {trajectory}/{attempt}: no such trajectory is open")
        if attempt < latest:
            raise APIError(410, f"session {trajectory}/{attempt} was retired by attempt {latest}")
        raise APIError(404, f"unknown session {trajectory}/{attempt}: not open (attempt {latest} was)")

    async def close(self, trajectory: str, attempt: int) -> Session:
        """Stop serving the session and return it once its turn in flight (if any) has committed."""
        session = self._sessions.pop((trajectory, attempt), None)
        if session is None:
            raise KeyError(f"session {trajectory}/{attempt} is not open")
        session.closed = True
        # the open session is always the latest attempt (opening one retires the older)
        self._closed[trajectory] = self._latest.pop(trajectory)
        while len(self._closed) > self.closed_kept:
            self._closed.popitem(last=False)
        async with session.lock:
            return session

    def sessions(self) -> list[Session]:
        return list(self._sessions.values())
