"""The calculator warm start's parts: its tokenizer, transcripts tokenized as the gateway records them,
the prefix-sharing SFT loss (equal to HF's), and a short build through the cache."""

from __future__ import annotations

import json
import random

import pytest
import torch

from loongsage.agentflow.chat.templates import QWEN3_TOOLS_TEMPLATE
from loongsage.agentflow.tasks.tool_calc import teacher_messages
from loongsage.agentflow.tasks.warmstart import (
    BUILDER_VERSION,
    TAGS,
    ToolCalcWarmStartParams,
    build_tokenizer,
    cached_tool_calc_warm_start,
    offered_tools,
    sft_batch,
    sft_loss,
    shared_prefix,
    transcript_tokens,
)
from loongsage.agentflow.trajectories.rendering import ChatRenderer


@pytest.fixture(scope="module")
def params():
    return ToolCalcWarmStartParams()


@pytest.fixture(scope="module")
def tokenizer(params):
    return build_tokenizer(params)


def _transcripts(params, tokenizer, count, seed=0):
    task, rng = params.task("train", count), random.Random(seed)
    return [teacher_messages(task[i], drop_prob=params.drop_prob, rng=rng) for i in range(count)]


def test_the_tokenizer_holds_the_tool_template(params, tokenizer):
    assert len(tokenizer) == params.vocab_size and tokenizer.chat_template == QWEN3_TOOLS_TEMPLATE
    for tag in TAGS:
        (token,) = tokenizer.encode(tag, add_special_tokens=False)
        assert tokenizer.decode([token]) == tag
    text = tokenizer.apply_chat_template(
        _transcripts(params, tokenizer, 1)[0], tools=offered_tools(params.tools), tokenize=False
    )
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text and len(ids) < 260  # the embedded tokenizer needs ~900
    assert [tokenizer.decode([t]) for t in tokenizer.encode("347*29", add_special_tokens=False)] == list("347*29")


def test_transcripts_are_tokenized_as_the_gateway_records_them(params, tokenizer):
    renderer, tools = ChatRenderer(tokenizer), offered_tools(params.tools)
    for messages in _transcripts(params, tokenizer, 20):
        ids, mask = transcript_tokens(renderer, messages, tools, tokenizer.eos_token_id)
        # the whole transcript as the template writes it, less the newline after the last reply
        assert tokenizer.decode(ids) + "\n" == renderer.render(messages, tools, generation_prompt=False)
        assert ids[: mask.index(1)] == renderer.prompt(messages[:1], tools)
        replies = [m for m in messages if m["role"] == "assistant"]
        trained, start = [], None
        for i, m in enumerate(mask + [0]):
            if m and start is None:
                start = i
            elif not m and start is not None:
                trained.append(tokenizer.decode(ids[start:i]))
                start = None
        assert len(trained) == len(replies) and all(t.endswith("<|im_end|>") for t in trained)
        if len(replies) == 2:  # a tool call, then the answer
            call = json.loads(trained[0].removeprefix("<tool_call>\n").removesuffix("\n</tool_call><|im_end|>"))
            assert call == {"name": "calculator", "arguments": replies[0]["tool_calls"][0]["function"]["arguments"]}
        assert trained[-1] == replies[-1]["content"] + "<|im_end|>"


def test_the_shared_prefix_loss_equals_hf_and_its_gradient(params, tokenizer):
    from loongsage.core.tinytask.tiny_model import build_tiny_qwen3

    model, _ = build_tiny_qwen3(tokenizer=tokenizer, max_position_embeddings=512)
    model.train()
    renderer, tools = ChatRenderer(tokenizer), offered_tools(params.tools)
    examples = [
        transcript_tokens(renderer, m, tools, tokenizer.eos_token_id) for m in _transcripts(params, tokenizer, 8)
    ]
    assert shared_prefix(examples) > 150  # the system turn with the tool's schema
    ids, attention, labels = sft_batch(examples, tokenizer.pad_token_id)
    reference = model(input_ids=ids, attention_mask=attention, labels=labels).loss
    expected = torch.autograd.grad(reference, list(model.parameters()))
    for min_shared in (16, 10**6):  # shared, and not
        loss = sft_loss(model, examples, tokenizer.pad_token_id, min_shared=min_shared)
        grads = torch.autograd.grad(loss, list(model.parameters()))
        assert loss.item() == pytest.approx(reference.item(), rel=1e-5)
        assert max((a - b).abs().max().item() for a, b in zip(grads, expected)) < 1e-5


def test_a_short_build_goes_through_the_cache(tmp_path):
    params = ToolCalcWarmStartParams(steps=2, batch_size=4, warmup_steps=1, tokenizer_transcripts=20)
    path = cached_tool_calc_warm_start(params, tmp_path)
    assert path.name == params.cache_key() and path.parent == tmp_path / "models"
    info = json.loads((path / "loongsage_warmstart.json").read_text())
    assert info["params"]["steps"] == 2 and info["builder_version"] == BUILDER_VERSION
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(path).chat_template == QWEN3_TOOLS_TEMPLATE
    assert cached_tool_calc_warm_start(params, tmp_path) == path  # found, not rebuilt
    assert (
        ToolCalcWarmStartParams(tools=["calculator", "read_file"]).cache_key() != ToolCalcWarmStartParams().cache_key()
    )
    with pytest.raises(ValueError, match="must be offered"):
        ToolCalcWarmStartParams(tools=["read_file"])
    with pytest.raises(ValueError, match="unknown tool"):
        ToolCalcWarmStartParams(tools=["shell"])
