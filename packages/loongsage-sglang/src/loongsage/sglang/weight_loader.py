"""A weight load that copies each pushed tensor straight into the server's parameter.

SGLang's own update (``model.load_weights``) walks every tensor through the model's Python
loader: name rewriting, a lookup of every parameter, a per-tensor weight loader with its checks.
For the 1.7B shape that is about 50 ms for 3.44 GB, several times what moving the bytes takes.
This loader runs inside SGLang's scheduler as a custom weight loader (``--custom-weight-loader``,
then ``load_format`` names it): the first push of a given layout is planned once, finding each
tensor's destination among the model's parameters (the merged ``qkv_proj`` and ``gate_up_proj``
rows included), and every push of that layout is then one batched copy.

The payload is one entry, ``(LAYOUT_PREFIX + layout JSON, flat uint8 buffer)``: the whole push
packed as :func:`loongsage.core.buckets.pack` lays it out, so the server opens one CUDA IPC handle
and unpickles one tensor, whatever the number of tensors.

What the plan cannot place exactly goes through the model's own ``load_weights``, so the result
never differs from SGLang's: a model outside the families whose loaders are plain copies, a
shape or dtype that differs (tensor parallelism, a padded vocabulary, quantized weights), a merged
parameter whose parts are not all in the push.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from loongsage.core.buckets import TensorMeta, unpack

LOAD_FLAT = "loongsage.sglang.weight_loader.load_flat"  # the import path SGLang is given
LAYOUT_PREFIX = "loongsage.flat:"
# the Llama family's merged parameters (SGLang's stacked_params_mapping), part -> (merged, index)
MERGED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_PARTS = {"qkv_proj": 3, "gate_up_proj": 2}
# models whose load_weights does nothing but copy each tensor into its (merged) parameter
PLAIN_LOADERS = frozenset({"Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM"})
_PLANS: dict[tuple[int, str], _Plan] = {}


@dataclass
class _Plan:
    copies: list[tuple[int, Tensor]]  # (index in the layout, destination view of a parameter)
    others: list[int]  # indices that go through the model's load_weights


def layout_name(metas: list[TensorMeta]) -> str:
    """The payload entry's name: the bucket's layout."""
    return LAYOUT_PREFIX + json.dumps(
        [[m.name, m.dtype, list(m.shape), m.offset, m.nbytes] for m in metas], separators=(",", ":")
    )


def load_flat(model: Any, named_tensors: list[tuple[str, Tensor]]) -> None:
    """SGLang's custom-loader entry: ``model`` is the served ``nn.Module``."""
    if len(named_tensors) != 1 or not str(named_tensors[0][0]).startswith(LAYOUT_PREFIX):
        raise ValueError(
            f"load_flat takes one ({LAYOUT_PREFIX}<layout>, flat buffer) entry; got {len(named_tensors)} entries"
        )
    key, flat = named_tensors[0]
    plan = _PLANS.get((id(model), key))
    metas = [TensorMeta(n, d, tuple(s), o, b) for n, d, s, o, b in json.loads(key[len(LAYOUT_PREFIX) :])]
    tensors = unpack(metas, flat, copy=False)
    if plan is None:
        plan = _PLANS[(id(model), key)] = plan_copies(model, tensors)
    if plan.copies:
        torch._foreach_copy_([dst for _, dst in plan.copies], [tensors[i][1] for i, _ in plan.copies])
    if plan.others:
        model.load_weights([tensors[i] for i in plan.others])
    if flat.is_cuda:
        # the sender reuses its buffer once the server answers: the copies must be done by then
        torch.cuda.current_stream(flat.device).synchronize()


def plan_copies(model: Any, tensors: list[tuple[str, Tensor]]) -> _Plan:
    """Each tensor's destination among ``model``'s parameters, or the model's own loader."""
    if type(model).__name__ not in PLAIN_LOADERS:
        return _Plan([], list(range(len(tensors))))
    params = dict(model.named_parameters())
    # a tied head that is a parameter of its own (pipeline stages) also loads from the embedding
    separate_head = "lm_head.weight" in params
    copies: list[tuple[int, Tensor]] = []
    merged: dict[tuple[str, str], dict[int, int]] = {}  # (merged parameter, kind) -> {part index: tensor index}
    others: list[int] = []
    for i, (name, tensor) in enumerate(tensors):
        param = params.get(name)
        if param is not None:
            if (
                param.shape == tensor.shape
                and param.dtype == tensor.dtype
                and not (separate_head and name == "model.embed_tokens.weight")
            ):
                copies.append((i, param.data))
            else:
                others.append(i)
            continue
        part = next((p for p in MERGED if f".{p}." in name), None)
        if part is None:
            others.append(i)
            continue
        target, index = MERGED[part]
        merged.setdefault((name.replace(f".{part}.", f".{target}."), target), {})[index] = i
    for (target, kind), parts in merged.items():
        param = params.get(target)
        members = [parts[k] for k in sorted(parts)]
        rows = [tensors[i][1].shape[0] for i in members]
        if (
            param is None
            or len(parts) != _PARTS[kind]
            or any(tensors[i][1].dtype != param.dtype for i in members)
            or any(tensors[i][1].shape[1:] != param.shape[1:] for i in members)
            or sum(rows) != param.shape[0]
        ):
            others += members
            continue
        start = 0
        for i, n in zip(members, rows):
            copies.append((i, param.data.narrow(0, start, n)))
            start += n
    return _Plan(copies, sorted(others))
