"""Supervised fine-tuning through the RL loop: a teacher-forced agent and a constant reward.

SFT needs no controller path of its own. The ``sft`` agent turns a record holding a conversation
into ONE trajectory without calling the engine: the chat messages are rendered with the
tokenizer's chat template and tokenized message by message, so every token is attributed to its
message, and ``loss_mask`` is 1 exactly on the assistant messages' tokens (their content and end
token ``<|im_end|>``; not the role header ``<|im_start|>assistant\\n`` nor what the template puts
after the end token). With ``algorithm.policy_loss: {name: nll}`` the trainer then minimises the
negative log-likelihood of those tokens; advantages and rewards are ignored by that loss.

Records. ``prompt`` is a list of chat messages. If it holds no assistant message and ``label`` is
a string, the assistant message is ``label`` (a prompt/answer data set such as the arithmetic
task becomes a two-message conversation). A plain-text prompt is a single user message.

One sample. Teacher forcing has nothing to sample, so the agent returns one trajectory per
record whatever the source's ``samples_per_prompt`` (set it to 1: a group of identical copies
would only weight the record more). Its tokens carry weight version -1 and a placeholder rollout
log-prob of 0: no engine sampled them, so the train-inference consistency metrics leave them out
(:func:`loongsage.core.batching.engine_sampled`); an SFT run emits none.

Evaluation. A teacher-forced trajectory measures nothing, so an SFT data source names a
generating agent for evaluation (``eval_agent: {name: single_turn, params: {prompt_template:
chat}}``); the evaluator runs that one greedily and the source's reward scores its answers.

The ``constant`` reward gives every trajectory the same value, for SFT data without a checker.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loongsage.core.contracts import Agent, Reward
from loongsage.core.rollout import AgentContext
from loongsage.core.types import DataRecord, Status, Trajectory


def conversation_of(record: DataRecord) -> list[dict[str, Any]]:
    """The chat messages of ``record``, with ``label`` as the assistant turn when it has none."""
    prompt = record.prompt
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    if not any(m.get("role") == "assistant" for m in messages):
        if not isinstance(record.label, str):
            raise ValueError(
                f"sft: record {record.source}[{record.index}] has no assistant message "
                f"and no string label to use as one"
            )
        messages.append({"role": "assistant", "content": record.label})
    return messages


def _render(tokenizer: Any, messages: list[dict[str, Any]], generation_prompt: bool = False) -> list[int]:
    if not messages and not generation_prompt:
        return []
    return list(
        tokenizer.apply_chat_template(
            messages, add_generation_prompt=generation_prompt, tokenize=True, return_dict=False
        )
    )


def _extends(prefix: list[int], tokens: list[int], what: str) -> None:
    if tokens[: len(prefix)] != prefix:
        raise ValueError(f"sft: the chat template is not append-only ({what} changes earlier tokens)")


def teacher_forced_tokens(tokenizer: Any, messages: list[dict[str, Any]]) -> tuple[list[int], list[int], list[int]]:
    """Tokens of the whole rendered conversation, a 0/1 loss mask over them, and the token range
    ``[start, end)`` of the last assistant message's content (without its end token).

    Rendered incrementally: the tokens of message ``k`` are those that rendering ``messages[:k+1]``
    adds to the rendering of ``messages[:k]``. For an assistant message, the rendering of
    ``messages[:k]`` with the generation prompt gives the role header; the mask is 1 from there up
    to and including the message's last end-of-turn token (``tokenizer.eos_token_id``).
    """
    eos = tokenizer.eos_token_id
    tokens: list[int] = []
    mask: list[int] = []
    last_content = (0, 0)
    for k, message in enumerate(messages):
        full = _render(tokenizer, messages[: k + 1])
        _extends(tokens, full, f"message {k}")
        if message.get("role") == "assistant":
            header = _render(tokenizer, messages[:k], generation_prompt=True)
            _extends(tokens, header, f"the header of message {k}")
            _extends(header, full, f"message {k} after its header")
            own = full[len(header) :]
            ends = [i for i, t in enumerate(own) if t == eos]
            stop = ends[-1] + 1 if ends else len(own)  # through the end-of-turn token
            mask += [0] * (len(header) - len(tokens)) + [1] * stop + [0] * (len(own) - stop)
            last_content = (len(header), len(header) + (ends[-1] if ends else len(own)))
        else:
            mask += [0] * (len(full) - len(tokens))
        tokens = full
    return tokens, mask, list(last_content)


@dataclass
class SFTAgent(Agent):
    """``sft``: one teacher-forced trajectory per record (no engine call); see the module doc."""

    async def run(self, record: DataRecord, ctx: AgentContext) -> list[Trajectory]:
        messages = conversation_of(record)
        tokens, mask, (start, end) = teacher_forced_tokens(ctx.tokenizer, messages)
        if 1 not in mask:
            raise ValueError(f"sft: record {record.source}[{record.index}] renders no assistant token")
        split = mask.index(1)
        response = tokens[split:]
        return [
            Trajectory(
                source=record.source,
                group_id=ctx.group_id,
                sample_index=0,
                prompt_ids=tokens[:split],
                response_ids=response,
                loss_mask=mask[split:],
                rollout_logprobs=[0.0] * len(response),
                versions=[-1] * len(response),
                status=Status.OK,
                response_text=ctx.tokenizer.decode(tokens[start:end], skip_special_tokens=True),
                metadata={"record_index": record.index, "teacher_forced": True},
            )
        ]


@dataclass(frozen=True)
class ConstantReward(Reward):
    """``constant``: the same reward for every trajectory (SFT data without a checker)."""

    value: float = 0.0

    def __call__(self, trajectory: Trajectory, record: DataRecord) -> float:
        return self.value
