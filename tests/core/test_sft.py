"""The teacher-forced SFT agent: token attribution and loss masks over a chat-template rendering."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from loongsage.core.rollout import AgentContext
from loongsage.core.sft import ConstantReward, SFTAgent, conversation_of
from loongsage.core.tinytask.tokenizer import IM_END, IM_START, build_tokenizer
from loongsage.core.types import DataRecord, SamplingParams, Status

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


class _NoEngine:
    """Teacher forcing must not reach the engine."""

    def __getattr__(self, name):
        raise AssertionError(f"the sft agent called engine.{name}")


def _run(tokenizer, record: DataRecord, samples: int = 1):
    ctx = AgentContext(_NoEngine(), tokenizer, SamplingParams(temperature=1.0, n=samples), group_id=7)
    return asyncio.run(SFTAgent().run(record, ctx))


CONVERSATION = [
    {"role": "user", "content": "what is 12+30?"},
    {"role": "assistant", "content": "the answer is 42"},
    {"role": "user", "content": "and 5+6?"},
    {"role": "assistant", "content": "11"},
]


def test_three_turn_masks_cover_exactly_the_assistant_tokens(tokenizer):
    [t] = _run(tokenizer, DataRecord("chat", 3, CONVERSATION), samples=4)  # one trajectory whatever n
    full = tokenizer.apply_chat_template(CONVERSATION, tokenize=True, return_dict=False)
    tokens = t.prompt_ids + t.response_ids
    assert tokens == list(full)
    assert tokenizer.decode(tokens) == tokenizer.apply_chat_template(CONVERSATION, tokenize=False)

    # expected mask from the rendered pieces: 1 on assistant content + its <|im_end|>, 0 elsewhere
    expected: list[int] = []
    for m in CONVERSATION:
        header = tokenizer.encode(f"{IM_START}{m['role']}\n", add_special_tokens=False)
        body = tokenizer.encode(m["content"] + IM_END, add_special_tokens=False)
        tail = tokenizer.encode("\n", add_special_tokens=False)
        expected += [0] * len(header) + [int(m["role"] == "assistant")] * len(body) + [0] * len(tail)
    mask = [0] * len(t.prompt_ids) + t.loss_mask
    assert mask == expected

    # the masked tokens are exactly the two answers, each closed by its end token
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    trained = [tok for tok, m in zip(tokens, mask) if m]
    assert tokenizer.decode(trained) == f"the answer is 42{IM_END}11{IM_END}"
    assert sum(tok == im_end for tok in trained) == 2
    # prompt ends with the first assistant header; the response starts at its first content token
    assert tokenizer.decode(t.prompt_ids).endswith(f"{IM_START}assistant\n")
    assert t.loss_mask[0] == 1 and t.loss_mask[-1] == 0  # the template's trailing newline is not trained
    assert t.rollout_logprobs == [0.0] * len(t.response_ids) and t.versions == [-1] * len(t.response_ids)
    assert t.status is Status.OK and t.metadata["teacher_forced"] and t.group_id == 7 and t.sample_index == 0
    assert t.response_text == "11"


def test_string_label_is_the_assistant_turn(tokenizer):
    record = DataRecord("arith", 0, [{"role": "user", "content": "47+85="}], label="231")
    assert conversation_of(record)[-1] == {"role": "assistant", "content": "231"}
    [t] = _run(tokenizer, record)
    prompt = tokenizer.apply_chat_template(record.prompt, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert t.prompt_ids == list(prompt)
    trained = [tok for tok, m in zip(t.response_ids, t.loss_mask) if m]
    assert tokenizer.decode(trained) == f"231{IM_END}"
    assert t.response_text == "231"


def test_record_without_an_answer_is_refused(tokenizer):
    with pytest.raises(ValueError, match=r"arith\[5\].*no assistant message"):
        _run(tokenizer, DataRecord("arith", 5, [{"role": "user", "content": "1+1="}], label=None))


def test_teacher_forcing_ignores_sampling_even_greedy(tokenizer):
    """Whatever the sampling, the agent never generates: evaluation uses the source's eval_agent."""
    record = DataRecord("arith", 0, [{"role": "user", "content": "4+5="}], label="9")
    ctx = AgentContext(None, tokenizer, SamplingParams(temperature=0.0), group_id=1)  # no engine at all
    [t] = asyncio.run(SFTAgent().run(record, ctx))
    assert t.metadata["teacher_forced"] and t.response_text == "9" and set(t.versions) == {-1}


def test_sft_recipe_evaluates_with_a_generating_agent(monkeypatch):
    from loongsage.core.config import load_config

    monkeypatch.chdir(REPO)
    cfg, _ = load_config("tiny/sft_chat_cpu")
    src = cfg.data_sources[0]
    assert src.agent["name"] == "sft" and src.eval_agent["name"] == "single_turn"


def test_constant_reward():
    assert ConstantReward()(None, None) == 0.0
    assert ConstantReward(value=0.5)(None, None) == 0.5


def test_teacher_forced_tokens_are_not_taken_for_engine_samples(tokenizer):
    """The step reads rollout log-probs only where an engine sampled: an SFT trajectory has none,
    so the train-inference consistency metrics never compare the placeholder 0s."""
    from loongsage.core.batching import engine_sampled, to_batch

    [t] = _run(tokenizer, DataRecord("arith", 0, [{"role": "user", "content": "4+5="}], label="9"))
    t.reward = 1.0  # scored, as the reward worker does before training
    batch = to_batch([t], pad_id=0)
    assert batch.response_mask.sum() > 0
    assert engine_sampled(batch).sum() == 0
