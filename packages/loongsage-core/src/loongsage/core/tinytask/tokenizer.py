"""An offline byte-level BPE tokenizer for the embedded tiny models.

The tiny CPU recipes need a real Hugging Face tokenizer (chat template, special tokens,
``AutoTokenizer.from_pretrained``) without downloading one. This module trains a small
byte-level BPE on a deterministic generated corpus (arithmetic lines plus a little ChatML chat
text) and saves it as a ``PreTrainedTokenizerFast`` folder.

Design choices:

* Digits are always split into single tokens (``Digits(individual_digits=True)`` runs before
  ``ByteLevel``), so numbers have one token per digit, as in Qwen/Llama tokenizers. Arithmetic
  is learnable digit by digit and answers can be scored token by token.
* Byte-level: any text round-trips, so chat text outside the corpus still encodes.
* Special tokens follow Qwen's ChatML convention: ``<|endoftext|>`` (pad), ``<|im_start|>``,
  ``<|im_end|>`` (end of a turn = eos, the stop token of generation).
"""

from __future__ import annotations

import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END)

# Qwen's ChatML template (without tool calls): each message is
# "<|im_start|>{role}\n{content}<|im_end|>\n"; the generation prompt opens an assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_WORDS = (
    "the a an is are was what how why who which number sum answer question please compute add "
    "subtract plus minus equals result digit digits carry borrow reverse first last small large "
    "yes no okay thanks hello hi you I we it this that of to in on for with and or not can will "
    "model user assistant system helpful math problem solve write tell me give short"
).split()
_SYSTEM_PROMPTS = ("You are a helpful assistant.", "You are a careful math assistant.")


def _chat_line(rng: random.Random) -> str:
    """One short ChatML conversation built from a small word list."""

    def sentence() -> str:
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 9))]
        return " ".join(words).capitalize() + rng.choice((".", "?", "!"))

    parts = []
    if rng.random() < 0.5:
        parts.append(f"{IM_START}system\n{rng.choice(_SYSTEM_PROMPTS)}{IM_END}\n")
    for _ in range(rng.randint(1, 2)):
        parts.append(f"{IM_START}user\n{sentence()}{IM_END}\n")
        parts.append(f"{IM_START}assistant\n{sentence()}{IM_END}\n")
    return "".join(parts)


def _arith_line(rng: random.Random) -> str:
    a, b = rng.randrange(10 ** rng.randint(1, 4)), rng.randrange(10 ** rng.randint(1, 4))
    op = rng.choice("+-*")
    value = a + b if op == "+" else a - b if op == "-" else a * b
    text = f"{a}{op}{b}={value}"
    if rng.random() < 0.5:  # the same problems as chat turns, as the recipes render them
        text = f"{IM_START}user\n{a}{op}{b}={IM_END}\n{IM_START}assistant\n{value}{IM_END}\n"
    return text


def generate_corpus(num_lines: int = 4000, seed: int = 0) -> list[str]:
    """Deterministic training corpus: about 3/4 arithmetic, 1/4 chat."""
    rng = random.Random(seed)
    return [_arith_line(rng) if rng.random() < 0.75 else _chat_line(rng) for _ in range(num_lines)]


def train_tokenizer(vocab_size: int = 384, *, corpus_lines: int = 4000, seed: int = 0) -> Tokenizer:
    """Train the byte-level BPE (a ``tokenizers.Tokenizer``); same arguments, same vocabulary.

    ``vocab_size`` counts the 256 byte tokens and the 3 special tokens, so a few hundred leaves
    room for a hundred or so merges (common words, role names, operators).
    """
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size={vocab_size}: must be >= {256 + len(SPECIAL_TOKENS)} (bytes + specials)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # The trainer does not cut special tokens out of its input; without this their fragments
    # ("<|", "im", "=<|") would take a good share of the few merges.
    pieces = []
    for line in generate_corpus(corpus_lines, seed):
        for special in SPECIAL_TOKENS:
            line = line.replace(special, "\0")
        pieces.extend(p for p in line.split("\0") if p)
    tok.train_from_iterator(pieces, trainer=trainer)
    return tok


def build_tokenizer(out_dir: str | Path | None = None, *, vocab_size: int = 384, seed: int = 0):
    """Train the tokenizer and wrap it as a ``PreTrainedTokenizerFast`` with the ChatML template.

    With ``out_dir`` the folder is written with ``save_pretrained`` and is loadable by
    ``AutoTokenizer.from_pretrained(out_dir)``. Returns the ``PreTrainedTokenizerFast``.
    """
    from transformers import PreTrainedTokenizerFast

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(vocab_size, seed=seed),
        pad_token=PAD_TOKEN,
        eos_token=IM_END,
        unk_token=None,
        bos_token=None,
        additional_special_tokens=[IM_START],
        model_max_length=1024,
        padding_side="left",  # prompts are left-padded for batched generation
        clean_up_tokenization_spaces=False,
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    if out_dir is not None:
        hf_tok.save_pretrained(str(out_dir))
    return hf_tok
