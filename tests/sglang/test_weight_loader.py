"""``loongsage.sglang.weight_loader``: a push loaded by one batched copy into the server's
parameters ends exactly where the model's own ``load_weights`` puts it. The model is the contract
server's (SGLang's merged q/k/v and gate/up parameters, loaded as SGLang's Llama family loads
them), built from a real checkpoint."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from loongsage.core.buckets import pack
from loongsage.sglang.weight_loader import _PLANS, layout_name, load_flat, plan_copies

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "core" / "engine"))
import sglang_contract_server as standin  # noqa: E402
from _engine_helpers import build_engine_test_model  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return build_engine_test_model(tmp_path_factory.mktemp("loader") / "m")


def served(checkpoint: str, architecture: str = "Qwen3ForCausalLM"):
    return type(architecture, (standin.Model,), {})(checkpoint, 512, [1], "bfloat16")


def push(model, named: dict[str, torch.Tensor]) -> None:
    metas, flat = pack(list(named.items()))
    load_flat(model, [(layout_name(metas), flat)])


def moved(model) -> dict[str, torch.Tensor]:
    """Every checkpoint tensor changed, by the names the trainer pushes."""
    ckpt = {}
    for name, param in model.named_parameters():
        merged = [(part, shard) for p, part, shard in standin.STACKED if f".{p}." in name]
        if not merged:
            ckpt[name] = param
            continue
        for part, shard in merged:
            start, rows = model.shards[(name, shard)]
            ckpt[name.replace(f".{name.split('.')[-2]}.", f".{part}.")] = param.narrow(0, start, rows)
    generator = torch.Generator().manual_seed(1)
    return {n: (t.float() + torch.randn(t.shape, generator=generator)).to(t.dtype) for n, t in ckpt.items()}


def params(model) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in model.named_parameters()}


@pytest.mark.parametrize("architecture", ["Qwen3ForCausalLM", "SomeOtherForCausalLM"])
def test_a_flat_push_lands_where_the_models_own_loader_puts_it(checkpoint, architecture):
    ours, theirs = served(checkpoint, architecture), served(checkpoint, architecture)
    named = moved(ours)
    assert any(".q_proj." in n for n in named) and any(".gate_proj." in n for n in named)
    push(ours, named)
    theirs.load_weights(list(named.items()))
    got, want = params(ours), params(theirs)
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
    assert not all(torch.equal(got[n], t) for n, t in params(served(checkpoint)).items())  # it moved
    metas, flat = pack(list(named.items()))
    tensors = [(m.name, named[m.name]) for m in metas]
    plan = plan_copies(ours, tensors)
    if architecture == "Qwen3ForCausalLM":  # every tensor copied straight, the merged rows included
        assert not plan.others and len(plan.copies) == len(named)
    else:  # a model whose loader may do more than copy: all through it
        assert not plan.copies and len(plan.others) == len(named)
    push(ours, named)  # the second push of a layout reuses its plan
    assert sum(1 for model_id, _ in _PLANS if model_id == id(ours)) == 1


def test_what_the_plan_cannot_place_goes_through_the_models_loader(checkpoint):
    ours, theirs = served(checkpoint), served(checkpoint)
    named = moved(ours)
    partial = {
        n: t
        for n, t in named.items()
        if ".layers.0.self_attn.q_proj." in n or n == "model.norm.weight" or ".layers.1.mlp." in n
    }
    partial["model.norm.weight"] = partial["model.norm.weight"].float()  # another dtype: cast by the loader
    push(ours, partial)
    theirs.load_weights(list(partial.items()))
    got, want = params(ours), params(theirs)
    assert all(torch.equal(got[n], want[n]) for n in want)
    tensors = list(partial.items())
    plan = plan_copies(ours, tensors)
    placed = {tensors[i][0] for i, _ in plan.copies}
    # the lone q part and the float32 norm go through load_weights; the whole gate/up pair and down are copied
    assert {tensors[i][0] for i in plan.others} == {"model.layers.0.self_attn.q_proj.weight", "model.norm.weight"}
    assert placed == {n for n in partial if ".layers.1.mlp." in n}


def test_a_payload_that_is_not_one_flat_layout_is_refused(checkpoint):
    model = served(checkpoint)
    with pytest.raises(ValueError, match=r"load_flat takes one \(loongsage.flat:<layout>, flat buffer\) entry; got 2"):
        load_flat(model, [("a", torch.zeros(1)), ("b", torch.zeros(1))])
