"""Per-group call logs: how a checkpoint holds a group cut in the middle of its rollout, and how a
resumed run carries it on exactly.

In an asynchronous run every training group's agent generates through a :class:`GroupRecorder` (its
``AgentContext.engine``), a small front of the engine router with the router's interface
(``generate(input_ids, sampling, session=...)``, ``release_session(session)``). It logs every call
the group made and what came back, and keeps the router's :class:`~loongsage.core.rollout.router.Call`
of each call still running. :meth:`GroupRecorder.snapshot`, taken while a weight update holds
generation and no request awaits an engine (:meth:`EngineRouter.settled`), is then the group's whole
rollout so far: the calls answered, and each open call's samples as they stand (finished, or cut with
their tokens, log-probs and versions).

A resumed run starts the group again under its own id (so with its own seeds), its recorder holding
the saved log. A call that asks what a saved one asked (same prompt ids, same sampling: seed and
``n`` included) takes its answer from the log: at once when the saved call had finished, else its
finished samples are kept and its cut ones continue from their tokens on the engines
(:meth:`EngineRouter.run`, ``resume_from``), as the uninterrupted run continued them after the
update. A multi-turn agent thus replays its earlier turns exactly; an agent that asks something
else (it is not deterministic given its answers) simply generates afresh.
"""

from __future__ import annotations

from dataclasses import dataclass

from loongsage.core.rollout.router import Call, EngineRouter
from loongsage.core.types import FinishReason, GenerationResult, SamplingParams


@dataclass
class RecordedCall:
    """One call of a group and its samples: all finished, or (a call cut by an update) some ``ABORT``."""

    input_ids: list[int]
    sampling: SamplingParams
    results: list[GenerationResult]

    @property
    def finished(self) -> bool:
        return all(r.finish_reason is not FinishReason.ABORT for r in self.results)


class GroupRecorder:
    """The engine one group's agent sees: the router's interface, every call logged (see the module
    docstring). ``saved`` is the group's log from a checkpoint, replayed first."""

    def __init__(self, router: EngineRouter, saved: list[RecordedCall] = ()):
        self.router = router
        self.answered: list[RecordedCall] = []
        self.replayed = 0  # calls answered from the saved log (in full or in part)
        self._saved = list(saved)
        self._open: list[Call] = []  # the router's calls not yet answered in full

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, session: str | None = None
    ) -> list[GenerationResult]:
        saved = self._take(input_ids, sampling)
        if saved is not None and saved.finished:
            results = list(saved.results)
        else:
            call = Call(list(input_ids), sampling, session, list(saved.results) if saved is not None else None)
            self._open.append(call)
            try:
                results = await self.router.run(call)
            finally:
                self._open.remove(call)
        self.answered.append(RecordedCall(list(input_ids), sampling, list(results)))
        return results

    def release_session(self, session: str) -> None:
        self.router.release_session(session)

    def _take(self, input_ids: list[int], sampling: SamplingParams) -> RecordedCall | None:
        """The first saved call that asked the same, removed from the log (a call is answered once)."""
        for k, call in enumerate(self._saved):
            if call.sampling == sampling and call.input_ids == list(input_ids):
                self.replayed += 1
                return self._saved.pop(k)
        return None

    def snapshot(self) -> list[RecordedCall]:
        """The calls answered so far, then each open call's samples as they stand. An open call no
        engine has answered yet is left out: it is made again, from the start, with its seed.
        Saved calls not asked for again yet are kept, so a second checkpoint still holds them."""
        open_calls = [
            RecordedCall(list(c.input_ids), c.sampling, list(c.results)) for c in self._open if c.results is not None
        ]
        return [*self.answered, *open_calls, *self._saved]
