"""HF <-> Megatron-Core weight conversion: exact both ways, for every tensor-parallel split, with
each rank holding whole query groups and its slice of gate over its slice of up."""

from __future__ import annotations

import pytest
import torch

from loongsage.megatron.convert import (
    Shape,
    fused_norm_names,
    hf_to_mcore,
    mcore_to_hf,
    qkv_interleave,
    qkv_split,
    unfused_norm_names,
)

HIDDEN, FFN = 32, 48


def hf_state(shape: Shape, *, bias: bool = False, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    d, q_rows, kv_rows = shape.head_dim, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    out = {"model.embed_tokens.weight": r(shape.vocab, HIDDEN), "model.norm.weight": r(HIDDEN)}
    if not shape.tied:
        out["lm_head.weight"] = r(shape.vocab, HIDDEN)
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": r(HIDDEN),
            p + "post_attention_layernorm.weight": r(HIDDEN),
            p + "self_attn.q_proj.weight": r(q_rows, HIDDEN),
            p + "self_attn.k_proj.weight": r(kv_rows, HIDDEN),
            p + "self_attn.v_proj.weight": r(kv_rows, HIDDEN),
            p + "self_attn.o_proj.weight": r(HIDDEN, q_rows),
            p + "self_attn.q_norm.weight": r(d),
            p + "self_attn.k_norm.weight": r(d),
            p + "mlp.gate_proj.weight": r(FFN, HIDDEN),
            p + "mlp.up_proj.weight": r(FFN, HIDDEN),
            p + "mlp.down_proj.weight": r(HIDDEN, FFN),
        }
        if bias:
            out |= {
                p + "self_attn.q_proj.bias": r(q_rows),
                p + "self_attn.k_proj.bias": r(kv_rows),
                p + "self_attn.v_proj.bias": r(kv_rows),
            }
    return out


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("tied,bias,vocab", [(True, False, 64), (False, True, 61)])
def test_the_round_trip_is_exact_for_every_split(tp, tied, bias, vocab):
    shape = Shape(layers=2, heads=8, kv_heads=4, head_dim=4, vocab=vocab, tied=tied)
    hf = hf_state(shape, bias=bias)
    shards = [hf_to_mcore(hf, shape, rank, tp) for rank in range(tp)]
    back = dict(mcore_to_hf(shards, shape))
    assert back.keys() == hf.keys()
    assert all(torch.equal(back[n], hf[n]) for n in hf)
    first = shards[0]
    # the embedding is padded to a multiple of tp and split by rows; the output layer exists untied
    assert first["embedding.word_embeddings.weight"].shape[0] == shape.padded_vocab(tp) // tp
    assert ("output_layer.weight" in first) is not tied
    assert first["decoder.layers.0.self_attention.linear_proj.weight"].shape == (HIDDEN, shape.heads * 4 // tp)


@pytest.mark.parametrize("moe", [False, True])
def test_transformer_engine_names_the_norms_it_fuses(moe):
    """Transformer Engine's layer holds a layer's input norm in ``linear_qkv`` and a dense layer's
    pre-MLP norm in ``linear_fc1`` (the names its Megatron spec gave on an H200); a mixture of
    experts keeps its pre-MLP norm apart. The HF round trip through those names is exact."""
    shape = Shape(layers=2, heads=8, kv_heads=4, head_dim=4, vocab=64, tied=False)
    hf = hf_state(shape)
    local = hf_to_mcore(hf, shape)
    te = {n for n in local if "layernorm" not in n or "q_layernorm" in n or "k_layernorm" in n or "final" in n}
    for i in range(shape.layers):
        p = f"decoder.layers.{i}."
        te |= {
            p + "self_attention.linear_qkv.layer_norm_weight",
            p + "self_attention.linear_qkv._extra_state",
            p + ("pre_mlp_layernorm.weight" if moe else "mlp.linear_fc1.layer_norm_weight"),
        }
    named = fused_norm_names(local, te)
    assert set(named) == te - {n for n in te if n.endswith("_extra_state")}
    assert torch.equal(
        named["decoder.layers.1.self_attention.linear_qkv.layer_norm_weight"],
        hf["model.layers.1.input_layernorm.weight"],
    )
    assert torch.equal(
        named["decoder.layers.0." + ("pre_mlp_layernorm.weight" if moe else "mlp.linear_fc1.layer_norm_weight")],
        hf["model.layers.0.post_attention_layernorm.weight"],
    )
    assert unfused_norm_names(named).keys() == local.keys()
    back = dict(mcore_to_hf([unfused_norm_names(named)], shape))
    assert back.keys() == hf.keys() and all(torch.equal(back[n], hf[n]) for n in hf)


def test_a_rank_holds_whole_query_groups_and_its_slices_of_gate_and_up():
    shape = Shape(layers=1, heads=8, kv_heads=4, head_dim=4, vocab=64, tied=True)
    hf = hf_state(shape)
    p = "model.layers.0."
    rank1 = hf_to_mcore(hf, shape, 1, 2)
    q, k, v = qkv_split(rank1["decoder.layers.0.self_attention.linear_qkv.weight"], shape)
    # rank 1 of 2: query groups 2 and 3, i.e. query heads 4..7 and key/value heads 2..3
    assert torch.equal(q, hf[p + "self_attn.q_proj.weight"][16:32])
    assert torch.equal(k, hf[p + "self_attn.k_proj.weight"][8:16]) and torch.equal(
        v, hf[p + "self_attn.v_proj.weight"][8:16]
    )
    fc1 = rank1["decoder.layers.0.mlp.linear_fc1.weight"]
    assert torch.equal(fc1[: FFN // 2], hf[p + "mlp.gate_proj.weight"][FFN // 2 :])
    assert torch.equal(fc1[FFN // 2 :], hf[p + "mlp.up_proj.weight"][FFN // 2 :])
    # the interleave: group 0's two query heads, then its key head, then its value head
    whole = qkv_interleave(
        hf[p + "self_attn.q_proj.weight"], hf[p + "self_attn.k_proj.weight"], hf[p + "self_attn.v_proj.weight"], shape
    )
    assert torch.equal(whole[:8], hf[p + "self_attn.q_proj.weight"][:8])
    assert torch.equal(whole[8:12], hf[p + "self_attn.k_proj.weight"][:4])
    assert torch.equal(whole[12:16], hf[p + "self_attn.v_proj.weight"][:4])


def test_shapes_that_do_not_divide_are_refused_in_one_line():
    shape = Shape.of(
        {
            "num_hidden_layers": 2,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "hidden_size": 64,
            "vocab_size": 64,
        }
    )
    assert shape.head_dim == 8 and not shape.tied
    with pytest.raises(
        ValueError, match=r"tensor_parallel=4 does not divide num_key_value_heads=2; allowed: a divisor of 2"
    ):
        hf_to_mcore(hf_state(Shape(2, 8, 2, 8, 64, False)), shape, 0, 4)
    with pytest.raises(ValueError, match="no lm_head.weight"):
        hf_to_mcore({"model.embed_tokens.weight": torch.zeros(64, 8)}, shape)
