"""A simulated engine whose samples are a real tokenizer's token ids: what a chat front end (the
gateway) can decode, parse and send back, with the timing of :class:`~loongsage.core.sim.engine.SimEngine`.

:class:`TextSimEngine` decodes as ``SimEngine`` does (same latency, same length per seed) and spells
each sample with words of the tokenizer's vocabulary, drawn with the request's seed. A sample that
ends before its budget ends with the end-of-turn token and finishes ``STOP``, as a model that
answered would; one that reaches the budget finishes ``LENGTH``. Plain ASCII words only: no special
token, no reasoning or tool-call markup, so a chat parser reads the text as content.

It runs on any event loop: in simulated time (:mod:`loongsage.core.sim.clock`), or in real time
behind an HTTP server, with a :class:`~loongsage.core.sim.engine.LatencyModel` scaled to the
milliseconds a test can afford.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import replace
from typing import Any

from loongsage.core.sim.engine import LatencyModel, LengthModel, SimEngine
from loongsage.core.types import FinishReason, GenerationRequest, GenerationResult

WORDS = (
    "the sum of two numbers is found by adding each digit and carrying what is left over to the next "
    "place we check the result twice then write the answer as a short sentence for the user"
).split()


class TextSimEngine(SimEngine):
    """A :class:`SimEngine` answering token ids of ``tokenizer`` (see the module docstring)."""

    def __init__(
        self,
        tokenizer: Any,
        latency: LatencyModel | None = None,
        lengths: LengthModel | None = None,
        *,
        words: tuple[str, ...] | list[str] = tuple(WORDS),
        **options: Any,
    ):
        super().__init__(latency, lengths, **options)
        if tokenizer.eos_token_id is None:
            raise ValueError("TextSimEngine: the tokenizer has no eos token (the end of a reply)")
        self.eos = int(tokenizer.eos_token_id)
        # each word with its leading space, as it sits inside a sentence
        self.spellings = [tokenizer.encode(f" {w}", add_special_tokens=False) for w in words]
        if not self.spellings or not all(self.spellings):
            raise ValueError("TextSimEngine: every word must encode to at least one token")

    async def generate(self, request: GenerationRequest) -> list[GenerationResult]:
        results = await super().generate(request)
        return [self._spelled(request, k, r) for k, r in enumerate(results)]

    def _spelled(self, request: GenerationRequest, sample: int, result: GenerationResult) -> GenerationResult:
        # a continued sample answers its earlier tokens first: they stay, only the new ones are spelled
        prior = list(request.resume_from.output_ids) if request.resume_from is not None else []
        total = len(result.output_ids)
        # the parent decodes every sample to its drawn length and says LENGTH; one shorter than its
        # budget is a reply the model ended itself
        stopped = result.finish_reason is FinishReason.LENGTH and total < request.sampling.max_new_tokens
        seed = request.sampling.seed
        key = zlib.crc32(f"{request.request_id}/{sample}".encode()) if seed is None else seed * 1_000_003 + sample
        rng, words = random.Random(key ^ len(prior)), []
        count = total - len(prior) - stopped
        while len(words) < count:
            words.extend(rng.choice(self.spellings))
        ids = prior + words[:count] + [self.eos] * stopped
        return replace(result, output_ids=ids, finish_reason=FinishReason.STOP if stopped else result.finish_reason)
