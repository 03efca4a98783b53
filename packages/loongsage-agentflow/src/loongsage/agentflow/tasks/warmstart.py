"""The tool-calling warm start: a tiny Qwen3 fine-tuned on the calculator teacher, built offline and cached.

Model builder ``tiny_tool_calc`` (``loongsage_backends``, kind ``model_builder``). It follows the
core's arithmetic warm start (:mod:`loongsage.core.tinytask.warmstart`): same tiny architecture,
same SFT recipe (AdamW, warm-up then cosine decay, loss on the answer tokens only), a folder keyed
by a hash of the parameters and the builder version, built in a temporary sibling and renamed into
place under a lock. What differs:

* **Tokenizer.** The embedded tokenizer has a hundred merges learnt on arithmetic and short chat:
  the tool template's system turn alone takes about 700 of its tokens. This builder trains the
  same kind of tokenizer (byte-level BPE, digits split one per token, the ChatML special tokens)
  on the embedded corpus plus rendered tool transcripts, with 512 tokens, and adds the template's
  tags (``<tool_call>``, ``<tool_response>``, ``<tools>``, ``<think>`` and their closings) as single
  tokens, as Qwen3's vocabulary has them: a whole transcript is then about 240 tokens. So the
  arithmetic warm start, tied to the other vocabulary, cannot be the init: the model starts random.
* **Chat template.** The tokenizer carries :data:`~loongsage.agentflow.chat.templates.QWEN3_TOOLS_TEMPLATE`,
  so a gateway using the tokenizer's own template renders what the model was trained on.
* **Transcripts.** Each SFT example is a teacher transcript
  (:func:`~loongsage.agentflow.tasks.tool_calc.teacher_messages`) tokenized as the gateway tokenizes
  an episode (:class:`~loongsage.agentflow.trajectories.rendering.ChatRenderer`): the first prompt
  rendered whole, each reply as the model writes it followed by the end-of-turn token (trained on),
  then the rest of the template's closing and the tool result with the next generation prompt (not
  trained on). The tools offered must be the agent's (their schemas are part of every prompt).

Determinism: the same parameters give bitwise the same weights on the same machine and library
versions with the same ``threads``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from loongsage.agentflow.agents.tools import schemas
from loongsage.agentflow.chat.messages import openai_tools
from loongsage.agentflow.chat.templates import QWEN3_TOOLS_TEMPLATE
from loongsage.agentflow.tasks.tool_calc import ToolCalcTask, teacher_messages
from loongsage.agentflow.trajectories.rendering import ChatRenderer
from loongsage.core.tinytask.builds import cached_build
from loongsage.core.tinytask.warmstart import run_sft, save_warm_start

# Bump whenever the output of build_tool_calc_warm_start changes for the same params.
BUILDER_VERSION = 2
TAGS = (
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<tools>",
    "</tools>",
    "<think>",
    "</think>",
)


@dataclass
class ToolCalcWarmStartParams:
    """Everything that determines the warm-start model (and so its cache key)."""

    name: str = "tiny-qwen3-tool-calc"
    tools: list[str] = field(default_factory=lambda: ["calculator"])  # must be the agent's
    # the teacher and its questions (ToolCalcTask / teacher_messages)
    drop_prob: float = 0.6
    plain_fraction: float = 0.65
    # tokenizer and model
    vocab_size: int = 512
    tokenizer_transcripts: int = 600  # teacher transcripts added to the embedded tokenizer corpus
    hidden_size: int = 64
    num_layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate_size: int = 256
    max_position_embeddings: int = 512
    # supervised fine-tuning
    steps: int = 800
    batch_size: int = 32
    lr: float = 3e-3
    warmup_steps: int = 30
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    seed: int = 0
    threads: int = 2

    def __post_init__(self) -> None:
        self.tools = list(self.tools)
        schemas(self.tools)  # unknown tools fail here
        if "calculator" not in self.tools:
            raise ValueError(f"tools={self.tools}: the teacher calls 'calculator', so it must be offered")
        if not 0 <= self.drop_prob <= 1:
            raise ValueError(f"drop_prob={self.drop_prob}: must be in [0, 1]")
        if self.steps < 1 or self.batch_size < 1:
            raise ValueError(f"steps={self.steps}, batch_size={self.batch_size}: must be >= 1")
        if self.vocab_size < 256 + 3 + len(TAGS) + 1:
            raise ValueError(f"vocab_size={self.vocab_size}: must leave room for the bytes, specials and tags")

    def task(self, split: str, size: int, seed: int = 0) -> ToolCalcTask:
        """The data source these params were trained for."""
        return ToolCalcTask(split=split, size=size, seed=seed, plain_fraction=self.plain_fraction)

    def cache_key(self) -> str:
        # the schemas and the template are rendered into every prompt: changing them changes the model
        blob = json.dumps(
            {
                "params": dataclasses.asdict(self),
                "builder": BUILDER_VERSION,
                "schemas": schemas(self.tools),
                "template": QWEN3_TOOLS_TEMPLATE,
            },
            sort_keys=True,
        )
        return f"{self.name}-{hashlib.sha256(blob.encode()).hexdigest()[:16]}"


def offered_tools(names: list[str]) -> list[dict[str, Any]]:
    """The tools as the gateway renders them: the agent's schemas in the gateway's canonical form."""
    return openai_tools(schemas(names))


# -------------------------------------------------------------------------------------- tokenizer
def build_tokenizer(params: ToolCalcWarmStartParams):
    """The embedded tokenizer's design retrained with tool transcripts in its corpus (see the module
    docstring); a ``PreTrainedTokenizerFast`` with the tools chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from loongsage.core.tinytask.tokenizer import IM_END, IM_START, PAD_TOKEN, SPECIAL_TOKENS, generate_corpus

    def wrap(tok: Any) -> PreTrainedTokenizerFast:
        hf = PreTrainedTokenizerFast(
            tokenizer_object=tok,
            pad_token=PAD_TOKEN,
            eos_token=IM_END,
            unk_token=None,
            bos_token=None,
            additional_special_tokens=[IM_START],
            model_max_length=params.max_position_embeddings,
            padding_side="left",
            clean_up_tokenization_spaces=False,
        )
        hf.chat_template = QWEN3_TOOLS_TEMPLATE
        return hf

    # the transcripts are rendered with a plain tokenizer object: only the template's text is needed
    renderer = wrap(Tokenizer(models.BPE()))
    task, rng = (
        params.task("train", params.tokenizer_transcripts, params.seed),
        random.Random(f"tokenizer/{params.seed}"),
    )
    tools = offered_tools(params.tools)
    lines = generate_corpus(4000, params.seed)
    for i in range(params.tokenizer_transcripts):
        messages = teacher_messages(task[i], drop_prob=params.drop_prob, rng=rng)
        lines.append(renderer.apply_chat_template(messages, tools=tools, tokenize=False))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=params.vocab_size - len(TAGS),
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    pieces = []  # special tokens and tags cut out: their fragments would take merges
    for line in lines:
        for token in (*SPECIAL_TOKENS, *TAGS):
            line = line.replace(token, "\0")
        pieces.extend(p for p in line.split("\0") if p)
    tok.train_from_iterator(pieces, trainer=trainer)
    # not special: decoding keeps them (the gateway's parser reads them), as in Qwen3's vocabulary
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAGS])
    return wrap(tok)


# ---------------------------------------------------------------------------------------- examples
def transcript_tokens(
    renderer: ChatRenderer, messages: list[dict[str, Any]], tools: list | None, eos_id: int
) -> tuple[list[int], list[int]]:
    """``(ids, mask)`` of a transcript as the gateway records its episode: 1 on reply tokens
    (each reply as the template writes it, then the end-of-turn token), 0 elsewhere."""
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    ids = renderer.prompt(messages[:first], tools)
    mask = [0] * len(ids)
    i = first
    while i < len(messages):
        opened = renderer.render(messages[:i], tools, generation_prompt=True)
        closed = renderer.render(messages[: i + 1], tools, generation_prompt=False)
        if not (closed.startswith(opened) and closed.endswith(renderer.closing)):
            raise ValueError("transcript_tokens: the template does not render replies append-only")
        reply = renderer.encode(closed[len(opened) : len(closed) - len(renderer.closing)]) + [eos_id]
        ids += reply
        mask += [1] * len(reply)
        j = i + 1
        while j < len(messages) and messages[j]["role"] != "assistant":
            j += 1
        if j < len(messages):
            text = renderer.continuation(messages[i + 1 : j], tools)
            if text is None:
                raise ValueError("transcript_tokens: the template does not render turns append-only")
            appended = renderer.encode(renderer.tail(eos_id) + text)
            ids += appended
            mask += [0] * len(appended)
        i = j
    return ids, mask


def sft_batch(examples: list[tuple[list[int], list[int]]], pad_id: int):
    """Right-padded ``(input_ids, attention_mask, labels)``; labels are -100 where the mask is 0."""
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    attention = torch.zeros((len(examples), width), dtype=torch.long)
    for row, (ids, mask) in enumerate(examples):
        tokens = torch.tensor(ids)
        input_ids[row, : len(ids)] = tokens
        attention[row, : len(ids)] = 1
        labels[row, : len(ids)] = torch.where(torch.tensor(mask, dtype=torch.bool), tokens, -100)
    return input_ids, attention, labels


def shared_prefix(examples: list[tuple[list[int], list[int]]]) -> int:
    """Length of the token prefix every example shares and none trains on (its next token not either)."""
    first, *rest = [ids for ids, _ in examples]
    n = min(
        min(len(ids) for ids, _ in examples), min(mask.index(1) if 1 in mask else len(mask) for _, mask in examples) - 1
    )
    for ids in rest:
        k = 0
        while k < n and ids[k] == first[k]:
            k += 1
        n = k
    return max(n, 0)


def sft_loss(model, examples: list[tuple[list[int], list[int]]], pad_id: int, *, min_shared: int = 16):
    """Mean cross-entropy of the trained tokens (mask 1) of ``examples``, each predicted from the
    tokens before it: the loss HF computes with ``labels``, for less compute.

    Every transcript starts with the same system turn (the tools' schemas: most of its tokens), so
    that prefix is run once and its keys and values shared by the batch (its gradient sums over the
    rows, as the batch's would); and the LM head runs only where a trained token is predicted.
    """
    shared = shared_prefix(examples)
    shared = shared if shared >= min_shared else 0
    input_ids, attention, labels = sft_batch([(ids[shared:], mask[shared:]) for ids, mask in examples], pad_id)
    # transformers renamed past_key_values to cache (5.2x); take whichever this version has
    name = "cache" if "cache" in inspect.signature(model.model.forward).parameters else "past_key_values"
    past = None
    if shared:
        prefix = torch.tensor([examples[0][0][:shared]])
        past = getattr(model.model(input_ids=prefix, use_cache=True), name)
        past.batch_repeat_interleave(len(examples))
        attention = torch.cat([torch.ones(len(examples), shared, dtype=attention.dtype), attention], 1)
    hidden = model.model(
        input_ids=input_ids, attention_mask=attention, use_cache=past is not None, **{name: past}
    ).last_hidden_state
    # position t predicts token t + 1; the first suffix token is never trained (shared_prefix)
    targets = labels[:, 1:]
    picked = targets != -100
    logits = model.lm_head(hidden[:, :-1][picked])
    return torch.nn.functional.cross_entropy(logits.float(), targets[picked])


def train_sft(model, tokenizer, params: ToolCalcWarmStartParams, *, log_every: int = 0) -> dict:
    """Fine-tune ``model`` in place on the teacher's transcripts of the train split; returns a summary."""
    torch.manual_seed(params.seed)
    rng = random.Random(f"sft/{params.seed}")
    task = params.task("train", params.steps * params.batch_size, params.seed)
    renderer, tools = ChatRenderer(tokenizer), offered_tools(params.tools)
    tool_calls = 0

    def step_loss(step: int) -> torch.Tensor:
        nonlocal tool_calls
        examples = []
        for index in range(step * params.batch_size, (step + 1) * params.batch_size):
            messages = teacher_messages(task[index], drop_prob=params.drop_prob, rng=rng)
            tool_calls += len(messages) > 2
            examples.append(transcript_tokens(renderer, messages, tools, tokenizer.eos_token_id))
        return sft_loss(model, examples, tokenizer.pad_token_id)

    summary = run_sft(model, params, step_loss, log_every=log_every)
    return {**summary, "teacher_tool_share": tool_calls / (params.steps * params.batch_size)}


def build_tool_calc_warm_start(
    out_dir: str | Path, params: ToolCalcWarmStartParams | None = None, *, log_every: int = 0
) -> Path:
    """Tokenizer + tiny Qwen3 + SFT on the teacher's transcripts, saved as an HF folder with
    ``loongsage_warmstart.json`` (params, builder version, final loss, timings); returns ``out_dir``."""
    from loongsage.core.tinytask.tiny_model import build_tiny_qwen3

    params = params or ToolCalcWarmStartParams()

    def make():
        tokenizer = build_tokenizer(params)
        model, tokenizer = build_tiny_qwen3(
            hidden_size=params.hidden_size,
            num_layers=params.num_layers,
            heads=params.heads,
            kv_heads=params.kv_heads,
            intermediate_size=params.intermediate_size,
            max_position_embeddings=params.max_position_embeddings,
            seed=params.seed,
            tokenizer=tokenizer,
        )
        return model, tokenizer, train_sft(model, tokenizer, params, log_every=log_every)

    return save_warm_start(out_dir, params, BUILDER_VERSION, make)


def cached_tool_calc_warm_start(
    params: ToolCalcWarmStartParams | None = None, cache_dir: str | Path | None = None, *, log_every: int = 0
) -> Path:
    """``<cache_dir>/models/<cache key>``, built on first use (see
    :func:`~loongsage.core.tinytask.builds.cached_build`)."""
    params = params or ToolCalcWarmStartParams()
    what = (
        f"a {params.vocab_size}-token tokenizer, then {params.steps} SFT steps of {params.batch_size} transcripts "
        f"on {params.threads} threads"
    )
    return cached_build(
        params.cache_key(), lambda tmp: build_tool_calc_warm_start(tmp, params, log_every=log_every), cache_dir, what
    )


@dataclass
class TinyToolCalcModel(ToolCalcWarmStartParams):
    """Model builder ``tiny_tool_calc``: the calculator warm start, cached by its params."""

    kind = "model_builder"

    def build(self) -> Path:
        return cached_tool_calc_warm_start(ToolCalcWarmStartParams(**dataclasses.asdict(self)))
