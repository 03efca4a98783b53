"""The trainer's forward with each prompt computed once for all the rows that begin with it.

GRPO and its kin sample several responses per prompt, and the rows of one prompt usually train in
the same micro-batch. The plain forward computes the prompt once per row: with 8 samples of 128 +
256 tokens, 29% of a micro-batch's tokens are prompt tokens computed 7 times too often. The forward
here runs the HF model's body in two passes:

1. **the prompts**: each distinct prompt once (right-padded to the longest), keeping every layer's
   keys and values (an HF ``DynamicCache``, with their autograd graph);
2. **the rest of each row**: the tokens from its first trained token on, at their own positions,
   attending to its prompt's keys and values (selected per row from the cache) and causally to its
   own tokens.

This is the plain forward's computation, reordered: a row's token sees exactly the keys it sees
there, and the backward of the per-row selection sums over the rows of a prompt, which is what the
prompt's positions receive from each row's plain forward. The numbers differ only by rounding (the
GEMMs run at other shapes), so it is an option (``share_prompts``), not the default.

A row's *prompt* is its tokens before its first trained token (the response mask's first nonzero
column); rows share one when those tokens are equal. Both passes get an explicit 4D mask (HF hands
a 4D mask to the attention as it is: boolean for sdpa, additive for eager), so each query sees
exactly the keys named above whatever HF's own mask builder would do: the attention must read such
a mask (``sdpa``, ``eager``).

:meth:`RowPrompts.plan` plans micro-batches by what the two passes compute (each prompt once),
keeping a prompt's rows together, and :func:`shared_groups` says whether a micro-batch is cheaper
this way than in one plain pass (a micro-batch of distinct prompts is not).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from loongsage.core.trainer.compiling import compile_like_eager
from loongsage.core.types import TrainBatch

# attention implementations that apply a 4D mask as given
MASKED_ATTENTION = ("sdpa", "eager")


@dataclass(frozen=True)
class PromptGroups:
    """The rows of a micro-batch grouped by the prompt they begin with."""

    group: Tensor  # [B] each row's prompt, an index into ``leaders``
    prompt: Tensor  # [B] each row's prompt length: tokens before its first trained token (>= 1)
    length: Tensor  # [B] each row's real tokens
    leaders: list[int]  # per prompt, the first row that holds it

    @classmethod
    def of(cls, input_ids: Tensor, attention_mask: Tensor, response_mask: Tensor) -> PromptGroups:
        """The groups of right-padded rows ``[B, T]``."""
        rows = RowPrompts.of(input_ids, attention_mask, response_mask)
        leaders: list[int] = []
        for row, group in enumerate(rows.groups):
            if group == len(leaders):  # numbered by first appearance: this row is its prompt's first
                leaders.append(row)
        return cls(
            group=torch.tensor(rows.groups, dtype=torch.long),
            prompt=torch.tensor(rows.prompts),
            length=torch.tensor(rows.lengths),
            leaders=leaders,
        )

    @property
    def prompt_width(self) -> int:
        return int(self.prompt.max())

    @property
    def rest_width(self) -> int:
        return int((self.length - self.prompt).max())

    def repeated_prompt_tokens(self) -> int:
        """Prompt tokens the plain forward computes beyond each prompt's first row: what sharing saves."""
        return int(self.prompt.sum()) - int(self.prompt[self.leaders].sum())

    def tokens(self) -> int:
        """Tokens the two passes compute, padding included: each prompt once, then each row's rest."""
        return len(self.leaders) * self.prompt_width + len(self.group) * self.rest_width


def prompt_lengths(response_mask: Tensor, length: Tensor) -> Tensor:
    """Each row's prompt: the columns before its first trained token, at least 1 (the first token
    is never predicted); a row that trains nothing is all prompt."""
    trained = response_mask.cpu() != 0
    first = torch.where(trained.any(-1), trained.float().argmax(-1), length)
    return first.clamp(min=1).minimum(length).long()


def prompt_groups(input_ids: Tensor, prompt: Tensor) -> list[int]:
    """Each row's prompt as a number, prompts numbered by first appearance: rows with equal prompt
    tokens get one number (the tokens are hashed here once, not again by every later comparison)."""
    numbers: dict[tuple[int, ...], int] = {}
    return [numbers.setdefault(tuple(row[:p].tolist()), len(numbers)) for row, p in zip(input_ids, prompt.tolist())]


def check_attention(model: nn.Module) -> None:
    """Refuse, in one line, a model whose attention would not read the two passes' 4D masks."""
    attention = model.config._attn_implementation
    if attention not in MASKED_ATTENTION:
        raise ValueError(
            f"share_prompts: needs attention that reads a 4D mask ({', '.join(MASKED_ATTENTION)}); "
            f"this model uses {attention!r}"
        )


def compile_around_attention(layer: nn.Module) -> None:
    """``compile_layers`` under the two passes: each part of a decoder layer compiled but its
    attention's own code, whose norms are compiled instead.

    The attention reads the prompts' cache by its layer's index, which ``torch.compile`` takes as a
    constant, and the cache's tensors change strides between the passes: compiled whole, the layers'
    shared code would be compiled again per layer, pass and stride until dynamo's recompile limit,
    past which layers run uncompiled. Compiled around the attention, the norms and the MLP (the
    kernels Inductor fuses: RMSNorm, SwiGLU) compile once per module kind, with dynamic shapes; the
    attention's projections, rotary embedding and sdpa run as they do uncompiled.
    """
    for name, child in layer.named_children():
        if not _is_attention(name, child):
            compile_like_eager(child, dynamic=True)
            continue
        for part in child.children():
            if not isinstance(part, nn.Linear) and any(True for _ in part.parameters()):
                compile_like_eager(part, dynamic=True)


def _is_attention(name: str, module: nn.Module) -> bool:
    return "attn" in name.lower() or "attention" in type(module).__name__.lower()


def shared_groups(batch: TrainBatch, pass_overhead: int) -> PromptGroups | None:
    """The prompt groups of a micro-batch ``batch`` when its two passes compute fewer tokens (one
    pass more counted as ``pass_overhead`` tokens) than the plain pass over its padded rows, else None."""
    groups = PromptGroups.of(batch.input_ids, batch.attention_mask, batch.response_mask)
    rows, width = batch.input_ids.shape
    if groups.rest_width == 0 or groups.tokens() + pass_overhead >= rows * width:
        return None
    return groups


@dataclass(frozen=True)
class RowPrompts:
    """What the planner knows of a batch's rows: each one's prompt (:func:`prompt_groups`), prompt
    length and length."""

    groups: list[int]
    prompts: list[int]
    lengths: list[int]

    @classmethod
    def of(cls, input_ids: Tensor, attention_mask: Tensor, response_mask: Tensor) -> RowPrompts:
        length = attention_mask.sum(-1).long().cpu()
        prompt = prompt_lengths(response_mask, length)
        return cls(prompt_groups(input_ids.cpu(), prompt), prompt.tolist(), length.tolist())

    def two_pass_tokens(self, rows: Sequence[int]) -> int:
        """Tokens the two passes compute for ``rows``: each distinct prompt once, each row's rest."""
        widest_prompt = max(self.prompts[i] for i in rows)
        widest_rest = max(self.lengths[i] - self.prompts[i] for i in rows)
        return len({self.groups[i] for i in rows}) * widest_prompt + len(rows) * widest_rest

    def plan_cost(self, plan: list[list[int]], pass_overhead: int) -> int:
        """A plan's padded tokens and per-pass overheads, each micro-batch run the cheaper way."""
        total = 0
        for rows in plan:
            plain = len(rows) * max(self.lengths[i] for i in rows)
            total += min(plain, self.two_pass_tokens(rows) + pass_overhead) + pass_overhead
        return total

    def plan(self, token_budget: int) -> list[list[int]]:
        """Micro-batches of rows kept with their prompt's other rows (prompts in order of first
        appearance), a new one whenever what the two passes compute would exceed the budget; a row
        over the budget on its own still forms one."""
        plans: list[list[int]] = []
        current: list[int] = []
        for row in sorted(range(len(self.groups)), key=self.groups.__getitem__):  # stable: rows in order
            if current and self.two_pass_tokens([*current, row]) > token_budget:
                plans.append(current)
                current = []
            current.append(row)
        if current:
            plans.append(current)
        return plans


def shared_prompt_hidden(body: nn.Module, input_ids: Tensor, groups: PromptGroups) -> Tensor:
    """The final hidden states ``[B, T, H]`` of right-padded rows at positions ``prompt - 1`` to
    ``length - 1`` of each row (those that predict its tokens from its first trained one on), by the
    two passes of the module docstring; zeros elsewhere. ``body`` is the HF model without its head."""
    from transformers import DynamicCache

    dev = input_ids.device
    rows, width = input_ids.shape
    group, prompt, length = (t.to(dev) for t in (groups.group, groups.prompt, groups.length))
    leaders = torch.tensor(groups.leaders, device=dev)
    n_prompts, p_width, r_width = len(groups.leaders), groups.prompt_width, groups.rest_width
    # sdpa takes the boolean mask as HF's own sdpa masks are; eager adds an additive one
    additive = body.config._attn_implementation != "sdpa"
    dtype = body.get_input_embeddings().weight.dtype
    cache_arg = _cache_argument(body)

    # 1. each prompt once, right-padded; a padded query attends to its prompt's tokens (never to none)
    cols = torch.arange(p_width, device=dev)
    prompt_len = prompt[leaders]
    real_key = cols[None] < prompt_len[:, None]  # [P, p_width]
    prompt_ids = torch.where(real_key, input_ids[leaders, :p_width], 0)
    allowed = (cols[:, None] >= cols[None, :])[None] & real_key[:, None, :]  # [P, q, k]
    cache = DynamicCache()
    prompt_hidden = body(
        input_ids=prompt_ids,
        attention_mask=_mask(allowed, dtype, additive),
        position_ids=cols.expand(n_prompts, p_width),
        use_cache=True,
        **{cache_arg: cache},
    ).last_hidden_state
    cache.batch_select_indices(group)  # every row its prompt's keys and values (backward: their sum)

    # 2. each row's rest at its own positions, after its prompt's keys
    steps = torch.arange(r_width, device=dev)
    real_rest = steps[None] < (length - prompt)[:, None]  # [B, r_width]
    columns = (prompt[:, None] + steps[None]).clamp(max=width - 1)
    rest_ids = torch.where(real_rest, input_ids.gather(1, columns), 0)
    own = (steps[:, None] >= steps[None, :]).expand(rows, r_width, r_width)
    allowed = torch.cat([real_key[group][:, None, :].expand(rows, r_width, p_width), own], dim=-1)
    rest_hidden = body(
        input_ids=rest_ids,
        attention_mask=_mask(allowed, dtype, additive),
        position_ids=prompt[:, None] + steps[None],
        use_cache=True,
        **{cache_arg: cache},
    ).last_hidden_state

    # each row's positions, read from the two passes (a zero row for the others)
    size = prompt_hidden.shape[-1]
    source = torch.cat(
        [prompt_hidden.reshape(-1, size), rest_hidden.reshape(-1, size), prompt_hidden.new_zeros(1, size)]
    )
    col = torch.arange(width, device=dev)[None]
    in_rest = (col >= prompt[:, None]) & (col < length[:, None])
    index = torch.full((rows, width), source.shape[0] - 1, device=dev, dtype=torch.long)
    index = torch.where(col == prompt[:, None] - 1, (group * p_width + prompt - 1)[:, None], index)
    rest_at = n_prompts * p_width + torch.arange(rows, device=dev)[:, None] * r_width + (col - prompt[:, None])
    index = torch.where(in_rest, rest_at, index)
    return source[index.reshape(-1)].view(rows, width, size)


def trained_columns(groups: PromptGroups, width: int, device: torch.device) -> Tensor:
    """``[B, width]``: the columns of each row from its first trained token on (its prompt excluded)."""
    return torch.arange(width, device=device)[None] >= groups.prompt.to(device)[:, None]


def _mask(allowed: Tensor, dtype: torch.dtype, additive: bool) -> Tensor:
    """A boolean ``[B, q, k]`` mask as HF's 4D one, ``[B, 1, q, k]``: boolean, or additive in ``dtype``."""
    if not additive:
        return allowed[:, None]
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)[:, None]


def _cache_argument(body: nn.Module) -> str:
    """The name under which this transformers version's model body takes a KV cache."""
    params = inspect.signature(body.forward).parameters
    return "cache" if "cache" in params else "past_key_values"
