"""One chat turn, protocol-independent: what both HTTP front ends call.

``ChatService.complete`` takes a session's request in canonical form (:class:`ChatRequest`) and,
under the session's lock: answers a retry from memory; plans the turn's tokens
(:func:`~loongsage.agentflow.trajectories.tito.plan_turn`); applies the budgets; asks the engine for token ids;
cuts stop strings, decodes and parses each sample (reasoning, tool calls); commits the tokens to the
session's lines; and remembers the answer. The turn runs as a task of its own, so a client that
goes away mid-request neither cancels the commit nor leaves the lock held.

Hashing the request, rendering and tokenizing run on a worker thread: on the event loop (in a run,
the rollout's) a prompt of a few MiB would stall every other session, and the engine, for
seconds. A prompt that certainly cannot fit the context budget is refused before it is tokenized
(:meth:`~loongsage.agentflow.trajectories.rendering.ChatRenderer.check`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from loongsage.agentflow.chat.errors import APIError
from loongsage.agentflow.chat.messages import Message, assistant, tool_call
from loongsage.agentflow.gateway.engines import EngineClient
from loongsage.agentflow.trajectories.rendering import ChatRenderer, PromptTooLong
from loongsage.agentflow.trajectories.store import Budget, Line, Sample, Session, TrajectoryStore
from loongsage.agentflow.trajectories.tito import TurnPlan, cut_at_stop, plan_turn
from loongsage.core.types import FinishReason, GenerationResult, SamplingParams


@dataclass
class ChatRequest:
    """A chat turn in canonical form (the fields that change the answer: its retry key)."""

    messages: list[Message]
    tools: list[dict[str, Any]] | None = None
    parse_tool_calls: bool = True  # False: tool_choice "none" (calls stay text)
    max_tokens: int | None = None  # None: the session budget's default
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    n: int = 1
    seed: int | None = None
    stop: list[str] = field(default_factory=list)

    def key(self) -> str:
        # vars, not asdict: the fields are JSON values already, and asdict deep-copies every message
        # of the history on every turn. A long text of a message is hashed first, on its own: the JSON
        # encoder holds the GIL throughout (tens of ms for a few MiB, the event loop waiting), hashlib
        # releases it; the digest goes in as an object, which no message's text can be.
        data = vars(self) | {"messages": [_digested(m) for m in self.messages]}
        blob = json.dumps(data, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
        return _sha256(blob)


@dataclass
class Choice:
    index: int
    message: Message  # canonical assistant message, tool calls with their ids
    finish_reason: str  # stop | length | tool_calls | abort
    token_ids: list[int]
    logprobs: list[float]  # the raw policy's log-prob of each token (temperature not folded in)
    stop_sequence: str | None = None


@dataclass
class ChatResult:
    id: str
    created: int
    choices: list[Choice]
    prompt_tokens: int
    completion_tokens: int


class ChatService:
    """The gateway's turn logic over one engine client, tokenizer and (optional) chat parser."""

    def __init__(
        self,
        engine: EngineClient,
        tokenizer: Any,
        *,
        parser: Any = None,
        chat_template: str | None = None,
        budget: Budget | None = None,
        model_name: str = "loongsage",
        max_n: int = 16,
        reasoning_optional: bool = False,
    ):
        self.engine, self.parser, self.model_name = engine, parser, model_name
        self.renderer = ChatRenderer(tokenizer, chat_template)
        self.store = TrajectoryStore(budget)
        self.max_n, self.reasoning_optional = int(max_n), bool(reasoning_optional)
        self.counters: Counter[str] = Counter()

    def metrics(self) -> dict[str, float]:
        """Counters since start: ``agentflow/turns``, ``agentflow/segments/<category>``, ..."""
        return {f"agentflow/{k}": float(v) for k, v in sorted(self.counters.items())}

    async def complete(self, trajectory: str, attempt: int, request: ChatRequest) -> ChatResult:
        session = self.store.get(trajectory, attempt)
        if not 1 <= request.n <= self.max_n:
            raise APIError(400, f"n={request.n}: must be between 1 and {self.max_n}", param="n")
        task = asyncio.ensure_future(self._turn(session, request))
        task.add_done_callback(_consume)
        return await asyncio.shield(task)

    async def _turn(self, session: Session, request: ChatRequest) -> ChatResult:
        async with session.lock:
            if session.closed:
                raise APIError(410, f"session {session.route_key} is closed")
            try:
                key, remembered, plan = await asyncio.to_thread(self._prepare, session, request)
            except _OverBudget as over:
                line = session.lines[over.line] if over.line is not None else None
                raise self._refuse(session, line, _context_spent(session, line, f"at least {over.at_least}")) from None
            if remembered is not None:
                self.counters["retries_answered"] += 1
                return remembered
            line = session.lines[plan.line] if plan.line is not None else None
            room = self._room(session, line, plan, request.n)
            wanted = request.max_tokens or session.budget.default_max_tokens
            chosen = request if session.sampling is None else session.sampling  # the session's, when it has one
            shape = {
                "temperature": chosen.temperature,
                "top_p": chosen.top_p,
                "top_k": chosen.top_k,
                "min_p": chosen.min_p,
            }
            sampling = SamplingParams(**shape, max_new_tokens=min(wanted, room), n=request.n, seed=request.seed)
            results = await self._generate(plan.prompt, sampling, session)
            choices, samples = zip(*(self._choice(k, r, request, len(plan.prompt)) for k, r in enumerate(results)))
            budget_cut = [wanted > room and s.finish_reason == "length" for s in samples]
            session.commit(plan, request.messages, request.tools, list(samples), budget_cut, shape)
            self._count(plan.category, len(plan.appended), samples, budget_cut)
            result = ChatResult(
                id=f"chatcmpl-{uuid.uuid4().hex[:24]}",
                created=int(time.time()),
                choices=list(choices),
                prompt_tokens=len(plan.prompt),
                completion_tokens=sum(len(s.ids) for s in samples),
            )
            session.remember(key, result)
            return result

    def _prepare(self, session: Session, request: ChatRequest) -> tuple[str, ChatResult | None, Any]:
        """``(retry key, the remembered answer or None, the turn's plan or None)``, on a worker
        thread (the session's lock is held: its lines do not change meanwhile)."""
        key = request.key()
        remembered = session.answer_for(key)
        if remembered is not None:
            return key, remembered, None
        budget = session.budget.max_context_tokens
        try:
            plan = plan_turn(
                session.lines,
                request.messages,
                request.tools,
                self.renderer.within(budget),
                reasoning_optional=self.reasoning_optional,
            )
        except PromptTooLong as exc:
            # the line the turn would have gone to, found without rendering, is marked truncated
            line = plan_turn(
                session.lines, request.messages, request.tools, _UNTOKENIZED, reasoning_optional=self.reasoning_optional
            ).line
            raise _OverBudget(exc.at_least, line) from None
        return key, None, plan

    async def _generate(self, prompt: list[int], sampling: SamplingParams, session: Session) -> list[GenerationResult]:
        try:
            sampling.validate()
            return await (session.engine or self.engine).generate(prompt, sampling, session=session.route_key)
        except ValueError as exc:
            raise APIError(400, (str(exc).splitlines() or ["bad request"])[0]) from None
        except (APIError, asyncio.CancelledError):
            raise
        except Exception as exc:  # noqa: BLE001 - the engine's failure, not the client's
            self.counters["engine_errors"] += 1
            raise APIError(
                503, f"the engine failed: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
            ) from None

    def _choice(
        self, index: int, result: GenerationResult, request: ChatRequest, prompt_tokens: int
    ) -> tuple[Choice, Sample]:
        ids, stop = list(result.output_ids), None
        sampled_stop = ids[-1] if result.finish_reason is FinishReason.STOP and ids else None
        kept, text = len(ids), None
        if request.stop:
            kept, text, stop = cut_at_stop(
                self.renderer.decode, ids[:-1] if sampled_stop is not None else ids, request.stop
            )
            if stop is None:
                kept, text = len(ids), None
            else:
                sampled_stop = None
        if text is None:
            text = self.renderer.decode(ids[:-1] if sampled_stop is not None else ids)
        message = self._message(text, request)
        ended = (
            "abort"
            if result.finish_reason is FinishReason.ABORT
            else "length"
            if result.finish_reason is FinishReason.LENGTH and stop is None
            else "stop"
        )
        routes = None if result.routed_experts is None else result.routed_experts[: prompt_tokens + kept]
        sample = Sample(
            ids[:kept],
            list(result.logprobs[:kept]),
            list(result.versions[:kept]),
            ended,
            message,
            self.renderer.tail(sampled_stop),
            routes,
            len(ids),
        )
        # complete calls are the client's to run, even from a reply the length limit ended
        finish = "tool_calls" if message.get("tool_calls") and ended != "abort" else ended
        return Choice(index, message, finish, sample.ids, sample.logprobs, stop), sample

    def _message(self, text: str, request: ChatRequest) -> Message:
        if self.parser is None:
            return assistant(text)
        parsed = self.parser.parse(text)
        calls = parsed.get("tool_calls") or []
        if calls and not (request.tools and request.parse_tool_calls):
            return assistant(text)  # no tools offered: what the model wrote is the content
        return assistant(
            parsed.get("content") or "",
            parsed.get("reasoning_content"),
            [
                tool_call(f"call_{uuid.uuid4().hex[:24]}", c["function"]["name"], c["function"]["arguments"])
                for c in calls
            ],
        )

    def _room(self, session: Session, line: Line | None, plan: TurnPlan, n: int) -> int:
        """New tokens each of the turn's ``n`` samples may take (>= 1), or the refusal raised: the
        least room left by the engine call's context, the line's sampled tokens, the line's length
        (its tokens, the prompt appended, the reply) and the session's sampled tokens shared by
        the ``n`` samples. A turn that would start more lines than ``max_lines`` is refused first."""
        budget = session.budget
        new_lines = (plan.line is None) + n - 1
        if len(session.lines) + new_lines > budget.max_lines:
            spent = f"{len(session.lines)} lines, the turn would start {new_lines} more (max_lines={budget.max_lines})"
            raise self._refuse(session, line, spent)
        generated = line.generated if line is not None else 0
        room = min(budget.max_context_tokens - len(plan.prompt), budget.max_response_tokens - generated)
        if room <= 0:
            raise self._refuse(session, line, _context_spent(session, line, str(len(plan.prompt))))
        length = (len(line.tokens) if line is not None else 0) + len(plan.appended)
        if length >= budget.line_tokens:
            spent = f"line of {length} tokens with the turn's prompt (max_line_tokens={budget.line_tokens})"
            raise self._refuse(session, line, spent)
        shared = (budget.session_tokens - session.generated) // n
        if shared <= 0:
            spent = (
                f"{session.generated} tokens sampled in the session, none left for each of {n} samples "
                f"(max_session_tokens={budget.session_tokens})"
            )
            raise self._refuse(session, line, spent)
        return min(room, budget.line_tokens - length, shared)

    def _refuse(self, session: Session, line: Line | None, spent: str) -> APIError:
        """Count a budget refusal, mark its line truncated, and return the error to raise; ``spent``
        says which budget ran out and its value."""
        session.refusals += 1
        self.counters["budget_refusals"] += 1
        if line is not None:
            line.truncated = True
        return APIError(400, f"session {session.route_key} is out of budget: {spent}", code="context_length_exceeded")

    def _count(self, category: str | None, appended: int, samples: tuple[Sample, ...], cut: list[bool]) -> None:
        c = self.counters
        c["turns"] += 1
        c["turns_appended" if category is None else f"segments/{category}"] += 1
        c["prompt_tokens_rendered"] += appended
        c["completion_tokens"] += sum(len(s.ids) for s in samples)
        c["budget_truncations"] += sum(cut)


def _context_spent(session: Session, line: Line | None, prompt_tokens: str) -> str:
    """What a refusal by the context or the line's sampled tokens says."""
    budget, generated = session.budget, line.generated if line is not None else 0
    return (
        f"prompt of {prompt_tokens} tokens (max_context_tokens={budget.max_context_tokens}), "
        f"{generated} tokens generated (max_response_tokens={budget.max_response_tokens})"
    )


_LONG = 1 << 14  # characters of a message's text from which the retry key holds its digest


def _sha256(text: str) -> str:
    # surrogatepass: the HTTP edge replaces lone surrogates, but a request built in code may hold one
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def _digested(message: Message) -> Message:
    if not any(isinstance(v, str) and len(v) >= _LONG for v in message.values()):
        return message
    # UTF-32: one code point in four bytes, a near copy of the string's memory (UTF-8 takes several
    # times longer, the GIL held), and every string, a lone surrogate too, has its own bytes
    return {
        k: {"sha256": hashlib.sha256(v.encode("utf-32-le", "surrogatepass")).hexdigest()}
        if isinstance(v, str) and len(v) >= _LONG
        else v
        for k, v in message.items()
    }


class _OverBudget(Exception):
    """A prompt of at least ``at_least`` tokens, refused before tokenizing; ``line``: its line."""

    def __init__(self, at_least: int, line: int | None):
        super().__init__(at_least, line)
        self.at_least, self.line = at_least, line


class _Untokenized:
    """A stand-in renderer for :func:`plan_turn` that renders nothing: which line a turn goes to
    depends on its messages and tools only."""

    def continuation(self, messages: list[Message], tools: list | None) -> str:
        return ""

    def encode(self, text: str) -> list[int]:
        return []

    def prompt(self, messages: list[Message], tools: list | None) -> list[int]:
        return []


_UNTOKENIZED = _Untokenized()


def _consume(task: asyncio.Task) -> None:
    """A turn whose client went away still ends; its error is not reported as unretrieved."""
    if not task.cancelled():
        task.exception()
