"""The simulated engine that answers a real tokenizer's token ids (``loongsage.core.sim.text``)."""

from __future__ import annotations

import pytest

from loongsage.core.sim.clock import run_simulated
from loongsage.core.sim.engine import LengthModel
from loongsage.core.sim.text import WORDS, TextSimEngine
from loongsage.core.types import FinishReason, GenerationRequest, GenerationResult, SamplingParams


@pytest.fixture(scope="module")
def tokenizer():
    from loongsage.core.tinytask.tokenizer import build_tokenizer

    return build_tokenizer()


def _generate(engine: TextSimEngine, request: GenerationRequest) -> list[GenerationResult]:
    async def main() -> list[GenerationResult]:
        return await engine.generate(request)

    return run_simulated(main())[0]


def test_replies_are_words_ended_by_the_eos_token_or_cut_at_the_budget(tokenizer):
    engine = TextSimEngine(tokenizer, lengths=LengthModel(median=16, p99=48))
    finishes = set()
    for seed in range(40):
        request = GenerationRequest(f"r{seed}", [1, 2, 3], SamplingParams(max_new_tokens=24, seed=seed))
        (result,) = _generate(engine, request)
        again = _generate(engine, request)[0]
        assert result.output_ids == again.output_ids  # the seed draws the length and the words
        ids = result.output_ids
        assert 1 <= len(ids) <= 24 and len(result.logprobs) == len(result.versions) == len(ids)
        if result.finish_reason is FinishReason.STOP:
            assert ids[-1] == tokenizer.eos_token_id and len(ids) < 24
            ids = ids[:-1]
        else:
            assert result.finish_reason is FinishReason.LENGTH and len(ids) == 24
        assert tokenizer.eos_token_id not in ids
        words = tokenizer.decode(ids).split()
        assert all(word in WORDS for word in words[:-1])  # the last one may be cut short
        finishes.add(result.finish_reason)
    assert finishes == {FinishReason.STOP, FinishReason.LENGTH}


def test_a_continued_sample_keeps_its_earlier_tokens(tokenizer):
    engine = TextSimEngine(tokenizer)
    prior = GenerationResult("r0", [300, 301], [-1.0, -1.0], [0, 0], FinishReason.ABORT)
    request = GenerationRequest("r1", [1, 2], SamplingParams(max_new_tokens=64, seed=3), resume_from=prior)
    (result,) = _generate(engine, request)
    assert result.output_ids[:2] == [300, 301] and len(result.output_ids) > 2


def test_a_tokenizer_without_an_eos_token_is_refused(tokenizer):
    class NoEos:
        eos_token_id = None

    with pytest.raises(ValueError, match="no eos token"):
        TextSimEngine(NoEos())
